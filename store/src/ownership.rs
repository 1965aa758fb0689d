//! Accounts, versioned address ownership and registered assets.
//!
//! Ownership is a range of heights: reassigning an address closes the open range at the new
//! owner's first height and opens another. The exclusion constraint `wallet_address_no_overlap`
//! is what makes two owners at one height impossible; the checks here only turn its refusal into
//! a message an operator can act on.

use custodian_domain::{Chain, ChainAddress};
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// An account as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Account {
    /// Database id (the `user:{id}` ledger account).
    pub id: i64,
    /// The operator's reference for it, unique.
    pub external_ref: String,
}

/// One ownership range of an address.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Ownership {
    /// Chain.
    pub chain: Chain,
    /// The address.
    pub address: ChainAddress,
    /// Owner.
    pub account_id: i64,
    /// First height owned.
    pub valid_from_height: i64,
    /// First height no longer owned, if closed.
    pub valid_to_height: Option<i64>,
}

/// Why an ownership or asset change was refused. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum OwnershipError {
    /// No account has this id or reference.
    #[error("unknown account {0:?}")]
    UnknownAccount(String),
    /// Reassigning from this height would hand deposits already observed to the new owner.
    #[error(
        "{chain} {address}: a deposit to it was observed at height {height}, which would move from account {owner} to \
         the new owner; reassign from a height above every observed deposit (or leave --from-height out)"
    )]
    WouldMoveDeposits {
        /// Chain.
        chain: Chain,
        /// Address.
        address: String,
        /// Current owner.
        owner: i64,
        /// The lowest height of a deposit that would move.
        height: i64,
    },
    /// A reassignment without a height needs the node's tip.
    #[error("{chain} {address} is assigned already: reassigning takes effect at the node's tip + 1, so configure the {chain} node, or give --from-height")]
    NeedsHeight {
        /// Chain.
        chain: Chain,
        /// Address.
        address: String,
    },
    /// The requested start would overlap an existing range.
    #[error("{address} on {chain} is owned by account {owner} from height {from}; a new owner must start above it")]
    Overlap {
        /// Chain.
        chain: Chain,
        /// Address.
        address: String,
        /// Current owner.
        owner: i64,
        /// Start of the conflicting range.
        from: i64,
    },
    /// Another asset already uses this symbol or contract, with different details.
    #[error("asset conflict: {0}")]
    AssetConflict(String),
    /// The database failed.
    #[error("database error: {}", crate::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Creates an account; with a reference that exists already, returns that account unchanged (a
/// retried create is not an error). The flag says whether it was created now.
pub async fn create_account<C: GenericClient>(
    client: &C,
    external_ref: &str,
) -> Result<(Account, bool), OwnershipError> {
    let inserted = client
        .query_opt(
            "insert into account (external_ref) values ($1) on conflict (external_ref) do nothing returning id",
            &[&external_ref],
        )
        .await?;
    match inserted {
        Some(row) => Ok((Account { id: row.get(0), external_ref: external_ref.to_owned() }, true)),
        None => find_account(client, external_ref).await.map(|account| (account, false)),
    }
}

/// Finds an account by reference, or by numeric id when no reference matches.
pub async fn find_account<C: GenericClient>(client: &C, key: &str) -> Result<Account, OwnershipError> {
    let by_ref = client.query_opt("select id, external_ref from account where external_ref = $1", &[&key]).await?;
    let row = match (by_ref, key.parse::<i64>()) {
        (Some(row), _) => Some(row),
        (None, Ok(id)) => client.query_opt("select id, external_ref from account where id = $1", &[&id]).await?,
        (None, Err(_)) => None,
    };
    row.map(|r| Account { id: r.get(0), external_ref: r.get(1) })
        .ok_or_else(|| OwnershipError::UnknownAccount(key.to_owned()))
}

/// Our tip on `chain` (highest non-orphaned block), if any block is held.
async fn tip<C: GenericClient>(client: &C, chain: Chain) -> Result<Option<i64>, tokio_postgres::Error> {
    let row = client
        .query_one("select max(height) from chain_block where chain = $1 and orphaned_at is null", &[&chain.as_str()])
        .await?;
    Ok(row.get(0))
}

/// [`assign_address_at`] without the node's tip: a reassignment then needs an explicit height.
pub async fn assign_address(
    client: &mut deadpool_postgres::Object,
    address: &ChainAddress,
    account_id: i64,
    from_height: Option<u64>,
) -> Result<(Ownership, bool), OwnershipError> {
    assign_address_at(client, address, account_id, from_height, None).await
}

