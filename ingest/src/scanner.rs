//! The scanner: fetch ahead concurrently, ingest strictly in order, reconcile on reorgs.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use custodian_domain::{Asset, Chain, ChainAddress, EthAddress};
use custodian_store::Pool;
use futures::{StreamExt, TryStreamExt};

use crate::block::{FetchedBlock, TransferAsset};
use crate::reader::{ChainReader, ReadError};
use crate::reorg::record_reorg;
use crate::sql::{self, DepositRow, IngestError, LeaseId};

/// How the scanner paces itself. Every limit is bounded.
#[derive(Debug, Clone)]
pub struct ScanConfig {
    /// Blocks stored per database transaction.
    pub batch_blocks: u64,
    /// Blocks fetched from the node concurrently.
    pub fetch_concurrency: usize,
    /// How far back a reorg may reach before the scanner stops and asks for a person; also how
    /// long raw payloads are kept.
    pub retention_blocks: u64,
    /// Where a never-scanned chain starts.
    pub start_height: u64,
    /// Consecutive failed node calls tolerated before `run_to_tip` gives up (`run` never does).
    pub max_retries: u32,
    /// First backoff after a node failure; doubles up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between retries.
    pub max_backoff: Duration,
    /// Wait between polls once caught up (continuous mode).
    pub poll_interval: Duration,
    /// How often a standby asks for the lease.
    pub lease_poll: Duration,
}

impl Default for ScanConfig {
    fn default() -> Self {
        ScanConfig {
            batch_blocks: 100,
            fetch_concurrency: 8,
            retention_blocks: 1024,
            start_height: 0,
            max_retries: 8,
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            poll_interval: Duration::from_secs(1),
            lease_poll: Duration::from_secs(1),
        }
    }
}

/// Why a scan step failed. In continuous mode only [`ScanError::is_fatal`] errors stop the
/// scanner; everything else is retried with backoff.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The node kept failing past the retry budget.
    #[error("giving up after {attempts} attempts: {last}")]
    NodeUnavailable {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: ReadError,
    },
    /// The node answered something that cannot be decoded.
    #[error(transparent)]
    Read(ReadError),
    /// A fork deeper than the retained window: never guessed at.
    #[error(
        "ALERT: {chain} reorg deeper than the retained window of {window} blocks: none of our blocks from \
         {our_tip} down to {lowest_checked} is on the node's chain; scanner stopped for an operator"
    )]
    DeepReorg {
        /// Chain.
        chain: Chain,
        /// Window in blocks.
        window: u64,
        /// Our tip when reconciliation started.
        our_tip: u64,
        /// Lowest height compared.
        lowest_checked: u64,
    },
    /// The node serves another chain than the one this database records.
    #[error("ALERT: {chain} node refused: {message}; nothing was written")]
    WrongChain {
        /// Chain.
        chain: Chain,
        /// What differs.
        message: String,
    },
    /// The node contradicts itself: the block it serves at `height` does not extend the block it
    /// reports at `height - 1`, and walking back orphans nothing (a load balancer in front of two
    /// nodes, a node mid-rewind). Retried with backoff, never spun on.
    #[error("ALERT: {chain} node is inconsistent: its block {height} does not extend the block it reports at {below}")]
    NodeInconsistent {
        /// Chain.
        chain: Chain,
        /// The block whose parent does not match.
        height: u64,
        /// The height below it.
        below: u64,
    },
    /// Another scanner holds the chain's lease (one-shot scans do not wait for it).
    #[error("another {chain} scanner holds the lease (database backend {pid:?}); it is scanning this chain already")]
    LeaseHeld {
        /// Chain.
        chain: Chain,
        /// Backend of the holder, if still visible.
        pid: Option<i32>,
    },
    /// The lease's session ended or another scanner took over mid-step; nothing was written.
    #[error("{chain} scanner lease lost")]
    LeaseLost {
        /// Chain.
        chain: Chain,
    },
    /// The database failed; the SQLSTATE stays in the source.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[source] tokio_postgres::Error),
    /// No database connection could be had.
    #[error("no database connection: {0}")]
    Unavailable(#[source] deadpool_postgres::PoolError),
    /// The database refused a batch (the cursor moved, a parent did not match); retried.
    #[error("storing a batch: {0}")]
    Store(#[source] IngestError),
    /// Shutdown came while the scanner waited on the node; nothing was being written.
    #[error("shutting down")]
    ShuttingDown,
}

impl ScanError {
    /// Only a refused chain identity and a fork deeper than the window stop a scanner for good.
    pub fn is_fatal(&self) -> bool {
        matches!(self, ScanError::DeepReorg { .. } | ScanError::WrongChain { .. })
    }

    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            ScanError::NodeUnavailable { .. } => "node_unavailable",
            ScanError::Read(_) => "node_answer",
            ScanError::DeepReorg { .. } => "deep_reorg",
            ScanError::WrongChain { .. } => "wrong_chain",
            ScanError::NodeInconsistent { .. } => "node_inconsistent",
            ScanError::LeaseHeld { .. } | ScanError::LeaseLost { .. } => "lease",
            ScanError::Database(_) | ScanError::Unavailable(_) | ScanError::Store(_) => "database",
            ScanError::ShuttingDown => "shutdown",
        }
    }
}

