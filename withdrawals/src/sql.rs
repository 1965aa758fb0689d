//! The withdrawal tables: event append with the projection updated in the same transaction, the
//! ledger transfers a withdrawal makes, and attempts.
//!
//! Every writer of a withdrawal's stream first locks its projection row (`for update`), so two
//! writers never race on one stream; the expected-sequence append is the second wall.

use alloy_primitives::U256;
use custodian_domain::withdrawal::{AttemptKind, Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{posting_rules, Nonce};
use custodian_domain::{Chain, ChainAddress, TxHash, WithdrawalId};
use custodian_store::{append_withdrawal_event, ledger, AppendError};
use deadpool_postgres::{GenericClient, Transaction};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Another writer appended first.
    #[error(transparent)]
    Conflict(#[from] AppendError),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Reads a stored event back.
pub fn event_from_row(event_type: &str, payload: &serde_json::Value) -> WithdrawalEvent {
    WithdrawalEvent::from_stored(event_type, payload)
        .unwrap_or_else(|e| panic!("BUG: stored {event_type} event does not decode: {e}"))
}

/// Appends `event` to `w`'s stream at its current sequence, applies it, writes the projection,
/// and posts the transfers the event entails by the posting rules: a stream and its ledger
/// movements are written together or not at all.
pub async fn append(tx: &Transaction<'_>, w: &mut Withdrawal, event: WithdrawalEvent) -> Result<(), StoreError> {
    append_withdrawal_event(tx, w.id().get(), w.last_seq(), event.event_type(), &event.payload()).await?;
    w.apply(&event);
    write_projection(tx, w).await?;
    post_entailed(tx, w, &event).await?;
    Ok(())
}

/// Starts a stream with its `requested` event, inserts the projection row and posts the hold.
pub async fn start(tx: &Transaction<'_>, id: i64, first: WithdrawalEvent) -> Result<Withdrawal, StoreError> {
    let w = Withdrawal::start(WithdrawalId::new(id), &first).expect("BUG: a stream starts with requested");
    append_withdrawal_event(tx, id, 0, first.event_type(), &first.payload()).await?;
    write_projection(tx, &w).await?;
    post_entailed(tx, &w, &first).await?;
    Ok(w)
}

/// The projection row's upsert ($1..$15 as [`projection_params`] orders them).
pub(crate) const UPSERT: &str = "
insert into withdrawal (id, account_id, external_id, chain, asset, destination, amount, state, lane, from_address,
                        nonce, tx_hash, mined_block_hash, last_seq, requested_by, stuck_at_cap)
values ($1, $2, $3, case $4 when 'BTC' then 'btc' else 'eth' end, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, nullif($14, ''), $15)
on conflict (id) do update set state = excluded.state, from_address = excluded.from_address, nonce = excluded.nonce,
    tx_hash = excluded.tx_hash, mined_block_hash = excluded.mined_block_hash, last_seq = excluded.last_seq,
    stuck_at_cap = excluded.stuck_at_cap, updated_at = now()";

/// [`UPSERT`]'s parameters for `w`, owned so a caller can pipeline the statement.
pub(crate) struct ProjectionParams {
    id: i64,
    account_id: i64,
    external_id: String,
    asset: String,
    destination: String,
    amount: U256,
    state: &'static str,
    lane: String,
    from_address: Option<String>,
    nonce: Option<i64>,
    tx_hash: Option<String>,
    mined_block_hash: Option<String>,
    last_seq: i32,
    requested_by: String,
    stuck_at_cap: bool,
}

impl ProjectionParams {
    /// What identifies the request: its account, external id and asset (the request check's
    /// parameters).
    pub(crate) fn request_key(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 3] {
        [&self.account_id, &self.external_id, &self.asset]
    }

    /// In [`UPSERT`]'s order.
    pub(crate) fn refs(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 15] {
        [
            &self.id,
            &self.account_id,
            &self.external_id,
            &self.asset,
            &self.destination,
            &self.amount,
            &self.state,
            &self.lane,
            &self.from_address,
            &self.nonce,
            &self.tx_hash,
            &self.mined_block_hash,
            &self.last_seq,
            &self.requested_by,
            &self.stuck_at_cap,
        ]
    }
}

/// The projection rows of new streams, in one statement: a table's CHECK expressions are
/// prepared once per statement, not per row. Parameters as [`NewProjections::params`] orders them.
pub(crate) const INSERT_NEW: &str = "
insert into withdrawal (id, account_id, external_id, chain, asset, destination, amount, state, lane, last_seq, requested_by)
select n.id, n.account_id, n.external_id, case n.asset when 'BTC' then 'btc' else 'eth' end, n.asset, n.destination,
       n.amount, n.state, n.lane, n.last_seq, nullif(n.requested_by, '')
  from unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::numeric[], $7::text[], $8::text[],
              $9::int[], $10::text[])
       as n (id, account_id, external_id, asset, destination, amount, state, lane, last_seq, requested_by)";

/// New streams' projection rows as [`INSERT_NEW`]'s columns: what a stream that has only been
/// requested (and perhaps sent for approval) projects; nothing signed, nothing on chain.
#[derive(Debug, Default)]
pub(crate) struct NewProjections {
    ids: Vec<i64>,
    account_ids: Vec<i64>,
    external_ids: Vec<String>,
    assets: Vec<String>,
    destinations: Vec<String>,
    amounts: Vec<U256>,
    states: Vec<&'static str>,
    lanes: Vec<String>,
    last_seqs: Vec<i32>,
    requested_by: Vec<String>,
}

impl NewProjections {
    /// Adds `w`'s row.
    pub(crate) fn push(&mut self, w: &Withdrawal) {
        let p = projection_params(w);
        debug_assert!(p.from_address.is_none() && p.nonce.is_none() && p.tx_hash.is_none() && !p.stuck_at_cap);
        self.ids.push(p.id);
        self.account_ids.push(p.account_id);
        self.external_ids.push(p.external_id);
        self.assets.push(p.asset);
        self.destinations.push(p.destination);
        self.amounts.push(p.amount);
        self.states.push(p.state);
        self.lanes.push(p.lane);
        self.last_seqs.push(p.last_seq);
        self.requested_by.push(p.requested_by);
    }

    /// In [`INSERT_NEW`]'s order.
    pub(crate) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 10] {
        [
            &self.ids,
            &self.account_ids,
            &self.external_ids,
            &self.assets,
            &self.destinations,
            &self.amounts,
            &self.states,
            &self.lanes,
            &self.last_seqs,
            &self.requested_by,
        ]
    }
}

