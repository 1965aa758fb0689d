//! The withdrawal worker: one pass per lane of settle, nonce-cursor check, simulate and
//! allocate-and-sign, cancel replacements, broadcast, and fee bumps.
//!
//! Node calls happen before or after database transactions, never inside one. Allocation is one
//! transaction per lane batch that locks the `hot_wallet` row, assigns consecutive nonces, signs
//! locally and stores every payload before committing: a crash before commit consumes nothing,
//! and after commit the stored bytes are what gets sent, however often.

use std::collections::HashMap;
use std::sync::Arc;

use alloy::consensus::{TxEip1559, TxEnvelope};
use alloy::eips::eip2718::Decodable2718;
use alloy_primitives::{Address, Bytes, TxKind, U256};
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::Amount;
use custodian_store::{Pipelined, Pool};
use serde::Serialize;

use crate::hot_wallet::{self, Lane};
use crate::rpc::{EthNode, NodeError};
use crate::signer::{SignedTx, Signer, SignerError};
use crate::sql::{self, Movement, StoreError};

/// Gas of a plain ether transfer.
pub const TRANSFER_GAS: u64 = 21_000;

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
    /// The database failed.
    #[error("database error: {0}")]
    Database(String),
}

impl WorkError {
    /// Whether retrying cannot help until an operator changes something (wrong chain, wrong key).
    pub fn is_fatal(&self) -> bool {
        matches!(self, WorkError::WrongChain { .. } | WorkError::WrongKey { .. } | WorkError::WrongIdentity { .. })
    }
}

impl From<tokio_postgres::Error> for WorkError {
    fn from(e: tokio_postgres::Error) -> Self {
        WorkError::Database(e.to_string())
    }
}

impl From<deadpool_postgres::PoolError> for WorkError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        WorkError::Database(e.to_string())
    }
}

