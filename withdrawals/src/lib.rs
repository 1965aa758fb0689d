//! Withdrawal requests, nonce allocation and signing, broadcast, fee bumps, settlement, cancel.
//!
//! Filled in by the withdrawals work; see ARCHITECTURE.md for what this crate owns.
