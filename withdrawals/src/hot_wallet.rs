//! Hot wallets: one lane each, the row whose lock serialises every withdrawal leaving it.

use custodian_domain::{BtcAddress, Chain, ChainAddress, EthAddress, LaneName, Nonce};
use custodian_store::operator::{self, Action};
use deadpool_postgres::GenericClient;
use serde::Serialize;

use crate::rpc::{EthNode, NodeError};

/// A lane as stored: an ETH lane by default, `Lane<BtcAddress>` on Bitcoin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Lane<A = EthAddress> {
    /// Lane name.
    pub lane: LaneName,
    /// Hot wallet address (for BTC, the funding address `…/0/0`).
    pub address: A,
    /// The next nonce we will allocate.
    pub next_nonce: Nonce,
    /// Why it is paused, if it is.
    pub pause_reason: Option<String>,
    /// What the hot wallet is short of, if anything: its withdrawals wait until it is topped up.
    pub shortage: Option<String>,
    /// Retired: new withdrawals no longer hash to it; its in-flight ones finish.
    pub retired: bool,
}

/// Why a hot-wallet change was refused.
#[derive(Debug, thiserror::Error)]
pub enum HotWalletError {
    /// The lane name or address is taken by another wallet.
    #[error("lane {lane:?} or address {address} is already registered differently")]
    Taken {
        /// Lane.
        lane: String,
        /// Address.
        address: String,
    },
    /// No such lane.
    #[error("no lane {0:?}")]
    UnknownLane(String),
    /// Not a lane name: letters, digits, `-` or `_`.
    #[error(transparent)]
    BadLaneName(#[from] custodian_domain::LaneNameError),
    /// The lane's key was used outside the service: its nonces must be re-synced first.
    #[error("lane {0:?} was paused because its key was used outside the service: run `custodian hot-wallet resync --lane {0}` before resuming it")]
    NeedsResync(String),
    /// The address is (or was) a customer's deposit address.
    #[error(
        "{address} is a deposit address of account {account:?}: a hot wallet's address must be the treasury's alone"
    )]
    CustomerAddress {
        /// Address.
        address: String,
        /// The account it belongs to.
        account: String,
    },
    /// Retiring the lane would leave new withdrawals nowhere to go.
    #[error("lane {0:?} is the last lane open to new withdrawals: add another before retiring it")]
    LastOpenLane(String),
    /// The node could not be asked for the pending nonce.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// The address a lane holds, read back from `hot_wallet.address` (checked by the table and by
/// registration).
pub trait LaneAddress: Sized {
    /// The stored address.
    fn from_stored(stored: &str) -> Self;
}

/// An address of one chain's lanes only: what [`lanes_on`] reads them as.
pub trait OnChain: LaneAddress {
    /// The chain whose lanes hold it.
    const CHAIN: Chain;
}

impl LaneAddress for EthAddress {
    fn from_stored(stored: &str) -> Self {
        EthAddress::parse(stored).expect("BUG: hot_wallet.address is checked by the table")
    }
}

impl OnChain for EthAddress {
    const CHAIN: Chain = Chain::Eth;
}

impl LaneAddress for BtcAddress {
    fn from_stored(stored: &str) -> Self {
        BtcAddress::from_stored(stored).expect("BUG: a BTC hot wallet's address was derived from its key")
    }
}

impl OnChain for BtcAddress {
    const CHAIN: Chain = Chain::Btc;
}

impl LaneAddress for ChainAddress {
    fn from_stored(stored: &str) -> Self {
        ChainAddress::parse_stored(stored).expect("BUG: hot_wallet.address is checked by the table")
    }
}

/// Every ETH lane, by name.
pub async fn lanes<C: GenericClient>(client: &C) -> Result<Vec<Lane>, tokio_postgres::Error> {
    lanes_on(client).await
}

/// Every lane of `A`'s chain, by name: `lanes_on::<BtcAddress, _>` reads the BTC lanes.
pub async fn lanes_on<A: OnChain, C: GenericClient>(client: &C) -> Result<Vec<Lane<A>>, tokio_postgres::Error> {
    let statement = client.prepare_cached(LANES_ON).await?;
    Ok(client.query(&statement, &[&A::CHAIN.as_str()]).await?.iter().map(lane_from_row).collect())
}

/// The lanes of chain `$1`, in [`lane_from_row`]'s columns.
const LANES_ON: &str = "
select lane, address, next_nonce, pause_reason, shortage, retired_at is not null
  from hot_wallet where chain = $1 order by lane";

