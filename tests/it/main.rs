//! End-to-end tests of the `custodian` binary against a real PostgreSQL (and anvil).

mod btc_withdrawals;
mod cli;
mod crash;
mod deposits;
#[path = "../../withdrawals/tests/it/harness.rs"]
#[allow(dead_code)]
mod eth_harness;
mod failover;
mod finance;
mod forgeries;
mod harness;
mod ledger;
#[path = "../../projections/tests/it/support.rs"]
#[allow(dead_code)]
mod ledger_support;
mod lifecycle;
mod lifecycle_eth;
mod node_failover;
mod ops;
mod serve;
mod webhooks;
mod withdrawal_edges;
mod withdrawals;
