//! Withdrawal requests: validation, client idempotency by `(account, external_id)`, the
//! available-balance check and the hold, all before or inside one transaction.

use alloy_primitives::U256;
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::{Amount, BtcAddress, BtcNetwork, Chain, EthAddress};
use custodian_store::AppendError;
use serde::Serialize;

use crate::sql::{self, Movement, StoreError};

/// What a client asks for, already parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The account paying.
    pub account_id: i64,
    /// The client's idempotency key.
    pub external_id: String,
    /// Asset key (`ETH`, `eth:0x…` or `BTC`).
    pub asset: String,
    /// Destination, on the asset's chain.
    pub destination: Destination,
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
        /// Available now.
        available: String,
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
    #[error("database error: {0}")]
    Database(#[from] tokio_postgres::Error),
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

/// Where a withdrawal pays: an address on the asset's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// A checksummed (or all-lowercase) Ethereum address.
    Eth(EthAddress),
    /// A standard Bitcoin address (P2PKH, P2SH, P2WPKH, P2WSH, P2TR) on the configured network.
    Btc(BtcAddress),
}

impl Destination {
    /// The chain it is on.
    pub fn chain(&self) -> Chain {
        match self {
            Destination::Eth(_) => Chain::Eth,
            Destination::Btc(_) => Chain::Btc,
        }
    }

    /// As stored: lowercase hex for ETH, the address string for BTC.
    pub fn stored(&self) -> String {
        match self {
            Destination::Eth(address) => address.to_lowercase_hex(),
            Destination::Btc(address) => address.to_string(),
        }
    }
}