/// A [`LANES_ON`] row.
pub(crate) fn lane_from_row<A: LaneAddress>(r: &tokio_postgres::Row) -> Lane<A> {
    Lane {
        lane: LaneName::parse(r.get(0)).expect("BUG: hot_wallet.lane is checked by the table"),
        address: A::from_stored(r.get(1)),
        next_nonce: Nonce::from_stored(r.get(2)),
        pause_reason: r.get(3),
        shortage: r.get(4),
        retired: r.get(5),
    }
}

/// Registers `address` as lane `lane`. The nonce cursor starts at
/// `max(chain pending nonce, highest local nonce + 1)`: transactions already in flight from
/// this key, ours or not, are never reused. Registering the same pair again is a no-op.
pub async fn add(
    client: &mut deadpool_postgres::Object,
    node: &EthNode,
    lane: &str,
    hot_wallet: EthAddress,
    by: &str,
) -> Result<(Lane, bool), HotWalletError> {
    let name = LaneName::parse(lane)?;
    let address = &*hot_wallet.to_lowercase_hex();
    let pending = node.nonce(hot_wallet.as_alloy(), true).await?;
    let tip = node.block_number().await?;
    let tx = client.transaction().await?;
    let existing = tx
        .query_opt(
            "select lane, address from hot_wallet where chain = 'eth' and (lane = $1 or address = $2)",
            &[&lane, &address],
        )
        .await?;
    if let Some(row) = existing {
        let (found_lane, found_address): (String, String) = (row.get(0), row.get(1));
        if found_lane == lane && found_address == address {
            let current =
                lanes(&tx).await?.into_iter().find(|l| l.lane == lane).expect("BUG: lane vanished in our transaction");
            return Ok((current, false));
        }
        return Err(HotWalletError::Taken { lane: lane.to_owned(), address: address.to_owned() });
    }
    refuse_customer_address(&tx, "eth", address).await?;
    let local: Option<i64> = tx
        .query_one("select max(nonce) from nonce_allocation where chain = 'eth' and from_address = $1", &[&address])
        .await?
        .get(0);
    let next = pending.max(local.map_or(Nonce::ZERO, |n| Nonce::from_stored(n).next()));
    tx.execute(
        "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, $2, $3)",
        &[&address, &lane, &next.stored()],
    )
    .await?;
    let watched_from = watch_as_treasury(&tx, "eth", address, tip).await?;
    let details = serde_json::json!({
        "chain": "eth", "lane": lane, "address": address, "next_nonce": next, "watched_from_height": watched_from,
    });
    operator::record(&tx, Action::LaneAdded, by, &details).await?;
    tx.commit().await?;
    let lane =
        Lane { lane: name, address: hot_wallet, next_nonce: next, pause_reason: None, shortage: None, retired: false };
    Ok((lane, true))
}

/// Pauses (`Some(reason)`) or resumes (`None`) a lane on `by`'s authority, recorded as an
/// operator action in the same transaction.
///
/// # Cancel safety
/// One transaction; cancelled, it changes nothing.
pub async fn set_paused(
    client: &mut deadpool_postgres::Object,
    lane: &str,
    reason: Option<&str>,
    by: &str,
) -> Result<(), HotWalletError> {
    let tx = client.transaction().await?;
    let changed = match reason {
        Some(reason) => {
            tx
                .execute(
                    "update hot_wallet set paused_at = coalesce(paused_at, now()), pause_reason = $2 where chain = 'eth' and lane = $1",
                    &[&lane, &reason],
                )
                .await?
        }
        None => {
            let row = tx
                .query_opt("select needs_resync from hot_wallet where chain = 'eth' and lane = $1 for update", &[&lane])
                .await?;
            if row.is_some_and(|r| r.get::<_, bool>(0)) {
                return Err(HotWalletError::NeedsResync(lane.to_owned()));
            }
            tx.execute("update hot_wallet set paused_at = null, pause_reason = null where chain = 'eth' and lane = $1", &[&lane])
                .await?
        }
    };
    if changed == 0 {
        return Err(HotWalletError::UnknownLane(lane.to_owned()));
    }
    let (action, details) = match reason {
        Some(reason) => (Action::LanePaused, serde_json::json!({"lane": lane, "reason": reason})),
        None => (Action::LaneResumed, serde_json::json!({"lane": lane})),
    };
    operator::record(&tx, action, by, &details).await?;
    tx.commit().await?;
    Ok(())
}

/// What a resync found and set.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Resync {
    /// The lane.
    pub lane: String,
    /// The chain's pending nonce of the lane's address, read before the transaction.
    pub chain_nonce: Nonce,
    /// One above the highest nonce we ever allocated from the address (0 if none).
    pub local_next: Nonce,
    /// The cursor before.
    pub previous_next_nonce: Nonce,
    /// The cursor now: the larger of the two.
    pub next_nonce: Nonce,
}