impl From<StoreError> for WorkError {
    fn from(e: StoreError) -> Self {
        WorkError::Database(e.to_string())
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
    /// Lanes paused by this pass.
    pub paused_lanes: Vec<String>,
    /// Lanes whose part of this pass failed transiently, with the error: the other lanes went on.
    pub lane_errors: Vec<String>,
}

/// First wait before a failing lane is tried again; doubles up to [`LANE_MAX_BACKOFF`].
const LANE_FIRST_BACKOFF: std::time::Duration = std::time::Duration::from_millis(500);
/// Longest wait between tries of a failing lane.
const LANE_MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(30);

/// The worker for every ETH lane it holds a key for.
pub struct Worker {
    pool: Pool,
    node: EthNode,
    signers: HashMap<String, Arc<dyn Signer>>,
    config: WorkerConfig,
    /// Lanes failing transiently: when each may be tried again, and its current backoff.
    lane_backoff: std::sync::Mutex<HashMap<String, (std::time::Instant, std::time::Duration)>>,
}

/// `to`, `value` and calldata of the payout a withdrawal asks for.
pub fn payout_call(w: &Withdrawal) -> (Address, U256, Bytes) {
    let destination: Address = w.destination.parse().expect("BUG: stored destination is not an address");
    match w.asset.strip_prefix("eth:") {
        None => (destination, w.amount.units(), Bytes::new()),
        Some(contract) => {
            let contract: Address = contract.parse().expect("BUG: stored asset key is not an address");
            let mut data = Vec::with_capacity(68);
            data.extend_from_slice(&[0xa9, 0x05, 0x9c, 0xbb]); // transfer(address,uint256)
            data.extend_from_slice(&[0u8; 12]);
            data.extend_from_slice(destination.as_slice());
            data.extend_from_slice(&w.amount.units().to_be_bytes::<32>());
            (contract, U256::ZERO, Bytes::from(data))
        }
    }
}

/// Fees for a new attempt: twice the base fee plus the tip, within the cap.
fn fresh_fees(base: U256, tip: U256, cap: U256) -> (U256, U256) {
    let max_fee = base.saturating_mul(U256::from(2)).saturating_add(tip).min(cap);
    (max_fee, tip.min(max_fee))
}

/// At least 12.5% more than `old` (geth requires 10%), rounded up.
fn raised(old: U256) -> U256 {
    old.saturating_add(old.div_ceil(U256::from(8))).max(old.saturating_add(U256::from(1)))
}

fn hex(value: impl std::fmt::LowerHex) -> String {
    format!("{value:#x}")
}

fn decode(raw: &[u8]) -> TxEip1559 {
    let envelope = TxEnvelope::decode_2718(&mut &raw[..]).expect("BUG: a stored attempt does not decode");
    envelope.as_eip1559().expect("BUG: attempts are EIP-1559").tx().clone()
}

/// Batches at least this large are signed on several threads (each thread takes at least
/// half of this many), so that a lane's row lock is held for less time.
const PARALLEL_SIGNING_FROM: usize = 16;

/// At most this many threads sign one batch.
const MAX_SIGNING_THREADS: usize = 4;

/// Signs `txs` in order, on as many threads as there are cores (up to
/// [`MAX_SIGNING_THREADS`]) when the batch is large enough to be worth it. The allocating
/// transaction waits on this with the lane locked, and the database is idle meanwhile.
fn sign_all(signer: &dyn Signer, txs: Vec<TxEip1559>) -> Result<Vec<SignedTx>, SignerError> {
    // Asked once: on Linux the answer reads the cgroup files, tens of microseconds a time.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let threads = cores.min(MAX_SIGNING_THREADS).min(txs.len() / (PARALLEL_SIGNING_FROM / 2)).max(1);
    if threads == 1 {
        return txs.into_iter().map(|tx| signer.sign(tx)).collect();
    }
    let sign = |chunk: &[TxEip1559]| chunk.iter().map(|tx| signer.sign(tx.clone())).collect::<Result<Vec<_>, _>>();
    let mut chunks = txs.chunks(txs.len().div_ceil(threads));
    let first = chunks.next().expect("BUG: no chunk to sign");
    std::thread::scope(|scope| {
        let others: Vec<_> = chunks.map(|chunk| scope.spawn(move || sign(chunk))).collect();
        let mut signed = sign(first)?;
        for other in others {
            signed.extend(other.join().expect("BUG: a signing thread panicked")?);
        }
        Ok(signed)
    })
}

/// Fees and context of one allocation round, read from the node before the transaction.
#[derive(Debug, Clone, Copy)]
pub struct Pricing {
    /// EIP-155 chain id.
    pub chain_id: u64,
    /// Max fee per gas, wei.
    pub max_fee: U256,
    /// Max priority fee per gas, wei.
    pub priority_fee: U256,
    /// Chain head when signing.
    pub head: u64,
}

/// The columns of one signed batch, as arrays for set-based statements.
#[derive(Default)]
struct SignedBatch {
    ids: Vec<i64>,
    nonces: Vec<i64>,
    seqs: Vec<i32>,
    payloads: Vec<serde_json::Value>,
    hashes: Vec<String>,
    raws: Vec<Vec<u8>>,
}

/// The lane's cursor (locked) and, in nonce order, the ready withdrawals still requested that no
/// other worker holds (locked, skipping locked ones), each with its whole event stream: what is
/// signed comes from the fold of the stream, which must be `requested` at the row's sequence, and
/// the projection row must agree with it. The lane row comes back even when no withdrawal does
/// (its withdrawal columns null).
const LOCK_LANE_AND_WITHDRAWALS: &str = "
with lane as (
    select next_nonce, paused_at is not null as paused from hot_wallet where chain = 'eth' and lane = $1 for update
), ready as (
    select id, account_id, asset, destination, amount, last_seq from withdrawal
     where id = any($2) and state = 'requested' and lane = $1
     order by id for update skip locked
)
select lane.next_nonce, lane.paused, ready.id, ready.account_id, ready.asset, ready.destination, ready.amount, ready.last_seq,
       (select array_agg(e.event_type order by e.seq) from withdrawal_event e where e.withdrawal_id = ready.id),
       (select array_agg(e.payload order by e.seq) from withdrawal_event e where e.withdrawal_id = ready.id)
  from lane left join ready on true
 order by ready.id";

/// Every write of an allocation in one statement, so the batch costs the server one execution
/// and one reply: the nonces, the signed payloads, the `signed` events, the projection, and the
/// lane's cursor. $1 lane, $2 from_address, $3 ids, $4 nonces, $5 seqs, $6 hashes, $7 raw
/// transactions, $8 payloads, $9 max fee, $10 priority fee, $11 the next nonce.
///
/// The sub-statements cannot see each other's rows, but the foreign key from
/// `withdrawal_attempt` to `nonce_allocation` is checked after the whole statement, when they
/// can. The projection is found through `id = any($3)`, which the generic plan always answers from
/// the primary key (joined to the unnest alone, a small table would be scanned whole).
const WRITE_ALLOCATIONS: &str = "
with signed as (
    select * from unnest($3::bigint[], $4::bigint[], $5::int[], $6::text[], $7::bytea[], $8::jsonb[])
        as s(id, nonce, seq, hash, raw, payload)
), allocated as (
    insert into nonce_allocation (chain, from_address, nonce, withdrawal_id)
    select 'eth', $2, nonce, id from signed
), attempted as (
    insert into withdrawal_attempt (tx_hash, withdrawal_id, chain, from_address, nonce, kind, raw_tx, max_fee, priority_fee)
    select hash, id, 'eth', $2, nonce, 'original', raw, $9, $10 from signed
), appended as (
    insert into withdrawal_event (withdrawal_id, seq, event_type, payload)
    select id, seq, 'signed', payload from signed
), projected as (
    update withdrawal w set state = 'signed', from_address = $2, nonce = s.nonce, tx_hash = s.hash, last_seq = s.seq,
           updated_at = now()
      from signed s
     where w.id = any($3) and w.id = s.id
)
update hot_wallet set next_nonce = $11 where chain = 'eth' and lane = $1";

/// What a withdrawal pays, as the allocator compares it between the event and the projection.
#[derive(Debug, PartialEq, Eq)]
struct PaidAs {
    account_id: i64,
    asset: String,
    destination: String,
    amount: Amount,
}

impl std::fmt::Display for PaidAs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} units of {} from account {} to {}", self.amount, self.asset, self.account_id, self.destination)
    }
}

