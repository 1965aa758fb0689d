//! `custodian serve`: the gRPC API, a scanner per configured chain (posting after every step),
//! the withdrawal worker, and `/metrics` and `/healthz`, in one process.
//!
//! On SIGTERM every part stops taking new work: scanners stop between batches, the worker between
//! passes, the API after in-flight requests; no database transaction is interrupted, and the
//! process exits 0. Several `serve` processes may share one database: scanners guard their cursor,
//! workers claim withdrawals with row locks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use custodian_domain::hd::{BtcDepositKey, DepositKey, EthDepositKey};
use custodian_domain::Chain;
use custodian_ingest::btc::BtcReader;
use custodian_ingest::{ChainReader, NoProgress, ScanConfig, Scanner, ScannerState, StateHandle};
use custodian_store::Pool;
use custodian_withdrawals::{hot_wallet, EthNode, Worker};
use tokio::sync::watch;

use super::scan::PostAfterStep;
use crate::cli::WorkerArgs;
use crate::exit::{invalid, Exit};
use crate::settings::Settings;

/// The API's own connections by default ([api] pool_size).
const API_POOL_SIZE: usize = 8;
/// How long an API call waits for one of them by default ([api] pool_timeout_ms).
const API_POOL_TIMEOUT: Duration = Duration::from_secs(2);

/// How often projection gauges (withdrawals per state, paused lanes) are refreshed.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

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
    // Printed so scripts and tests can find ports chosen by the system (":0").
    println!("grpc listening on {}", grpc.local_addr()?);
    println!("metrics listening on {}", metrics.local_addr()?);

    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        super::shutdown_signal().await;
        tracing::warn!("shutdown requested: finishing in-flight work");
        let _ = stop.send(true);
    });

    let mut tasks = tokio::task::JoinSet::new();
    // Parts that stopped for good (a worker on the wrong chain): /healthz answers 503 with them.
    let broken: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let config = ScanConfig { retention_blocks: settings.retention_blocks, ..ScanConfig::default() };
    // Each scanner's state, for /healthz: scanning, standby, retrying since …, stopped.
    let mut scanners: Vec<(Chain, StateHandle)> = Vec::new();
    if settings.eth_rpc.is_some() {
        let reader = super::scan::eth_reader(settings).await?;
        let state = StateHandle::new(std::sync::Mutex::new(ScannerState::Starting));
        scanners.push((Chain::Eth, state.clone()));
        tasks.spawn(scan(reader, pool.clone(), config.clone(), state, stopped.clone()));
    }
    if let Some(url) = &settings.btc_rpc {
        let reader =
            BtcReader::new(url, settings.btc_auth.clone(), settings.btc_network).map_err(|e| invalid(e.to_string()))?;
        let state = StateHandle::new(std::sync::Mutex::new(ScannerState::Starting));
        scanners.push((Chain::Btc, state.clone()));
        tasks.spawn(scan(reader, pool.clone(), config, state, stopped.clone()));
    }
    if let Some(url) = &settings.eth_rpc {
        let lanes = hot_wallet::lanes(&pool.get().await?).await?;
        let signers = super::withdraw::signers(settings, &lanes, &worker_args.key_files)?;
        super::withdraw::require_chain_id(settings, &signers)?;
        let node = EthNode::with_timeout(url, settings.eth_rpc_timeout).map_err(|e| invalid(e.to_string()))?;
        let worker = Worker::new(pool.clone(), node, signers, super::withdraw::worker_config(settings, worker_args));
        tasks.spawn(work(worker, Duration::from_millis(worker_args.interval_ms), stopped.clone(), broken.clone()));
    }
    if let Some(btc) = super::withdraw::btc_worker(settings, &pool).await? {
        let interval = Duration::from_millis(worker_args.interval_ms);
        let (stopped, broken) = (stopped.clone(), broken.clone());
        tasks.spawn(async move {
            if let Err(e) = btc.run(interval, stopped).await {
                let reason = format!("the BTC withdrawal worker stopped: {e}");
                broken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(reason.clone());
                anyhow::bail!(reason);
            }
            Ok(())
        });
    }
    tasks.spawn(gauges(pool.clone(), stopped.clone()));
    let thresholds = low_balance_thresholds(settings)?;
    let eth_node = match &settings.eth_rpc {
        Some(url) => Some(EthNode::with_timeout(url, settings.eth_rpc_timeout).map_err(|e| invalid(e.to_string()))?),
        None => None,
    };
    tasks.spawn(hot_wallet_gauges(pool.clone(), eth_node, thresholds, stopped.clone()));
    tasks.spawn(reconcile(settings.eth_rpc.clone(), settings.eth_rpc_timeout, pool.clone(), stopped.clone()));
    if settings.file.webhooks.enabled.unwrap_or(true) {
        let deliverer = super::webhook::deliverer(settings, pool.clone())?;
        let stopped = stopped.clone();
        tasks.spawn(async move { deliverer.run(stopped).await.map_err(|e| anyhow::anyhow!("webhook delivery: {e}")) });
    }
    let parts = Parts { warnings, broken, scanners };
    tasks.spawn(health(metrics, pool.clone(), Arc::new(recorder), Arc::new(parts), stopped.clone()));
    let mut api_stopped = stopped.clone();
    let api_shutdown = async move {
        let _ = api_stopped.wait_for(|stop| *stop).await;
    };
    tasks.spawn(async move {
        custodian_api::serve(grpc, api_pool, api_config, api_shutdown)
            .await
            .map_err(|e| anyhow::anyhow!("gRPC API: {e}"))
    });

    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::error!("a component stopped: {e:#}");
                failure.get_or_insert(e);
            }
            Err(e) => {
                failure.get_or_insert(anyhow::anyhow!("a component panicked: {e}"));
            }
        }
    }
    match failure {
        Some(e) if !*stopped.borrow() => Err(e),
        _ => Ok(Exit::Success),
    }
}

