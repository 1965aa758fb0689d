//! Chain readers and the deposit scanner (ETH over JSON-RPC, BTC over Bitcoin Core JSON-RPC).
//!
//! Filled in by the deposits work; see ARCHITECTURE.md for what this crate owns.
