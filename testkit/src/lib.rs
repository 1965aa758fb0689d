//! Test-only helpers: a fresh PostgreSQL database per test, cloned from a migrated template, and
//! an anvil launcher. Never a dependency of production code.

pub mod anvil;
mod bip39;
pub mod btcsim;
pub mod db;
pub mod faulty;
pub mod fixtures;
pub mod proxy;
pub mod tls_proxy;

pub use anvil::Anvil;
pub use btcsim::BitcoinSim;
pub use db::TestDb;

/// Polls `check` until it returns `Some`, or panics with `what` after `deadline`.
/// Tests synchronise with this, never with sleeps alone.
pub async fn eventually<T, F, Fut>(what: &str, deadline: std::time::Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = std::time::Instant::now();
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(start.elapsed() < deadline, "timed out after {deadline:?} waiting for {what}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