/// States in which a withdrawal has a nonce but no mined attempt yet.
const UNMINED: [WithdrawalState; 3] =
    [WithdrawalState::Signed, WithdrawalState::Broadcast, WithdrawalState::CancelRequested];

/// What broadcasting stored bytes came to.
enum Sent {
    Accepted,
    Pending,
}

impl Worker {
    /// A worker signing for `signers` (lane name → signer).
    pub fn new(pool: Pool, node: EthNode, signers: HashMap<String, Arc<dyn Signer>>, config: WorkerConfig) -> Worker {
        Worker { pool, node, signers, config, lane_backoff: std::sync::Mutex::default() }
    }

    /// One pass over every lane this worker holds a key for.
    pub async fn pass(&self) -> Result<PassReport, WorkError> {
        let mut report = PassReport::default();
        let lanes = hot_wallet::lanes(&self.pool.get().await?).await?;
        let chain_id = self.chain_id().await?;
        for lane in lanes {
            let Some(signer) = self.signers.get(&lane.lane) else { continue };
            if hex(signer.address()) != lane.address {
                return Err(WorkError::WrongKey {
                    lane: lane.lane,
                    key_address: hex(signer.address()),
                    lane_address: lane.address,
                });
            }
            // Each lane's part is independent: a lane failing transiently (its node calls, its
            // rows) is logged, counted and backed off with jitter, and the other lanes go on.
            if self.backing_off(&lane.lane) {
                continue;
            }
            match self.lane_pass(&lane, signer.as_ref(), chain_id, &mut report).await {
                Ok(()) => {
                    self.lane_backoff.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(&lane.lane);
                }
                Err(e) if e.is_fatal() => return Err(e),
                Err(e) => {
                    let wait = self.lane_failed(&lane.lane);
                    metrics::counter!("custodian_lane_errors_total", "lane" => lane.lane.clone()).increment(1);
                    tracing::warn!(lane = %lane.lane, retry_in_ms = wait.as_millis() as u64,
                        "the lane's pass failed; the other lanes go on: {e}");
                    report.lane_errors.push(format!("{}: {e}", lane.lane));
                }
            }
        }
        Ok(report)
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
        self.broadcast(&lane, report).await?;
        self.bump(&lane, signer, report).await?;
        Ok(())
    }

    /// Whether `lane` failed recently and its backoff has not run out.
    fn backing_off(&self, lane: &str) -> bool {
        let backoff = self.lane_backoff.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        backoff.get(lane).is_some_and(|(until, _)| std::time::Instant::now() < *until)
    }