/// Re-syncs a lane's nonce cursor with the chain on `by`'s authority: the cursor becomes the
/// larger of the chain's pending nonce (read first, outside the transaction) and one above our
/// highest allocated nonce, the resync is recorded with both figures as an operator action, and
/// the lane may resume. The lane stays paused.
///
/// # Cancel safety
/// One transaction after the node call; cancelled, it changes nothing.
pub async fn resync(
    client: &mut deadpool_postgres::Object,
    node: &EthNode,
    lane: &str,
    by: &str,
) -> Result<Resync, HotWalletError> {
    let address = lanes(&*client)
        .await?
        .into_iter()
        .find(|l| l.lane == lane)
        .ok_or_else(|| HotWalletError::UnknownLane(lane.to_owned()))?
        .address;
    let chain_nonce = node.nonce(address.as_alloy(), true).await?;
    let address = address.to_lowercase_hex();
    let tx = client.transaction().await?;
    let previous: i64 = tx
        .query_one("select next_nonce from hot_wallet where chain = 'eth' and lane = $1 for update", &[&lane])
        .await?
        .get(0);
    let highest: Option<i64> = tx
        .query_one("select max(nonce) from nonce_allocation where chain = 'eth' and from_address = $1", &[&address])
        .await?
        .get(0);
    let local_next = highest.map_or(Nonce::ZERO, |n| Nonce::from_stored(n).next());
    let next = chain_nonce.max(local_next);
    tx.execute(
        "update hot_wallet set next_nonce = $2, needs_resync = false where chain = 'eth' and lane = $1",
        &[&lane, &next.stored()],
    )
    .await?;
    let done = Resync {
        lane: lane.to_owned(),
        chain_nonce,
        local_next,
        previous_next_nonce: Nonce::from_stored(previous),
        next_nonce: next,
    };
    operator::record(&tx, Action::LaneResynced, by, &serde_json::to_value(&done).expect("BUG: a resync serialises"))
        .await?;
    tx.commit().await?;
    Ok(done)
}

/// Retires a lane on `by`'s authority: new withdrawals hash over the other open lanes, while the
/// ones already on it are signed, bumped and settled as before. Recorded as an operator action;
/// retiring a retired lane changes nothing. Returns whether it was retired now.
///
/// # Cancel safety
/// One transaction; cancelled, it changes nothing.
pub async fn retire(client: &mut deadpool_postgres::Object, lane: &str, by: &str) -> Result<bool, HotWalletError> {
    let tx = client.transaction().await?;
    // Every lane row locked: two retirements at once cannot both leave the other open.
    let rows = tx
        .query("select lane, retired_at is not null from hot_wallet where chain = 'eth' order by lane for update", &[])
        .await?;
    let Some(retired) = rows.iter().find(|r| r.get::<_, &str>(0) == lane).map(|r| r.get::<_, bool>(1)) else {
        return Err(HotWalletError::UnknownLane(lane.to_owned()));
    };
    if retired {
        return Ok(false);
    }
    if rows.iter().filter(|r| !r.get::<_, bool>(1)).count() == 1 {
        return Err(HotWalletError::LastOpenLane(lane.to_owned()));
    }
    tx.execute("update hot_wallet set retired_at = now() where chain = 'eth' and lane = $1", &[&lane]).await?;
    operator::record(&tx, Action::LaneRetired, by, &serde_json::json!({"lane": lane})).await?;
    tx.commit().await?;
    Ok(true)
}

/// A BTC lane as stored, with what its addresses hold on the canonical chain (`migrations/V5__withdrawals.sql`'s
/// `btc_lane_coin`: its funding address and its change addresses).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BtcLane {
    /// Lane name.
    pub lane: String,
    /// Funding address (`…/0/0`): top it up here.
    pub funding_address: String,
    /// Why it is paused, if it is.
    pub pause_reason: Option<String>,
    /// What it is short of, if anything: its withdrawals wait until it is topped up.
    pub shortage: Option<String>,
    /// Satoshis the worker may spend: custody coins confirmed by the deposit tiers (paid to it
    /// after registration) and our own change, unspent and not reserved. What reached the
    /// address before it was registered is not custody and not counted.
    pub spendable: String,
    /// Satoshis in coins reserved by signed spends not yet mined.
    pub reserved: String,
    /// Satoshis paid to it on the canonical chain, not yet confirmed.
    pub unconfirmed: String,
    /// Coins counted above.
    pub coins: i64,
}

