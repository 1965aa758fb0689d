//! Hot wallets: one lane each, the row whose lock serialises every withdrawal leaving it.

use custodian_store::operator::{self, Action};
use deadpool_postgres::GenericClient;
use serde::Serialize;

use crate::rpc::{EthNode, NodeError};

/// A lane as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Lane {
    /// Lane name.
    pub lane: String,
    /// Hot wallet address (lowercase hex).
    pub address: String,
    /// The next nonce we will allocate.
    pub next_nonce: i64,
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
    #[error("database error: {0}")]
    Database(#[from] tokio_postgres::Error),
}

/// Every ETH lane, by name.
pub async fn lanes<C: GenericClient>(client: &C) -> Result<Vec<Lane>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select lane, address, next_nonce, pause_reason, shortage, retired_at is not null
               from hot_wallet where chain = 'eth' order by lane",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Lane {
            lane: r.get(0),
            address: r.get(1),
            next_nonce: r.get(2),
            pause_reason: r.get(3),
            shortage: r.get(4),
            retired: r.get(5),
        })
        .collect())
}

/// Registers `address` as lane `lane`. The nonce cursor starts at
/// `max(chain pending nonce, highest local nonce + 1)`: transactions already in flight from
/// this key, ours or not, are never reused. Registering the same pair again is a no-op.
pub async fn add(
    client: &mut deadpool_postgres::Object,
    node: &EthNode,
    lane: &str,
    address: &str,
    by: &str,
) -> Result<(Lane, bool), HotWalletError> {
    let parsed: alloy_primitives::Address =
        address.parse().map_err(|_| HotWalletError::UnknownLane(lane.to_owned()))?;
    let pending = node.nonce(parsed, true).await?;
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
    // A hot wallet is treasury's: an address a customer's deposits go to cannot be one.
    let owner = tx
        .query_opt(
            "select a.external_ref from wallet_address w join account a on a.id = w.account_id
              where w.chain = 'eth' and w.address = $1 and not a.treasury limit 1",
            &[&address],
        )
        .await?;
    if let Some(owner) = owner {
        return Err(HotWalletError::CustomerAddress { address: address.to_owned(), account: owner.get(0) });
    }
    let local: Option<i64> = tx
        .query_one("select max(nonce) from nonce_allocation where chain = 'eth' and from_address = $1", &[&address])
        .await?
        .get(0);
    let next = i64::try_from(pending).expect("BUG: nonce beyond i64").max(local.map_or(0, |n| n + 1));
    tx.execute(
        "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, $2, $3)",
        &[&address, &lane, &next],
    )
    .await?;
    // Watched from the next block: what arrives from outside is a top-up, credited to treasury
    // (what the address held before registration is not custody until it is deposited).
    let watched_from = i64::try_from(tip + 1).expect("BUG: height beyond i64");
    tx.execute(
        "insert into wallet_address (chain, address, account_id, valid_from_height)
         select 'eth', $1, id, $2 from account where treasury",
        &[&address, &watched_from],
    )
    .await?;
    let details = serde_json::json!({
        "chain": "eth", "lane": lane, "address": address, "next_nonce": next, "watched_from_height": watched_from,
    });
    operator::record(&tx, Action::LaneAdded, by, &details).await?;
    tx.commit().await?;
    let lane = Lane {
        lane: lane.to_owned(),
        address: address.to_owned(),
        next_nonce: next,
        pause_reason: None,
        shortage: None,
        retired: false,
    };
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
    pub chain_nonce: u64,
    /// One above the highest nonce we ever allocated from the address (0 if none).
    pub local_next: u64,
    /// The cursor before.
    pub previous_next_nonce: u64,
    /// The cursor now: the larger of the two.
    pub next_nonce: u64,
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
    let chain_nonce = node.nonce(address.parse().expect("BUG: stored hot wallet is not an address"), true).await?;
    let tx = client.transaction().await?;
    let previous: i64 = tx
        .query_one("select next_nonce from hot_wallet where chain = 'eth' and lane = $1 for update", &[&lane])
        .await?
        .get(0);
    let highest: Option<i64> = tx
        .query_one("select max(nonce) from nonce_allocation where chain = 'eth' and from_address = $1", &[&address])
        .await?
        .get(0);
    let local_next = highest.map_or(0, |n| u64::try_from(n).expect("BUG: negative nonce") + 1);
    let next = chain_nonce.max(local_next);
    tx.execute(
        "update hot_wallet set next_nonce = $2, needs_resync = false where chain = 'eth' and lane = $1",
        &[&lane, &i64::try_from(next).expect("BUG: nonce beyond i64")],
    )
    .await?;
    let done = Resync {
        lane: lane.to_owned(),
        chain_nonce,
        local_next,
        previous_next_nonce: u64::try_from(previous).expect("BUG: negative nonce"),
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