    /// Records a failure of `lane`: its next try waits twice as long as the last (with jitter).
    fn lane_failed(&self, lane: &str) -> std::time::Duration {
        use std::hash::{BuildHasher, Hasher};
        let mut backoff = self.lane_backoff.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = backoff.get(lane).map_or(LANE_FIRST_BACKOFF, |(_, last)| (*last * 2).min(LANE_MAX_BACKOFF));
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let half = u64::try_from(current.as_millis() / 2).unwrap_or(u64::MAX).max(1);
        let wait = current + std::time::Duration::from_millis(random % half);
        backoff.insert(lane.to_owned(), (std::time::Instant::now() + wait, current));
        wait
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
        if let Some(signer) = self.signers.get(&lane.lane) {
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
        movements: &[(Movement, Amount)],
    ) -> Result<bool, WorkError> {
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let mut w = sql::lock(&tx, id).await?.expect("BUG: recording on a missing withdrawal");
        if !still(&w) {
            return Ok(false);
        }
        let state = event.event_type();
        sql::append(&tx, &mut w, event).await?;
        for (movement, fee) in movements {
            sql::post(&tx, &w, *movement, *fee).await?;
        }
        tx.commit().await?;
        metrics::counter!("custodian_withdrawals_total", "state" => state).increment(1);
        Ok(true)
    }

    async fn pause(&self, lane: &Lane, reason: &str, report: &mut PassReport) -> Result<(), WorkError> {
        self.pause_lane(lane, reason, false, report).await
    }

    /// Pauses a lane whose key was used outside the service: it resumes only after a resync.
    async fn pause_for_resync(&self, lane: &Lane, reason: &str, report: &mut PassReport) -> Result<(), WorkError> {
        self.pause_lane(lane, &format!("{reason}; resync the lane before resuming it"), true, report).await
    }

    async fn pause_lane(
        &self,
        lane: &Lane,
        reason: &str,
        needs_resync: bool,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        if sql::pause_lane(&self.pool.get().await?, &lane.lane, reason, needs_resync).await? {
            report.paused_lanes.push(lane.lane.clone());
        }
        Ok(())
    }

    /// Which attempt mined, once the address's mined nonce count passes a withdrawal's nonce;
    /// then confirmation depth, status, and reorgs of mined attempts.
    async fn settle(&self, lane: &Lane, report: &mut PassReport) -> Result<(), WorkError> {
        let address: Address = lane.address.parse().expect("BUG: stored hot wallet is not an address");
        let mined_count = self.node.nonce(address, false).await?;
        let head = self.node.block_number().await?;
        let client = self.pool.get().await?;
        let waiting = sql::in_states(&client, &lane.lane, &UNMINED).await?;
        for id in waiting {
            let w = sql::load(&client, id).await?.expect("BUG: listed withdrawal has no events");
            let Some(nonce) = w.nonce.filter(|n| *n < mined_count) else { continue };
            let mut found = None;
            for attempt in sql::attempts(&client, id).await? {
                if let Some(receipt) = self.node.receipt(attempt.tx_hash.parse().expect("BUG: stored hash")).await? {
                    found = Some((attempt, receipt));
                    break;
                }
            }
            match found {
                Some((attempt, receipt)) => {
                    let event = WithdrawalEvent::Mined {
                        tx_hash: attempt.tx_hash,
                        block_hash: hex(receipt.block_hash),
                        block_number: receipt.block_number,
                    };
                    if self.record(id, |w| UNMINED.contains(&w.state), event, &[]).await? {
                        report.mined += 1;
                    }
                }
                None => {
                    let reason = format!(
                        "nonce {nonce} of {} was used by a transaction this service did not sign",
                        lane.address
                    );
                    metrics::counter!("custodian_unknown_transaction_alerts_total", "address" => lane.address.clone())
                        .increment(1);
                    tracing::error!(withdrawal = id, lane = %lane.lane, "ALERT: {reason}");
                    if self
                        .record(
                            id,
                            |w| UNMINED.contains(&w.state),
                            WithdrawalEvent::NeedsReview { reason: reason.clone() },
                            &[],
                        )
                        .await?
                    {
                        report.needs_review += 1;
                        self.pause_for_resync(lane, &format!("needs review: {reason}"), report).await?;
                    }
                }
            }
        }
        for id in sql::in_states(&client, &lane.lane, &[WithdrawalState::Mined]).await? {
            let w = sql::load(&client, id).await?.expect("BUG: listed withdrawal has no events");
            let tx_hash = w.tx_hash.clone().expect("BUG: mined without a hash");
            let mined_in = w.mined_block_hash.clone().expect("BUG: mined without a block");
            let expected = mined_in.clone();
            let still_mined_there = move |w: &Withdrawal| {
                w.state == WithdrawalState::Mined && w.mined_block_hash.as_deref() == Some(expected.as_str())
            };
            let receipt = self.node.receipt(tx_hash.parse().expect("BUG: stored hash")).await?;
            let Some(receipt) = receipt.filter(|r| hex(r.block_hash) == mined_in) else {
                tracing::warn!(withdrawal = id, %tx_hash, block = %mined_in, "mined block reorged out; the same bytes go out again");
                if self
                    .record(id, &still_mined_there, WithdrawalEvent::Unmined { tx_hash, block_hash: mined_in }, &[])
                    .await?
                {
                    report.unmined += 1;
                }
                continue;
            };
            if head + 1 < receipt.block_number + self.config.confirmations {
                continue;
            }
            let fee = Amount::from_units(receipt.fee);
            let is_cancel =
                sql::attempts(&client, id).await?.iter().any(|a| a.tx_hash == tx_hash && a.kind == "cancel");
            if is_cancel {
                let event = WithdrawalEvent::Cancelled { tx_hash: Some(tx_hash), fee, by: None };
                if self
                    .record(id, &still_mined_there, event, &[(Movement::Fee, fee), (Movement::Release, Amount::ZERO)])
                    .await?
                {
                    report.cancelled += 1;
                }
            } else if receipt.success {
                let event = WithdrawalEvent::Confirmed { tx_hash, block_hash: mined_in, fee };
                if self
                    .record(id, &still_mined_there, event, &[(Movement::Settle, Amount::ZERO), (Movement::Fee, fee)])
                    .await?
                {
                    report.confirmed += 1;
                }
            } else {
                let event = WithdrawalEvent::FailedOnchain { tx_hash, block_hash: mined_in, fee };
                if self
                    .record(id, &still_mined_there, event, &[(Movement::Fee, fee), (Movement::Release, Amount::ZERO)])
                    .await?
                {
                    report.failed_onchain += 1;
                }
            }
        }
        Ok(())
    }

    /// A pending nonce above our cursor means the key signed something we did not allocate.
    async fn check_cursor(&self, lane: &Lane, report: &mut PassReport) -> Result<(), WorkError> {
        let address: Address = lane.address.parse().expect("BUG: stored hot wallet is not an address");
        let pending = self.node.nonce(address, true).await?;
        // Read our cursor after the node: every nonce the node has seen from us was committed
        // before it was sent, so a cursor read now covers it (a cursor read earlier, with other
        // workers allocating meanwhile, would not).
        let next: i64 = self
            .pool
            .get()
            .await?
            .query_one("select next_nonce from hot_wallet where chain = 'eth' and lane = $1", &[&lane.lane])
            .await?
            .get(0);
        let next = u64::try_from(next).expect("BUG: negative nonce");
        if pending > next {
            let reason =
                format!("chain nonce {pending} is above our next nonce {next}: the key was used outside the service");
            metrics::counter!("custodian_unknown_transaction_alerts_total", "address" => lane.address.clone())
                .increment(1);
            self.pause_for_resync(lane, &reason, report).await?;
        }
        Ok(())
    }

    /// Simulates what needs it, then allocates consecutive nonces and signs in one transaction.
    async fn allocate(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        chain_id: u64,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let client = self.pool.get().await?;
        let mut candidates = sql::in_states(&client, &lane.lane, &[WithdrawalState::Requested]).await?;
        candidates.truncate(usize::try_from(self.config.batch_size).expect("BUG: negative batch"));
        if candidates.is_empty() {
            return Ok(());
        }
        let mut gas = HashMap::new();
        for id in &candidates {
            // A row without events is tampering: the allocation below reviews it.
            let Some(w) = sql::load(&client, *id).await? else {
                gas.insert(*id, TRANSFER_GAS);
                continue;
            };
            let (to, value, data) = payout_call(&w);
            // Plain ETH to an address without code costs exactly 21,000 gas; to a contract (a
            // Safe, an exchange's deposit contract) its receive code runs and is simulated.
            if data.is_empty() {
                match self.node.has_code(to).await {
                    Ok(false) => {
                        gas.insert(*id, TRANSFER_GAS);
                        continue;
                    }
                    Ok(true) => {}
                    Err(e) => {
                        tracing::warn!(
                            withdrawal = id,
                            "reading the destination's code failed, retried next pass: {e}"
                        );
                        continue;
                    }
                }
            }
            match self.node.estimate_gas(signer.address(), to, value, &data).await {
                Ok(estimate) => {
                    gas.insert(*id, estimate + estimate / 5);
                }
                Err(e) if e.is_revert() => {
                    let reason = format!("simulation reverted: {e}");
                    let rejected = WithdrawalEvent::Rejected { reason };
                    if self
                        .record(
                            *id,
                            |w| w.state == WithdrawalState::Requested,
                            rejected,
                            &[(Movement::Release, Amount::ZERO)],
                        )
                        .await?
                    {
                        report.rejected += 1;
                    }
                }
                Err(e) => tracing::warn!(withdrawal = id, "simulation failed, retried next pass (no nonce used): {e}"),
            }
        }
        let (base, tip) = self.node.fees().await?;
        let (max_fee, priority_fee) = fresh_fees(base, tip, self.config.max_fee_per_gas_wei);
        let head = self.node.block_number().await?;
        drop(client);
        let pricing = Pricing { chain_id, max_fee, priority_fee, head };
        let mut ready: Vec<(i64, u64)> = gas.into_iter().collect();
        ready.sort_unstable();
        report.signed += self.sign_batch(lane, signer, &pricing, &ready).await?;
        Ok(())
    }

    /// The allocation transaction itself: lock the lane's `hot_wallet` row, take the `ready`
    /// withdrawals still `requested` (skipping any another worker holds), assign consecutive
    /// nonces, sign locally, store every payload, advance the cursor, commit. No network call.
    /// Returns how many were signed.
    ///
    /// # Cancel safety
    /// One transaction, pipelined in two round trips ([`Pipelined`]): cancelled or crashed before
    /// commit, no nonce is consumed, and the connection is closed rather than pooled.
    pub async fn sign_batch(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        pricing: &Pricing,
        ready: &[(i64, u64)],
    ) -> Result<u64, WorkError> {
        let Pricing { chain_id, max_fee, priority_fee, head } = *pricing;
        let gas: HashMap<i64, u64> = ready.iter().copied().collect();
        let ids: Vec<i64> = ready.iter().map(|(id, _)| *id).collect();
        let client = self.pool.get().await?;
        // Prepared once per connection, so none of these costs a round trip after the first batch.
        let (lock, write) = futures::try_join!(
            client.prepare_cached(LOCK_LANE_AND_WITHDRAWALS),
            client.prepare_cached(WRITE_ALLOCATIONS),
        )?;
        // First round trip: BEGIN, then lock the lane's row (every allocation on the lane
        // serialises here) and the withdrawals still requested that no other worker holds.
        let (tx, rows) = Pipelined::begin_with(client, &lock, &[&lane.lane, &ids]).await?;
        let Some(first) = rows.first() else {
            tx.rollback().await?;
            return Ok(0);
        };
        let (next_nonce, paused): (i64, bool) = (first.get(0), first.get(1));
        if paused {
            tx.rollback().await?;
            return Ok(0);
        }
        let mut batch = SignedBatch::default();
        let mut unsigned = Vec::new();
        let mut tampered = Vec::new();
        let mut nonce = next_nonce;
        for row in rows.iter().filter(|r| r.get::<_, Option<i64>>(2).is_some()) {
            let id: i64 = row.get(2);
            let projected = PaidAs {
                account_id: row.get(3),
                asset: row.get(4),
                destination: row.get(5),
                amount: Amount::from_units(row.get::<_, U256>(6)),
            };
            let types: Vec<String> = row.get::<_, Option<Vec<String>>>(8).unwrap_or_default();
            let payloads: Vec<serde_json::Value> = row.get::<_, Option<Vec<serde_json::Value>>>(9).unwrap_or_default();
            let stream: Result<Vec<WithdrawalEvent>, _> =
                types.iter().zip(&payloads).map(|(t, p)| WithdrawalEvent::from_stored(t, p)).collect();
            let folded = stream.ok().and_then(|events| Withdrawal::fold(id, &events));
            let row_seq: i32 = row.get(7);
            let Some(folded) = folded else {
                tampered.push((
                    id,
                    format!(
                        "the withdrawal row has no readable event stream ({} events); nothing was signed",
                        types.len()
                    ),
                ));
                continue;
            };
            if folded.state != WithdrawalState::Requested || folded.last_seq != row_seq {
                tampered.push((
                    id,
                    format!(
                        "the withdrawal row says requested at event {row_seq}, its event stream says {} at event {}; \
                         nothing was signed",
                        folded.state.as_str(),
                        folded.last_seq
                    ),
                ));
                continue;
            }
            let fact = PaidAs {
                account_id: folded.account_id,
                asset: folded.asset,
                destination: folded.destination,
                amount: folded.amount,
            };
            if fact != projected {
                tampered.push((
                    id,
                    format!(
                        "the withdrawal row does not match its requested event: the event pays {fact}, the row says \
                         {projected}; nothing was signed"
                    ),
                ));
                continue;
            }
            // Signed from the fact, which the projection matched.
            let w = Withdrawal {
                id,
                account_id: fact.account_id,
                external_id: String::new(),
                asset: fact.asset,
                destination: fact.destination,
                amount: fact.amount,
                state: WithdrawalState::Requested,
                lane: lane.lane.clone(),
                from_address: None,
                nonce: None,
                tx_hash: None,
                mined_block_hash: None,
                last_seq: row.get(7),
                state_before_cancel: None,
                attempt_at_block: None,
                requested_by: String::new(),
                approvals_required: 0,
                approvers: Vec::new(),
            };
            let (to, value, input) = payout_call(&w);
            unsigned.push(TxEip1559 {
                chain_id,
                nonce: u64::try_from(nonce).expect("BUG: negative nonce"),
                gas_limit: gas[&w.id],
                max_fee_per_gas: max_fee.to::<u128>(),
                max_priority_fee_per_gas: priority_fee.to::<u128>(),
                to: TxKind::Call(to),
                value,
                input,
                ..Default::default()
            });
            batch.ids.push(w.id);
            batch.nonces.push(nonce);
            batch.seqs.push(w.last_seq + 1);
            nonce += 1;
        }
        if !tampered.is_empty() {
            // Sign nothing: someone changed what a withdrawal pays behind the event stream.
            tx.rollback().await?;
            self.review_tampered(lane, tampered).await?;
            return Ok(0);
        }
        for (signed_tx, nonce) in sign_all(signer, unsigned)?.into_iter().zip(&batch.nonces) {
            let hash = hex(signed_tx.hash);
            let event = WithdrawalEvent::Signed {
                from_address: lane.address.clone(),
                nonce: u64::try_from(*nonce).expect("BUG: negative nonce"),
                tx_hash: hash.clone(),
                at_block: head,
            };
            batch.payloads.push(event.payload());
            batch.hashes.push(hash);
            batch.raws.push(signed_tx.raw);
        }
        let signed = batch.ids.len() as u64;
        if signed == 0 {
            tx.rollback().await?;
            return Ok(0);
        }
        // Second round trip: every write and COMMIT. The primary key (chain, from_address, nonce)
        // is the last word on double allocation; (withdrawal_id, seq) on the streams, whose rows
        // we hold locked.
        tx.commit_with(&[(
            &write,
            &[
                &lane.lane,
                &lane.address,
                &batch.ids,
                &batch.nonces,
                &batch.seqs,
                &batch.hashes,
                &batch.raws,
                &batch.payloads,
                &max_fee,
                &priority_fee,
                &nonce,
            ],
        )])
        .await?;
        metrics::counter!("custodian_withdrawals_total", "state" => "signed").increment(signed);
        Ok(signed)
    }

    /// Each withdrawal whose projection disagrees with its event stream (what it pays, its state
    /// or its sequence) goes to `needs_review` with both versions, and the lane pauses: nothing
    /// more leaves it until a person has looked. A row without a readable stream cannot take an
    /// event; it is alerted on and its lane pauses all the same.
    async fn review_tampered(&self, lane: &Lane, tampered: Vec<(i64, String)>) -> Result<(), WorkError> {
        for (id, reason) in tampered {
            tracing::error!(withdrawal = id, lane = %lane.lane, %reason, "ALERT: withdrawal projection tampered with");
            metrics::counter!("custodian_withdrawal_tampered_total").increment(1);
            let mut client = self.pool.get().await?;
            let tx = client.transaction().await?;
            if tx.query_opt("select 1 from withdrawal where id = $1 for update", &[&id]).await?.is_none() {
                continue;
            }
            let events: Result<Vec<WithdrawalEvent>, _> = tx
                .query("select event_type, payload from withdrawal_event where withdrawal_id = $1 order by seq", &[&id])
                .await?
                .iter()
                .map(|r| WithdrawalEvent::from_stored(r.get(0), &r.get(1)))
                .collect();
            let Some(mut w) = events.ok().and_then(|events| Withdrawal::fold(id, &events)) else { continue };
            if !w.state.holds_funds() {
                // Settled, cancelled or refused: its money is where its events put it. Put the
                // row back as the stream says; there is nothing left for a person to decide.
                sql::write_projection(&tx, &w).await?;
                tx.commit().await?;
            } else if w.state != WithdrawalState::NeedsReview {
                sql::append(&tx, &mut w, WithdrawalEvent::NeedsReview { reason }).await?;
                tx.commit().await?;
            }
        }
        sql::pause_lane(
            &self.pool.get().await?,
            &lane.lane,
            "a withdrawal row did not match its requested event",
            false,
        )
        .await?;
        Ok(())
    }

    /// Signs a sibling of the latest attempt: same nonce, fees raised at least 12.5%. `cancel`
    /// turns it into a zero-value transfer to ourselves.
    async fn sibling(&self, lane: &Lane, signer: &dyn Signer, id: i64, cancel: bool) -> Result<bool, WorkError> {
        let (base, tip) = self.node.fees().await?;
        let head = self.node.block_number().await?;
        let mut client = self.pool.get().await?;
        let tx = client.transaction().await?;
        let Some(mut w) = sql::lock(&tx, id).await? else { return Ok(false) };
        let wanted = if cancel { WithdrawalState::CancelRequested } else { WithdrawalState::Broadcast };
        if w.state != wanted {
            return Ok(false);
        }
        let attempts = sql::attempts(&tx, id).await?;
        if cancel && attempts.iter().any(|a| a.kind == "cancel") {
            return Ok(false);
        }
        let latest = attempts.last().expect("BUG: a signed withdrawal without attempts");
        let previous = decode(&latest.raw);
        let cap = self.config.max_fee_per_gas_wei;
        let (fresh_max, fresh_tip) = fresh_fees(base, tip, cap);
        let old_tip = U256::from(previous.max_priority_fee_per_gas);
        let old_max = U256::from(previous.max_fee_per_gas);
        let priority_fee = raised(old_tip).max(fresh_tip).min(cap);
        let max_fee = raised(old_max).max(fresh_max).max(priority_fee).min(cap);
        if priority_fee < raised(old_tip) || max_fee < raised(old_max) {
            tracing::warn!(withdrawal = id, cap = %cap, "cannot raise fees by 12.5% within the configured maximum");
            return Ok(false);
        }
        let mut next = previous.clone();
        next.max_fee_per_gas = max_fee.to::<u128>();
        next.max_priority_fee_per_gas = priority_fee.to::<u128>();
        if cancel {
            next.to = TxKind::Call(signer.address());
            next.value = U256::ZERO;
            next.input = Bytes::new();
            next.gas_limit = TRANSFER_GAS;
        }
        let signed = signer.sign(next)?;
        let hash = hex(signed.hash);
        let kind = if cancel { "cancel" } else { "bump" };
        sql::insert_attempt(&tx, &w, &lane.address, previous.nonce, kind, &hash, &signed.raw, max_fee, priority_fee)
            .await?;
        sql::append(&tx, &mut w, WithdrawalEvent::Bumped { tx_hash: hash.clone(), at_block: head }).await?;
        tx.commit().await?;
        metrics::counter!("custodian_bumps_total", "kind" => kind).increment(1);
        match self.node.send_raw(&signed.raw).await {
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(withdrawal = id, %hash, "sending the {kind} attempt failed; retried next pass: {e}")
            }
        }
        Ok(true)
    }

