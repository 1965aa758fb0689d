//! Withdrawals: each request becomes exactly one on-chain transaction.
//!
//! The nonce is a database row, allocated in the same transaction that stores the signed payload.
//! Broadcast happens after commit and resends the same bytes; fee bumps are sibling attempts at
//! the same nonce; settlement is keyed on `(from_address, nonce)`; cancel is a replacement.
//! Requests are idempotent per `(account, external_id)`. This crate does not know about deposit
//! scanning.

pub mod actions;
pub mod btc;
pub mod btc_key;
pub mod coalesce;
pub mod hot_wallet;
pub mod limits;
pub mod listing;
pub mod payout;
pub mod request;
pub mod rpc;
pub mod signer;
pub mod sql;
pub mod worker;

pub use request::{Request, RequestError, Requested};
pub use rpc::EthNode;
pub use signer::{LocalSigner, Signer};
pub use worker::{PassReport, Worker, WorkerConfig};
