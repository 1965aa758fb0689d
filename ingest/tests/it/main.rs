//! Integration tests of the scanner against real PostgreSQL, a real anvil and the Bitcoin Core
//! simulator.

mod eth;
mod support;
