//! PostgreSQL access for Custodian: the connection pool, the migration runner, and the append of
//! withdrawal events with optimistic concurrency.
//!
//! The schema itself lives only in `migrations/`; this crate embeds it. Every query here uses
//! parameters, never SQL assembled from input.

pub mod btc_rpc;
pub mod deposit_addresses;
pub mod events;
pub mod ledger;
pub mod migrate;
pub mod nodes;
pub mod operator;
pub mod ownership;
pub mod pipeline;
pub mod pool;
pub mod roles;
pub mod tls;

pub use events::{append_withdrawal_event, AppendError};
pub use pipeline::Pipelined;
pub use pool::{connect, DatabaseUrl, Pool, PoolError, DEFAULT_DATABASE_URL, DEFAULT_MIGRATE_DATABASE_URL};
pub use roles::{check_service_role, RoleError};

/// What a database error was, with the server's message and SQLSTATE: the error's own `Display`
/// says only "db error".
pub fn describe(error: &tokio_postgres::Error) -> String {
    match (error.as_db_error(), std::error::Error::source(error)) {
        (Some(db), _) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        (None, Some(source)) => format!("{error}: {source}"),
        (None, None) => error.to_string(),
    }
}

/// SQLSTATE of a unique or primary-key violation.
pub const UNIQUE_VIOLATION: &str = "23505";

/// Whether `error` is PostgreSQL refusing a duplicate key, optionally on the named constraint.
pub fn is_unique_violation(error: &tokio_postgres::Error, constraint: Option<&str>) -> bool {
    error.as_db_error().is_some_and(|db| {
        db.code().code() == UNIQUE_VIOLATION && constraint.is_none_or(|name| db.constraint() == Some(name))
    })
}

/// `base` plus up to half of it again, at random: retries of many processes never line up.
pub fn jittered(base: std::time::Duration) -> std::time::Duration {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
    let half = u64::try_from(base.as_millis() / 2).unwrap_or(u64::MAX).max(1);
    base + std::time::Duration::from_millis(random % half)
}