/// The projection row of `w`, a fold of its stream.
pub(crate) fn projection_params(w: &Withdrawal) -> ProjectionParams {
    ProjectionParams {
        id: w.id().get(),
        account_id: w.account_id().get(),
        external_id: w.external_id().to_string(),
        asset: w.asset().key(),
        destination: w.destination().stored(),
        amount: w.amount().units(),
        state: w.state().as_str(),
        lane: w.lane().to_string(),
        from_address: w.from_address().map(ChainAddress::stored),
        nonce: w.nonce().map(Nonce::stored),
        tx_hash: w.tx_hash().map(|h| h.to_string()),
        mined_block_hash: w.mined_block_hash().map(|h| h.to_string()),
        last_seq: w.last_seq(),
        requested_by: w.requested_by().to_owned(),
        stuck_at_cap: w.stuck_at_cap(),
    }
}

/// Writes `w`, a fold of its stream, as the projection row.
pub async fn write_projection(tx: &Transaction<'_>, w: &Withdrawal) -> Result<(), tokio_postgres::Error> {
    tx.execute(UPSERT, &projection_params(w).refs()).await?;
    Ok(())
}

/// Every event of `id`, in order.
pub async fn events<C: GenericClient>(client: &C, id: i64) -> Result<Vec<WithdrawalEvent>, tokio_postgres::Error> {
    let rows = client
        .query("select event_type, payload from withdrawal_event where withdrawal_id = $1 order by seq", &[&id])
        .await?;
    Ok(rows.iter().map(|r| event_from_row(r.get(0), &r.get(1))).collect())
}

