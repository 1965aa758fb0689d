// SPDX-License-Identifier: MIT
pragma solidity ^0.8.37;

/// Moves ETH by contract calls, as contract wallets and exchanges do: the payments are internal
/// calls, found only in call traces.
contract Forwarder {
    /// Pays `to` the whole value sent (a contract wallet paying us).
    function forward(address payable to) external payable {
        (bool ok, ) = to.call{value: msg.value}("");
        require(ok, "Forwarder: payment failed");
    }

    /// Pays each recipient its amount (an exchange's batch payout); the value must cover them.
    function batch(address payable[] calldata to, uint256[] calldata amounts) external payable {
        require(to.length == amounts.length, "Forwarder: lengths differ");
        for (uint256 i = 0; i < to.length; i++) {
            (bool ok, ) = to[i].call{value: amounts[i]}("");
            require(ok, "Forwarder: payment failed");
        }
    }

    /// Pays `to` inside an inner call that then reverts, and swallows the revert: the transaction
    /// succeeds and `to` receives nothing.
    function payThenRevert(address payable to) external payable {
        try this.payAndRevert{value: msg.value}(to) {} catch {}
    }

    /// Pays `to`, then reverts.
    function payAndRevert(address payable to) external payable {
        (bool ok, ) = to.call{value: msg.value}("");
        require(ok, "Forwarder: payment failed");
        revert("Forwarder: inner call reverts");
    }
}

/// A token whose payable `gift` mints to `to` and keeps the ETH: one transaction that pays ETH to
/// the contract and emits a `Transfer` at log 0.
contract GiftToken {
    mapping(address => uint256) public balanceOf;

    event Transfer(address indexed from, address indexed to, uint256 value);

    function gift(address to, uint256 value) external payable {
        balanceOf[to] += value;
        emit Transfer(address(0), to, value);
    }
}
