// SPDX-License-Identifier: MIT
pragma solidity ^0.8.37;

/// A contract destination whose receive() writes storage: paying it plain ETH needs more than
/// 21,000 gas, as paying a Safe or an exchange's deposit contract does. Once closed it refuses
/// payments, so a payment simulated while open and mined after closing fails on chain.
contract Vault {
    mapping(address => uint256) public deposited;
    bool public closed;

    function close() external {
        closed = true;
    }

    receive() external payable {
        require(!closed, "Vault: closed");
        deposited[msg.sender] += msg.value;
    }
}