/// Locks `id`'s projection row and folds its stream. `None` if there is no such withdrawal.
///
/// # Cancel safety
/// Holds a row lock until the caller's transaction ends; cancelling rolls it back.
pub async fn lock(tx: &Transaction<'_>, id: i64) -> Result<Option<Withdrawal>, tokio_postgres::Error> {
    if tx.query_opt("select 1 from withdrawal where id = $1 for update", &[&id]).await?.is_none() {
        return Ok(None);
    }
    Ok(Withdrawal::fold(WithdrawalId::new(id), &events(tx, id).await?))
}

/// Folds `id`'s stream without locking.
pub async fn load<C: GenericClient>(client: &C, id: i64) -> Result<Option<Withdrawal>, tokio_postgres::Error> {
    Ok(Withdrawal::fold(WithdrawalId::new(id), &events(client, id).await?))
}

/// [`load`] for each of `ids` in one query, in the order given.
pub async fn load_many<C: GenericClient>(
    client: &C,
    ids: &[i64],
) -> Result<Vec<Option<Withdrawal>>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select withdrawal_id, event_type, payload from withdrawal_event where withdrawal_id = any($1)
              order by withdrawal_id, seq",
            &[&ids],
        )
        .await?;
    let mut streams: std::collections::HashMap<i64, Vec<WithdrawalEvent>> = std::collections::HashMap::new();
    for r in &rows {
        streams.entry(r.get(0)).or_default().push(event_from_row(r.get(1), &r.get(2)));
    }
    Ok(ids
        .iter()
        .map(|id| streams.get(id).and_then(|events| Withdrawal::fold(WithdrawalId::new(*id), events)))
        .collect())
}

/// Posts what `event`, just appended to `w`'s stream, entails ([`posting_rules::entailed`]);
/// a transfer posted before is not posted again.
async fn post_entailed(
    tx: &Transaction<'_>,
    w: &Withdrawal,
    event: &WithdrawalEvent,
) -> Result<(), tokio_postgres::Error> {
    ledger::write(tx, &entailed(w, event)).await?;
    Ok(())
}

/// [`append`] for many streams at once: their events, projection rows and ledger transfers each
/// written by one statement for all of them, as a table's CHECK expressions are prepared once per
/// statement and each statement costs a round trip. Event by event they took about a millisecond
/// a withdrawal: a burst's 1,000 settlements a lane, over a second each time a block settles them.
#[derive(Default)]
pub(crate) struct Appended {
    ids: Vec<i64>,
    seqs: Vec<i32>,
    types: Vec<&'static str>,
    payloads: Vec<serde_json::Value>,
    states: Vec<&'static str>,
    from_addresses: Vec<Option<String>>,
    nonces: Vec<Option<i64>>,
    tx_hashes: Vec<Option<String>>,
    mined_block_hashes: Vec<Option<String>>,
    last_seqs: Vec<i32>,
    stuck_at_cap: Vec<bool>,
    transfers: Vec<ledger::Transfer>,
}

/// The projection rows of [`Appended`], each updated with what [`UPSERT`] sets on a row that
/// exists: $1 ids, $2..$8 the columns.
const UPDATE_MANY: &str = "
update withdrawal w set state = n.state, from_address = n.from_address, nonce = n.nonce, tx_hash = n.tx_hash,
       mined_block_hash = n.mined_block_hash, last_seq = n.last_seq, stuck_at_cap = n.stuck_at_cap, updated_at = now()
  from unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::text[], $6::text[], $7::int[], $8::bool[])
       as n (id, state, from_address, nonce, tx_hash, mined_block_hash, last_seq, stuck_at_cap)
 where w.id = any($1) and w.id = n.id";