/// Assigns `address` to `account_id` from `from_height`, closing the current
/// owner's open range. Default start: 0 for a never-assigned address; for a reassignment the
/// node's tip + 1 (`node_tip`, read by the caller before this transaction), never below our own
/// tip + 1, so payments in blocks the scanner has not read yet stay with the old owner. An explicit
/// height at or below our tip is refused if it would move an observed deposit to another owner.
/// Assigning an address to its current owner again changes nothing.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn assign_address_at(
    client: &mut deadpool_postgres::Object,
    owned: &ChainAddress,
    account_id: i64,
    from_height: Option<u64>,
    node_tip: Option<u64>,
) -> Result<(Ownership, bool), OwnershipError> {
    let chain = owned.chain();
    let address = &*owned.stored();
    let tx = client.transaction().await?;
    // Serialise assignments of one address; the exclusion constraint is the real guard.
    tx.execute("select pg_advisory_xact_lock(hashtext($1 || ':' || $2))", &[&chain.as_str(), &address]).await?;
    let latest = tx
        .query_opt(
            "select account_id, valid_from_height, valid_to_height from wallet_address
              where chain = $1 and address = $2 order by valid_from_height desc limit 1",
            &[&chain.as_str(), &address],
        )
        .await?
        .map(|r| (r.get::<_, i64>(0), r.get::<_, i64>(1), r.get::<_, Option<i64>>(2)));
    let requested = from_height.map(|h| i64::try_from(h).expect("BUG: height beyond i64"));
    let from = match (latest, requested) {
        (Some((owner, from, None)), _) if owner == account_id => {
            return Ok((
                Ownership { chain, address: owned.clone(), account_id, valid_from_height: from, valid_to_height: None },
                false,
            ));
        }
        (None, requested) => requested.unwrap_or(0),
        (Some((owner, _, _)), Some(requested)) => {
            let moved: Option<i64> = tx
                .query_one(
                    "select min(b.height) from deposit_event d join chain_block b using (chain, block_hash)
                      where d.chain = $1 and d.address = $2 and b.height >= $3",
                    &[&chain.as_str(), &address, &requested],
                )
                .await?
                .get(0);
            if let Some(height) = moved {
                return Err(OwnershipError::WouldMoveDeposits { chain, address: address.to_owned(), owner, height });
            }
            requested
        }
        (Some((_, from, to)), None) => {
            let Some(node_tip) = node_tip else {
                return Err(OwnershipError::NeedsHeight { chain, address: address.to_owned() });
            };
            let node_next = i64::try_from(node_tip).expect("BUG: height beyond i64") + 1;
            let next = tip(&tx, chain).await?.map_or(0, |t| t + 1).max(node_next);
            next.max(from + 1).max(to.unwrap_or(0))
        }
    };
    if let Some((owner, open_from, None)) = latest {
        if from <= open_from {
            return Err(OwnershipError::Overlap { chain, address: address.to_owned(), owner, from: open_from });
        }
        tx.execute(
            "update wallet_address set valid_to_height = $3
              where chain = $1 and address = $2 and valid_to_height is null",
            &[&chain.as_str(), &address, &from],
        )
        .await?;
    }
    let inserted = tx
        .execute(
            "insert into wallet_address (chain, address, account_id, valid_from_height) values ($1, $2, $3, $4)",
            &[&chain.as_str(), &address, &account_id, &from],
        )
        .await;
    if let Err(e) = inserted {
        if let (Some(db), Some((owner, open_from, _))) = (e.as_db_error(), latest) {
            if db.constraint() == Some("wallet_address_no_overlap") || db.constraint() == Some("wallet_address_pkey") {
                return Err(OwnershipError::Overlap { chain, address: address.to_owned(), owner, from: open_from });
            }
        }
        return Err(e.into());
    }
    tx.commit().await?;
    Ok((Ownership { chain, address: owned.clone(), account_id, valid_from_height: from, valid_to_height: None }, true))
}

/// Registers an ERC-20 token. Registering the same token with the same details again is a no-op.
pub async fn add_token<C: GenericClient>(
    client: &C,
    contract: &str,
    symbol: &str,
    decimals: u8,
) -> Result<(String, bool), OwnershipError> {
    let asset = format!("eth:{contract}");
    let existing = client
        .query_opt(
            "select asset, contract, symbol, decimals from asset
              where chain = 'eth' and (contract = $1 or symbol = $2)",
            &[&contract, &symbol],
        )
        .await?;
    if let Some(row) = existing {
        let (found_contract, found_symbol, found_decimals): (Option<String>, String, i16) =
            (row.get(1), row.get(2), row.get(3));
        if found_contract.as_deref() == Some(contract)
            && found_symbol == symbol
            && found_decimals == i16::from(decimals)
        {
            return Ok((asset, false));
        }
        return Err(OwnershipError::AssetConflict(format!(
            "{} is already registered as symbol {found_symbol} with {found_decimals} decimals (contract {})",
            row.get::<_, String>(0),
            found_contract.unwrap_or_else(|| "none: native".into())
        )));
    }
    client
        .execute(
            "insert into asset (asset, chain, contract, symbol, decimals) values ($1, 'eth', $2, $3, $4)",
            &[&asset, &contract, &symbol, &i16::from(decimals)],
        )
        .await?;
    Ok((asset, true))
}

/// Decimals and symbol of an asset key, if registered.
pub async fn asset_info<C: GenericClient>(
    client: &C,
    asset: &str,
) -> Result<Option<(String, u8)>, tokio_postgres::Error> {
    let row = client.query_opt("select symbol, decimals from asset where asset = $1", &[&asset]).await?;
    Ok(row.map(|r| (r.get(0), u8::try_from(r.get::<_, i16>(1)).expect("BUG: decimals outside 0..=77"))))
}

/// An asset of `chain` named by its symbol (any case) or its key (a checksummed contract is
/// accepted): its key and decimals, if registered. Operators and clients name assets this way.
pub async fn find_asset<C: GenericClient>(
    client: &C,
    chain: Chain,
    name: &str,
) -> Result<Option<(String, u8)>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "select asset, decimals from asset
              where chain = $1 and (lower(asset) = lower($2) or upper(symbol) = upper($2))",
            &[&chain.as_str(), &name],
        )
        .await?;
    Ok(row.map(|r| (r.get(0), u8::try_from(r.get::<_, i16>(1)).expect("BUG: decimals outside 0..=77"))))
}
