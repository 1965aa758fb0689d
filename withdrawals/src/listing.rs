//! Withdrawals as people and clients read them: one, or a page, each with every transaction
//! signed for it (ETH's payloads, or the BTC transactions of its spend). The CLI and the API both
//! read through here; neither has its own copy of these queries.
//!
//! A withdrawal is its event stream folded ([`Withdrawal::fold`]), the same fold the projection
//! is written from; the projection row adds only what the stream does not say (the asset's symbol
//! and decimals, when it was requested and last changed). Whatever is read, it is one round trip
//! once the ids are known.

use std::collections::HashMap;
use std::time::SystemTime;

use alloy_primitives::U256;
use custodian_domain::withdrawal::{AttemptKind, Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::WithdrawalId;
use deadpool_postgres::GenericClient;
use serde::Serialize;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::sql::{self, Intent};

/// The projection columns a listing shows beside the fold, for some ids.
const ROWS: &str = "
select w.id, a.symbol, a.decimals, w.requested_at, w.updated_at
  from unnest($1::bigint[]) as k (id)
 cross join lateral (select * from withdrawal w where w.id = k.id offset 0) w
  join asset a on a.chain = w.chain and a.asset = w.asset";

/// The event streams of some ids, in order.
const EVENTS: &str = "
select e.withdrawal_id, e.event_type, e.payload
  from unnest($1::bigint[]) as k (id)
 cross join lateral (select * from withdrawal_event e where e.withdrawal_id = k.id offset 0) e
 order by e.withdrawal_id, e.seq";

/// The ids of a page: $1 account (null: all), $2 state (null: all), $3 after this id, $4 at most.
const PAGE: &str = "
select id from withdrawal
 where ($1::bigint is null or account_id = $1) and ($2::text is null or state = $2) and id > $3
 order by id
 limit $4";

/// Every signed payload of the withdrawals whose ids `$ids` (a `from` item with one column, `id`)
/// yields, oldest first per withdrawal. Each id is looked up on its own (`lateral … offset 0`),
/// so the plan is index probes whatever the statistics said when it was made: a generic plan made
/// while the tables were small scans them whole for `= any($1)`.
macro_rules! attempts_of {
    ($ids:literal) => {
        concat!(
            "select a.withdrawal_id, a.tx_hash, a.kind, a.intent, a.max_fee, null::numeric as fee, null::int as vsize, a.created_at
  from ", $ids, "
 cross join lateral (select * from withdrawal_attempt a where a.withdrawal_id = k.id offset 0) a
union all
select b.withdrawal_id, b.tx_hash, b.kind, case b.kind when 'cancel' then 'cancel' else 'payout' end, null,
       b.fee, b.vsize, b.created_at
  from ", $ids, "
 cross join lateral (select p.withdrawal_id, a.tx_hash, a.kind, a.fee, a.vsize, a.created_at
                       from btc_spend_payout p join btc_attempt a on a.spend_id = p.spend_id
                      where p.withdrawal_id = k.id offset 0) b
 order by 1, 8, 2"
        )
    };
}

/// [`attempts_of`] some ids ($1).
const ATTEMPTS: &str = attempts_of!("unnest($1::bigint[]) as k (id)");

/// [`attempts_of`] the withdrawals of some requests' idempotency keys ($1 accounts, $2 external
/// ids): read in the same round trip as the requests' earlier streams, so an idempotent hit is
/// answered without another.
pub(crate) const ATTEMPTS_BY_KEY: &str = attempts_of!(
    "(select w.id from unnest($1::bigint[], $2::text[]) as r (account_id, external_id)
         cross join lateral (select w.id from withdrawal w
                              where w.account_id = r.account_id and w.external_id = r.external_id offset 0) w) as k (id)"
);

/// Which withdrawals a page holds.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// One account's only.
    pub account_id: Option<i64>,
    /// In this state only.
    pub state: Option<WithdrawalState>,
    /// Ids greater than this (0: from the first).
    pub after: i64,
    /// At most this many.
    pub limit: i64,
}

