//! The scanner: fetch ahead concurrently, ingest strictly in order, reconcile on reorgs.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use custodian_domain::Chain;
use custodian_store::Pool;
use futures::{StreamExt, TryStreamExt};

use crate::block::{FetchedBlock, TransferAsset};
use crate::reader::{ChainReader, ReadError};
use crate::sql::{self, DepositRow, IngestError};

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
        }
    }
}

/// Why the scanner stopped.
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
    /// A previously orphaned block is canonical again.
    #[error("ALERT: {0}; scanner stopped for an operator")]
    Reinstated(IngestError),
    /// The database failed.
    #[error("database error: {0}")]
    Database(String),
}

impl From<tokio_postgres::Error> for ScanError {
    fn from(e: tokio_postgres::Error) -> Self {
        ScanError::Database(e.to_string())
    }
}

impl From<deadpool_postgres::PoolError> for ScanError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        ScanError::Database(e.to_string())
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
    reader: R,
    pool: Pool,
    config: ScanConfig,
    after_step: Option<std::sync::Arc<dyn AfterStep>>,
    /// The next batch (its first height and blocks), fetched while the previous one was being
    /// stored, so that the node (or the reader's decoding) and the database work at once.
    prefetched: std::sync::Mutex<Option<(u64, Vec<FetchedBlock>)>>,
}

enum Step {
    CaughtUp,
    Stored,
}

impl<R: ChainReader> Scanner<R> {
    /// A scanner reading from `reader` into `pool`.
    pub fn new(reader: R, pool: Pool, config: ScanConfig) -> Self {
        Scanner { reader, pool, config, after_step: None, prefetched: std::sync::Mutex::new(None) }
    }

    /// Runs `hook` after every step that stored blocks or handled a reorg.
    pub fn with_after_step(mut self, hook: std::sync::Arc<dyn AfterStep>) -> Self {
        self.after_step = Some(hook);
        self
    }

    async fn stepped(&self) {
        if let Some(hook) = &self.after_step {
            hook.after_step(self.chain()).await;
        }
    }

    /// The chain scanned.
    pub fn chain(&self) -> Chain {
        self.reader.chain()
    }

    /// Scans until our cursor passes the node's tip, then returns.
    pub async fn run_to_tip(&self, progress: &dyn Progress) -> Result<ScanReport, ScanError> {
        let mut report = ScanReport::default();
        let started = Instant::now();
        while let Step::Stored = self.step(&mut report, progress, started, Some(self.config.max_retries)).await? {}
        report.our_tip = sql::our_tip(&self.pool.get().await?, self.chain()).await?.map(|(h, _)| h);
        Ok(report)
    }

    /// Scans forever (node failures are retried without limit) until `shutdown` turns true.
    /// Stops only between batches, never inside a database transaction.
    pub async fn run(
        &self,
        progress: &dyn Progress,
        mut shutdown: tokio::sync::watch::Receiver<bool>,
    ) -> Result<ScanReport, ScanError> {
        let mut report = ScanReport::default();
        let started = Instant::now();
        while !*shutdown.borrow() {
            let step = tokio::select! {
                step = self.step(&mut report, progress, started, None) => step?,
                _ = shutdown.changed() => break,
            };
            if let Step::CaughtUp = step {
                tokio::select! {
                    _ = tokio::time::sleep(self.config.poll_interval) => {}
                    _ = shutdown.changed() => {}
                }
            }
        }
        Ok(report)
    }

