//! `custodian serve`: the gRPC API, a scanner per configured chain (posting after every step),
//! the withdrawal worker, and `/metrics` and `/healthz`, in one process.
//!
//! On SIGTERM every part stops taking new work: scanners stop between batches, the worker between
//! passes, the API after in-flight requests; no database transaction is interrupted, and the
//! process exits 0. Several `serve` processes may share one database: scanners guard their cursor,
//! workers claim withdrawals with row locks.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, Result};
use custodian_domain::hd::{BtcDepositKey, DepositKey, EthDepositKey};
use custodian_domain::Chain;
use custodian_ingest::btc::BtcReader;
use custodian_ingest::ScanConfig;
use custodian_service::Service;
use custodian_withdrawals::{hot_wallet, Worker};
use tokio::sync::watch;

use crate::cli::WorkerArgs;
use crate::exit::{invalid, Exit};
use crate::settings::Settings;

/// The API's own connections by default ([api] pool_size).
const API_POOL_SIZE: usize = 8;
/// How long an API call waits for one of them by default ([api] pool_timeout_ms).
const API_POOL_TIMEOUT: Duration = Duration::from_secs(2);

fn deposit_keys(settings: &Settings) -> Result<HashMap<Chain, DepositKey>> {
    let mut keys = HashMap::new();
    if let Some(xpub) = &settings.file.eth.deposit_xpub {
        let key = EthDepositKey::parse(xpub).map_err(|e| invalid(format!("[eth] deposit_xpub: {e}")))?;
        keys.insert(Chain::Eth, DepositKey::from(key));
    }
    if let Some(xpub) = &settings.file.btc.deposit_xpub {
        let key = BtcDepositKey::parse(xpub, settings.btc_network)
            .map_err(|e| invalid(format!("[btc] deposit_xpub: {e}")))?;
        keys.insert(Chain::Btc, DepositKey::from(key));
    }
    Ok(keys)
}

/// The gRPC listener's TLS from `[api] tls_cert` / `tls_key` / `client_ca`. The key file must be
/// readable by its owner only, like hot-wallet key files.
fn server_tls(api: &crate::config::ApiConfig) -> Result<Option<custodian_api::ServerTls>> {
    let read = |path: &std::path::Path, what: &str| {
        std::fs::read(path).map_err(|e| invalid(format!("[api] {what} {}: {e}", path.display())))
    };
    match (&api.tls_cert, &api.tls_key) {
        (None, None) if api.client_ca.is_some() => Err(invalid("[api] client_ca needs tls_cert and tls_key")),
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => {
            let exposed = crate::config::readable_by_others(key)
                .map_err(|e| invalid(format!("[api] tls_key {}: {e}", key.display())))?;
            if let Some(mode) = exposed {
                return Err(invalid(format!(
                    "[api] tls_key {} is readable by other users (mode {mode:o}); chmod 600 it",
                    key.display()
                )));
            }
            Ok(Some(custodian_api::ServerTls {
                cert_pem: read(cert, "tls_cert")?,
                key_pem: read(key, "tls_key")?,
                client_ca_pem: api.client_ca.as_deref().map(|ca| read(ca, "client_ca")).transpose()?,
            }))
        }
        _ => Err(invalid("[api] tls_cert and tls_key go together")),
    }
}

async fn bind(what: &str, address: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(address)
        .await
        .map_err(|e| invalid(format!("cannot listen for {what} on {address}: {e}")))
}

