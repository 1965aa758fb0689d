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
pub mod metric_catalog;
mod rate;
mod services;
mod status;
mod time;
pub mod tokens;
pub mod webhooks;
mod wire;

/// Generated protobuf and gRPC types (clients included, for tests and other Rust callers).
// Generated code is not ours to lint.
#[allow(clippy::all)]
pub mod pb {
    tonic::include_proto!("custodian.v1");

    /// The API's encoded file descriptors, served by reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("custodian_descriptor");
}

/// How often the standard health service (`grpc.health.v1`) asks the database.
const STANDARD_HEALTH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

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
    /// Requests per second each peer address may make, sustained, checked before any database
    /// work (at least 1).
    pub peer_requests_per_second: u32,
    /// Requests a peer may make at once (at least 1).
    pub peer_burst: u32,
    /// Calls the server handles at once, across all connections; more wait.
    pub max_concurrent_requests: usize,
    /// How long one call may take before it is answered `CANCELLED`/`DEADLINE_EXCEEDED`.
    pub request_timeout: std::time::Duration,
    /// TLS for the listener; `None` serves plaintext (warned about off loopback).
    pub tls: Option<ServerTls>,
}

/// The server's certificate and key, and optionally the CA client certificates must chain to.
#[derive(Clone)]
pub struct ServerTls {
    /// PEM certificate chain.
    pub cert_pem: Vec<u8>,
    /// PEM private key.
    pub key_pem: Vec<u8>,
    /// PEM CA: when set, every client must present a certificate it signed.
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("key_pem", &"(not shown)")
            .field("client_certificates_required", &self.client_ca_pem.is_some())
            .finish_non_exhaustive()
    }
}

impl ApiConfig {
    /// The defaults of `[api]` (see `custodian.example.toml`) with these deposit keys.
    pub fn with_defaults(deposit_keys: HashMap<Chain, DepositKey>, btc_network: BtcNetwork) -> ApiConfig {
        ApiConfig {
            deposit_keys,
            btc_network,
            requests_per_second: 50,
            burst: 100,
            peer_requests_per_second: 200,
            peer_burst: 400,
            max_concurrent_requests: 256,
            request_timeout: std::time::Duration::from_secs(30),
            tls: None,
        }
    }
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
        if self.requests_per_second == 0
            || self.burst == 0
            || self.peer_requests_per_second == 0
            || self.peer_burst == 0
        {
            return Err(ApiError::Config(format!(
                "the rate limits must allow at least 1 request per second and a burst of 1 (got {} per second, burst \
                 {} per token; {} per second, burst {} per peer)",
                self.requests_per_second, self.burst, self.peer_requests_per_second, self.peer_burst
            )));
        }
        if self.max_concurrent_requests == 0 || self.request_timeout.is_zero() {
            return Err(ApiError::Config("max_concurrent_requests and request_timeout_ms must be positive".into()));
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
    /// The Bitcoin network withdrawal destinations must be on.
    pub btc_network: BtcNetwork,
    /// Turns true when the server begins shutting down; open event streams end on it.
    pub stopping: watch::Receiver<bool>,
    /// Withdrawal requests made at the same moment, recorded in one transaction.
    pub requests: custodian_withdrawals::coalesce::Coalescer,
    /// Accounts and assets already found: neither is ever deleted or renamed, so a request for a
    /// known one reads neither again (the request's own checks still refuse an unknown account).
    pub known: std::sync::Mutex<Known>,
}

/// See [`State::known`].
#[derive(Debug, Default)]
pub(crate) struct Known {
    /// Account ids found.
    pub accounts: std::collections::HashSet<i64>,
    /// Asset names as asked → key, decimals, chain.
    pub assets: HashMap<String, (custodian_domain::Asset, u8, Chain)>,
}

/// Entries [`Known`] keeps of each kind before it starts over.
pub(crate) const KNOWN_MAX: usize = 100_000;

/// Transactions writing withdrawal requests at once: while one commits, the next batch gathers.
const REQUEST_WRITERS: usize = 2;

/// Requests one transaction records at most.
const REQUEST_BATCH_MAX: usize = 64;

impl State {
    /// A pooled connection, or `UNAVAILABLE`.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, Status> {
        self.pool.get().await.map_err(|e| status::pool(&e))
    }
}