impl std::fmt::Display for Destination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Destination::Eth(address) => f.write_str(&address.to_checksummed()),
            Destination::Btc(address) => write!(f, "{address}"),
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
) -> Result<(Destination, Amount), RequestError> {
    let invalid = |e: &dyn std::fmt::Display| RequestError::Invalid(e.to_string());
    let destination = match chain {
        Chain::Eth => Destination::Eth(EthAddress::parse(destination.trim()).map_err(|e| invalid(&e))?),
        Chain::Btc => Destination::Btc(BtcAddress::parse(destination.trim(), network).map_err(|e| invalid(&e))?),
    };
    let amount = Amount::parse_decimal(amount, decimals).map_err(|e| invalid(&e))?;
    if amount.is_zero() {
        return Err(RequestError::Invalid("amount must be greater than zero".into()));
    }
    if let Destination::Btc(address) = &destination {
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

/// Finds a withdrawable asset by key or symbol, on any chain: its key, decimals and chain.
pub async fn find_asset<C: deadpool_postgres::GenericClient>(
    client: &C,
    name: &str,
) -> Result<Option<(String, u8, Chain)>, tokio_postgres::Error> {
    for chain in [Chain::Eth, Chain::Btc] {
        if let Some((key, decimals)) = custodian_store::ownership::find_asset(client, chain, name).await? {
            return Ok(Some((key, decimals, chain)));
        }
    }
    Ok(None)
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
    if existing.asset != request.asset {
        fields.push("asset");
    }
    if existing.destination != request.destination.stored() {
        fields.push("destination");
    }
    if existing.amount != request.amount {
        fields.push("amount");
    }
    fields
}

/// The earlier withdrawal with the request's external id, if any: returned when it asks for the
/// same, refused as a conflict when not.
async fn existing<C: deadpool_postgres::GenericClient>(
    client: &C,
    request: &Request,
) -> Result<Option<Requested>, RequestError> {
    let row = client
        .query_opt(
            "select id from withdrawal where account_id = $1 and external_id = $2",
            &[&request.account_id, &request.external_id],
        )
        .await?;
    let Some(row) = row else { return Ok(None) };
    let withdrawal = sql::load(client, row.get(0)).await?.expect("BUG: projection row without events");
    compare(withdrawal, request).map(Some)
}

fn compare(withdrawal: Withdrawal, request: &Request) -> Result<Requested, RequestError> {
    let fields = differing(&withdrawal, request);
    if fields.is_empty() {
        Ok(Requested { withdrawal, created: false })
    } else {
        Err(RequestError::Conflict { external_id: request.external_id.clone(), existing: withdrawal.id, fields })
    }
}

/// Records a request, or returns the earlier one with the same external id and payload.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn request(client: &mut deadpool_postgres::Object, request: &Request) -> Result<Requested, RequestError> {
    // The key as the CLI and the API both take it: trimmed, bounded, printable.
    let external_id =
        custodian_domain::ExternalId::parse(&request.external_id).map_err(|e| RequestError::Invalid(e.to_string()))?;
    let trimmed;
    let request = if external_id.as_str() == request.external_id {
        request
    } else {
        trimmed = Request { external_id: external_id.as_str().to_owned(), ..request.clone() };
        &trimmed
    };
    // Two concurrent first requests with one external id: the loser hits the unique key, rolls
    // back, and on the retry finds the winner's withdrawal.
    for _ in 0..2 {
        match try_request(client, request).await {
            Err(RequestError::Database(e))
                if custodian_store::is_unique_violation(&e, Some("withdrawal_account_id_external_id_key")) =>
            {
                continue
            }
            other => return other,
        }
    }
    existing(&*client, request).await?.ok_or_else(|| panic!("BUG: external id conflict without an existing withdrawal"))
}

/// Under the account's lock, in one statement: an earlier withdrawal with this external id (one
/// that committed while this request waited for the lock), the balance, the rolling 24-hour total,
/// and a fresh withdrawal id. ($1 account, $2 external id, $3 asset.) A statement after the lock,
/// so its snapshot includes whatever committed before the lock was granted.
const UNDER_LOCK: &str = "
select (select id from withdrawal where account_id = $1 and external_id = $2),
       coalesce((select balance from user_balance where ledger_account = 'user:' || $1::bigint and asset = $3), 0)::text,
       (select coalesce(sum(amount), 0) from withdrawal
         where account_id = $1 and asset = $3 and requested_at > now() - interval '24 hours'
           and state not in ('rejected', 'cancelled', 'failed_onchain')),
       nextval('withdrawal_id_seq')";

/// The first event of a new stream ($1 id, $2 seq, $3 type, $4 payload).
const INSERT_EVENT: &str =
    "insert into withdrawal_event (withdrawal_id, seq, event_type, payload) values ($1, $2, $3, $4)";

async fn try_request(client: &mut deadpool_postgres::Object, request: &Request) -> Result<Requested, RequestError> {
    // Before any lock: the idempotent hit, and what does not depend on the balance.
    if let Some(found) = existing(&*client, request).await? {
        return Ok(found);
    }
    if request.requested_by.trim().is_empty() {
        return Err(RequestError::Invalid("a withdrawal needs the authenticated principal asking for it".into()));
    }
    let chain = request.destination.chain().as_str();
    let destination = request.destination.stored();
    let asset_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&request.asset, &chain];
    let ours_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&chain, &destination];
    let (asset, ours, lanes) = {
        let c = &*client;
        futures::try_join!(
            c.query_opt(
                "select approval_limit, approvals_required, daily_limit from asset where asset = $1 and chain = $2",
                &asset_params,
            ),
            // One of our hot wallets; for BTC also any of our own addresses (a deposit address, a
            // change address): paying it would only move a coin between our keys, at a fee.
            c.query_opt(
                "select case when exists (select 1 from hot_wallet where chain = $1 and address = $2)
                             then 'is one of our hot wallets'
                             when $1 = 'btc' and (exists (select 1 from wallet_address where chain = 'btc' and address = $2)
                                                  or exists (select 1 from btc_change_address where chain = 'btc' and address = $2))
                             then 'is one of our own addresses' end",
                &ours_params,
            ),
            crate::hot_wallet::lanes_on(c, chain),
        )?
    };
    let asset = asset.ok_or_else(|| RequestError::Invalid(format!("unknown asset {:?} on {chain}", request.asset)))?;
    let approval_limit: Option<U256> = asset.get(0);
    let approvals = u32::try_from(asset.get::<_, i16>(1)).expect("BUG: approvals_required is checked positive");
    let daily_limit: Option<U256> = asset.get(2);
    if let Some(why) = ours.and_then(|r| r.get::<_, Option<String>>(0)) {
        return Err(RequestError::Invalid(format!("{} {why}", request.destination)));
    }
    // Retired lanes finish what they hold and take nothing new.
    let lanes: Vec<_> = lanes.into_iter().filter(|l| !l.retired).collect();
    if lanes.is_empty() {
        return Err(RequestError::NoHotWallet(chain));
    }
    // Prepared once per connection: none costs a round trip after the first request.
    let (lock, under_lock, insert_event, projection, hold) = {
        let c = &*client;
        futures::try_join!(
            c.prepare_cached("select 1 from account where id = $1 for update"),
            c.prepare_cached(UNDER_LOCK),
            c.prepare_cached(INSERT_EVENT),
            c.prepare_cached(sql::UPSERT),
            c.prepare_cached(sql::POST_TRANSFER),
        )?
    };
    let tx = client.transaction().await?;
    // The account row lock serialises requests of one account: the balance read next cannot be
    // spent twice by concurrent requests. From here to COMMIT: four round trips (the lock, one
    // read, the writes together, COMMIT).
    if tx.query_opt(&lock, &[&request.account_id]).await?.is_none() {
        return Err(RequestError::Invalid(format!("unknown account {}", request.account_id)));
    }
    let read = tx.query_one(&under_lock, &[&request.account_id, &request.external_id, &request.asset]).await?;
    let (earlier, available, past_day, id): (Option<i64>, String, U256, i64) =
        (read.get(0), read.get(1), read.get(2), read.get(3));
    // A duplicate that waited for the lock while the first request committed finds it now,
    // instead of reading the balance that request already spent.
    if let Some(earlier) = earlier {
        let withdrawal = sql::load(&tx, earlier).await?.expect("BUG: projection row without events");
        return compare(withdrawal, request);
    }
    let enough = !available.starts_with('-')
        && available.parse::<Amount>().expect("BUG: the database returned a non-integer balance") >= request.amount;
    if !enough {
        return Err(RequestError::InsufficientFunds {
            asset: request.asset.clone(),
            requested: request.amount,
            available,
        });
    }
    let waits = match (approval_limit, daily_limit) {
        (Some(limit), _) if request.amount.units() > limit => Some((limit, "approval_limit")),
        (_, Some(daily)) if past_day.checked_add(request.amount.units()).is_none_or(|total| total > daily) => {
            Some((daily, "daily_limit"))
        }
        _ => None,
    };
    let lane = &lanes[lane_index(id, lanes.len())];
    if let Some(reason) = &lane.pause_reason {
        return Err(RequestError::LanePaused { lane: lane.lane.clone(), reason: reason.clone() });
    }
    let requested = WithdrawalEvent::Requested {
        account_id: request.account_id,
        external_id: request.external_id.clone(),
        asset: request.asset.clone(),
        destination,
        amount: request.amount,
        lane: lane.lane.clone(),
        requested_by: request.requested_by.trim().to_owned(),
        treasury: false,
    };
    let mut withdrawal = Withdrawal::start(id, &requested).expect("BUG: a stream starts with requested");
    let awaiting = waits.map(|(limit, reason)| WithdrawalEvent::AwaitingApproval {
        limit: Amount::from_units(limit),
        approvals,
        reason: reason.to_owned(),
    });
    if let Some(event) = &awaiting {
        withdrawal.apply(event);
    }
    // Third round trip: the events, the projection (its state after them) and the hold, together.
    let first_payload = requested.payload();
    let held = sql::transfer_parts(&withdrawal, Movement::Hold, Amount::ZERO).expect("BUG: a positive amount is held");
    let awaiting_payload = awaiting.as_ref().map(WithdrawalEvent::payload);
    let projected = sql::projection_params(&withdrawal);
    let projected = projected.refs();
    let (one, two) = (1i32, 2i32);
    let requested_type = "requested";
    let first_params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&id, &one, &requested_type, &first_payload];
    let hold_params = held.params();
    let writes = async {
        futures::try_join!(
            tx.execute(&insert_event, &first_params),
            async {
                match &awaiting_payload {
                    Some(payload) => tx.execute(&insert_event, &[&id, &two, &"awaiting_approval", payload]).await,
                    None => Ok(0),
                }
            },
            tx.execute(&projection, &projected),
            tx.execute(&hold, &hold_params),
        )
    };
    writes.await?;
    tx.commit().await?;
    metrics::counter!("custodian_withdrawals_total", "state" => "requested").increment(1);
    if awaiting.is_some() {
        metrics::counter!("custodian_withdrawals_total", "state" => "awaiting_approval").increment(1);
    }
    debug_assert!(matches!(withdrawal.state, WithdrawalState::Requested | WithdrawalState::AwaitingApproval));
    Ok(Requested { withdrawal, created: true })
}