impl From<IngestError> for ScanError {
    fn from(e: IngestError) -> Self {
        match e {
            IngestError::LeaseLost { chain } => ScanError::LeaseLost { chain },
            IngestError::Database { source, .. } => source.into(),
            other => ScanError::Store(other),
        }
    }
}

/// What a scanner is doing, as `/healthz` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScannerState {
    /// Not started yet.
    Starting,
    /// Waiting for the lease another scanner holds.
    Standby {
        /// The holder's database backend.
        holder: Option<i32>,
    },
    /// Working normally.
    Scanning,
    /// Failing transiently since `since`, retried with backoff.
    Retrying {
        /// First failure of this run of failures.
        since: std::time::SystemTime,
        /// The latest failure.
        reason: String,
    },
    /// Stopped for good (refused chain identity, fork deeper than the window).
    Stopped {
        /// Why.
        reason: String,
    },
}

impl ScannerState {
    /// One line for people: `scanning`, `retrying since …: reason`, `stopped: reason`.
    pub fn describe(&self) -> String {
        match self {
            ScannerState::Starting => "starting".to_owned(),
            ScannerState::Standby { holder } => match holder {
                Some(pid) => format!("standby (the lease is held by database backend {pid})"),
                None => "standby".to_owned(),
            },
            ScannerState::Scanning => "scanning".to_owned(),
            ScannerState::Retrying { since, reason } => {
                let unix = since.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                let ago = since.elapsed().map_or(0, |d| d.as_secs());
                format!("retrying since unix time {unix} ({ago} s ago): {reason}")
            }
            ScannerState::Stopped { reason } => format!("stopped: {reason}"),
        }
    }

    /// Whether the scanner stopped for good.
    pub fn is_stopped(&self) -> bool {
        matches!(self, ScannerState::Stopped { .. })
    }
}

/// A scanner's state, shared with whoever reports it.
pub type StateHandle = std::sync::Arc<std::sync::Mutex<ScannerState>>;

/// A held scanner lease: a pooled session holding the chain's advisory lock. Dropping it closes
/// the session (rather than pooling it), which releases the lock.
struct Lease {
    client: Option<deadpool_postgres::Object>,
    id: LeaseId,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

impl From<tokio_postgres::Error> for ScanError {
    fn from(e: tokio_postgres::Error) -> Self {
        ScanError::Database(e)
    }
}

impl From<deadpool_postgres::PoolError> for ScanError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        ScanError::Unavailable(e)
    }
}

/// What a scan did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ScanReport {
    /// Blocks newly stored.
    pub blocks: u64,
    /// Deposit observations newly stored.
    pub deposits: u64,
    /// Reorgs handled.
    pub reorgs: u64,
    /// Blocks orphan-marked.
    pub orphaned: u64,
    /// Blocks orphaned earlier that came back.
    pub reinstated: u64,
    /// Our tip at the end, if any block is held.
    pub our_tip: Option<u64>,
    /// The node's tip as last seen.
    pub node_tip: u64,
}

/// Receives progress after every stored batch (a progress bar on a terminal, log lines otherwise).
pub trait Progress: Send + Sync {
    /// `height` is the last block stored, `node_tip` the node's tip, `report` the totals so far.
    fn batch_done(&self, chain: Chain, height: u64, node_tip: u64, report: &ScanReport, elapsed: Duration);
}

/// Progress that goes nowhere.
pub struct NoProgress;

impl Progress for NoProgress {
    fn batch_done(&self, _: Chain, _: u64, _: u64, _: &ScanReport, _: Duration) {}
}

/// Work the binary wires in after every stored batch or reorg (posting confirmed deposits), so
/// this crate need not know about the ledger.
pub trait AfterStep: Send + Sync {
    /// Runs after a step changed what we hold for `chain`.
    fn after_step(&self, chain: Chain) -> futures::future::BoxFuture<'_, ()>;
}

