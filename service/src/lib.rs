//! The long-running service, assembled: what `custodian serve` runs (a scanner per configured
//! chain, posting after every step; the withdrawal workers; the gRPC API; `/metrics` and
//! `/healthz`; the gauges, the periodic reconciliation and webhook delivery) and what `custodian
//! work` runs (the workers alone). The binary reads configuration, builds the parts and hands them
//! to a [`Service`]; the parts' loops, the hot-key lookup order and the lane checks live here.
//!
//! Every part stops when the shared stop signal turns true: scanners between batches, workers
//! between passes, the API after in-flight requests; no database transaction is interrupted.
//! A part that stops with an error while the service is not stopping is reported by `/healthz`
//! (503) and, once every part has returned, by [`Service::run`].
//!
//! This crate knows no command line and no configuration file: what it is given, it runs.

pub mod gauges;
pub mod health;
pub mod keys;
pub mod posting;
pub mod reconcile;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use custodian_domain::Chain;
use custodian_ingest::{ChainReader, NoProgress, ScanConfig, Scanner, ScannerState, StateHandle};
use custodian_store::Pool;
use custodian_withdrawals::btc::BtcWorker;
use custodian_withdrawals::Worker;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A part of the service that stopped with an error, with what it stopped on.
#[derive(Debug, thiserror::Error)]
#[error("{part} stopped: {source}")]
pub struct PartFailed {
    /// Which part.
    pub part: String,
    /// Why.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl PartFailed {
    fn new(part: impl Into<String>, source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        PartFailed { part: part.into(), source: source.into() }
    }
}

/// Parts that stopped for good, as `/healthz` names them.
pub type Broken = Arc<Mutex<Vec<String>>>;

/// The parts of a running service and the stop signal they share.
pub struct Service {
    pool: Pool,
    stopped: watch::Receiver<bool>,
    tasks: JoinSet<Result<(), PartFailed>>,
    broken: Broken,
    scanners: Vec<(Chain, StateHandle)>,
}

impl Service {
    /// A service on `pool` whose parts stop once `stopped` turns true.
    pub fn new(pool: Pool, stopped: watch::Receiver<bool>) -> Service {
        Service { pool, stopped, tasks: JoinSet::new(), broken: Broken::default(), scanners: Vec::new() }
    }

