//! Withdrawal requests: validation, client idempotency by `(account, external_id)`, the
//! available-balance check and the hold, all before or inside one transaction.

use alloy_primitives::U256;
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{AccountId, Asset, ExternalId, WithdrawalId};
use custodian_domain::{Amount, BtcAddress, BtcNetwork, Chain, ChainAddress, EthAddress, LedgerAccount, SignedAmount};
use custodian_store::{ledger, AppendError};
use serde::Serialize;

use crate::listing::{self, Extras};
use crate::sql::{self, StoreError};

/// What a client asks for, already parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The account paying.
    pub account_id: AccountId,
    /// The client's idempotency key.
    pub external_id: ExternalId,
    /// What is paid (an asset the database must know).
    pub asset: Asset,
    /// Destination, on the asset's chain.
    pub destination: ChainAddress,
    /// Smallest units, positive.
    pub amount: Amount,
    /// The authenticated principal asking (an API token's name): recorded in the `requested`
    /// event, and never allowed to approve this withdrawal.
    pub requested_by: String,
}

/// How a request ended.
#[derive(Debug, Clone, Serialize)]
pub struct Requested {
    /// The withdrawal.
    pub withdrawal: Withdrawal,
    /// False when an earlier request with the same external id and payload was returned.
    pub created: bool,
    /// What the withdrawal's listing shows beside the fold, when the request already knows it (a
    /// new one's from what it wrote, an idempotent hit's read with its stream); `None`: read it.
    #[serde(skip)]
    pub extras: Option<Extras>,
}

/// Why a request was refused. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Bad input: checksum, zero amount, too many decimals, unknown asset, our own hot wallet.
    #[error("{0}")]
    Invalid(String),
    /// The external id was used before with another payload.
    #[error("external id {external_id:?} was already used for withdrawal {existing} with a different {}", fields.join(", "))]
    Conflict {
        /// The client's key.
        external_id: String,
        /// The earlier withdrawal.
        existing: i64,
        /// Which fields differ.
        fields: Vec<&'static str>,
    },
    /// Not enough available balance.
    #[error("insufficient funds: {requested} requested, {available} available (smallest units of {asset})")]
    InsufficientFunds {
        /// Asset.
        asset: String,
        /// Requested.
        requested: Amount,
        /// Available now (below zero when a reversed deposit left the account owing).
        available: SignedAmount,
    },
    /// The lane the withdrawal hashes to is paused.
    #[error("lane {lane} is paused: {reason}")]
    LanePaused {
        /// Lane.
        lane: String,
        /// Why.
        reason: String,
    },
    /// No hot wallet is registered on the chain.
    #[error("no hot wallet is registered for {0}: `custodian hot-wallet add` first")]
    NoHotWallet(&'static str),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
    /// No database connection could be had.
    #[error("no database connection: {0}")]
    Unavailable(#[from] deadpool_postgres::PoolError),
    /// The service is stopping and takes no new request.
    #[error("the service is shutting down")]
    ShuttingDown,
}

impl RequestError {
    /// True when the request itself was refused (exit 2, a client error); false when the
    /// database failed and the same request may succeed later.
    pub fn is_refusal(&self) -> bool {
        !matches!(self, RequestError::Database(_) | RequestError::Unavailable(_) | RequestError::ShuttingDown)
    }
}

impl From<StoreError> for RequestError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Database(e) => RequestError::Database(e),
            StoreError::Conflict(AppendError::Database { source, .. }) => RequestError::Database(source),
            StoreError::Conflict(conflict) => panic!("BUG: a new stream conflicted: {conflict}"),
        }
    }
}

/// Parses the parts of a request that need only the asset: the destination on its chain (for BTC,
/// a standard address of `network`) and a positive amount within the asset's decimals (for BTC,
/// at least the destination type's dust limit, which Bitcoin Core would not relay).
pub fn parse(
    chain: Chain,
    network: BtcNetwork,
    destination: &str,
    amount: &str,
    decimals: u8,
) -> Result<(ChainAddress, Amount), RequestError> {
    let invalid = |e: &dyn std::fmt::Display| RequestError::Invalid(e.to_string());
    let destination = match chain {
        Chain::Eth => ChainAddress::Eth(EthAddress::parse(destination.trim()).map_err(|e| invalid(&e))?),
        Chain::Btc => ChainAddress::Btc(BtcAddress::parse(destination.trim(), network).map_err(|e| invalid(&e))?),
    };
    let amount = Amount::parse_decimal(amount, decimals).map_err(|e| invalid(&e))?;
    if amount.is_zero() {
        return Err(RequestError::Invalid("amount must be greater than zero".into()));
    }
    if let ChainAddress::Btc(address) = &destination {
        let script = address.as_bitcoin().script_pubkey();
        if !script.is_p2pkh() && !script.is_p2sh() && !script.is_p2wpkh() && !script.is_p2wsh() && !script.is_p2tr() {
            return Err(RequestError::Invalid(format!(
                "{address} is not a standard destination (P2PKH, P2SH, P2WPKH, P2WSH or P2TR)"
            )));
        }
        let dust = script.minimal_non_dust().to_sat();
        if amount.units() < U256::from(dust) {
            return Err(RequestError::Invalid(format!(
                "{} BTC to {address} is below its dust limit of {dust} satoshis, which nodes do not relay",
                amount.to_decimal_string(8)
            )));
        }
    }
    Ok((destination, amount))
}

