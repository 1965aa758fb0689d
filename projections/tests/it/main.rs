//! The projections against a real PostgreSQL and the Bitcoin Core simulator: posting per deposit
//! key, confirmation tiers, reorgs whose money comes back or not, ownership by height, and the
//! property that custody follows the chain whatever happens. What runs the `custodian` binary is
//! the root's (`tests/it/`).

mod ledger;
mod posting_pass;
mod properties;
#[allow(dead_code)]
mod support;