/// An internal withdrawal between two hot wallets (DESIGN §7.8).
#[derive(Debug, Clone)]
pub struct Rebalance {
    /// The lane paying.
    pub from_lane: String,
    /// The lane receiving.
    pub to_lane: String,
    /// Asset key (`ETH` or `eth:0x…`).
    pub asset: String,
    /// Smallest units.
    pub amount: Amount,
    /// The operator's idempotency key.
    pub external_id: String,
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
    let external_id =
        custodian_domain::ExternalId::parse(&r.external_id).map_err(|e| RequestError::Invalid(e.to_string()))?;
    let trimmed;
    let r = if external_id.as_str() == r.external_id {
        r
    } else {
        trimmed = Rebalance { external_id: external_id.as_str().to_owned(), ..r.clone() };
        &trimmed
    };
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
        .query_opt("select id from withdrawal where account_id = $1 and external_id = $2", &[&treasury, &r.external_id])
        .await?;
    if let Some(row) = found {
        let withdrawal = sql::load(&tx, row.get(0)).await?.expect("BUG: projection row without events");
        let mut fields = Vec::new();
        if withdrawal.asset != r.asset {
            fields.push("asset");
        }
        if withdrawal.destination != to.address || withdrawal.lane != from.lane {
            fields.push("lanes");
        }
        if withdrawal.amount != r.amount {
            fields.push("amount");
        }
        if fields.is_empty() {
            return Ok(Requested { withdrawal, created: false });
        }
        return Err(RequestError::Conflict { external_id: r.external_id.clone(), existing: withdrawal.id, fields });
    }
    if let Some(reason) = &from.pause_reason {
        return Err(RequestError::LanePaused { lane: from.lane.clone(), reason: reason.clone() });
    }
    if tx.query_opt("select 1 from asset where asset = $1 and chain = 'eth'", &[&r.asset]).await?.is_none() {
        return Err(RequestError::Invalid(format!("unknown asset {:?}", r.asset)));
    }
    let id: i64 = tx.query_one("select nextval('withdrawal_id_seq')", &[]).await?.get(0);
    let withdrawal = sql::start(
        &tx,
        id,
        WithdrawalEvent::Requested {
            account_id: treasury,
            external_id: r.external_id.clone(),
            asset: r.asset.clone(),
            destination: to.address.clone(),
            amount: r.amount,
            lane: from.lane.clone(),
            requested_by: r.requested_by.trim().to_owned(),
            treasury: true,
        },
    )
    .await?;
    sql::post(&tx, &withdrawal, Movement::Hold, Amount::ZERO).await?;
    tx.commit().await?;
    metrics::counter!("custodian_withdrawals_total", "state" => withdrawal.state.as_str()).increment(1);
    Ok(Requested { withdrawal, created: true })
}
