//! The withdrawal worker: one pass per lane of settle, nonce-cursor check, simulate and
//! allocate-and-sign, cancel replacements, broadcast, and fee bumps.
//!
//! Node calls happen before or after database transactions, never inside one. Allocation is one
//! transaction per lane batch that locks the `hot_wallet` row, assigns consecutive nonces, signs
//! locally and stores every payload before committing: a crash before commit consumes nothing,
//! and after commit the stored bytes are what gets sent, however often.
//!
//! The seams: [`allocation`] (funds, simulation, the nonce allocator and its SQL), [`broadcast`],
//! [`replacement`] (bumps and cancels over one helper, under the lane lock) and [`settlement`]
//! (receipts against intents, the cursor check); the pure parts live in [`crate::payout`].

mod allocation;
pub(crate) mod lanes;
mod nonce_allocator;
pub(crate) use allocation::{review_tampered, verified_request};
mod broadcast;
mod replacement;
mod settlement;

use std::collections::HashMap;
use std::sync::Arc;

use alloy_primitives::U256;
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_store::Pool;
use serde::Serialize;
use tokio::sync::watch;

use crate::hot_wallet::{self, Lane};
use crate::payout::hex;
use crate::rpc::{EthNode, NodeError};
use crate::signer::{Signer, SignerError};
use crate::sql::{self, StoreError};

pub use crate::payout::{payout_call, TRANSFER_GAS};
pub use nonce_allocator::Pricing;

/// How the worker paces and prices its work.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Withdrawals signed per lane per transaction at most.
    pub batch_size: i64,
    /// Blocks an attempt may stay unmined before a sibling with higher fees is signed.
    pub bump_after_blocks: u64,
    /// No attempt pays more than this per gas, wei.
    pub max_fee_per_gas_wei: U256,
    /// Blocks on top of (and including) the mined block before a withdrawal is confirmed.
    pub confirmations: u64,
    /// The EIP-155 chain id this worker signs for. A node answering another is refused before
    /// anything is signed ([`WorkError::WrongChain`]). The binary requires it whenever hot keys
    /// are configured; `None` (library tests against a throwaway node) takes the node's word.
    pub chain_id: Option<u64>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            batch_size: 64,
            bump_after_blocks: 3,
            max_fee_per_gas_wei: U256::from(500_000_000_000u64),
            confirmations: 12,
            chain_id: None,
        }
    }
}

/// Why a pass stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkError {
    /// A node call failed; the pass is retried later.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// Signing failed.
    #[error(transparent)]
    Sign(#[from] SignerError),
    /// The lane's key does not belong to its address.
    #[error("the key configured for lane {lane} signs for {key_address}, but the lane's address is {lane_address}")]
    WrongKey {
        /// Lane.
        lane: String,
        /// What the key signs for.
        key_address: String,
        /// What the database says.
        lane_address: String,
    },
    /// The node is on another chain than the one configured: nothing is signed or settled.
    #[error("the Ethereum node answers chain id {node}, but the worker is configured for {configured} ([eth] chain_id): nothing was signed")]
    WrongChain {
        /// `[eth] chain_id`.
        configured: u64,
        /// What the node said.
        node: u64,
    },
    /// The node's chain is not the one the scanners recorded (another genesis or chain id).
    #[error("the Ethereum node serves {node}, but this database records {recorded}: nothing was signed")]
    WrongIdentity {
        /// What the scanner recorded on the first scan.
        recorded: String,
        /// What the node says.
        node: String,
    },
    /// A Bitcoin node call failed; the pass is retried later.
    #[error("Bitcoin node: {0}")]
    Bitcoin(#[from] crate::btc::node::BtcNodeError),
    /// The database failed: the server's message and SQLSTATE (also in the source).
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[source] tokio_postgres::Error),
    /// No database connection could be had.
    #[error("no database connection: {0}")]
    Unavailable(#[source] deadpool_postgres::PoolError),
    /// Another writer appended to a withdrawal's stream first; the next pass decides again.
    #[error("a withdrawal changed meanwhile: {0}")]
    Conflict(#[source] custodian_store::AppendError),
}

impl WorkError {
    /// Whether retrying cannot help until an operator changes something (wrong chain, wrong key).
    pub fn is_fatal(&self) -> bool {
        matches!(self, WorkError::WrongChain { .. } | WorkError::WrongKey { .. } | WorkError::WrongIdentity { .. })
    }
}

impl From<tokio_postgres::Error> for WorkError {
    fn from(e: tokio_postgres::Error) -> Self {
        WorkError::Database(e)
    }
}

impl From<deadpool_postgres::PoolError> for WorkError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        WorkError::Unavailable(e)
    }
}

