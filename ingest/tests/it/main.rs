//! Integration tests of the scanner against real PostgreSQL, a real anvil and the Bitcoin Core
//! simulator.

mod btc;
mod eth;
mod support;