/// One transaction signed for a withdrawal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ListedAttempt {
    /// Its hash (ETH) or txid (BTC).
    pub tx_hash: String,
    /// How it came to be signed.
    pub kind: AttemptKind,
    /// What it was signed to do.
    pub intent: Intent,
    /// ETH: the max fee per gas it offers, wei.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "decimal_text")]
    pub max_fee_per_gas_wei: Option<U256>,
    /// BTC: the fee it pays, satoshis (shared with the batch's other payouts).
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "decimal_text")]
    pub fee_sat: Option<U256>,
    /// BTC: its virtual size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vsize: Option<i32>,
}

fn decimal_text<S: serde::Serializer>(value: &Option<U256>, s: S) -> Result<S::Ok, S::Error> {
    match value {
        Some(v) => s.serialize_str(&v.to_string()),
        None => s.serialize_none(),
    }
}

/// A withdrawal as listed.
#[derive(Debug, Clone)]
pub struct Listed {
    /// Its event stream, folded.
    pub withdrawal: Withdrawal,
    /// The asset's symbol.
    pub symbol: String,
    /// The asset's decimals.
    pub decimals: u8,
    /// When it was requested.
    pub requested_at: SystemTime,
    /// When it last changed.
    pub updated_at: SystemTime,
    /// Every transaction signed for it, oldest first.
    pub attempts: Vec<ListedAttempt>,
}

/// What a listing shows beside the folded stream, when it is known without reading the listing:
/// a new request's, from what it wrote; an idempotent hit's, read with its stream.
#[derive(Debug, Clone)]
pub struct Extras {
    /// The asset's symbol.
    pub symbol: String,
    /// The asset's decimals.
    pub decimals: u8,
    /// When it was requested.
    pub requested_at: SystemTime,
    /// When it last changed.
    pub updated_at: SystemTime,
    /// Every transaction signed for it, oldest first.
    pub attempts: Vec<ListedAttempt>,
}

impl Extras {
    /// `withdrawal` as listed.
    pub fn listed(self, withdrawal: Withdrawal) -> Listed {
        let Extras { symbol, decimals, requested_at, updated_at, attempts } = self;
        Listed { withdrawal, symbol, decimals, requested_at, updated_at, attempts }
    }
}

impl Extras {
    /// Symbol, decimals, `requested_at` and `updated_at` from `row`'s columns `at`, `at + 1`, …
    /// (as [`ROWS`] reads them), with `attempts`.
    pub(crate) fn from_row(row: &Row, at: usize, attempts: Vec<ListedAttempt>) -> Extras {
        Extras {
            symbol: row.get(at),
            decimals: stored_decimals(row.get(at + 1)),
            requested_at: row.get(at + 2),
            updated_at: row.get(at + 3),
            attempts,
        }
    }
}

/// Decimals as stored (`smallint`, checked 0..=77).
pub(crate) fn stored_decimals(decimals: i16) -> u8 {
    u8::try_from(decimals).expect("BUG: decimals outside 0..=77")
}

/// The withdrawal `id`, or `None`.
pub async fn one<C: GenericClient>(client: &C, id: i64) -> Result<Option<Listed>, tokio_postgres::Error> {
    Ok(these(client, &[id]).await?.pop())
}

/// The page `filter` asks for, oldest first, and whether another page follows.
pub async fn page<C: GenericClient>(client: &C, filter: &Filter) -> Result<(Vec<Listed>, bool), tokio_postgres::Error> {
    let state = filter.state.map(WithdrawalState::as_str);
    let limit = filter.limit.max(0);
    let rows = client.query(PAGE, &[&filter.account_id, &state, &filter.after, &(limit + 1)]).await?;
    let more = i64::try_from(rows.len()).unwrap_or(i64::MAX) > limit;
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).take(usize::try_from(limit).unwrap_or(usize::MAX)).collect();
    Ok((these(client, &ids).await?, more))
}

