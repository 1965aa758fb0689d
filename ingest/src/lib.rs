//! Chain readers and the reorg-safe deposit scanner.
//!
//! Readers ask a node for blocks and hand back what it said: the exact payload (kept in
//! `raw_block`) and the value transfers decoded from it. The scanner stores those observations in
//! order, one database transaction per batch, checks every block's parent against our own
//! canonical chain, and on a mismatch walks back to the fork point and orphan-marks what the node
//! retracted (`reorg.rs`). It never deletes an observation and never makes a network call inside a database
//! transaction.
//!
//! This crate does not know about balances, ledger postings or withdrawals.

pub mod block;
pub mod btc;
pub mod eth;
pub mod reader;
pub mod reorg;
pub mod reparse;
pub mod scanner;
pub mod sql;

pub use block::{DepositKind, FetchedBlock, Transfer, TransferAsset};
pub use reader::{ChainIdentity, ChainReader, ReadError};
pub use scanner::{
    AfterStep, NoProgress, Progress, ScanConfig, ScanError, ScanReport, Scanner, ScannerState, StateHandle,
};