/// Serves the API on `listener` until `shutdown` resolves; in-flight requests finish first.
/// Open event streams end with `UNAVAILABLE` when shutdown begins, so clients resume elsewhere
/// instead of holding the server up.
///
/// `pool` should be the API's own: a flood of calls then waits for its connections (and times out
/// with `UNAVAILABLE`) without ever taking one the scanners or the worker need.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pool: Pool,
    config: ApiConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ApiError> {
    config.validate()?;
    let (stop, stopping) = watch::channel(false);
    let rates = auth::Rates {
        token: (config.requests_per_second, config.burst),
        peer: (config.peer_requests_per_second, config.peer_burst),
    };
    let state = Arc::new(State {
        auth: auth::Authenticator::new(pool.clone(), rates),
        requests: custodian_withdrawals::coalesce::Coalescer::start(pool.clone(), REQUEST_WRITERS, REQUEST_BATCH_MAX),
        known: std::sync::Mutex::default(),
        pool,
        deposit_keys: config.deposit_keys,
        btc_network: config.btc_network,
        stopping,
    });
    if let Ok(address) = listener.local_addr() {
        match (&config.tls, address.ip().is_loopback()) {
            (Some(tls), _) => {
                tracing::info!(%address, client_certificates = tls.client_ca_pem.is_some(), "serving the gRPC API over TLS")
            }
            (None, true) => tracing::info!(%address, "serving the gRPC API in plaintext on loopback"),
            (None, false) => tracing::warn!(
                %address,
                "serving the gRPC API in PLAINTEXT beyond loopback: set [api] tls_cert and tls_key"
            ),
        }
    }
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &config.tls {
        let mut server_tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&tls.cert_pem, &tls.key_pem));
        if let Some(ca) = &tls.client_ca_pem {
            server_tls = server_tls.client_ca_root(tonic::transport::Certificate::from_pem(ca));
        }
        builder = builder.tls_config(server_tls)?;
    }
    let (begun, mut shutdown_begun) = watch::channel(false);
    let signal = async move {
        shutdown.await;
        tracing::info!("shutting down the gRPC API: finishing in-flight requests");
        // Nobody listening (no open stream) is fine.
        let _ = stop.send(true);
        let _ = begun.send(true);
    };
    // The standard probes: grpc.health.v1 (grpc_health_probe, Kubernetes) answers SERVING while
    // the database does, for the server ("") and each service; reflection lets grpcurl list and
    // call the API without the .proto files.
    let (health_reporter, standard_health) = tonic_health::server::health_reporter();
    let probe_pool = state.pool.clone();
    let mut probe_stop = state.stopping.clone();
    tokio::spawn(async move {
        loop {
            let serving = match tokio::time::timeout(STANDARD_HEALTH_INTERVAL, probe_pool.get()).await {
                Ok(Ok(client)) => client.query_one("select 1", &[]).await.is_ok(),
                _ => false,
            };
            let status =
                if serving { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
            for service in STANDARD_HEALTH_SERVICES {
                health_reporter.set_service_status(service, status).await;
            }
            tokio::select! {
                () = tokio::time::sleep(STANDARD_HEALTH_INTERVAL) => {}
                () = async { let _ = probe_stop.wait_for(|stop| *stop).await; } => {
                    for service in STANDARD_HEALTH_SERVICES {
                        health_reporter.set_service_status(service, tonic_health::ServingStatus::NotServing).await;
                    }
                    return;
                }
            }
        }
    });
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ApiError::Config(format!("server reflection: {e}")))?;
    let server = builder
        .timeout(config.request_timeout)
        .concurrency_limit_per_connection(config.max_concurrent_requests)
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(config.max_concurrent_requests))
        .add_service(standard_health)
        .add_service(reflection)
        .add_service(pb::health_server::HealthServer::new(services::health::HealthService::new(state.clone())))
        .add_service(pb::accounts_server::AccountsServer::new(services::accounts::AccountsService::new(state.clone())))
        .add_service(pb::withdrawals_server::WithdrawalsServer::new(services::withdrawals::WithdrawalsService::new(
            state.clone(),
        )))
        .add_service(pb::audit_server::AuditServer::new(services::audit::AuditService::new(state.clone())))
        .add_service(pb::admin_server::AdminServer::new(services::admin::AdminService::new(state)))
        .serve_with_incoming_shutdown(incoming(listener), signal);
    // A client that never answers the graceful goodbye cannot hold the process up: after the
    // grace period its connection is dropped. Every write is one library transaction, committed
    // whole or not at all, so nothing is left half done.
    let deadline = async {
        let _ = shutdown_begun.wait_for(|begun| *begun).await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        served = server => served?,
        () = deadline => tracing::warn!(grace = ?SHUTDOWN_GRACE, "closing the gRPC connections still open after the grace period"),
    }
    Ok(())
}

/// The names `grpc.health.v1` answers for: the whole server and each of our services.
const STANDARD_HEALTH_SERVICES: [&str; 6] = [
    "",
    "custodian.v1.Health",
    "custodian.v1.Accounts",
    "custodian.v1.Withdrawals",
    "custodian.v1.Audit",
    "custodian.v1.Admin",
];

/// How long in-flight calls and open connections get to finish once shutdown begins.
pub const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Accepted connections with Nagle's algorithm off. A response goes out as several small writes
/// (HTTP/2 headers, data, trailers); with Nagle on, a later write waits for the client's
/// acknowledgement of the earlier one, which a client delays by up to 40 ms: a floor of about
/// 45 ms under every call whose answer does not fit one write.
fn incoming(
    listener: tokio::net::TcpListener,
) -> impl futures::Stream<Item = Result<tokio::net::TcpStream, std::io::Error>> {
    use futures::StreamExt;
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}