/// Every BTC lane with its balances.
pub async fn btc_lanes<C: GenericClient>(client: &C) -> Result<Vec<BtcLane>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select h.lane, h.address, h.pause_reason, h.shortage,
                    coalesce(sum(c.amount) filter (where c.state = 'spendable'), 0)::text,
                    coalesce(sum(c.amount) filter (where c.state = 'reserved'), 0)::text,
                    coalesce(sum(c.amount) filter (where c.state = 'unconfirmed'), 0)::text,
                    count(c.amount) filter (where c.state <> 'not_custody')
               from hot_wallet h
               join btc_hot_wallet b on b.chain = h.chain and b.lane = h.lane
               left join btc_lane_coin c on c.lane = h.lane
              where h.chain = 'btc'
              group by h.lane, h.address, h.pause_reason, h.shortage
              order by h.lane",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| BtcLane {
            lane: r.get(0),
            funding_address: r.get(1),
            pause_reason: r.get(2),
            shortage: r.get(3),
            spendable: r.get(4),
            reserved: r.get(5),
            unconfirmed: r.get(6),
            coins: r.get(7),
        })
        .collect())
}

/// Registers a BTC hot wallet as lane `lane` on `by`'s authority: its funding address (the key's
/// `…/0/0`) becomes the lane's `hot_wallet` row, the account's extended public key is kept for
/// change addresses, and the funding address is watched from `tip + 1` as the treasury's (what
/// arrives there from outside is credited to `treasury`). Registering the same key and lane
/// again is a no-op.
///
/// # Cancel safety
/// One transaction; cancelled, it changes nothing.
pub async fn add_btc(
    client: &mut deadpool_postgres::Object,
    key: &crate::btc_key::BtcHotKey,
    lane: &str,
    tip: u64,
    by: &str,
) -> Result<(BtcLane, bool), HotWalletError> {
    LaneName::parse(lane)?;
    let address = key.funding_address().to_string();
    let xpub = key.account_xpub().to_string();
    let tx = client.transaction().await?;
    let existing = tx
        .query_opt(
            "select h.lane, h.address, b.account_xpub from hot_wallet h
               left join btc_hot_wallet b on b.chain = h.chain and b.lane = h.lane
              where h.chain = 'btc' and (h.lane = $1 or h.address = $2)",
            &[&lane, &address],
        )
        .await?;
    let created = match existing {
        Some(row) => {
            let (found_lane, found_address, found_xpub): (String, String, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            if found_lane != lane || found_address != address || found_xpub.as_deref() != Some(xpub.as_str()) {
                return Err(HotWalletError::Taken { lane: lane.to_owned(), address });
            }
            false
        }
        None => {
            refuse_customer_address(&tx, "btc", &address).await?;
            tx.execute(
                "insert into hot_wallet (chain, address, lane, next_nonce) values ('btc', $1, $2, 0)",
                &[&address, &lane],
            )
            .await?;
            tx.execute(
                "insert into btc_hot_wallet (lane, address, account_xpub) values ($1, $2, $3)",
                &[&lane, &address, &xpub],
            )
            .await?;
            let watched_from = watch_as_treasury(&tx, "btc", &address, tip).await?;
            let details = serde_json::json!({
                "chain": "btc", "lane": lane, "address": address, "watched_from_height": watched_from,
            });
            operator::record(&tx, Action::LaneAdded, by, &details).await?;
            true
        }
    };
    let lane = btc_lanes(&tx).await?.into_iter().find(|l| l.lane == lane).expect("BUG: the lane was just read");
    tx.commit().await?;
    Ok((lane, created))
}

/// Refuses `address` as a hot wallet if it is (or was) a customer's deposit address: a hot
/// wallet is the treasury's alone, or its top-ups would be credited to that customer.
async fn refuse_customer_address(
    tx: &deadpool_postgres::Transaction<'_>,
    chain: &str,
    address: &str,
) -> Result<(), HotWalletError> {
    let owner = tx
        .query_opt(
            "select a.external_ref from wallet_address w join account a on a.id = w.account_id
              where w.chain = $1 and w.address = $2 and not a.treasury limit 1",
            &[&chain, &address],
        )
        .await?;
    match owner {
        Some(owner) => Err(HotWalletError::CustomerAddress { address: address.to_owned(), account: owner.get(0) }),
        None => Ok(()),
    }
}

/// Watches `address` as the treasury's from the block after `tip`: what arrives from outside is a
/// top-up, credited to treasury (what it held before registration is not custody). Returns the
/// first watched height.
async fn watch_as_treasury(
    tx: &deadpool_postgres::Transaction<'_>,
    chain: &str,
    address: &str,
    tip: u64,
) -> Result<i64, HotWalletError> {
    let watched_from = i64::try_from(tip + 1).expect("BUG: height beyond i64");
    tx.execute(
        "insert into wallet_address (chain, address, account_id, valid_from_height)
         select $1, $2, id, $3 from account where treasury",
        &[&chain, &address, &watched_from],
    )
    .await?;
    Ok(watched_from)
}
