//! The withdrawal library against a real PostgreSQL and anvil: allocation, broadcast, bumps,
//! cancels, settlement and the edges real chains produce. What runs the `custodian` binary is
//! the root's (`tests/it/`).

mod edges;
mod eth;
#[allow(dead_code)]
mod harness;