/// Finds a withdrawable asset by key or symbol, on any chain: the asset, its decimals and chain.
pub async fn find_asset<C: deadpool_postgres::GenericClient>(
    client: &C,
    name: &str,
) -> Result<Option<(Asset, u8, Chain)>, tokio_postgres::Error> {
    // ETH's first where both chains know the name; the key or symbol is unique per chain.
    let statement = client
        .prepare_cached(
            "select asset, decimals, chain = 'btc' from asset
              where (lower(asset) = lower($1) or upper(symbol) = upper($1)) and chain in ('eth', 'btc')
              order by chain = 'btc' limit 1",
        )
        .await?;
    Ok(client.query_opt(&statement, &[&name]).await?.map(|r| {
        let chain = if r.get(2) { Chain::Btc } else { Chain::Eth };
        let asset = Asset::parse_key(r.get(0)).expect("BUG: asset.asset is checked by the table");
        (asset, u8::try_from(r.get::<_, i16>(1)).expect("BUG: decimals outside 0..=77"), chain)
    }))
}

/// FNV-1a of the id: a stable lane choice that every process computes alike.
pub fn lane_index(id: i64, lanes: usize) -> usize {
    let hash = id
        .to_le_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    usize::try_from(hash % lanes as u64).expect("BUG: lane index beyond usize")
}

fn differing(existing: &Withdrawal, request: &Request) -> Vec<&'static str> {
    let mut fields = Vec::new();
    if existing.asset() != request.asset {
        fields.push("asset");
    }
    if *existing.destination() != request.destination {
        fields.push("destination");
    }
    if existing.amount() != request.amount {
        fields.push("amount");
    }
    fields
}

/// The earlier withdrawal folded from its events' rows ([`EXISTING`]'s for one key), if there was one.
fn fold_existing(rows: &[tokio_postgres::Row]) -> Option<Withdrawal> {
    let id: i64 = rows.first()?.get(0);
    let events: Vec<WithdrawalEvent> = rows.iter().map(|r| sql::event_from_row(r.get(1), &r.get(2))).collect();
    Some(Withdrawal::fold(WithdrawalId::new(id), &events).expect("BUG: projection row without a requested event"))
}

/// The earlier withdrawal with the request's external id, if any: returned when it asks for the
/// same, refused as a conflict when not.
async fn existing(client: &deadpool_postgres::Object, request: &Request) -> Result<Option<Requested>, RequestError> {
    let statements = Statements::prepare(client).await?;
    let [unlocked] =
        Unlocked::read_many(client, &statements, &[request]).await?.try_into().ok().expect("BUG: one read per request");
    unlocked.earlier.map(|(w, _)| compare(w, request)).transpose()
}

fn compare(withdrawal: Withdrawal, request: &Request) -> Result<Requested, RequestError> {
    let fields = differing(&withdrawal, request);
    if fields.is_empty() {
        Ok(Requested { withdrawal, created: false, extras: None })
    } else {
        Err(RequestError::Conflict {
            external_id: request.external_id.to_string(),
            existing: withdrawal.id().get(),
            fields,
        })
    }
}