/// Events of many streams in one statement ($1 ids, $2 seqs, $3 types, $4 payloads), each the
/// next of its stream (the primary key refuses another): [`Appended`]'s, and new streams' first.
pub(crate) const INSERT_EVENTS: &str = "
insert into withdrawal_event (withdrawal_id, seq, event_type, payload)
select * from unnest($1::bigint[], $2::int[], $3::text[], $4::jsonb[])";

impl Appended {
    /// Appends `event` to `w` (read under its row's lock, which the caller holds) and applies it.
    pub(crate) fn push(&mut self, w: &mut Withdrawal, event: &WithdrawalEvent) {
        self.ids.push(w.id().get());
        self.seqs.push(w.last_seq() + 1);
        self.types.push(event.event_type());
        self.payloads.push(event.payload());
        w.apply(event);
        let p = projection_params(w);
        self.states.push(p.state);
        self.from_addresses.push(p.from_address);
        self.nonces.push(p.nonce);
        self.tx_hashes.push(p.tx_hash);
        self.mined_block_hashes.push(p.mined_block_hash);
        self.last_seqs.push(p.last_seq);
        self.stuck_at_cap.push(p.stuck_at_cap);
        self.transfers.extend(entailed(w, event));
    }

    /// Writes everything pushed, in `tx`.
    pub(crate) async fn write(&self, tx: &Transaction<'_>) -> Result<(), tokio_postgres::Error> {
        if self.ids.is_empty() {
            return Ok(());
        }
        let (events, projections) =
            futures::try_join!(tx.prepare_cached(INSERT_EVENTS), tx.prepare_cached(UPDATE_MANY))?;
        tx.execute(&events, &[&self.ids, &self.seqs, &self.types, &self.payloads]).await?;
        tx.execute(
            &projections,
            &[
                &self.ids,
                &self.states,
                &self.from_addresses,
                &self.nonces,
                &self.tx_hashes,
                &self.mined_block_hashes,
                &self.last_seqs,
                &self.stuck_at_cap,
            ],
        )
        .await?;
        ledger::write(tx, &self.transfers).await?;
        Ok(())
    }
}

/// The ledger transfers `event` of `w`'s stream entails, booked by the posting rules
/// ([`posting_rules::entailed`], [`posting_rules::booking`]).
pub(crate) fn entailed(w: &Withdrawal, event: &WithdrawalEvent) -> Vec<ledger::Transfer> {
    posting_rules::entailed(event)
        .into_iter()
        .filter_map(|(movement, fee)| posting_rules::booking(w, movement, fee))
        .filter_map(|b| {
            let reference = serde_json::json!({ "withdrawal_id": w.id() });
            ledger::Transfer::moving(b.key, b.kind, reference, (b.debit, b.credit), &b.asset.key(), b.amount)
        })
        .collect()
}

/// What an attempt was signed to do (DESIGN §7 item 11).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Intent {
    /// Pays what the requested event asks for.
    Payout,
    /// A zero-value transfer to ourselves that consumes the nonce.
    Cancel,
}

impl Intent {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Intent::Payout => "payout",
            Intent::Cancel => "cancel",
        }
    }
}

/// One signed payload of a withdrawal.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// Hash.
    pub tx_hash: TxHash,
    /// How it came to be signed.
    pub kind: AttemptKind,
    /// What it was signed to do.
    pub intent: Intent,
    /// Exact bytes.
    pub raw: Vec<u8>,
    /// Max fee per gas, wei.
    pub max_fee: U256,
}

/// [`attempts`] for each of `ids` in one query, in the order given.
pub async fn attempts_many<C: GenericClient>(
    client: &C,
    ids: &[i64],
) -> Result<Vec<Vec<Attempt>>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select withdrawal_id, tx_hash, kind, intent, raw_tx, max_fee from withdrawal_attempt
              where withdrawal_id = any($1) order by withdrawal_id, created_at, tx_hash",
            &[&ids],
        )
        .await?;
    let mut by_id: std::collections::HashMap<i64, Vec<Attempt>> = std::collections::HashMap::new();
    for r in &rows {
        by_id.entry(r.get(0)).or_default().push(attempt_from_row(r, 1));
    }
    Ok(ids.iter().map(|id| by_id.remove(id).unwrap_or_default()).collect())
}