impl From<StoreError> for WorkError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Database(e)
            | StoreError::Conflict(custodian_store::AppendError::Database { source: e, .. }) => WorkError::Database(e),
            StoreError::Conflict(conflict) => WorkError::Conflict(conflict),
        }
    }
}

/// What one pass did, summed over lanes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PassReport {
    /// Withdrawals rejected by simulation.
    pub rejected: u64,
    /// Withdrawals signed (nonces allocated).
    pub signed: u64,
    /// First broadcasts accepted.
    pub broadcast: u64,
    /// Stored bytes sent again.
    pub rebroadcast: u64,
    /// Sibling attempts with higher fees.
    pub bumped: u64,
    /// Cancel replacements signed.
    pub cancel_attempts: u64,
    /// Attempts found mined.
    pub mined: u64,
    /// Mined attempts whose block was reorged out.
    pub unmined: u64,
    /// Settled.
    pub confirmed: u64,
    /// Mined with status 0.
    pub failed_onchain: u64,
    /// Cancelled by a replacement that mined.
    pub cancelled: u64,
    /// Flagged for a person.
    pub needs_review: u64,
    /// Mined paying less of a token than asked (or nothing): failed on chain, alerted.
    pub short_paid: u64,
    /// Lowest open nonces that could not be bumped within the fee cap (alerted once each).
    pub fee_cap_reached: u64,
    /// Lanes that signed nothing because the hot wallet is short, with what it is short of.
    pub short_lanes: Vec<String>,
    /// Lanes whose chain nonce is below our cursor with nothing of ours in flight (alerted).
    pub nonce_gaps: Vec<String>,
    /// Lanes paused by this pass.
    pub paused_lanes: Vec<String>,
    /// Lanes whose part of this pass failed transiently, with the error: the other lanes went on.
    pub lane_errors: Vec<String>,
}

impl PassReport {
    /// Adds `other`'s counts and lists to this report (one lane's part of a pass).
    pub fn merge(&mut self, other: PassReport) {
        let PassReport {
            rejected,
            signed,
            broadcast,
            rebroadcast,
            bumped,
            cancel_attempts,
            mined,
            unmined,
            confirmed,
            failed_onchain,
            cancelled,
            needs_review,
            short_paid,
            fee_cap_reached,
            short_lanes,
            nonce_gaps,
            paused_lanes,
            lane_errors,
        } = other;
        self.rejected += rejected;
        self.signed += signed;
        self.broadcast += broadcast;
        self.rebroadcast += rebroadcast;
        self.bumped += bumped;
        self.cancel_attempts += cancel_attempts;
        self.mined += mined;
        self.unmined += unmined;
        self.confirmed += confirmed;
        self.failed_onchain += failed_onchain;
        self.cancelled += cancelled;
        self.needs_review += needs_review;
        self.short_paid += short_paid;
        self.fee_cap_reached += fee_cap_reached;
        self.short_lanes.extend(short_lanes);
        self.nonce_gaps.extend(nonce_gaps);
        self.paused_lanes.extend(paused_lanes);
        self.lane_errors.extend(lane_errors);
    }
}

/// Appends `event` to `id` under its row lock, with the transfers it implies, if the locked
/// withdrawal still passes `still` (another worker may have moved it since it was read: then
/// nothing is written and `false` is returned). Both chains' workers record through here.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub(crate) async fn record(
    pool: &Pool,
    id: i64,
    still: impl Fn(&Withdrawal) -> bool,
    event: WithdrawalEvent,
) -> Result<bool, WorkError> {
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let mut w = sql::lock(&tx, id).await?.expect("BUG: recording on a missing withdrawal");
    if !still(&w) {
        return Ok(false);
    }
    let state = event.event_type();
    sql::append(&tx, &mut w, event).await?;
    tx.commit().await?;
    metrics::counter!("custodian_withdrawals_total", "state" => state).increment(1);
    Ok(true)
}

/// One event to record with [`record_all`]: what [`record`] takes, for one withdrawal.
pub(crate) struct Recording {
    pub(crate) id: i64,
    pub(crate) still: Box<dyn Fn(&Withdrawal) -> bool + Send + Sync>,
    pub(crate) event: WithdrawalEvent,
}

/// Events recorded per transaction by [`record_all`].
const RECORD_BATCH: usize = 500;

