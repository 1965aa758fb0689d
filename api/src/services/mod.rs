//! The gRPC services, one module each. Every RPC authorises first, naming the scope it needs.

pub(crate) mod accounts;
pub(crate) mod admin;
pub(crate) mod audit;
pub(crate) mod health;
pub(crate) mod withdrawals;
