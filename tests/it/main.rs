//! End-to-end tests of the `custodian` binary against a real PostgreSQL (and anvil).

mod btc_withdrawals;
mod cli;
mod crash;
mod deposits;
mod failover;
mod finance;
mod forgeries;
mod harness;
mod ledger;
mod lifecycle;
mod lifecycle_eth;
mod node_failover;
mod ops;
mod properties;
mod serve;
mod webhooks;
mod withdrawal_edges;
mod withdrawals;