/// Every attempt of `id`, oldest first.
pub async fn attempts<C: GenericClient>(client: &C, id: i64) -> Result<Vec<Attempt>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select tx_hash, kind, intent, raw_tx, max_fee from withdrawal_attempt where withdrawal_id = $1
              order by created_at, tx_hash",
            &[&id],
        )
        .await?;
    Ok(rows.iter().map(|r| attempt_from_row(r, 0)).collect())
}

/// An attempt's intent as stored (a check constraint allows only the two names).
pub fn stored_intent(intent: &str) -> Intent {
    match intent {
        "payout" => Intent::Payout,
        "cancel" => Intent::Cancel,
        other => panic!("BUG: the database holds an unknown intent {other:?}"),
    }
}

/// An attempt's kind as stored (a check constraint allows only the three names).
pub fn stored_kind(kind: &str) -> AttemptKind {
    kind.parse().expect("BUG: the database holds an unknown attempt kind")
}

/// An attempt from `tx_hash, kind, intent, raw_tx, max_fee` starting at column `at`.
fn attempt_from_row(r: &tokio_postgres::Row, at: usize) -> Attempt {
    Attempt {
        tx_hash: TxHash::parse(Chain::Eth, r.get(at)).expect("BUG: withdrawal_attempt.tx_hash is checked by the table"),
        kind: stored_kind(r.get(at + 1)),
        intent: stored_intent(r.get(at + 2)),
        raw: r.get(at + 3),
        max_fee: r.get(at + 4),
    }
}

/// A signed payload to record: how it came to be, what it does, its bytes and fees.
pub struct NewAttempt<'a> {
    /// Hot wallet.
    pub from: &'a str,
    /// Nonce.
    pub nonce: Nonce,
    /// How it came to be signed.
    pub kind: AttemptKind,
    /// What it does.
    pub intent: Intent,
    /// Destination, value and calldata it was signed with.
    pub call: (&'a str, U256, &'a [u8]),
    /// Hash.
    pub hash: TxHash,
    /// Exact bytes.
    pub raw: &'a [u8],
    /// Max fee per gas, wei.
    pub max_fee: U256,
    /// Max priority fee per gas, wei.
    pub priority_fee: U256,
}

/// Records a signed payload.
pub async fn insert_attempt(
    tx: &Transaction<'_>,
    w: &Withdrawal,
    a: &NewAttempt<'_>,
) -> Result<(), tokio_postgres::Error> {
    let (to, value, data) = a.call;
    let hash = a.hash.to_string();
    tx.execute(
        "insert into withdrawal_attempt (tx_hash, withdrawal_id, chain, from_address, nonce, kind, intent, intent_to,
                                         intent_value, intent_data, raw_tx, max_fee, priority_fee)
         values ($1, $2, 'eth', $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
        &[
            &hash,
            &w.id().get(),
            &a.from,
            &a.nonce.stored(),
            &a.kind.as_str(),
            &a.intent.as_str(),
            &to,
            &value,
            &data,
            &a.raw,
            &a.max_fee,
            &a.priority_fee,
        ],
    )
    .await?;
    Ok(())
}

/// Ids of the ETH lane `$1`'s withdrawals in state `$2`, oldest first, at most `$3`. Planned with
/// the state's value, so the requested ones are read in the order of the queue's index
/// (`withdrawal_requested`, `migrations/V10__requested_queue.sql`), whatever the statistics say.
pub(crate) const IN_STATE: &str = "
select id from withdrawal where chain = 'eth' and lane = $1 and state = $2 order by requested_at, id limit $3";