/// [`record`] for many withdrawals at once: one transaction per [`RECORD_BATCH`] of them, their
/// rows locked in id order (as every writer locks them, so two never wait on each other in a
/// cycle), each appended only if it still passes its check. A batch whose transaction fails is
/// recorded one by one instead, so one withdrawal's conflict never loses another's event.
/// Returns, in the order given, whether each was recorded.
///
/// # Cancel safety
/// One transaction per batch; cancelled, the batch in progress writes nothing.
pub(crate) async fn record_all(pool: &Pool, items: Vec<Recording>) -> Result<Vec<bool>, WorkError> {
    let mut recorded = vec![false; items.len()];
    let mut order: Vec<(usize, Recording)> = items.into_iter().enumerate().collect();
    order.sort_by_key(|(_, item)| item.id);
    for chunk in order.chunks(RECORD_BATCH) {
        match record_in_one_transaction(pool, chunk, None).await {
            Ok((done, _)) => {
                for ((index, _), took) in chunk.iter().zip(done) {
                    recorded[*index] = took;
                }
            }
            Err(e) => {
                tracing::info!("recording {} events together failed ({e}); recording them one by one", chunk.len());
                for (index, item) in chunk {
                    recorded[*index] = record(pool, item.id, &item.still, item.event.clone()).await?;
                }
            }
        }
    }
    Ok(recorded)
}

/// [`record`] for the withdrawals one transaction pays (a BTC spend's): all of them in one
/// database transaction, or, if it fails, none (never one by one, which a failure or a stop
/// midway would leave split). Returns, in the order given, whether each was recorded.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub(crate) async fn record_together(pool: &Pool, items: Vec<Recording>) -> Result<Vec<bool>, WorkError> {
    Ok(record_together_pausing(pool, items, None).await?.0)
}

/// The pause reason of a lane whose key was used outside the service.
fn resync_first(reason: &str) -> String {
    format!("{reason}; resync the lane before resuming it")
}

/// A lane to pause in the same transaction as the alert that calls for it: the withdrawals an
/// alert sends to review and the pause that stops their lane are written together or not at all.
/// Written one after the other, a stop in between would leave the lane paying on (its key perhaps
/// known outside) with the alert recorded, and nothing would raise it again.
pub(crate) struct Pause<'a> {
    pub(crate) chain: &'static str,
    pub(crate) lane: &'a str,
    pub(crate) reason: String,
    /// Resuming the lane takes a resync first (its key was used outside the service).
    pub(crate) needs_resync: bool,
}

/// [`record_together`], and, when anything was recorded, `pause` in the same transaction.
/// Returns whether each was recorded and whether the lane was paused by this call (it may have
/// been paused already).
pub(crate) async fn record_together_pausing(
    pool: &Pool,
    items: Vec<Recording>,
    pause: Option<&Pause<'_>>,
) -> Result<(Vec<bool>, bool), WorkError> {
    let mut order: Vec<(usize, Recording)> = items.into_iter().enumerate().collect();
    order.sort_by_key(|(_, item)| item.id);
    let (done, paused) = record_in_one_transaction(pool, &order, pause).await?;
    let mut recorded = vec![false; order.len()];
    for ((index, _), took) in order.iter().zip(done) {
        recorded[*index] = took;
    }
    Ok((recorded, paused))
}

