//! The gRPC API of Custodian (`proto/custodian/v1`): accounts and deposit addresses, balances and
//! ledger entries, withdrawals, the auditors' event stream and the operators' lane controls, each
//! call behind a bearer token with scopes.
//!
//! The services are thin: they authorise the caller (`auth`), convert the request into domain
//! types by hand (`wire`), call the same library functions the CLI calls, and map refusals to
//! status codes (`status`). Protobuf types do not leave this crate. A client that hangs up
//! cancels its handler; every write is one library transaction, so it is committed whole or not
//! at all.
//!
//! [`serve`] is the entry point `custodian serve` calls; [`tokens`] is what `custodian token`
//! calls.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use custodian_domain::hd::DepositKey;
use custodian_domain::{BtcNetwork, Chain};
use custodian_store::Pool;
use tokio::sync::watch;
use tonic::Status;

mod auth;
mod rate;
mod services;
mod status;
mod time;
pub mod tokens;
mod wire;

/// Generated protobuf and gRPC types (clients included, for tests and other Rust callers).
// Generated code is not ours to lint.
#[allow(clippy::all)]
pub mod pb {
    tonic::include_proto!("custodian.v1");
}

/// What the API needs beyond the database.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// The extended public key each chain's deposit addresses are derived from. A chain without
    /// one refuses `NewDepositAddress` with `FAILED_PRECONDITION`.
    pub deposit_keys: HashMap<Chain, DepositKey>,
    /// The Bitcoin network; a configured BTC deposit key must belong to it.
    pub btc_network: BtcNetwork,
    /// Requests per second each token may make, sustained (at least 1).
    pub requests_per_second: u32,
    /// Requests a token may make at once before the sustained rate applies (at least 1).
    pub burst: u32,
}

/// Why the API could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The configuration cannot work; nothing was started.
    #[error("invalid API configuration: {0}")]
    Config(String),
    /// The gRPC server failed (the listener broke).
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

impl ApiConfig {
    fn validate(&self) -> Result<(), ApiError> {
        if self.requests_per_second == 0 || self.burst == 0 {
            return Err(ApiError::Config(format!(
                "the rate limit must allow at least 1 request per second and a burst of 1 (got {} per second, burst {})",
                self.requests_per_second, self.burst
            )));
        }
        for (chain, key) in &self.deposit_keys {
            if key.chain() != *chain {
                return Err(ApiError::Config(format!(
                    "the deposit key configured for {chain} is a {} key",
                    key.chain()
                )));
            }
            if let DepositKey::Btc(key) = key {
                if key.network() != self.btc_network {
                    return Err(ApiError::Config(format!(
                        "the BTC deposit key derives {} addresses, but Bitcoin is configured for {}",
                        key.network().as_str(),
                        self.btc_network.as_str()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// What every service shares.
#[derive(Debug)]
pub(crate) struct State {
    /// The database.
    pub pool: Pool,
    /// Tokens, scopes and rate limits.
    pub auth: auth::Authenticator,
    /// Deposit keys per chain.
    pub deposit_keys: HashMap<Chain, DepositKey>,
    /// Turns true when the server begins shutting down; open event streams end on it.
    pub stopping: watch::Receiver<bool>,
}

impl State {
    /// A pooled connection, or `UNAVAILABLE`.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, Status> {
        self.pool.get().await.map_err(|e| status::pool(&e))
    }
}

/// Serves the API on `listener` until `shutdown` resolves; in-flight requests finish first.
/// Open event streams end with `UNAVAILABLE` when shutdown begins, so clients resume elsewhere
/// instead of holding the server up.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pool: Pool,
    config: ApiConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ApiError> {
    config.validate()?;
    let (stop, stopping) = watch::channel(false);
    let state = Arc::new(State {
        auth: auth::Authenticator::new(pool.clone(), config.requests_per_second, config.burst),
        pool,
        deposit_keys: config.deposit_keys,
        stopping,
    });
    if let Ok(address) = listener.local_addr() {
        tracing::info!(%address, "serving the gRPC API");
    }
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down the gRPC API: finishing in-flight requests");
        // Nobody listening (no open stream) is fine.
        let _ = stop.send(true);
    };
    tonic::transport::Server::builder()
        .add_service(pb::health_server::HealthServer::new(services::health::HealthService::new(state.clone())))
        .add_service(pb::accounts_server::AccountsServer::new(services::accounts::AccountsService::new(state.clone())))
        .add_service(pb::withdrawals_server::WithdrawalsServer::new(services::withdrawals::WithdrawalsService::new(
            state.clone(),
        )))
        .add_service(pb::audit_server::AuditServer::new(services::audit::AuditService::new(state.clone())))
        .add_service(pb::admin_server::AdminServer::new(services::admin::AdminService::new(state)))
        .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), signal)
        .await?;
    Ok(())
}