    /// Runs `part`; when `to_health`, its failure is recorded for `/healthz` before it is
    /// returned (a scanner's is not: its own state says it stopped, and why).
    fn spawn<F, E>(&mut self, part: String, to_health: bool, run: F)
    where
        F: std::future::Future<Output = Result<(), E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let broken = to_health.then(|| self.broken.clone());
        self.tasks.spawn(async move {
            run.await.map_err(|e| {
                let failed = PartFailed::new(part, e);
                if let Some(broken) = broken {
                    broken.lock().unwrap_or_else(PoisonError::into_inner).push(failed.to_string());
                }
                failed
            })
        });
    }

    /// A scanner of `reader`'s chain that posts confirmed deposits and seals the history after
    /// every step ([`posting::PostAfterStep`]).
    pub fn scanner<R: ChainReader + 'static>(&mut self, reader: R, config: ScanConfig) -> &mut Self {
        let chain = reader.chain();
        let state = StateHandle::new(Mutex::new(ScannerState::Starting));
        self.scanners.push((chain, state.clone()));
        let scanner = Scanner::new(reader, self.pool.clone(), config)
            .with_after_step(Arc::new(posting::PostAfterStep::new(self.pool.clone())))
            .with_state(state);
        let stopped = self.stopped.clone();
        self.spawn(format!("the {chain} scanner"), false, async move {
            scanner.run(&NoProgress, stopped).await.map(|_| ())
        });
        self
    }

    /// The ETH withdrawal worker, a pass every `interval`.
    pub fn eth_worker(&mut self, worker: Worker, interval: Duration) -> &mut Self {
        let stopped = self.stopped.clone();
        self.spawn("the withdrawal worker".to_owned(), true, async move { worker.run(interval, stopped).await });
        self
    }

    /// The BTC withdrawal worker, a pass every `interval`.
    pub fn btc_worker(&mut self, worker: BtcWorker, interval: Duration) -> &mut Self {
        let stopped = self.stopped.clone();
        self.spawn("the BTC withdrawal worker".to_owned(), true, async move { worker.run(interval, stopped).await });
        self
    }

    /// The projection gauges and the history's seals ([`gauges::projections`]), and the hot
    /// wallets' balance gauges against `thresholds` ([`gauges::hot_wallets`]).
    pub fn gauges(&mut self, eth: Option<custodian_withdrawals::EthNode>, thresholds: gauges::Thresholds) -> &mut Self {
        let (pool, stopped) = (self.pool.clone(), self.stopped.clone());
        self.spawn("the gauges".to_owned(), true, async move {
            gauges::projections(pool, stopped).await;
            Ok::<(), PartFailed>(())
        });
        let (pool, stopped) = (self.pool.clone(), self.stopped.clone());
        self.spawn("the hot-wallet gauges".to_owned(), true, async move {
            gauges::hot_wallets(pool, eth, thresholds, stopped).await;
            Ok::<(), PartFailed>(())
        });
        self
    }

    /// The ledger reconciled with the chain every [`reconcile::INTERVAL`] ([`reconcile::periodically`]).
    pub fn reconciliation(&mut self, eth: Option<custodian_withdrawals::EthNode>) -> &mut Self {
        let (pool, stopped) = (self.pool.clone(), self.stopped.clone());
        self.spawn("reconciliation".to_owned(), true, async move {
            reconcile::periodically(eth, pool, stopped).await;
            Ok::<(), PartFailed>(())
        });
        self
    }

    /// Webhook delivery.
    pub fn webhooks(&mut self, deliverer: custodian_api::webhooks::Deliverer) -> &mut Self {
        let stopped = self.stopped.clone();
        self.spawn("webhook delivery".to_owned(), true, async move { deliverer.run(stopped).await });
        self
    }

    /// The gRPC API on `listener`, with its own connections (`api_pool`): no flood of calls can
    /// take one the scanners or the workers need. It stops after its in-flight requests.
    pub fn api(
        &mut self,
        listener: tokio::net::TcpListener,
        api_pool: Pool,
        config: custodian_api::ApiConfig,
    ) -> &mut Self {
        let mut stopped = self.stopped.clone();
        let shutdown = async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        };
        self.spawn("the gRPC API".to_owned(), true, custodian_api::serve(listener, api_pool, config, shutdown));
        self
    }

    /// `/metrics` and `/healthz` on `listener` ([`health::serve`]), reporting the scanners added
    /// so far, every part that stopped, and the standing `warnings`. Add it last.
    pub fn health(
        &mut self,
        listener: tokio::net::TcpListener,
        recorder: metrics_exporter_prometheus::PrometheusHandle,
        warnings: Vec<String>,
    ) -> &mut Self {
        let parts = health::Parts { warnings, broken: self.broken.clone(), scanners: self.scanners.clone() };
        let (pool, stopped) = (self.pool.clone(), self.stopped.clone());
        self.spawn(
            "/metrics and /healthz".to_owned(),
            true,
            health::serve(listener, pool, Arc::new(recorder), Arc::new(parts), stopped),
        );
        self
    }

    /// Waits for every part to return. The first failure is returned unless the service was
    /// asked to stop (a part cut short by the stop signal is not a failure); a panic is one.
    pub async fn run(mut self) -> Result<(), PartFailed> {
        let mut failure = None;
        while let Some(joined) = self.tasks.join_next().await {
            match joined {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!("a component stopped: {e}");
                    failure.get_or_insert(e);
                }
                Err(e) => {
                    failure.get_or_insert(PartFailed::new("a component", format!("panicked: {e}")));
                }
            }
        }
        match failure {
            Some(e) if !*self.stopped.borrow() => Err(e),
            _ => Ok(()),
        }
    }
}