async fn scan<R: ChainReader + 'static>(
    reader: R,
    pool: Pool,
    config: ScanConfig,
    state: StateHandle,
    stopped: watch::Receiver<bool>,
) -> Result<()> {
    let chain = reader.chain();
    let scanner =
        Scanner::new(reader, pool.clone(), config).with_after_step(Arc::new(PostAfterStep(pool))).with_state(state);
    scanner.run(&NoProgress, stopped).await.with_context(|| format!("{chain} scanner"))?;
    Ok(())
}

async fn work(
    worker: Worker,
    interval: Duration,
    stopped: watch::Receiver<bool>,
    broken: Arc<std::sync::Mutex<Vec<String>>>,
) -> Result<()> {
    if let Err(e) = worker.run(interval, stopped).await {
        let reason = format!("the withdrawal worker stopped: {e}");
        broken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(reason.clone());
        anyhow::bail!(reason);
    }
    Ok(())
}

/// How often the hot wallets' balances are read for their gauges.
const HOT_WALLET_GAUGE_INTERVAL: Duration = Duration::from_secs(30);

/// `[metrics] low_balance`, per lane in smallest units of the lane's native coin.
fn low_balance_thresholds(settings: &Settings) -> Result<HashMap<String, alloy_primitives::U256>> {
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

/// Each hot wallet's balance of its native coin as `custodian_hot_wallet_balance{chain,lane}`
/// (smallest units: ETH from the node at its latest block, BTC the lane's spendable coins), and
/// `custodian_hot_wallet_low{lane}` against `[metrics] low_balance`. Node calls happen outside
/// any transaction; a failed read leaves the gauge as it was.
async fn hot_wallet_gauges(
    pool: Pool,
    eth: Option<EthNode>,
    thresholds: HashMap<String, alloy_primitives::U256>,
    mut stopped: watch::Receiver<bool>,
) -> Result<()> {
    let mut alerted: std::collections::HashSet<String> = std::collections::HashSet::new();
    while !*stopped.borrow() {
        let mut balances: Vec<(&'static str, String, alloy_primitives::U256)> = Vec::new();
        if let Ok(client) = pool.get().await {
            if let Ok(lanes) = hot_wallet::btc_lanes(&client).await {
                for lane in lanes {
                    if let Ok(spendable) = lane.spendable.parse::<alloy_primitives::U256>() {
                        balances.push(("btc", lane.lane, spendable));
                    }
                }
            }
            let eth_lanes = hot_wallet::lanes(&client).await.unwrap_or_default();
            drop(client);
            if let Some(node) = &eth {
                for lane in eth_lanes {
                    let Ok(address) = lane.address.parse() else { continue };
                    if let Ok(balance) = node.balance(address).await {
                        balances.push(("eth", lane.lane, balance));
                    }
                }
            }
        }
        for (chain, lane, balance) in balances {
            metrics::gauge!("custodian_hot_wallet_balance", "chain" => chain, "lane" => lane.clone())
                .set(u128::try_from(balance).unwrap_or(u128::MAX) as f64);
            let Some(threshold) = thresholds.get(&lane) else { continue };
            // Thresholds are parsed to 18 decimals; BTC counts in 8.
            let threshold =
                if chain == "btc" { *threshold / alloy_primitives::U256::from(10_000_000_000u64) } else { *threshold };
            let low = balance < threshold;
            metrics::gauge!("custodian_hot_wallet_low", "lane" => lane.clone()).set(if low { 1.0 } else { 0.0 });
            if low && alerted.insert(lane.clone()) {
                tracing::error!(chain, lane = %lane, %balance, %threshold, "ALERT: hot wallet below its low-balance threshold; top it up");
            } else if !low {
                alerted.remove(&lane);
            }
        }
        tokio::select! {
            _ = stopped.changed() => {}
            _ = tokio::time::sleep(HOT_WALLET_GAUGE_INTERVAL) => {}
        }
    }
    Ok(())
}

/// How often `serve` reconciles the ledger with the chain.
const RECONCILE_INTERVAL: Duration = Duration::from_secs(300);
/// How soon a reconciliation that could not read everything (or failed) is tried again.
const RECONCILE_RETRY: Duration = Duration::from_secs(5);

/// `custodian reconcile` every [`RECONCILE_INTERVAL`]: its result is the
/// `custodian_reconciliation_difference{asset}` gauges, and each difference an alert.
async fn reconcile(
    eth_rpc: Option<String>,
    eth_rpc_timeout: Duration,
    pool: Pool,
    mut stopped: watch::Receiver<bool>,
) -> Result<()> {
    while !*stopped.borrow() {
        // Soon again while an asset could not be read yet (its chain not scanned yet, say).
        let wait = match super::reconcile::run(eth_rpc.as_deref(), eth_rpc_timeout, &pool).await {
            Ok(found) => {
                for difference in &found.differences {
                    tracing::error!("ALERT: reconciliation: {difference}");
                }
                if found.skipped.is_empty() {
                    RECONCILE_INTERVAL
                } else {
                    RECONCILE_RETRY
                }
            }
            Err(e) => {
                tracing::warn!("reconciling the ledger with the chain failed; tried again soon: {e:#}");
                RECONCILE_RETRY
            }
        };
        tokio::select! {
            _ = stopped.changed() => {}
            _ = tokio::time::sleep(wait) => {}
        }
    }
    Ok(())
}

/// Withdrawals per state and paused lanes, read from the projections.
async fn gauges(pool: Pool, mut stopped: watch::Receiver<bool>) -> Result<()> {
    while !*stopped.borrow() {
        if let Ok(client) = pool.get().await {
            // Every state, zero included: a state that empties must read 0, not its last count.
            let per_state =
                "select s.state, count(w.id) from unnest(array['requested', 'awaiting_approval', 'rejected',
                                     'signed', 'broadcast', 'mined', 'confirmed', 'failed_onchain', 'cancel_requested',
                                     'cancelled', 'needs_review']) as s (state)
                               left join withdrawal w on w.state = s.state group by s.state";
            if let Ok(rows) = client.query(per_state, &[]).await {
                for row in rows {
                    metrics::gauge!("custodian_withdrawals", "state" => row.get::<_, String>(0))
                        .set(row.get::<_, i64>(1) as f64);
                }
            }
            if let Ok(row) = client.query_one("select count(*) from hot_wallet where paused_at is not null", &[]).await
            {
                metrics::gauge!("custodian_paused_lanes").set(row.get::<_, i64>(0) as f64);
            }
            if let Err(e) = custodian_api::webhooks::record_gauges(&client).await {
                tracing::warn!("reading the webhook backlog failed; retried next round: {e}");
            }
            // The history's hash chain follows every writer (withdrawals, operator actions too).
            if let Err(e) = custodian_projections::seals::seal(&client).await {
                tracing::warn!("sealing the history failed; retried next round: {e}");
            }
        }
        tokio::select! {
            _ = stopped.changed() => {}
            _ = tokio::time::sleep(GAUGE_INTERVAL) => {}
        }
    }
    Ok(())
}