/// Records a request, or returns the earlier one with the same external id and payload.
///
/// An idempotent hit costs one round trip on one pooled connection: the earlier withdrawal's
/// stream, listing columns and attempts. A new request costs three: that one, the other reads that
/// need no lock, then `BEGIN`, the account lock with the checks under it
/// (`withdrawal_request_check`, refusing by raising), the writes, the transaction's timestamp
/// (for the answer) and `COMMIT` together, so the account's lock is held across no round trip.
/// An asset with a daily limit takes four: what it writes depends on the day's total read under
/// the lock.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing (the connection it held is closed, not pooled).
pub async fn request(pool: &deadpool_postgres::Pool, request: &Request) -> Result<Requested, RequestError> {
    let request = normalized(request)?;
    // Two concurrent first requests with one external id: the loser hits the unique key, rolls
    // back, and on the retry finds the winner's withdrawal.
    for _ in 0..2 {
        match try_request(pool.get().await?, request).await {
            Ok(Tried::Done(requested)) => return Ok(*requested),
            Ok(Tried::Raced(earlier)) => tracing::debug!(earlier, "a request with this external id committed first"),
            Err(RequestError::Database(e))
                if custodian_store::is_unique_violation(&e, Some("withdrawal_account_id_external_id_key")) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    }
    existing(&pool.get().await?, request)
        .await?
        .ok_or_else(|| panic!("BUG: external id conflict without an existing withdrawal"))
}

/// The request if it can be recorded: a positive amount, asked for by a named principal (its
/// key, asset and destination were parsed into their types).
fn normalized(request: &Request) -> Result<&Request, RequestError> {
    if request.requested_by.trim().is_empty() {
        return Err(RequestError::Invalid("a withdrawal needs the authenticated principal asking for it".into()));
    }
    if request.amount.is_zero() {
        return Err(RequestError::Invalid("amount must be greater than zero".into()));
    }
    Ok(request)
}

/// Under the account's lock, in one statement, for an asset with a daily limit: an earlier
/// withdrawal with this external id (one that committed while this request waited for the lock),
/// the balance and the rolling 24-hour total. ($1 account, $2 external id, $3 asset.) A statement after the lock, so its snapshot includes whatever committed before
/// the lock was granted.
const UNDER_LOCK: &str = "
select (select id from withdrawal where account_id = $1 and external_id = $2),
       available($1, $3)::text,
       (select coalesce(sum(amount), 0) from withdrawal
         where account_id = $1 and asset = $3 and requested_at > now() - interval '24 hours'
           and state not in ('rejected', 'cancelled', 'failed_onchain'))";

/// The account's row lock: serialises the requests of one account.
const LOCK: &str = "select 1 from account where id = $1 for update";

/// The account lock and the checks under it, server-side, refusing by raising (`withdrawal_request_check`, `migrations/V5__withdrawals.sql`):
/// CW001 unknown account, CW002 an earlier withdrawal with this external id (detail: its id),
/// CW003 a short balance (detail: the balance). ($1 account, $2 external id, $3 asset, $4 amount.)
const CHECK: &str = "select withdrawal_request_check($1, $2, $3, $4)";

/// The first event of a new stream ($1 id, $2 seq, $3 type, $4 payload).
const INSERT_EVENT: &str =
    "insert into withdrawal_event (withdrawal_id, seq, event_type, payload) values ($1, $2, $3, $4)";

/// How one try of a request ended.
enum Tried {
    /// Recorded, returned or refused as a conflict.
    Done(Box<Requested>),
    /// This earlier withdrawal with the same external id committed while the try waited for the
    /// lock: the next try returns it (or refuses the conflict) from its first read.
    Raced(i64),
}

type P<'a> = &'a (dyn tokio_postgres::types::ToSql + Sync);

/// The refusal a [`CHECK`] error stands for, if it is one.
fn refusal(e: &tokio_postgres::Error, request: &Request) -> Option<Result<Tried, RequestError>> {
    let db = e.as_db_error()?;
    let detail = || db.detail().expect("BUG: withdrawal_request_check refuses with a detail").to_owned();
    match db.code().code() {
        "CW001" => Some(Err(RequestError::Invalid(format!("unknown account {}", request.account_id)))),
        "CW002" => Some(Ok(Tried::Raced(detail().parse().expect("BUG: CW002's detail is an id")))),
        "CW003" => Some(Err(RequestError::InsufficientFunds {
            asset: request.asset.key(),
            requested: request.amount,
            available: detail().parse().expect("BUG: CW003's detail is a balance"),
        })),
        _ => None,
    }
}

/// Every statement a request uses, prepared on one connection (cached: no round trip after the
/// connection's first request).
struct Statements {
    existing: tokio_postgres::Statement,
    asset_limits: tokio_postgres::Statement,
    ours: tokio_postgres::Statement,
    lanes: tokio_postgres::Statement,
    next_ids: tokio_postgres::Statement,
    attempts_by_key: tokio_postgres::Statement,
    now: tokio_postgres::Statement,
    check: tokio_postgres::Statement,
    lock: tokio_postgres::Statement,
    under_lock: tokio_postgres::Statement,
    insert_event: tokio_postgres::Statement,
    insert_events: tokio_postgres::Statement,
    projection: tokio_postgres::Statement,
    insert_new: tokio_postgres::Statement,
    hold: tokio_postgres::Statement,
}

impl Statements {
    async fn prepare(client: &deadpool_postgres::Object) -> Result<Statements, tokio_postgres::Error> {
        let (
            existing,
            asset_limits,
            ours,
            lanes,
            next_ids,
            attempts_by_key,
            now,
            check,
            lock,
            under_lock,
            insert_event,
            insert_events,
            projection,
            insert_new,
            hold,
        ) = futures::try_join!(
            client.prepare_cached(EXISTING),
            client.prepare_cached(ASSET_LIMITS),
            client.prepare_cached(OURS),
            client.prepare_cached(LANES),
            client.prepare_cached(NEXT_IDS),
            client.prepare_cached(listing::ATTEMPTS_BY_KEY),
            client.prepare_cached(NOW),
            client.prepare_cached(CHECK),
            client.prepare_cached(LOCK),
            client.prepare_cached(UNDER_LOCK),
            client.prepare_cached(INSERT_EVENT),
            client.prepare_cached(sql::INSERT_EVENTS),
            client.prepare_cached(sql::UPSERT),
            client.prepare_cached(sql::INSERT_NEW),
            client.prepare_cached(ledger::WRITE),
        )?;
        Ok(Statements {
            existing,
            asset_limits,
            ours,
            lanes,
            next_ids,
            attempts_by_key,
            now,
            check,
            lock,
            under_lock,
            insert_event,
            insert_events,
            projection,
            insert_new,
            hold,
        })
    }
}

impl Statements {
    /// Every statement, for [`warm`].
    fn all(&self) -> [&tokio_postgres::Statement; 15] {
        [
            &self.existing,
            &self.asset_limits,
            &self.ours,
            &self.lanes,
            &self.next_ids,
            &self.attempts_by_key,
            &self.now,
            &self.check,
            &self.lock,
            &self.under_lock,
            &self.insert_event,
            &self.insert_events,
            &self.projection,
            &self.insert_new,
            &self.hold,
        ]
    }
}

/// A parameter of any type whose value is null: what [`warm`] binds, since binding plans a
/// statement whatever its values are.
#[derive(Debug)]
struct Null;

impl tokio_postgres::types::ToSql for Null {
    fn to_sql(
        &self,
        _: &tokio_postgres::types::Type,
        _: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        Ok(tokio_postgres::types::IsNull::Yes)
    }

    fn accepts(_: &tokio_postgres::types::Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

/// Readies `client` for requests without making one: prepares every statement a request uses and
/// binds each once, with null values, under the generic plan the request runs them with, then
/// rolls back. Binding plans a statement without running it, so nothing is read for a client or
/// written; what it pays for here instead of in a client's first request on the connection is
/// the connection's first plans, with the catalog lookups behind them (about 25 ms on a new
/// backend, measured through `serve`).
///
/// # Errors
/// The database's, as it refused a statement; the connection is then fit only to be dropped.
pub async fn warm(client: &mut deadpool_postgres::Object) -> Result<(), tokio_postgres::Error> {
    let statements = Statements::prepare(client).await?;
    let tx = client.transaction().await?;
    tx.batch_execute("set local plan_cache_mode = force_generic_plan").await?;
    let nulls = |statement: &tokio_postgres::Statement| {
        vec![&Null as &(dyn tokio_postgres::types::ToSql + Sync); statement.params().len()]
    };
    futures::future::try_join_all(statements.all().map(|statement| tx.bind_raw(statement, nulls(statement)))).await?;
    tx.rollback().await
}

/// What a request learns before any lock: the earlier withdrawal with its external id (one round
/// trip, and all a hit needs), else the asset's approval settings, whether the destination is
/// ours, the chain's lanes and a fresh id (a second). Each read is planned generically
/// ([`custodian_store::Pipelined::read_generic`]): custom plans of these statements were made
/// anew on every call, at up to twice the server time of the generic plan's execution.
struct Unlocked {
    /// The earlier withdrawal with the request's key, with its listing columns. When there is
    /// one, nothing else is read: the request is answered with it (or refused as a conflict).
    earlier: Option<(Withdrawal, Extras)>,
    asset: Option<tokio_postgres::Row>,
    ours: Option<String>,
    lanes: Vec<crate::hot_wallet::Lane<ChainAddress>>,
    /// The new withdrawal's id (`None` when there is an earlier one).
    id: Option<i64>,
}

/// What [`Unlocked`] is read from, set-based, for any number of requests: this and
/// [`listing::ATTEMPTS_BY_KEY`] in one round trip, then four statements for the requests that found
/// no earlier withdrawal. The events of each key's earlier withdrawal, oldest first ($1 accounts, $2 keys).
/// Each key is looked up on its own (`lateral … offset 0` keeps the subquery from being joined
/// as a whole): joined to the unnest, the generic plan made while the table was small hashes the
/// keys and scans `withdrawal` whole, and keeps doing so as it grows until the next ANALYZE
/// (seen at 6.6 ms per request behind 4,160 withdrawals in the request path bench).
const EXISTING: &str = "
select e.withdrawal_id, e.event_type, e.payload, w.account_id, w.external_id,
       a.symbol, a.decimals, w.requested_at, w.updated_at
  from unnest($1::bigint[], $2::text[]) as k (account_id, external_id)
 cross join lateral (select w.id, w.account_id, w.external_id, w.chain, w.asset, w.requested_at, w.updated_at
                       from withdrawal w
                      where w.account_id = k.account_id and w.external_id = k.external_id offset 0) w
  join asset a on a.chain = w.chain and a.asset = w.asset
  join withdrawal_event e on e.withdrawal_id = w.id
 order by e.withdrawal_id, e.seq";
/// The approval settings of each asset ($1 assets, $2 chains).
const ASSET_LIMITS: &str = "
select a.approval_limit, a.approvals_required, a.daily_limit, a.asset, a.chain, a.symbol, a.decimals
  from asset a join unnest($1::text[], $2::text[]) as k (asset, chain) on k.asset = a.asset and k.chain = a.chain";
/// Why each destination is ours, if it is: one of our hot wallets; for BTC also any of our own
/// addresses (a deposit address, a change address): paying it would only move a coin between our
/// keys, at a fee. ($1 chains, $2 addresses.)
const OURS: &str = "
select k.chain, k.address,
       case when exists (select 1 from hot_wallet where chain = k.chain and address = k.address)
            then 'is one of our hot wallets'
            when k.chain = 'btc' and (exists (select 1 from wallet_address where chain = 'btc' and address = k.address)
                                 or exists (select 1 from btc_change_address where chain = 'btc' and address = k.address))
            then 'is one of our own addresses' end
  from unnest($1::text[], $2::text[]) as k (chain, address)";
/// The lanes of the chains ($1), in [`crate::hot_wallet::lane_from_row`]'s columns and then the chain.
const LANES: &str = "
select lane, address, next_nonce, pause_reason, shortage, retired_at is not null, chain
  from hot_wallet where chain = any($1) order by chain, lane";
/// The transaction's timestamp: a new withdrawal's `requested_at` and `updated_at`.
const NOW: &str = "select now()";
/// A fresh id per request, read before any lock (a refused request leaves a gap, as ids may).
const NEXT_IDS: &str = "select nextval('withdrawal_id_seq') from generate_series(1, $1::int)";

impl Unlocked {
    async fn read_many(
        client: &deadpool_postgres::Object,
        statements: &Statements,
        requests: &[&Request],
    ) -> Result<Vec<Unlocked>, tokio_postgres::Error> {
        let accounts: Vec<i64> = requests.iter().map(|r| r.account_id.get()).collect();
        let keys: Vec<&str> = requests.iter().map(|r| r.external_id.as_str()).collect();
        let by_key: [P<'_>; 2] = [&accounts, &keys];
        // First round trip: the earlier withdrawals, as listed. An idempotent hit is answered
        // from it alone, and costs the server no more than these two reads.
        let [existing, attempts]: [Vec<tokio_postgres::Row>; 2] = custodian_store::Pipelined::read_generic(
            client,
            &[(&statements.existing, &by_key), (&statements.attempts_by_key, &by_key)],
        )
        .await?
        .try_into()
        .expect("BUG: two reads answer twice");
        let mut streams: std::collections::HashMap<(i64, String), Vec<tokio_postgres::Row>> = Default::default();
        for row in existing {
            streams.entry((row.get(3), row.get(4))).or_default().push(row);
        }
        let attempts = listing::by_withdrawal(&attempts);
        let earlier: Vec<Option<(Withdrawal, Extras)>> = (0..requests.len())
            .map(|n| {
                let rows = streams.get(&(accounts[n], keys[n].to_owned()))?;
                let first = rows.first()?;
                let signed = attempts.get(&first.get::<_, i64>(0)).cloned().unwrap_or_default();
                let extras = Extras::from_row(first, 5, signed);
                Some((fold_existing(rows)?, extras))
            })
            .collect();
        // Second, for the new requests only: what recording one needs.
        let new: Vec<&Request> = requests.iter().zip(&earlier).filter(|(_, e)| e.is_none()).map(|(r, _)| *r).collect();
        let mut fresh = Unlocked::read_new(client, statements, &new).await?.into_iter();
        Ok(earlier
            .into_iter()
            .map(|earlier| match earlier {
                Some(earlier) => {
                    Unlocked { earlier: Some(earlier), asset: None, ours: None, lanes: Vec::new(), id: None }
                }
                None => fresh.next().expect("BUG: one read per new request"),
            })
            .collect())
    }

    /// The asset's settings, whether the destination is ours, the lanes and a fresh id of each
    /// of `requests`, none of which found an earlier withdrawal: four reads in one round trip
    /// (none when there are no requests).
    async fn read_new(
        client: &deadpool_postgres::Object,
        statements: &Statements,
        requests: &[&Request],
    ) -> Result<Vec<Unlocked>, tokio_postgres::Error> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        let assets: Vec<String> = requests.iter().map(|r| r.asset.key()).collect();
        let chains: Vec<&str> = requests.iter().map(|r| r.destination.chain().as_str()).collect();
        let destinations: Vec<String> = requests.iter().map(|r| r.destination.stored()).collect();
        let count = i32::try_from(requests.len()).expect("BUG: a batch beyond i32");
        let by_asset: [P<'_>; 2] = [&assets, &chains];
        let by_address: [P<'_>; 2] = [&chains, &destinations];
        let on_chain: [P<'_>; 1] = [&chains];
        let ids: [P<'_>; 1] = [&count];
        let [limits, ours, lanes, ids]: [Vec<tokio_postgres::Row>; 4] = custodian_store::Pipelined::read_generic(
            client,
            &[
                (&statements.asset_limits, &by_asset),
                (&statements.ours, &by_address),
                (&statements.lanes, &on_chain),
                (&statements.next_ids, &ids),
            ],
        )
        .await?
        .try_into()
        .expect("BUG: four reads answer four times");
        let ours: std::collections::HashMap<(String, String), Option<String>> =
            ours.iter().map(|r| ((r.get(0), r.get(1)), r.get(2))).collect();
        Ok((0..requests.len())
            .map(|n| {
                let chain = chains[n];
                Unlocked {
                    earlier: None,
                    asset: limits
                        .iter()
                        .find(|row| row.get::<_, &str>(3) == assets[n] && row.get::<_, &str>(4) == chain)
                        .cloned(),
                    ours: ours.get(&(chain.to_owned(), destinations[n].clone())).cloned().flatten(),
                    // Retired lanes finish what they hold and take nothing new.
                    lanes: lanes
                        .iter()
                        .filter(|row| row.get::<_, &str>(6) == chain)
                        .map(crate::hot_wallet::lane_from_row)
                        .filter(|l| !l.retired)
                        .collect(),
                    id: Some(ids[n].get(0)),
                }
            })
            .collect())
    }
}

/// The id read for a request without an earlier withdrawal (the only requests composed).
fn fresh_id(unlocked: &Unlocked) -> i64 {
    unlocked.id.expect("BUG: a request with an earlier withdrawal was composed")
}

impl Unlocked {
    /// A new withdrawal's listing columns: its asset's, stamped with the time `at` of the
    /// transaction that wrote it (its rows' `requested_at` and `updated_at`); nothing signed yet.
    fn new_extras(&self, at: std::time::SystemTime) -> Extras {
        let asset = self.asset.as_ref().expect("BUG: a request was composed without its asset row");
        Extras {
            symbol: asset.get(5),
            decimals: listing::stored_decimals(asset.get(6)),
            requested_at: at,
            updated_at: at,
            attempts: Vec::new(),
        }
    }
}

/// The policy a request is held to, from its asset row.
struct Policy {
    approval_limit: Option<U256>,
    approvals: u32,
    daily_limit: Option<U256>,
}

/// The answer to a request decided before any lock, or the policy it is recorded under.
fn decide(request: &Request, unlocked: &Unlocked) -> Result<Policy, Result<Tried, RequestError>> {
    let chain = request.destination.chain().as_str();
    if let Some((withdrawal, extras)) = &unlocked.earlier {
        let answer = compare(withdrawal.clone(), request);
        return Err(answer.map(|r| Tried::Done(Box::new(Requested { extras: Some(extras.clone()), ..r }))));
    }
    let Some(asset) = &unlocked.asset else {
        return Err(Err(RequestError::Invalid(format!("unknown asset {:?} on {chain}", request.asset.key()))));
    };
    if let Some(why) = &unlocked.ours {
        return Err(Err(RequestError::Invalid(format!("{} {why}", request.destination))));
    }
    if unlocked.lanes.is_empty() {
        return Err(Err(RequestError::NoHotWallet(chain)));
    }
    Ok(Policy {
        approval_limit: asset.get(0),
        approvals: u32::try_from(asset.get::<_, i16>(1)).expect("BUG: approvals_required is checked positive"),
        daily_limit: asset.get(2),
    })
}

/// A new withdrawal's stream, projection and hold, composed before they are written; its
/// statement parameters borrow from it.
struct Composed {
    withdrawal: Withdrawal,
    id: i64,
    first_payload: serde_json::Value,
    awaiting_payload: Option<serde_json::Value>,
    projected: sql::ProjectionParams,
    holds: Vec<ledger::Transfer>,
    amount: U256,
}

impl Composed {
    /// The withdrawal `id` of `request` on its lane, waiting for approval when its amount is over
    /// the approval limit or `past_day` plus it is over the daily limit; refused when the lane
    /// is paused.
    fn new(
        request: &Request,
        unlocked: &Unlocked,
        policy: &Policy,
        id: i64,
        past_day: U256,
    ) -> Result<Composed, RequestError> {
        let waits = match (policy.approval_limit, policy.daily_limit) {
            (Some(limit), _) if request.amount.units() > limit => Some((limit, "approval_limit")),
            (_, Some(daily)) if past_day.checked_add(request.amount.units()).is_none_or(|total| total > daily) => {
                Some((daily, "daily_limit"))
            }
            _ => None,
        };
        let lane = &unlocked.lanes[lane_index(id, unlocked.lanes.len())];
        if let Some(reason) = &lane.pause_reason {
            return Err(RequestError::LanePaused { lane: lane.lane.to_string(), reason: reason.clone() });
        }
        let requested = WithdrawalEvent::Requested {
            account_id: request.account_id,
            external_id: request.external_id.clone(),
            asset: request.asset,
            destination: request.destination.clone(),
            amount: request.amount,
            lane: lane.lane.clone(),
            requested_by: request.requested_by.trim().to_owned(),
            treasury: false,
        };
        let mut withdrawal =
            Withdrawal::start(WithdrawalId::new(id), &requested).expect("BUG: a stream starts with requested");
        let awaiting = waits.map(|(limit, reason)| WithdrawalEvent::AwaitingApproval {
            limit: Amount::from_units(limit),
            approvals: policy.approvals,
            reason: reason.to_owned(),
        });
        if let Some(event) = &awaiting {
            withdrawal.apply(event);
        }
        debug_assert!(matches!(withdrawal.state(), WithdrawalState::Requested | WithdrawalState::AwaitingApproval));
        Ok(Composed {
            id,
            first_payload: requested.payload(),
            awaiting_payload: awaiting.as_ref().map(WithdrawalEvent::payload),
            projected: sql::projection_params(&withdrawal),
            holds: sql::entailed(&withdrawal, &requested),
            amount: request.amount.units(),
            withdrawal,
        })
    }

    /// Its statements in order: the checks under the account lock when `checked` (the one-trip
    /// path), the events, the projection (its state after them) and the hold (`held`, its
    /// [`Composed::holds`] as columns).
    fn statements<'a>(
        &'a self,
        s: &'a Statements,
        checked: bool,
        held: &'a ledger::Columns,
    ) -> Vec<(&'a tokio_postgres::Statement, Vec<P<'a>>)> {
        let mut out: Vec<(&tokio_postgres::Statement, Vec<P<'a>>)> = Vec::with_capacity(5);
        if checked {
            let [account_id, external_id, asset] = self.projected.request_key();
            out.push((&s.check, vec![account_id, external_id, asset, &self.amount]));
        }
        out.push((&s.insert_event, vec![&self.id, &1i32, &"requested", &self.first_payload]));
        if let Some(payload) = &self.awaiting_payload {
            out.push((&s.insert_event, vec![&self.id, &2i32, &"awaiting_approval", payload]));
        }
        out.push((&s.projection, self.projected.refs().to_vec()));
        out.push((&s.hold, held.params().to_vec()));
        out
    }

    fn counted(&self) {
        metrics::counter!("custodian_withdrawals_total", "state" => "requested").increment(1);
        if self.awaiting_payload.is_some() {
            metrics::counter!("custodian_withdrawals_total", "state" => "awaiting_approval").increment(1);
        }
    }
}

async fn try_request(client: deadpool_postgres::Object, request: &Request) -> Result<Tried, RequestError> {
    let statements = Statements::prepare(&client).await?;
    // First round trip, before any lock: the idempotent hit, and what does not depend on the
    // balance.
    let [unlocked] = Unlocked::read_many(&client, &statements, &[request])
        .await?
        .try_into()
        .ok()
        .expect("BUG: one read per request");
    let policy = match decide(request, &unlocked) {
        Ok(policy) => policy,
        Err(answer) => return answer,
    };
    // Without a daily limit nothing written depends on a read under the lock: the lock, the
    // checks, the writes and COMMIT go in one round trip, and the lock is held for no round trip
    // at all. With one, whether the request waits for approval depends on the day's total read
    // under the lock: BEGIN, the lock and that read first, then the writes with COMMIT.
    if policy.daily_limit.is_none() {
        let composed = Composed::new(request, &unlocked, &policy, fresh_id(&unlocked), U256::ZERO)?;
        let held = ledger::Columns::of(&composed.holds);
        let params = composed.statements(&statements, true, &held);
        let writes: Vec<_> = params.iter().map(|(s, p)| (*s, p.as_slice())).collect();
        let now = match custodian_store::Pipelined::once_reading(client, &writes, (&statements.now, &[])).await {
            Ok((_, now)) => now,
            Err(e) => {
                return match refusal(&e, request) {
                    Some(refused) => refused,
                    None => Err(e.into()),
                }
            }
        };
        composed.counted();
        let extras = Some(unlocked.new_extras(now[0].get(0)));
        return Ok(Tried::Done(Box::new(Requested { withdrawal: composed.withdrawal, created: true, extras })));
    }
    let (account, key, asset) = (request.account_id.get(), request.external_id.as_str(), request.asset.key());
    let (tx, reads) = custodian_store::Pipelined::begin_with_all(
        client,
        &[(&statements.lock, &[&account as P<'_>]), (&statements.under_lock, &[&account, &key, &asset])],
    )
    .await?;
    if reads[0].is_empty() {
        tx.rollback().await?;
        return Err(RequestError::Invalid(format!("unknown account {}", request.account_id)));
    }
    let read = &reads[1][0];
    let (earlier, available, past_day): (Option<i64>, &str, U256) = (read.get(0), read.get(1), read.get(2));
    let available: SignedAmount = available.parse().expect("BUG: the database returned a non-integer balance");
    // A duplicate that waited for the lock while the first request committed finds it now,
    // instead of reading the balance that request already spent.
    if let Some(earlier) = earlier {
        tx.rollback().await?;
        return Ok(Tried::Raced(earlier));
    }
    if !available.covers(request.amount) {
        tx.rollback().await?;
        return Err(RequestError::InsufficientFunds {
            asset: request.asset.key(),
            requested: request.amount,
            available,
        });
    }
    let composed = match Composed::new(request, &unlocked, &policy, fresh_id(&unlocked), past_day) {
        Ok(composed) => composed,
        Err(refused) => {
            tx.rollback().await?;
            return Err(refused);
        }
    };
    let held = ledger::Columns::of(&composed.holds);
    let params = composed.statements(&statements, false, &held);
    let writes: Vec<_> = params.iter().map(|(s, p)| (*s, p.as_slice())).collect();
    tx.commit_with(&writes).await?;
    composed.counted();
    Ok(Tried::Done(Box::new(Requested { withdrawal: composed.withdrawal, created: true, extras: None })))
}

/// Records several requests, each as [`request`] would, answering each in order: the requests
/// that concurrent callers make at once, in one transaction and one commit where they can be.
///
/// One round trip reads what every request needs before a lock; those it answers alone (an
/// idempotent hit, a refusal) are answered. The rest without a daily limit go in one more round
/// trip: `BEGIN`, for each in account order the checks under its account's lock (its amount plus
/// what the batch holds before it of the same account and asset), then each table's rows for the
/// whole batch in one statement, `COMMIT` — so the accounts' locks are taken in one order by every
/// batch, a table's CHECK expressions are prepared once per batch rather than once per request,
/// and one commit makes them all durable. If any of them is refused under its lock (a short balance, a duplicate that
/// committed meanwhile) the transaction writes nothing and each is then recorded on its own, as
/// are requests with a daily limit and a batch holding one external id twice.
///
/// # Cancel safety
/// As [`request`]: cancelled, a transaction not yet committed writes nothing.
pub async fn request_batch(
    pool: &deadpool_postgres::Pool,
    requests: &[Request],
) -> Vec<Result<Requested, RequestError>> {
    let mut answers: Vec<Option<Result<Requested, RequestError>>> = requests.iter().map(|_| None).collect();
    let normalized: Vec<_> = requests.iter().map(normalized).collect();
    let mut keys = std::collections::HashSet::new();
    let distinct = normalized.iter().flatten().all(|r| keys.insert((r.account_id, &r.external_id)));
    let mut alone = Vec::new();
    match batch(pool, &normalized, distinct).await {
        Ok(outcomes) => {
            for (n, outcome) in outcomes.into_iter().enumerate() {
                match outcome {
                    Some(answer) => answers[n] = Some(answer),
                    None => alone.push(n),
                }
            }
        }
        Err(e) => {
            tracing::debug!("a batch of requests is recorded one by one: {e}");
            alone = (0..requests.len()).collect();
        }
    }
    for n in alone {
        answers[n] = Some(match &normalized[n] {
            Ok(r) => request(pool, r).await,
            Err(e) => Err(RequestError::Invalid(e.to_string())),
        });
    }
    answers.into_iter().map(|a| a.expect("BUG: every request is answered")).collect()
}

/// [`request_batch`]'s batch: the answer of each request it settled, `None` for those left to
/// [`request`]; an error when none could be settled together.
async fn batch(
    pool: &deadpool_postgres::Pool,
    requests: &[Result<&Request, RequestError>],
    distinct: bool,
) -> Result<Vec<Option<Result<Requested, RequestError>>>, RequestError> {
    let mut outcomes: Vec<Option<Result<Requested, RequestError>>> = requests.iter().map(|_| None).collect();
    if !distinct || requests.len() < 2 {
        return Ok(outcomes);
    }
    let client = pool.get().await?;
    let statements = Statements::prepare(&client).await?;
    let valid: Vec<&Request> = requests.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
    let mut read = Unlocked::read_many(&client, &statements, &valid).await?.into_iter();
    let reads: Vec<Option<Unlocked>> =
        requests.iter().map(|r| r.is_ok().then(|| read.next().expect("BUG: one read per request"))).collect();
    let mut together = Vec::new();
    for (n, (r, unlocked)) in requests.iter().zip(&reads).enumerate() {
        let (Ok(r), Some(unlocked)) = (r, unlocked) else { continue };
        let composed = match decide(r, unlocked) {
            Err(answer) => {
                outcomes[n] = Some(answer.map(|tried| match tried {
                    Tried::Done(requested) => *requested,
                    Tried::Raced(_) => unreachable!("BUG: a read before any lock does not race"),
                }));
                continue;
            }
            Ok(policy) if policy.daily_limit.is_some() => continue,
            Ok(policy) => Composed::new(r, unlocked, &policy, fresh_id(unlocked), U256::ZERO),
        };
        match composed {
            Ok(composed) => together.push((n, composed)),
            Err(refused) => outcomes[n] = Some(Err(refused)),
        }
    }
    // One order of locks for every batch: by ledger account as text, the order in which the
    // balance trigger and the deposit posting pass touch `user_balance` rows too.
    together.sort_by_cached_key(|(_, c)| (LedgerAccount::User(c.withdrawal.account_id().get()).to_string(), c.id));
    if together.len() < 2 {
        return Ok(outcomes); // one is cheaper on its own path
    }
    // Every check first, in that order, each against its amount plus what the batch holds before
    // it of the same account and asset (the holds are written after all the checks, so a check
    // reads the balance from before the batch); then each table written once for the whole
    // batch, as a table's CHECK expressions are prepared once per statement, not per row.
    let mut held_before: std::collections::HashMap<(i64, String), U256> = Default::default();
    let covering: Vec<U256> = together
        .iter()
        .map(|(_, c)| {
            let total = held_before.entry((c.withdrawal.account_id().get(), c.withdrawal.asset().key())).or_default();
            // Saturated, it cannot be covered: the batch is refused and each request tried alone.
            *total = total.saturating_add(c.amount);
            *total
        })
        .collect();
    let mut events = NewEvents::default();
    let mut projections = sql::NewProjections::default();
    for (_, c) in &together {
        events.push(c.id, 1, "requested", &c.first_payload);
        if let Some(payload) = &c.awaiting_payload {
            events.push(c.id, 2, "awaiting_approval", payload);
        }
        projections.push(&c.withdrawal);
    }
    let held = ledger::Columns::of(together.iter().flat_map(|(_, c)| c.holds.iter()));
    let mut params: Vec<(&tokio_postgres::Statement, Vec<P<'_>>)> = together
        .iter()
        .zip(&covering)
        .map(|((_, c), amount)| {
            let [account_id, external_id, asset] = c.projected.request_key();
            (&statements.check, vec![account_id, external_id, asset, amount as P<'_>])
        })
        .collect();
    params.push((&statements.insert_events, events.params().to_vec()));
    params.push((&statements.insert_new, projections.params().to_vec()));
    params.push((&statements.hold, held.params().to_vec()));
    let writes: Vec<_> = params.iter().map(|(s, p)| (*s, p.as_slice())).collect();
    let (_, now) = custodian_store::Pipelined::once_reading(client, &writes, (&statements.now, &[])).await?;
    let at = now[0].get(0);
    for (n, composed) in together {
        composed.counted();
        let extras = reads[n].as_ref().map(|unlocked| unlocked.new_extras(at));
        outcomes[n] = Some(Ok(Requested { withdrawal: composed.withdrawal, created: true, extras }));
    }
    Ok(outcomes)
}

/// New streams' first events as [`sql::INSERT_EVENTS`]'s columns.
#[derive(Default)]
struct NewEvents {
    ids: Vec<i64>,
    seqs: Vec<i32>,
    types: Vec<&'static str>,
    payloads: Vec<serde_json::Value>,
}

impl NewEvents {
    fn push(&mut self, id: i64, seq: i32, event_type: &'static str, payload: &serde_json::Value) {
        self.ids.push(id);
        self.seqs.push(seq);
        self.types.push(event_type);
        self.payloads.push(payload.clone());
    }

    fn params(&self) -> [P<'_>; 4] {
        [&self.ids, &self.seqs, &self.types, &self.payloads]
    }
}

/// An internal withdrawal between two hot wallets (DESIGN §7.8).
#[derive(Debug, Clone)]
pub struct Rebalance {
    /// The lane paying.
    pub from_lane: String,
    /// The lane receiving.
    pub to_lane: String,
    /// What is moved (ETH or a token).
    pub asset: Asset,
    /// Smallest units.
    pub amount: Amount,
    /// The operator's idempotency key.
    pub external_id: ExternalId,
    /// The operator.
    pub requested_by: String,
}

/// Records a rebalance: a withdrawal of `treasury` through the same allocator, from `from_lane`
/// to `to_lane`'s address, held from `treasury` (the fee goes to `network_fees`; the arrival is a
/// deposit of the receiving hot wallet, credited back to `treasury`). Whether the paying hot
/// wallet can cover it is the worker's question (a shortage waits). Idempotent per external id.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn rebalance(client: &mut deadpool_postgres::Object, r: &Rebalance) -> Result<Requested, RequestError> {
    if r.requested_by.trim().is_empty() {
        return Err(RequestError::Invalid("a rebalance needs the authenticated principal asking for it".into()));
    }
    if r.amount.is_zero() {
        return Err(RequestError::Invalid("amount must be greater than zero".into()));
    }
    if r.from_lane == r.to_lane {
        return Err(RequestError::Invalid(format!("--from and --to are both lane {}", r.from_lane)));
    }
    let tx = client.transaction().await?;
    let treasury: i64 = tx.query_one("select id from account where treasury for update", &[]).await?.get(0);
    let lanes = crate::hot_wallet::lanes(&tx).await?;
    let find = |name: &str| {
        lanes.iter().find(|l| l.lane == name).ok_or_else(|| RequestError::Invalid(format!("no lane {name:?}")))
    };
    let (from, to) = (find(&r.from_lane)?, find(&r.to_lane)?);
    let found = tx
        .query_opt(
            "select id from withdrawal where account_id = $1 and external_id = $2",
            &[&treasury, &r.external_id.as_str()],
        )
        .await?;
    if let Some(row) = found {
        let withdrawal = sql::load(&tx, row.get(0)).await?.expect("BUG: projection row without events");
        let mut fields = Vec::new();
        if withdrawal.asset() != r.asset {
            fields.push("asset");
        }
        if *withdrawal.destination() != ChainAddress::Eth(to.address) || *withdrawal.lane() != from.lane {
            fields.push("lanes");
        }
        if withdrawal.amount() != r.amount {
            fields.push("amount");
        }
        if fields.is_empty() {
            return Ok(Requested { withdrawal, created: false, extras: None });
        }
        return Err(RequestError::Conflict {
            external_id: r.external_id.to_string(),
            existing: withdrawal.id().get(),
            fields,
        });
    }
    if let Some(reason) = &from.pause_reason {
        return Err(RequestError::LanePaused { lane: from.lane.to_string(), reason: reason.clone() });
    }
    if tx.query_opt("select 1 from asset where asset = $1 and chain = 'eth'", &[&r.asset.key()]).await?.is_none() {
        return Err(RequestError::Invalid(format!("unknown asset {:?}", r.asset.key())));
    }
    let id: i64 = tx.query_one("select nextval('withdrawal_id_seq')", &[]).await?.get(0);
    let withdrawal = sql::start(
        &tx,
        id,
        WithdrawalEvent::Requested {
            account_id: AccountId::new(treasury),
            external_id: r.external_id.clone(),
            asset: r.asset,
            destination: ChainAddress::Eth(to.address),
            amount: r.amount,
            lane: from.lane.clone(),
            requested_by: r.requested_by.trim().to_owned(),
            treasury: true,
        },
    )
    .await?;
    tx.commit().await?;
    metrics::counter!("custodian_withdrawals_total", "state" => withdrawal.state().as_str()).increment(1);
    Ok(Requested { withdrawal, created: true, extras: None })
}
