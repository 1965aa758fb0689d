// SPDX-License-Identifier: MIT
pragma solidity ^0.8.37;

/// An ERC-20 that can be told to lie, for Custodian's withdrawal tests. Not for production.
/// Modes: 0 honest; 1 `transfer` moves nothing, emits nothing and returns false; 2 a tenth of
/// every transfer goes to the deployer (fee on transfer, two `Transfer` events); 3 `transfer`
/// reverts.
contract LyingToken {
    mapping(address => uint256) public balanceOf;
    uint8 public mode;
    address public immutable owner;

    event Transfer(address indexed from, address indexed to, uint256 value);

    constructor(uint256 initialSupply) {
        owner = msg.sender;
        balanceOf[msg.sender] = initialSupply;
        emit Transfer(address(0), msg.sender, initialSupply);
    }

    function setMode(uint8 m) external {
        mode = m;
    }

    function transfer(address to, uint256 value) external returns (bool) {
        require(mode != 3, "LyingToken: transfers refused");
        if (mode == 1) {
            return false;
        }
        require(balanceOf[msg.sender] >= value, "LyingToken: insufficient balance");
        uint256 fee = mode == 2 ? value / 10 : 0;
        balanceOf[msg.sender] -= value;
        balanceOf[to] += value - fee;
        emit Transfer(msg.sender, to, value - fee);
        if (fee > 0) {
            balanceOf[owner] += fee;
            emit Transfer(msg.sender, owner, fee);
        }
        return true;
    }
}