/// Ids of the lane's withdrawals in `state`, oldest first; at most `limit` of them (`None`: all),
/// so a backlog is read a pass's worth at a time, not whole at every pass.
pub async fn in_state<C: GenericClient>(
    client: &C,
    lane: &str,
    state: WithdrawalState,
    limit: Option<usize>,
) -> Result<Vec<i64>, tokio_postgres::Error> {
    let limit = limit.map(|l| i64::try_from(l).unwrap_or(i64::MAX));
    let rows = client.query(IN_STATE, &[&lane, &state.as_str(), &limit]).await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The ids of the lane's withdrawals in one of `states`, oldest first, each with its nonce as the
/// projection holds it (`None` before one is allocated): which of them a nonce count concerns is
/// known before any stream is read.
pub async fn nonces_in_states<C: GenericClient>(
    client: &C,
    lane: &str,
    states: &[WithdrawalState],
) -> Result<Vec<(i64, Option<Nonce>)>, tokio_postgres::Error> {
    let states: Vec<&str> = states.iter().map(|s| s.as_str()).collect();
    let statement = client
        .prepare_cached(
            "select id, nonce from withdrawal where chain = 'eth' and lane = $1 and state = any($2) order by id",
        )
        .await?;
    let rows = client.query(&statement, &[&lane, &states]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get::<_, Option<i64>>(1).map(Nonce::from_stored))).collect())
}

/// Pauses a lane with a reason (kept if already paused).
pub async fn pause_lane<C: GenericClient>(
    client: &C,
    lane: &str,
    reason: &str,
    needs_resync: bool,
) -> Result<bool, tokio_postgres::Error> {
    pause_lane_on(client, "eth", lane, reason, needs_resync).await
}

/// Pauses a lane of `chain` with a reason (kept if already paused).
pub async fn pause_lane_on<C: GenericClient>(
    client: &C,
    chain: &str,
    lane: &str,
    reason: &str,
    needs_resync: bool,
) -> Result<bool, tokio_postgres::Error> {
    if needs_resync {
        // Marked even when the lane was paused already for another reason: resuming it now
        // takes a resync first.
        client
            .execute("update hot_wallet set needs_resync = true where chain = $2 and lane = $1", &[&lane, &chain])
            .await?;
    }
    let paused = client
        .execute(
            "update hot_wallet set paused_at = now(), pause_reason = $2 where chain = $3 and lane = $1 and paused_at is null",
            &[&lane, &reason, &chain],
        )
        .await?;
    if paused > 0 {
        tracing::error!(chain, lane, reason, "ALERT: lane paused");
    }
    Ok(paused > 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use custodian_testkit::db::plan;
    use custodian_testkit::fixtures::stale_requested_queue;
    use custodian_testkit::TestDb;

    /// A lane's requested withdrawals are read from the queue's index whatever the statistics say:
    /// ordered by id, on statistics taken while most of a long history was still requested, the
    /// plan walked withdrawal_pkey past every withdrawal the lane had ever signed.
    #[tokio::test]
    async fn the_requested_are_read_by_the_queue_index_after_stale_statistics() {
        let db = TestDb::new().await;
        let owner = db.owner_client().await;
        let (lane, wallet) = ("e0", "0x00000000000000000000000000000000000000e0");
        owner
            .execute(
                "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, $2, 0)",
                &[&wallet, &lane],
            )
            .await
            .unwrap();
        stale_requested_queue(&owner, ("eth", "ETH"), lane, "0x00000000000000000000000000000000000000d0", 1_000).await;
        let client = db.pool.get().await.unwrap();
        let plan = plan(&client, IN_STATE, &[&lane, &"requested", &Some(50i64)]).await;
        assert!(plan.contains("using withdrawal_requested"), "not read from the queue index:\n{plan}");
        assert!(!plan.contains("using withdrawal_pkey"), "read in id order, filtered:\n{plan}");
        let ids = in_state(&client, lane, WithdrawalState::Requested, Some(50)).await.unwrap();
        assert_eq!(ids, (2151..=2200).collect::<Vec<i64>>(), "the 50 oldest requested, in order");
    }
}
