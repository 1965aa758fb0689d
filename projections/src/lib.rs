//! Balances, ledger postings from confirmed deposits, reversal proposals, replay and verify.
//!
//! Everything here is a projection: SQL over the appended facts, rebuildable at any time.
//! This crate does not know how blocks are fetched or how withdrawals are signed.

pub mod balances;
mod btc_spends;
pub mod deposits;
pub mod history;
pub mod policy;
pub mod posting;
pub mod replay;
pub mod reversals;
pub mod seals;