pub async fn run(
    settings: &Settings,
    grpc_listen: Option<&str>,
    metrics_listen: Option<&str>,
    worker_args: &WorkerArgs,
) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    custodian_api::metric_catalog::describe_all();
    let grpc = bind("gRPC", grpc_listen.or(settings.file.api.listen.as_deref()).unwrap_or("127.0.0.1:50051")).await?;
    let metrics =
        bind("metrics", metrics_listen.or(settings.file.metrics.listen.as_deref()).unwrap_or("127.0.0.1:9100")).await?;
    let api = &settings.file.api;
    let defaults = custodian_api::ApiConfig::with_defaults(deposit_keys(settings)?, settings.btc_network);
    let api_config = custodian_api::ApiConfig {
        requests_per_second: api.requests_per_second.unwrap_or(defaults.requests_per_second),
        burst: api.burst.unwrap_or(defaults.burst),
        peer_requests_per_second: api.peer_requests_per_second.unwrap_or(defaults.peer_requests_per_second),
        peer_burst: api.peer_burst.unwrap_or(defaults.peer_burst),
        max_concurrent_requests: api.max_concurrent_requests.unwrap_or(defaults.max_concurrent_requests),
        request_timeout: api.request_timeout_ms.map_or(defaults.request_timeout, Duration::from_millis),
        tls: server_tls(&settings.file.api)?,
        ..defaults
    };
    let mut warnings = Vec::new();
    let grpc_address = grpc.local_addr()?;
    if api_config.tls.is_none() && !grpc_address.ip().is_loopback() {
        warnings.push(format!("the gRPC API listens in plaintext on {grpc_address}: set [api] tls_cert and tls_key"));
    }
    if !settings.database_url.is_loopback()
        && settings.database_url.ssl_mode() != custodian_store::tls::SslMode::VerifyFull
    {
        warnings.push(format!(
            "the database connection is not verified (sslmode={:?}): use sslmode=verify-full with sslrootcert",
            settings.database_url.ssl_mode()
        ));
    }
    for warning in &warnings {
        tracing::warn!("{warning}");
    }
    // The API's own connections: no flood of calls can take one the scanners or the worker need.
    let api_pool = custodian_store::pool::connect_with(
        &settings.database_url,
        api.pool_size.unwrap_or(API_POOL_SIZE),
        api.pool_timeout_ms.map_or(API_POOL_TIMEOUT, Duration::from_millis),
    )
    .await
    .context("opening the API's connections")?;
    warm(&api_pool, api.pool_size.unwrap_or(API_POOL_SIZE)).await;
    // Printed so scripts and tests can find ports chosen by the system (":0").
    println!("grpc listening on {}", grpc.local_addr()?);
    println!("metrics listening on {}", metrics.local_addr()?);

    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        super::shutdown_signal().await;
        tracing::warn!("shutdown requested: finishing in-flight work");
        let _ = stop.send(true);
    });

    let mut service = Service::new(pool.clone(), stopped);
    let config = ScanConfig { retention_blocks: settings.retention_blocks, ..ScanConfig::default() };
    if settings.eth_rpc.is_some() {
        service.scanner(super::scan::eth_reader(settings).await?, config.clone());
    }
    if let Some(url) = &settings.btc_rpc {
        let reader =
            BtcReader::new(url, settings.btc_auth.clone(), settings.btc_network).map_err(|e| invalid(e.to_string()))?;
        service.scanner(reader, config);
    }
    let interval = Duration::from_millis(worker_args.interval_ms);
    let eth_node = super::reconcile::eth_node(settings)?;
    if let Some(node) = &eth_node {
        let lanes = hot_wallet::lanes(&pool.get().await?).await?;
        let signers = super::withdraw::signers(settings, &lanes, &worker_args.key_files, false)?;
        let config = super::withdraw::worker_config(settings, worker_args);
        service.eth_worker(Worker::new(pool.clone(), node.clone(), signers, config), interval);
    }
    if let Some(btc) = super::withdraw::btc_worker(settings, &pool).await? {
        service.btc_worker(btc, interval);
    }
    service.gauges(eth_node.clone(), low_balance_thresholds(settings)?).reconciliation(eth_node);
    if settings.file.webhooks.enabled.unwrap_or(true) {
        service.webhooks(super::webhook::deliverer(settings, pool.clone())?);
    }
    service.api(grpc, api_pool, api_config).health(metrics, recorder, warnings);
    service.run().await?;
    Ok(Exit::Success)
}

/// Opens every one of the API's `size` connections and readies each for withdrawal requests
/// ([`custodian_withdrawals::request::warm`]), before the API listens: otherwise the first
/// requests after a start each open a connection and plan every statement on it, at about 25 ms
/// where a request takes 2-5. A connection that cannot be warmed is only logged: the pool opens
/// another when a request needs one.
async fn warm(pool: &deadpool_postgres::Pool, size: usize) {
    let started = std::time::Instant::now();
    // All checked out before any is warmed, so that each is a connection of its own.
    let checked_out = futures::future::join_all((0..size).map(|_| pool.get())).await;
    let mut failures = Vec::new();
    let mut clients = Vec::new();
    for client in checked_out {
        match client {
            Ok(client) => clients.push(client),
            Err(e) => failures.push(e.to_string()),
        }
    }
    let warmed = futures::future::join_all(clients.iter_mut().map(custodian_withdrawals::request::warm)).await;
    failures.extend(warmed.into_iter().filter_map(Result::err).map(|e| e.to_string()));
    match failures.first() {
        None => {
            tracing::info!(connections = size, elapsed_ms = started.elapsed().as_millis(), "API connections warmed")
        }
        Some(first) => {
            tracing::warn!(failed = failures.len(), connections = size, "warming the API's connections: {first}")
        }
    }
}

/// `[metrics] low_balance`, per lane in smallest units of the lane's native coin.
fn low_balance_thresholds(settings: &Settings) -> Result<custodian_service::gauges::Thresholds> {
    settings
        .file
        .metrics
        .low_balance
        .iter()
        .map(|(lane, amount)| {
            // Which coin is only known from the lane's chain; both parse the same way, ETH to 18
            // decimals and BTC to 8, so the lane's chain is looked up when the gauge is set.
            let units = custodian_domain::Amount::parse_decimal(amount, 18)
                .map_err(|e| invalid(format!("[metrics] low_balance.{lane} = {amount:?}: {e}")))?;
            Ok((lane.clone(), units.units()))
        })
        .collect()
}