    /// Cancel replacements for withdrawals whose cancel was requested after signing.
    async fn cancel_attempts(
        &self,
        lane: &Lane,
        signer: &dyn Signer,
        report: &mut PassReport,
    ) -> Result<(), WorkError> {
        let ids = sql::in_states(&self.pool.get().await?, &lane.lane, &[WithdrawalState::CancelRequested]).await?;
        for id in ids {
            if self.sibling(lane, signer, id, true).await? {
                report.cancel_attempts += 1;
            }
        }
        Ok(())
    }

    /// Sends stored bytes: first broadcasts, and again whenever the node no longer knows them.
    async fn broadcast(&self, lane: &Lane, report: &mut PassReport) -> Result<(), WorkError> {
        let client = self.pool.get().await?;
        let ids = sql::in_states(&client, &lane.lane, &UNMINED).await?;
        for id in ids {
            let w = sql::load(&client, id).await?.expect("BUG: listed withdrawal has no events");
            let attempts = sql::attempts(&client, id).await?;
            let Some(latest) = attempts.last() else { continue };
            let hash = latest.tx_hash.parse().expect("BUG: stored hash");
            if w.state != WithdrawalState::Signed && self.node.knows(hash).await? {
                continue;
            }
            match self.send(lane, &latest.raw, report).await? {
                Sent::Accepted if w.state == WithdrawalState::Signed => {
                    let event = WithdrawalEvent::Broadcast { tx_hash: latest.tx_hash.clone() };
                    if self.record(id, |w| w.state == WithdrawalState::Signed, event, &[]).await? {
                        report.broadcast += 1;
                    }
                }
                Sent::Accepted => {
                    tracing::info!(withdrawal = id, tx = %latest.tx_hash, "the node had lost the attempt; sent the same bytes again");
                    report.rebroadcast += 1;
                }
                Sent::Pending => {}
            }
        }
        Ok(())
    }