/// Scans one chain into the database.
pub struct Scanner<R> {
    pub(crate) reader: R,
    pub(crate) pool: Pool,
    pub(crate) config: ScanConfig,
    after_step: Option<std::sync::Arc<dyn AfterStep>>,
    /// The next batch (its first height and blocks), fetched while the previous one was being
    /// stored, so that the node (or the reader's decoding) and the database work at once.
    prefetched: std::sync::Mutex<Option<(u64, Vec<FetchedBlock>)>>,
    /// The chain's lease, while this scanner holds it.
    lease: tokio::sync::Mutex<Option<Lease>>,
    state: StateHandle,
    /// When the current run of failures began (node calls retried inside a step included).
    failing_since: std::sync::Mutex<Option<std::time::SystemTime>>,
    /// Set by [`Scanner::run`]: turns true on shutdown, which cuts node waits short (never a
    /// batch being stored).
    shutdown: std::sync::Mutex<Option<tokio::sync::watch::Receiver<bool>>>,
}

pub(crate) enum Step {
    CaughtUp,
    Stored,
    Standby(Option<i32>),
}

impl<R: ChainReader> Scanner<R> {
    /// A scanner reading from `reader` into `pool`.
    pub fn new(reader: R, pool: Pool, config: ScanConfig) -> Self {
        Scanner {
            reader,
            pool,
            config,
            after_step: None,
            prefetched: std::sync::Mutex::new(None),
            lease: tokio::sync::Mutex::new(None),
            state: std::sync::Arc::new(std::sync::Mutex::new(ScannerState::Starting)),
            failing_since: std::sync::Mutex::new(None),
            shutdown: std::sync::Mutex::new(None),
        }
    }

    /// Runs `hook` after every step that stored blocks or handled a reorg.
    pub fn with_after_step(mut self, hook: std::sync::Arc<dyn AfterStep>) -> Self {
        self.after_step = Some(hook);
        self
    }

    /// Reports the scanner's state into `state`.
    pub fn with_state(mut self, state: StateHandle) -> Self {
        self.state = state;
        self
    }

    /// The scanner's state.
    pub fn state(&self) -> StateHandle {
        self.state.clone()
    }

    /// Records a transient failure: the state says `retrying since …` from the first one on.
    fn note_failure(&self, reason: String) {
        let since = *self
            .failing_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_or_insert_with(std::time::SystemTime::now);
        self.set_state(ScannerState::Retrying { since, reason });
    }

    /// Records progress: the state is `state` and the failures are over.
    fn note_progress(&self, state: ScannerState) {
        self.failing_since.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take();
        self.set_state(state);
    }

    fn set_state(&self, state: ScannerState) {
        let chain = self.chain().as_str();
        metrics::gauge!("custodian_scanner_up", "chain" => chain).set(if matches!(state, ScannerState::Scanning) {
            1.0
        } else {
            0.0
        });
        *self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = state;
    }

    pub(crate) async fn stepped(&self) {
        if let Some(hook) = &self.after_step {
            hook.after_step(self.chain()).await;
        }
    }

    /// The chain scanned.
    pub fn chain(&self) -> Chain {
        self.reader.chain()
    }

    /// Scans until our cursor passes the node's tip, then returns. Fails at once if another
    /// scanner holds the chain's lease.
    pub async fn run_to_tip(&self, progress: &dyn Progress) -> Result<ScanReport, ScanError> {
        let mut report = ScanReport::default();
        let started = Instant::now();
        let outcome = async {
            loop {
                match self.leased_step(&mut report, progress, started).await? {
                    Step::Stored => {}
                    Step::CaughtUp => break,
                    Step::Standby(pid) => return Err(ScanError::LeaseHeld { chain: self.chain(), pid }),
                }
            }
            report.our_tip = sql::our_tip(&self.pool.get().await?, self.chain()).await?.map(|(h, _)| h);
            Ok(report)
        }
        .await;
        self.release_lease().await;
        outcome
    }

    /// Gives the lease up: unlocked on its session before the session is closed, so a scanner
    /// started right after this one returns finds it free (closing alone releases it only once
    /// the server has noticed the connection is gone).
    async fn release_lease(&self) {
        let Some(lease) = self.lease.lock().await.take() else { return };
        if let Some(client) = lease.client.as_ref() {
            let (class, object) = (sql::LEASE_CLASS, sql::lease_object(self.chain()));
            if let Err(e) = client.query_one("select pg_advisory_unlock($1, $2)", &[&class, &object]).await {
                tracing::debug!(chain = %self.chain(), "unlocking the lease failed; closing its session releases it: {e}");
            }
        }
    }