/// What `/healthz` reports besides the database.
struct Parts {
    /// Standing warnings (plaintext listeners, unverified TLS).
    warnings: Vec<String>,
    /// Parts that stopped for good.
    broken: Arc<std::sync::Mutex<Vec<String>>>,
    /// Each scanner's state.
    scanners: Vec<(Chain, StateHandle)>,
}

impl Parts {
    /// Reasons to answer 503, and a line per scanner.
    fn report(&self) -> (Vec<String>, Vec<String>) {
        let mut down = self.broken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut lines = Vec::new();
        for (chain, state) in &self.scanners {
            let state = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            if state.is_stopped() {
                down.push(format!("the {chain} scanner {}", state.describe()));
            }
            lines.push(format!("{chain} scanner: {}", state.describe()));
        }
        (down, lines)
    }
}

/// A minimal HTTP/1.1 responder: `GET /metrics` (Prometheus text) and `GET /healthz` (200 when
/// the database answers and no part stopped, 503 otherwise, with each scanner's state). One
/// request per connection.
async fn health(
    listener: tokio::net::TcpListener,
    pool: Pool,
    recorder: Arc<metrics_exporter_prometheus::PrometheusHandle>,
    parts: Arc<Parts>,
    mut stopped: watch::Receiver<bool>,
) -> Result<()> {
    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::IntoResponse;
    const TEXT: &str = "text/plain; version=0.0.4";
    let metrics = axum::routing::get(move || {
        let recorder = recorder.clone();
        async move { ([(header::CONTENT_TYPE, TEXT)], recorder.render()) }
    });
    let healthz = axum::routing::get(move || {
        let (pool, parts) = (pool.clone(), parts.clone());
        async move {
            let (down, scanner_lines) = parts.report();
            let scanner_lines: String = scanner_lines.iter().map(|l| format!("{l}\n")).collect();
            let (status, body) = if !down.is_empty() {
                (StatusCode::SERVICE_UNAVAILABLE, format!("stopped: {}\n{scanner_lines}", down.join("\n")))
            } else {
                match pool.get().await {
                    Ok(client) if client.query_one("select 1", &[]).await.is_ok() => {
                        let notes: String = parts.warnings.iter().map(|w| format!("warning: {w}\n")).collect();
                        (StatusCode::OK, format!("ok\n{scanner_lines}{notes}"))
                    }
                    _ => (StatusCode::SERVICE_UNAVAILABLE, format!("database unreachable\n{scanner_lines}")),
                }
            };
            (status, [(header::CONTENT_TYPE, TEXT)], body)
        }
    });
    let router = axum::Router::new()
        .route("/metrics", metrics)
        .route("/healthz", healthz)
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n").into_response() })
        // One request per connection, as probes and scrapers make them.
        .layer(axum::middleware::map_response(|mut response: axum::response::Response| async move {
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }));
    axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })
        .await
        .context("serving /metrics and /healthz")?;
    Ok(())
}