    /// Sends bytes and classifies the node's answer (DESIGN §7.4).
    async fn send(&self, lane: &Lane, raw: &[u8], report: &mut PassReport) -> Result<Sent, WorkError> {
        match self.node.send_raw(raw).await {
            Ok(_) => Ok(Sent::Accepted),
            Err(e) => {
                let message = e.message();
                if ["already known", "known transaction", "transaction already exists", "already imported"]
                    .iter()
                    .any(|m| message.contains(m))
                {
                    Ok(Sent::Accepted)
                } else if message.contains("nonce too low") {
                    // Benign for the broadcaster (settlement decides), but outside a slot that was
                    // just settled it is the signature of double allocation: count it.
                    metrics::counter!("custodian_nonce_too_low_total", "address" => lane.address.clone()).increment(1);
                    Ok(Sent::Pending)
                } else if message.contains("insufficient funds") {
                    self.pause(lane, &format!("hot wallet cannot pay: {e}"), report).await?;
                    Ok(Sent::Pending)
                } else {
                    // Underpriced replacements wait for a bump; transport errors for the next pass.
                    tracing::warn!(lane = %lane.lane, "broadcast not accepted, retried next pass: {e}");
                    Ok(Sent::Pending)
                }
            }
        }
    }

    /// Bumps attempts unmined for `bump_after_blocks`.
    async fn bump(&self, lane: &Lane, signer: &dyn Signer, report: &mut PassReport) -> Result<(), WorkError> {
        let head = self.node.block_number().await?;
        let client = self.pool.get().await?;
        for id in sql::in_states(&client, &lane.lane, &[WithdrawalState::Broadcast]).await? {
            let w = sql::load(&client, id).await?.expect("BUG: listed withdrawal has no events");
            let Some(at) = w.attempt_at_block else { continue };
            if head < at + self.config.bump_after_blocks {
                continue;
            }
            if let Some(hash) = &w.tx_hash {
                if self.node.receipt(hash.parse().expect("BUG: stored hash")).await?.is_some() {
                    continue;
                }
            }
            if self.sibling(lane, signer, id, false).await? {
                report.bumped += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bumps_raise_by_at_least_an_eighth_and_fresh_fees_respect_the_cap() {
        for (old, expected) in
            [(0u64, 1u64), (1, 2), (8, 9), (9, 11), (1_000_000_000, 1_125_000_000), (1_000_000_001, 1_125_000_002)]
        {
            assert_eq!(raised(U256::from(old)), U256::from(expected), "raised({old})");
            assert!(raised(U256::from(old)) * U256::from(8) >= U256::from(old) * U256::from(9));
        }
        let cap = U256::from(100u64);
        assert_eq!(fresh_fees(U256::from(10u64), U256::from(2u64), cap), (U256::from(22u64), U256::from(2u64)));
        assert_eq!(fresh_fees(U256::from(60u64), U256::from(2u64), cap), (cap, U256::from(2u64)));
        assert_eq!(fresh_fees(U256::from(60u64), U256::from(200u64), cap), (cap, cap));
    }
}