    /// Scans until `shutdown` turns true: as the chain's one scanner while it holds the lease, as
    /// a standby while another does. Transient failures (node, database, an inconsistent node,
    /// a lost lease) are retried with exponential backoff and jitter and reported in the state
    /// and metrics; only a refused chain identity or a fork deeper than the window stops it.
    /// Shutdown cuts short a wait on the node (a call, a backoff, the poll interval) but never a
    /// batch being stored: a batch whose transaction has begun commits (or fails) first.
    pub async fn run(
        &self,
        progress: &dyn Progress,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<ScanReport, ScanError> {
        let mut report = ScanReport::default();
        let started = Instant::now();
        let mut backoff = self.config.initial_backoff;
        let chain = self.chain();
        *self.shutdown.lock().expect("BUG: shutdown lock poisoned") = Some(shutdown.clone());
        while !*shutdown.borrow() {
            let step = self.leased_step(&mut report, progress, started).await;
            let wait = match step {
                Err(ScanError::ShuttingDown) => break,
                Ok(step) => {
                    backoff = self.config.initial_backoff;
                    match step {
                        Step::Stored => {
                            self.note_progress(ScannerState::Scanning);
                            continue;
                        }
                        Step::CaughtUp => {
                            self.note_progress(ScannerState::Scanning);
                            self.config.poll_interval
                        }
                        Step::Standby(holder) => {
                            self.note_progress(ScannerState::Standby { holder });
                            self.config.lease_poll
                        }
                    }
                }
                Err(e) if e.is_fatal() => {
                    tracing::error!(%chain, "{e}");
                    self.set_state(ScannerState::Stopped { reason: e.to_string() });
                    self.release_lease().await;
                    return Err(e);
                }
                Err(e) => {
                    self.prefetched.lock().expect("BUG: prefetch lock poisoned").take();
                    if matches!(e, ScanError::LeaseLost { .. }) {
                        self.lease.lock().await.take();
                    }
                    metrics::counter!("custodian_scanner_retries_total", "chain" => chain.as_str(), "reason" => e.label())
                        .increment(1);
                    let wait = custodian_store::jittered(backoff);
                    tracing::warn!(%chain, retry_in_ms = wait.as_millis() as u64, "scan step failed, retrying: {e}");
                    self.note_failure(e.to_string());
                    backoff = (backoff * 2).min(self.config.max_backoff);
                    wait
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.changed() => {}
            }
        }
        self.release_lease().await;
        Ok(report)
    }

    /// Takes (or checks) the lease, checks the node's identity once per lease, then steps.
    async fn leased_step(
        &self,
        report: &mut ScanReport,
        progress: &dyn Progress,
        started: Instant,
    ) -> Result<Step, ScanError> {
        let mut held = self.lease.lock().await;
        if let Some(lease) = held.as_ref() {
            let client = lease.client.as_ref().expect("BUG: a lease without its session");
            if client.query_one("select 1", &[]).await.is_err() {
                held.take();
                return Err(ScanError::LeaseLost { chain: self.chain() });
            }
        }
        if held.is_none() {
            let client = self.pool.get().await?;
            let (class, object) = (sql::LEASE_CLASS, sql::lease_object(self.chain()));
            let row =
                client.query_one("select pg_try_advisory_lock($1, $2), pg_backend_pid()", &[&class, &object]).await?;
            if !row.get::<_, bool>(0) {
                let holder = sql::lease_holder(&client, self.chain()).await?;
                return Ok(Step::Standby(holder));
            }
            let lease = Lease { client: Some(client), id: LeaseId { chain: self.chain(), pid: row.get(1) } };
            // A new holder starts from what the database says, not from a batch fetched before.
            self.prefetched.lock().expect("BUG: prefetch lock poisoned").take();
            tracing::info!(chain = %self.chain(), backend = lease.id.pid, "took the scanner lease");
            self.check_identity().await?;
            *held = Some(lease);
        }
        let lease = held.as_ref().expect("BUG: lease taken above").id;
        drop(held);
        self.step(lease, report, progress, started).await
    }

    /// Records the node's identity on the first scan; refuses a node whose identity differs.
    /// Nothing is written before this check passes.
    async fn check_identity(&self) -> Result<(), ScanError> {
        let chain = self.chain();
        let theirs = match self.with_retry("reading the node's identity", || self.reader.identity()).await {
            Err(ScanError::Read(ReadError::WrongNetwork { message, .. })) => {
                return Err(ScanError::WrongChain { chain, message })
            }
            other => other?,
        };
        let client = self.pool.get().await?;
        let ours = match sql::chain_identity(&client, chain).await? {
            Some(ours) => ours,
            None => sql::record_identity(&client, chain, &theirs).await?,
        };
        if ours != theirs {
            return Err(ScanError::WrongChain {
                chain,
                message: format!("this database scans {ours}; the node serves {theirs}"),
            });
        }
        Ok(())
    }

    /// Calls the node, retrying transient failures with exponential backoff up to the budget.
    pub(crate) async fn with_retry<T, F, Fut>(&self, what: &str, mut call: F) -> Result<T, ScanError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ReadError>>,
    {
        let mut backoff = self.config.initial_backoff;
        let mut attempts = 0;
        loop {
            attempts += 1;
            match self.unless_shutdown(call()).await? {
                Ok(value) => return Ok(value),
                Err(e) if !e.is_transient() => return Err(ScanError::Read(e)),
                Err(e) if attempts >= self.config.max_retries.max(1) => {
                    return Err(ScanError::NodeUnavailable { attempts, last: e })
                }
                Err(e) => {
                    tracing::debug!(chain = %self.chain(), attempt = attempts, retry_in_ms = backoff.as_millis() as u64,
                        "{what} failed, retrying: {e}");
                    metrics::counter!("custodian_scanner_retries_total", "chain" => self.chain().as_str(), "reason" => "node_call")
                        .increment(1);
                    self.note_failure(format!("{what}: {e}"));
                    self.unless_shutdown(tokio::time::sleep(custodian_store::jittered(backoff))).await?;
                    backoff = (backoff * 2).min(self.config.max_backoff);
                }
            }
        }
    }

    /// `wait`, or [`ScanError::ShuttingDown`] as soon as [`Scanner::run`]'s shutdown turns true.
    /// Only node calls and backoffs are waited on this way, never database work.
    async fn unless_shutdown<T>(&self, wait: impl std::future::Future<Output = T>) -> Result<T, ScanError> {
        let shutdown = self.shutdown.lock().expect("BUG: shutdown lock poisoned").clone();
        let Some(mut shutdown) = shutdown else { return Ok(wait.await) };
        tokio::pin!(wait);
        let stopped = tokio::select! {
            value = &mut wait => return Ok(value),
            stopped = shutdown.wait_for(|stop| *stop) => stopped.is_ok(),
        };
        if stopped {
            return Err(ScanError::ShuttingDown);
        }
        // Nobody can ask for a shutdown any more: the wait goes on.
        Ok(wait.await)
    }

    pub(crate) fn record_lag(&self, node_tip: u64, our_tip: Option<u64>) {
        let lag = match our_tip {
            Some(ours) => node_tip.saturating_sub(ours),
            None => node_tip.saturating_add(1).saturating_sub(self.config.start_height),
        };
        metrics::gauge!("custodian_scanner_lag_blocks", "chain" => self.chain().as_str()).set(lag as f64);
    }

    async fn step(
        &self,
        lease: LeaseId,
        report: &mut ScanReport,
        progress: &dyn Progress,
        started: Instant,
    ) -> Result<Step, ScanError> {
        let chain = self.chain();
        let cursor = {
            let client = self.pool.get().await?;
            sql::init_cursor(&client, chain, self.config.start_height).await?
        };
        let node_tip = self.with_retry("reading the node's tip", || self.reader.tip_height()).await?;
        report.node_tip = node_tip;
        metrics::gauge!("custodian_scanner_node_tip", "chain" => chain.as_str()).set(node_tip as f64);
        if cursor > node_tip {
            return self.check_tip(lease, node_tip, report).await;
        }
        let end = node_tip.min(cursor + self.config.batch_blocks - 1);
        let prefetched = self.prefetched.lock().expect("BUG: prefetch lock poisoned").take();
        let blocks = match prefetched {
            // Checked like any other batch: its first parent against our block below the cursor.
            Some((from, blocks)) if from == cursor && !blocks.is_empty() => blocks,
            _ => self.with_retry("fetching blocks", || self.fetch_range(cursor, end)).await?,
        };
        if blocks.is_empty() {
            return Ok(Step::CaughtUp);
        }
        let next_from = blocks.last().expect("BUG: empty batch").height + 1;
        let next_to = node_tip.min(next_from + self.config.batch_blocks - 1);

        let (watched, tokens) = {
            let client = self.pool.get().await?;
            (sql::watched_addresses(&client, chain).await?, sql::registered_tokens(&client).await?)
        };
        let deposits = deposits_in(chain, &blocks, &watched, &tokens);
        let client = self.pool.get().await?;
        // The next batch is fetched while this one is stored. The fetch is not part of the
        // transaction (which neither waits for it nor depends on it); a failed fetch is simply
        // retried next step, with backoff.
        let prefetch = async {
            if next_from > next_to {
                return None;
            }
            self.fetch_range(next_from, next_to).await.ok()
        };
        let (stored, next) = futures::join!(
            sql::ingest_batch(client, chain, lease, &blocks, &deposits, self.config.retention_blocks),
            prefetch
        );
        match stored {
            Ok(outcome) => {
                if let Some(next) = next {
                    *self.prefetched.lock().expect("BUG: prefetch lock poisoned") = Some((next_from, next));
                }
                report.blocks += outcome.blocks_inserted;
                report.deposits += outcome.deposits_inserted;
                report.reinstated += outcome.reinstated;
                if outcome.orphaned > 0 {
                    report.reorgs += 1;
                    report.orphaned += outcome.orphaned;
                    record_reorg(chain, outcome.orphaned);
                }
                if outcome.reinstated > 0 {
                    metrics::counter!("custodian_blocks_reinstated_total", "chain" => chain.as_str())
                        .increment(outcome.reinstated);
                    tracing::warn!(%chain, reinstated = outcome.reinstated,
                        "blocks orphaned earlier are on the node's chain again: reinstated, their deposits count again");
                }
                let height = blocks.last().expect("BUG: empty batch ingested").height;
                metrics::gauge!("custodian_scanner_height", "chain" => chain.as_str()).set(height as f64);
                self.record_lag(node_tip, Some(height));
                metrics::counter!("custodian_deposits_observed_total", "chain" => chain.as_str())
                    .increment(outcome.deposits_inserted);
                progress.batch_done(chain, height, node_tip, report, started.elapsed());
                self.stepped().await;
                Ok(Step::Stored)
            }
            Err(IngestError::ParentMismatch { height, .. }) => {
                self.reconcile(lease, height, report).await?;
                self.stepped().await;
                Ok(Step::Stored)
            }
            Err(IngestError::CursorMoved { expected, found, .. }) => {
                tracing::warn!(%chain, expected, ?found, "cursor moved under us (a rewind?); re-reading");
                Ok(Step::Stored)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Fetches `from..=to` concurrently, in order, stopping at the node's tip or where the fetched
    /// blocks stop forming one chain (the node reorged mid-fetch; the rest comes next batch).
    async fn fetch_range(&self, from: u64, to: u64) -> Result<Vec<FetchedBlock>, ReadError> {
        let fetched: Vec<Option<FetchedBlock>> = futures::stream::iter(from..=to)
            .map(|height| self.reader.fetch_block(height))
            .buffered(self.config.fetch_concurrency)
            .try_collect()
            .await?;
        let mut blocks: Vec<FetchedBlock> = Vec::with_capacity(fetched.len());
        for block in fetched.into_iter().map_while(|b| b) {
            if blocks.last().is_some_and(|prev| prev.hash != block.parent_hash) {
                break;
            }
            blocks.push(block);
        }
        Ok(blocks)
    }
}

/// The transfers in `blocks` that are deposits: to a watched address, in the native asset or a
/// registered token.
pub fn deposits_in(
    chain: Chain,
    blocks: &[FetchedBlock],
    watched: &HashSet<ChainAddress>,
    tokens: &HashMap<EthAddress, Asset>,
) -> Vec<DepositRow> {
    blocks
        .iter()
        .flat_map(|block| block.transfers.iter().map(move |t| (block, t)))
        .filter(|(_, t)| watched.contains(&t.to))
        .filter_map(|(block, t)| {
            let asset = match &t.asset {
                TransferAsset::Native => Asset::Native(chain),
                TransferAsset::Erc20(contract) => *tokens.get(contract)?,
            };
            Some(DepositRow {
                block_hash: block.hash,
                tx_hash: t.tx_hash,
                kind: t.kind,
                output_index: t.output_index,
                coinbase: t.coinbase,
                address: t.to.clone(),
                asset,
                amount: t.amount.to_string(),
            })
        })
        .collect()
}
