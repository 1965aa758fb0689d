// SPDX-License-Identifier: MIT
pragma solidity ^0.8.37;

/// Rejects every call and every ETH transfer, so a value-carrying tx to it is mined with status 0.
contract Reverter {
    receive() external payable {
        revert("Reverter: no deposits");
    }

    fallback() external payable {
        revert("Reverter: no deposits");
    }
}