/// `items` (sorted by id) recorded in one transaction: their rows locked first, in id order, by
/// one statement; then their streams read by one, and their events, projection rows and ledger
/// transfers written by one statement each ([`sql::Appended`]). With `pause`, the lane's
/// row is locked before theirs (the order in which the allocator and the replacements lock them,
/// so none waits on another in a cycle) and the lane paused if anything was recorded. Whether each
/// was recorded, in the order given, and whether the lane was paused.
async fn record_in_one_transaction(
    pool: &Pool,
    items: &[(usize, Recording)],
    pause: Option<&Pause<'_>>,
) -> Result<(Vec<bool>, bool), WorkError> {
    let mut client = pool.get().await?;
    let transaction = client.transaction().await?;
    if let Some(pause) = pause {
        transaction
            .execute("select 1 from hot_wallet where chain = $1 and lane = $2 for update", &[&pause.chain, &pause.lane])
            .await?;
    }
    let ids: Vec<i64> = items.iter().map(|(_, item)| item.id).collect();
    transaction.execute("select 1 from withdrawal where id = any($1) order by id for update", &[&ids]).await?;
    // Read under the locks: each check and each event decided on the stream as it is now.
    let mut appended = sql::Appended::default();
    let mut done: Vec<(usize, &'static str)> = Vec::with_capacity(items.len());
    for (at, ((_, item), w)) in items.iter().zip(sql::load_many(&transaction, &ids).await?).enumerate() {
        let mut w = w.expect("BUG: recording on a missing withdrawal");
        if !(item.still)(&w) {
            continue;
        }
        appended.push(&mut w, &item.event);
        done.push((at, item.event.event_type()));
    }
    appended.write(&transaction).await?;
    let paused = match pause {
        Some(pause) if !done.is_empty() => {
            sql::pause_lane_on(&transaction, pause.chain, pause.lane, &pause.reason, pause.needs_resync).await?
        }
        _ => false,
    };
    transaction.commit().await?;
    let mut recorded = vec![false; items.len()];
    for (at, state) in done {
        recorded[at] = true;
        metrics::counter!("custodian_withdrawals_total", "state" => state).increment(1);
    }
    Ok((recorded, paused))
}

/// The worker for every ETH lane it holds a key for.
pub struct Worker {
    pool: Pool,
    node: EthNode,
    signers: HashMap<String, Arc<dyn Signer>>,
    config: WorkerConfig,
    /// Lanes failing transiently, backed off.
    lane_backoff: lanes::LaneBackoff,
    /// Withdrawals whose nonce the chain counted as used with none of their attempts mined, and
    /// the head at which that was first seen: a second sighting at a later head, not one
    /// answer, is the evidence for `needs_review`.
    suspects: std::sync::Mutex<HashMap<i64, u64>>,
}

/// States in which a withdrawal has a nonce but no mined attempt yet.
const UNMINED: [WithdrawalState; 3] =
    [WithdrawalState::Signed, WithdrawalState::Broadcast, WithdrawalState::CancelRequested];

impl Worker {
    /// A worker signing for `signers` (lane name → signer).
    pub fn new(pool: Pool, node: EthNode, signers: HashMap<String, Arc<dyn Signer>>, config: WorkerConfig) -> Worker {
        Worker {
            pool,
            node,
            signers,
            config,
            lane_backoff: lanes::LaneBackoff::default(),
            suspects: std::sync::Mutex::default(),
        }
    }

    /// Passes every `interval` until `stopped` turns true; a pass is never cut short (the flag is
    /// looked at between passes). Transient failures are logged and retried; returns the error
    /// that retrying cannot help (wrong chain, wrong key). Used by `work` and by `serve`.
    pub async fn run(
        &self,
        interval: std::time::Duration,
        mut stopped: watch::Receiver<bool>,
    ) -> Result<(), WorkError> {
        while !*stopped.borrow() {
            match self.pass().await {
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => tracing::warn!("withdrawal pass failed, retried after the interval: {e}"),
                Ok(_) => {}
            }
            tokio::select! {
                _ = stopped.changed() => {}
                _ = tokio::time::sleep(interval) => {}
            }
        }
        Ok(())
    }

    /// One pass over every lane this worker holds a key for, the lanes at once
    /// ([`lanes::run_at_once`]).
    pub async fn pass(&self) -> Result<PassReport, WorkError> {
        let lanes = hot_wallet::lanes(&self.pool.get().await?).await?;
        let chain_id = self.chain_id().await?;
        let mut parts = Vec::new();
        for lane in lanes {
            let Some(signer) = self.signers.get(lane.lane.as_str()) else { continue };
            if signer.address() != lane.address.as_alloy() {
                return Err(WorkError::WrongKey {
                    lane: lane.lane.to_string(),
                    key_address: hex(signer.address()),
                    lane_address: lane.address.to_lowercase_hex(),
                });
            }
            if self.lane_backoff.waiting(lane.lane.as_str()) {
                continue;
            }
            let name = lane.lane.to_string();
            parts.push((name, async move {
                let mut part = PassReport::default();
                let result = self.lane_pass(&lane, signer.as_ref(), chain_id, &mut part).await;
                (part, result)
            }));
        }
        lanes::run_at_once(&self.lane_backoff, "eth", parts).await
    }

    /// One lane's part of a pass: settle, the cursor check, then (unless paused) allocate,
    /// cancel, broadcast and bump.
    async fn lane_pass(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        chain_id: u64,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        self.settle(lane, report).await?;
        self.check_cursor(lane, report).await?;
        let lane = hot_wallet::lanes(&self.pool.get().await?)
            .await?
            .into_iter()
            .find(|l| l.lane == lane.lane)
            .expect("BUG: a lane disappeared");
        if lane.pause_reason.is_some() {
            return Ok(());
        }
        self.allocate(&lane, signer, chain_id, report).await?;
        self.cancel_attempts(&lane, signer, report).await?;
        let refused = self.broadcast(&lane, report).await?;
        self.bump(&lane, signer, &refused, report).await?;
        Ok(())
    }

    /// The node's chain id, refused unless it is the configured one and the node's chain is the
    /// one the scanner recorded (chain id and genesis block).
    async fn chain_id(&self) -> Result<u64, WorkError> {
        let node = self.node.chain_id().await?;
        if let Some(configured) = self.config.chain_id.filter(|configured| *configured != node) {
            tracing::error!(configured, node, "ALERT: the Ethereum node is on another chain; the worker stops");
            return Err(WorkError::WrongChain { configured, node });
        }
        let recorded = self
            .pool
            .get()
            .await?
            .query_opt("select genesis_hash, chain_id from chain_identity where chain = 'eth'", &[])
            .await?
            .map(|row| (row.get::<_, String>(0), row.get::<_, Option<i64>>(1)));
        if let Some((genesis, chain_id)) = recorded {
            let theirs = self.node.block_hash(0).await?.map(hex);
            if theirs.as_deref() != Some(genesis.as_str()) || chain_id != i64::try_from(node).ok() {
                let recorded = format!("chain id {} with genesis {genesis}", chain_id.unwrap_or_default());
                let node = format!("chain id {node} with genesis {}", theirs.unwrap_or_else(|| "none".to_owned()));
                tracing::error!(%recorded, %node, "ALERT: the Ethereum node is on another chain; the worker stops");
                return Err(WorkError::WrongIdentity { recorded, node });
            }
        }
        Ok(node)
    }

    /// Only the allocate-and-sign step for one lane (its simulation included): what a process
    /// that dies right after committing would have done. Operators use `pass`.
    pub async fn allocate_lane(&self, lane: &Lane) -> Result<PassReport, WorkError> {
        let mut report = PassReport::default();
        let chain_id = self.chain_id().await?;
        if let Some(signer) = self.signers.get(lane.lane.as_str()) {
            self.allocate(lane, signer.as_ref(), chain_id, &mut report).await?;
        }
        Ok(report)
    }

    /// Appends `event` to `id` under its row lock, with the transfers it implies, if the locked
    /// withdrawal still passes `still` (another worker may have moved it since it was read: then
    /// nothing is written and `false` is returned).
    async fn record(
        &self,
        id: i64,
        still: impl Fn(&Withdrawal) -> bool,
        event: WithdrawalEvent,
    ) -> Result<bool, WorkError> {
        record(&self.pool, id, still, event).await
    }

    /// Sends `id` to `needs_review` for `reason` if it still passes `still`, and pauses its lane
    /// for `pause` in the same transaction ([`Pause`]; `needs_resync` when the key was used
    /// outside the service). Whether it was recorded.
    #[allow(clippy::too_many_arguments)]
    async fn review(
        &self,
        lane: &Lane,
        id: i64,
        still: impl Fn(&Withdrawal) -> bool + Send + Sync + 'static,
        reason: &str,
        pause: &str,
        needs_resync: bool,
        report: &mut PassReport,
    ) -> Result<bool, WorkError> {
        let item =
            Recording { id, still: Box::new(still), event: WithdrawalEvent::NeedsReview { reason: reason.to_owned() } };
        let pause = Pause {
            chain: "eth",
            lane: lane.lane.as_str(),
            reason: if needs_resync { resync_first(pause) } else { pause.to_owned() },
            needs_resync,
        };
        let (recorded, paused) = record_together_pausing(&self.pool, vec![item], Some(&pause)).await?;
        if paused {
            report.paused_lanes.push(lane.lane.to_string());
        }
        let recorded = recorded[0];
        report.needs_review += u64::from(recorded);
        Ok(recorded)
    }

    async fn pause(&self, lane: &Lane, reason: &str, report: &mut PassReport) -> Result<(), WorkError> {
        self.pause_lane(lane, reason, false, report).await
    }

    /// Pauses a lane whose key was used outside the service: it resumes only after a resync.
    async fn pause_for_resync(&self, lane: &Lane, reason: &str, report: &mut PassReport) -> Result<(), WorkError> {
        self.pause_lane(lane, &resync_first(reason), true, report).await
    }

    async fn pause_lane(
        &self,
        lane: &Lane,
        reason: &str,
        needs_resync: bool,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        if sql::pause_lane(&self.pool.get().await?, lane.lane.as_str(), reason, needs_resync).await? {
            report.paused_lanes.push(lane.lane.to_string());
        }
        Ok(())
    }
}
