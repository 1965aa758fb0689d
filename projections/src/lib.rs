//! Balances, ledger postings from confirmed deposits, reversal proposals, replay and verify.
//!
//! Filled in by the ledger work; see ARCHITECTURE.md for what this crate owns.
