//! End-to-end tests of the gRPC API: a real tonic client against a server on a free port, over a
//! fresh PostgreSQL database per test, with anvil where a chain is involved.

mod accounts;
mod auth;
mod end_to_end;
mod events;
mod probes;
mod support;
mod tls;
mod withdrawals;