    /// Calls the node, retrying transient failures with exponential backoff.
    async fn with_retry<T, F, Fut>(&self, what: &str, budget: Option<u32>, mut call: F) -> Result<T, ScanError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, ReadError>>,
    {
        let mut backoff = self.config.initial_backoff;
        let mut attempts = 0;
        loop {
            attempts += 1;
            match call().await {
                Ok(value) => return Ok(value),
                Err(e) if !e.is_transient() => return Err(ScanError::Read(e)),
                Err(e) if budget.is_some_and(|b| attempts >= b) => {
                    return Err(ScanError::NodeUnavailable { attempts, last: e })
                }
                Err(e) => {
                    tracing::warn!(chain = %self.chain(), attempt = attempts, retry_in_ms = backoff.as_millis() as u64,
                        "{what} failed, retrying: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(self.config.max_backoff);
                }
            }
        }
    }

    async fn step(
        &self,
        report: &mut ScanReport,
        progress: &dyn Progress,
        started: Instant,
        budget: Option<u32>,
    ) -> Result<Step, ScanError> {
        let chain = self.chain();
        let cursor = {
            let client = self.pool.get().await?;
            sql::init_cursor(&client, chain, self.config.start_height).await?
        };
        let node_tip = self.with_retry("reading the node's tip", budget, || self.reader.tip_height()).await?;
        report.node_tip = node_tip;
        metrics::gauge!("custodian_scanner_node_tip", "chain" => chain.as_str()).set(node_tip as f64);
        if cursor > node_tip {
            metrics::gauge!("custodian_scanner_lag_blocks", "chain" => chain.as_str()).set(0.0);
            return self.check_tip(node_tip, report, budget).await;
        }
        let end = node_tip.min(cursor + self.config.batch_blocks - 1);
        let prefetched = self.prefetched.lock().expect("BUG: prefetch lock poisoned").take();
        let blocks = match prefetched {
            // Checked like any other batch: its first parent against our block below the cursor.
            Some((from, blocks)) if from == cursor && !blocks.is_empty() => blocks,
            _ => self.with_retry("fetching blocks", budget, || self.fetch_range(cursor, end)).await?,
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
            sql::ingest_batch(client, chain, &blocks, &deposits, self.config.retention_blocks),
            prefetch
        );
        match stored {
            Ok(outcome) => {
                if let Some(next) = next {
                    *self.prefetched.lock().expect("BUG: prefetch lock poisoned") = Some((next_from, next));
                }
                report.blocks += outcome.blocks_inserted;
                report.deposits += outcome.deposits_inserted;
                if outcome.orphaned > 0 {
                    report.reorgs += 1;
                    report.orphaned += outcome.orphaned;
                    record_reorg(chain, outcome.orphaned);
                }
                let height = blocks.last().expect("BUG: empty batch ingested").height;
                metrics::gauge!("custodian_scanner_height", "chain" => chain.as_str()).set(height as f64);
                metrics::gauge!("custodian_scanner_lag_blocks", "chain" => chain.as_str())
                    .set(node_tip.saturating_sub(height) as f64);
                metrics::counter!("custodian_deposits_observed_total", "chain" => chain.as_str())
                    .increment(outcome.deposits_inserted);
                progress.batch_done(chain, height, node_tip, report, started.elapsed());
                self.stepped().await;
                Ok(Step::Stored)
            }
            Err(IngestError::ParentMismatch { height, .. }) => {
                self.reconcile(height, report, budget).await?;
                self.stepped().await;
                Ok(Step::Stored)
            }
            Err(IngestError::CursorMoved { expected, found, .. }) => {
                tracing::warn!(%chain, expected, ?found, "cursor moved under us (another scanner?); re-reading");
                Ok(Step::Stored)
            }
            Err(e @ IngestError::Reinstated { .. }) => Err(ScanError::Reinstated(e)),
            Err(IngestError::Database { source, .. }) => Err(source.into()),
        }
    }

    /// Caught up: a reorg that replaced our tip without lengthening the chain shows only as a
    /// different hash at our tip's height. A node that lacks that height (lagging, resyncing) says
    /// nothing about it and moves nothing.
    async fn check_tip(&self, node_tip: u64, report: &mut ScanReport, budget: Option<u32>) -> Result<Step, ScanError> {
        let Some((our_tip, ours)) = sql::our_tip(&self.pool.get().await?, self.chain()).await? else {
            return Ok(Step::CaughtUp);
        };
        if our_tip > node_tip {
            return Ok(Step::CaughtUp);
        }
        let theirs = self.with_retry("checking our tip", budget, || self.reader.block_hash(our_tip)).await?;
        match theirs {
            Some(theirs) if theirs != ours => {
                self.reconcile(our_tip, report, budget).await?;
                self.stepped().await;
                Ok(Step::Stored)
            }
            _ => Ok(Step::CaughtUp),
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

    /// Walks back from our tip comparing hashes with the node, orphan-marks what diverged and
    /// moves the cursor to just above the fork point. All node calls happen before the one
    /// transaction that marks.
    async fn reconcile(
        &self,
        mismatch_height: u64,
        report: &mut ScanReport,
        budget: Option<u32>,
    ) -> Result<(), ScanError> {
        let chain = self.chain();
        let window = self.config.retention_blocks;
        let ours = sql::canonical_desc(&self.pool.get().await?, chain, window + 1).await?;
        let Some(&(our_tip, _)) = ours.first() else { return Ok(()) };
        let mut fork = None;
        for (height, hash) in &ours {
            let theirs = self.with_retry("comparing block hashes", budget, || self.reader.block_hash(*height)).await?;
            if theirs.as_deref() == Some(hash.as_str()) {
                fork = Some(*height);
                break;
            }
        }
        let lowest = ours.last().map_or(0, |(h, _)| *h);
        if fork.is_none() && ours.len() as u64 > window {
            return Err(ScanError::DeepReorg { chain, window, our_tip, lowest_checked: lowest });
        }
        // Everything we hold diverges but we hold less than the window: the fork is below our
        // first block, which is where scanning started.
        let fork_height = fork.or_else(|| lowest.checked_sub(1));
        let orphaned = sql::orphan_above(&mut self.pool.get().await?, chain, fork_height).await?;
        report.reorgs += 1;
        report.orphaned += orphaned;
        record_reorg(chain, orphaned);
        tracing::warn!(%chain, mismatch_height, fork_height = ?fork_height, orphaned,
            "reorg: orphan-marked {orphaned} blocks above the fork point; re-scanning from there");
        Ok(())
    }
}

fn record_reorg(chain: Chain, depth: u64) {
    metrics::counter!("custodian_reorgs_total", "chain" => chain.as_str()).increment(1);
    metrics::gauge!("custodian_reorg_last_depth_blocks", "chain" => chain.as_str()).set(depth as f64);
}

/// The transfers in `blocks` that are deposits: to a watched address, in the native asset or a
/// registered token.
pub fn deposits_in(
    chain: Chain,
    blocks: &[FetchedBlock],
    watched: &HashSet<String>,
    tokens: &HashMap<String, String>,
) -> Vec<DepositRow> {
    let native = chain.native_symbol();
    blocks
        .iter()
        .flat_map(|block| block.transfers.iter().map(move |t| (block, t)))
        .filter(|(_, t)| watched.contains(&t.to))
        .filter_map(|(block, t)| {
            let asset = match &t.asset {
                TransferAsset::Native => native.to_owned(),
                TransferAsset::Erc20(contract) => tokens.get(contract)?.clone(),
            };
            Some(DepositRow {
                block_hash: block.hash.clone(),
                tx_hash: t.tx_hash.clone(),
                output_index: t.output_index,
                address: t.to.clone(),
                asset,
                amount: t.amount.to_string(),
            })
        })
        .collect()
}