/// Withdrawals as listed whose streams the caller has just folded (the answers of requests: a
/// new one as its request wrote it, an earlier one as the request read it): only the
/// projection's own columns and the attempts are read, for all of them in one round trip. In the
/// order given; `None` for an id with no row.
pub async fn folded<C: GenericClient>(
    client: &C,
    withdrawals: Vec<Withdrawal>,
) -> Result<Vec<Option<Listed>>, tokio_postgres::Error> {
    if withdrawals.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<i64> = withdrawals.iter().map(|w| w.id().get()).collect();
    let (rows, attempts) = futures::try_join!(client.prepare_cached(ROWS), client.prepare_cached(ATTEMPTS))?;
    let params: [&(dyn ToSql + Sync); 1] = [&ids];
    let (rows, attempts) = futures::try_join!(client.query(&rows, &params), client.query(&attempts, &params))?;
    let signed = by_withdrawal(&attempts);
    // One withdrawal may be the answer of several requests (a request and its resent copy).
    let columns: HashMap<i64, &Row> = rows.iter().map(|r| (r.get(0), r)).collect();
    Ok(withdrawals
        .into_iter()
        .map(|w| {
            let id = w.id().get();
            let row = columns.get(&id)?;
            Some(listed(w, row, signed.get(&id).cloned().unwrap_or_default()))
        })
        .collect())
}

/// A withdrawal with its [`ROWS`] row and attempts.
fn listed(withdrawal: Withdrawal, row: &Row, attempts: Vec<ListedAttempt>) -> Listed {
    Extras::from_row(row, 1, attempts).listed(withdrawal)
}

/// `ids` that exist, in the order given: the three reads in one round trip.
async fn these<C: GenericClient>(client: &C, ids: &[i64]) -> Result<Vec<Listed>, tokio_postgres::Error> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let ids = ids.to_vec();
    let (rows, events, attempts) = futures::try_join!(
        client.prepare_cached(ROWS),
        client.prepare_cached(EVENTS),
        client.prepare_cached(ATTEMPTS)
    )?;
    let params: [&(dyn ToSql + Sync); 1] = [&ids];
    let (rows, events, attempts) = futures::try_join!(
        client.query(&rows, &params),
        client.query(&events, &params),
        client.query(&attempts, &params)
    )?;
    let mut streams: HashMap<i64, Vec<WithdrawalEvent>> = HashMap::new();
    for r in &events {
        streams.entry(r.get(0)).or_default().push(sql::event_from_row(r.get(1), &r.get(2)));
    }
    let mut signed = by_withdrawal(&attempts);
    let mut columns: HashMap<i64, &Row> = rows.iter().map(|r| (r.get(0), r)).collect();
    Ok(ids
        .iter()
        .filter_map(|id| {
            let row = columns.remove(id)?;
            let withdrawal = Withdrawal::fold(WithdrawalId::new(*id), streams.get(id)?)
                .expect("BUG: a projection row whose stream does not fold");
            Some(listed(withdrawal, row, signed.remove(id).unwrap_or_default()))
        })
        .collect())
}

/// [`ATTEMPTS`] rows by withdrawal id, oldest first.
pub(crate) fn by_withdrawal(rows: &[Row]) -> HashMap<i64, Vec<ListedAttempt>> {
    let mut signed: HashMap<i64, Vec<ListedAttempt>> = HashMap::new();
    for r in rows {
        signed.entry(r.get(0)).or_default().push(attempt(r));
    }
    signed
}

/// An [`ATTEMPTS`] row.
fn attempt(r: &Row) -> ListedAttempt {
    ListedAttempt {
        tx_hash: r.get(1),
        kind: sql::stored_kind(r.get(2)),
        intent: sql::stored_intent(r.get(3)),
        max_fee_per_gas_wei: r.get(4),
        fee_sat: r.get(5),
        vsize: r.get(6),
    }
}
