//! Deposit addresses derived from the chain's extended public key, with the derivation index
//! allocated by the database.
//!
//! `deposit_address_counter` holds each chain's next index. One transaction takes the next index
//! (locking the counter row), derives the address for it, records it in `wallet_address` and
//! commits, so concurrent requests never share an index and a failed request consumes none: the
//! indexes in use are always exactly `0..next_index`. The partial unique index
//! `wallet_address_derivation_index` is the guard that makes a shared index impossible even if the
//! counter were rewound by hand; the counter is what keeps requests from running into it.
//!
//! Key handling stays in `custodian_domain::hd`: this module only asks a
//! [`DepositKey`] for the address at an index and for the fingerprint of the key.

use custodian_domain::hd::{DepositKey, HdError};
use custodian_domain::{Chain, ChainAddress};
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// An address derived for an account, as recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DerivedAddress {
    /// Chain.
    pub chain: Chain,
    /// The address.
    pub address: ChainAddress,
    /// Child index under the chain's receive chain (`…/0/{derivation_index}`).
    pub derivation_index: u32,
    /// Owner.
    pub account_id: i64,
    /// First height owned (0: the address was new when derived).
    pub valid_from_height: i64,
    /// First height no longer owned, if the address has since been reassigned.
    pub valid_to_height: Option<i64>,
}

/// Why no address was allocated. Nothing was written and no index was consumed.
#[derive(Debug, thiserror::Error)]
pub enum DepositAddressError {
    /// No account has this id.
    #[error("unknown account {0}")]
    UnknownAccount(i64),
    /// The chain's indexes were counted under another extended public key. Continuing would hand
    /// out indexes the new key's wallet never scanned from 0, or restart at indexes already used.
    #[error(
        "the {chain} deposit key changed: indexes were allocated under key fingerprint {stored}, the \
         configured key has fingerprint {configured}; configure the original key"
    )]
    KeyChanged {
        /// Chain.
        chain: Chain,
        /// Fingerprint the counter was created with.
        stored: String,
        /// Fingerprint of the key given now.
        configured: String,
    },
    /// The key cannot derive an address at the allocated index.
    #[error("cannot derive the {chain} deposit address at index {index}: {source}")]
    Derivation {
        /// Chain.
        chain: Chain,
        /// The allocated index.
        index: u32,
        /// Why.
        source: HdError,
    },
    /// The address derived at the index is already in `wallet_address` (assigned by hand before
    /// it was derived). Every retry meets the same index, so an operator must resolve it.
    #[error("the {chain} deposit address {address} at index {index} is already assigned; resolve it by hand")]
    AddressTaken {
        /// Chain.
        chain: Chain,
        /// The derived address.
        address: String,
        /// Its index.
        index: u32,
    },
    /// The index was already assigned to another address: the counter is behind
    /// `wallet_address`, which only a manual change to the counter can cause.
    #[error("{chain} derivation index {index} is already assigned; deposit_address_counter is behind wallet_address")]
    IndexTaken {
        /// Chain.
        chain: Chain,
        /// The index.
        index: u32,
    },
    /// Every non-hardened index (below 2^31 - 1, the largest counter value) is used.
    #[error("the {chain} deposit key has no unused non-hardened index left")]
    Exhausted {
        /// Chain.
        chain: Chain,
    },
    /// The database failed.
    #[error("database error: {}", crate::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Takes the chain's next index, creating the counter at 0 for the first address, but only when
/// the counter belongs to key `$2`; no row comes back for another key. Locks the counter row until
/// the transaction ends, which is what serialises allocations on one chain.
const TAKE_NEXT_INDEX: &str = "
insert into deposit_address_counter as c (chain, xpub_fingerprint, next_index)
values ($1, $2, 1)
on conflict (chain) do update
   set next_index = c.next_index + 1
 where c.xpub_fingerprint = excluded.xpub_fingerprint
returning c.next_index - 1";

/// The key a chain's counter belongs to.
const COUNTER_FINGERPRINT: &str = "select xpub_fingerprint from deposit_address_counter where chain = $1";

/// Records a derived address as owned from height 0.
const RECORD_ADDRESS: &str = "
insert into wallet_address (chain, address, account_id, valid_from_height, derivation_index)
values ($1, $2, $3, 0, $4)
returning valid_from_height";

/// An account's derived addresses, oldest index first per chain.
const ACCOUNT_DERIVED_ADDRESSES: &str = "
select chain, address, derivation_index, account_id, valid_from_height, valid_to_height
  from wallet_address
 where account_id = $1
   and derivation_index is not null
 order by chain, derivation_index";

/// SQLSTATE of a foreign-key violation.
const FOREIGN_KEY_VIOLATION: &str = "23503";
/// SQLSTATE of an exclusion-constraint violation.
const EXCLUSION_VIOLATION: &str = "23P01";
/// SQLSTATE of an integer overflow (the counter passing `i32::MAX`).
const NUMERIC_VALUE_OUT_OF_RANGE: &str = "22003";

/// Derives a new deposit address on `key`'s chain for `account_id` at the chain's next
/// derivation index, records it in `wallet_address`, and returns it.
///
/// Not idempotent: every call allocates a fresh address. An unused address costs nothing, so a
/// retried request may simply get another one.
///
/// # Cancel safety
/// One transaction. Cancelled before the commit is sent, it writes nothing and consumes no index;
/// cancelled while the commit is in flight, the address may or may not have been recorded
/// ([`list`] tells). Either way indexes stay gapless. The counter row stays locked, blocking
/// other allocations on the chain, only while the transaction is open.
pub async fn new_address(
    client: &mut deadpool_postgres::Object,
    key: &DepositKey,
    account_id: i64,
) -> Result<DerivedAddress, DepositAddressError> {
    let chain = key.chain();
    let tx = client.transaction().await?;
    let taken = match tx.query_opt(TAKE_NEXT_INDEX, &[&chain.as_str(), &key.fingerprint()]).await {
        Ok(row) => row,
        Err(e) if has_code(&e, NUMERIC_VALUE_OUT_OF_RANGE) => return Err(DepositAddressError::Exhausted { chain }),
        Err(e) => return Err(e.into()),
    };
    let Some(row) = taken else {
        let stored: String = tx.query_one(COUNTER_FINGERPRINT, &[&chain.as_str()]).await?.get(0);
        return Err(DepositAddressError::KeyChanged { chain, stored, configured: key.fingerprint().to_owned() });
    };
    let stored_index: i32 = row.get(0);
    let index = u32::try_from(stored_index).expect("BUG: next_index >= 0 is checked by the table");
    let address = key.address(index).map_err(|source| DepositAddressError::Derivation { chain, index, source })?;
    let recorded =
        tx.query_one(RECORD_ADDRESS, &[&chain.as_str(), &address.stored(), &account_id, &stored_index]).await;
    let valid_from_height = match recorded {
        Ok(row) => row.get(0),
        Err(e) => {
            let constraint = e.as_db_error().and_then(|db| db.constraint()).unwrap_or_default();
            return Err(if has_code(&e, FOREIGN_KEY_VIOLATION) {
                DepositAddressError::UnknownAccount(account_id)
            } else if crate::is_unique_violation(&e, Some("wallet_address_derivation_index")) {
                DepositAddressError::IndexTaken { chain, index }
            } else if crate::is_unique_violation(&e, Some("wallet_address_pkey"))
                || (has_code(&e, EXCLUSION_VIOLATION) && constraint == "wallet_address_no_overlap")
            {
                DepositAddressError::AddressTaken { chain, address: address.stored(), index }
            } else {
                e.into()
            });
        }
    };
    tx.commit().await?;
    Ok(DerivedAddress { chain, address, derivation_index: index, account_id, valid_from_height, valid_to_height: None })
}

/// The addresses derived for `account_id`, by chain and index. An address since reassigned to
/// another account is listed with its closed range; the new owner's row carries no index.
pub async fn list<C: GenericClient>(client: &C, account_id: i64) -> Result<Vec<DerivedAddress>, tokio_postgres::Error> {
    let rows = client.query(ACCOUNT_DERIVED_ADDRESSES, &[&account_id]).await?;
    Ok(rows
        .iter()
        .map(|row| DerivedAddress {
            chain: row.get::<_, &str>(0).parse().expect("BUG: wallet_address.chain is checked by the table"),
            address: ChainAddress::parse_stored(row.get(1))
                .expect("BUG: wallet_address.address is checked by the table"),
            derivation_index: u32::try_from(row.get::<_, i32>(2))
                .expect("BUG: derivation_index >= 0 is checked by the table"),
            account_id: row.get(3),
            valid_from_height: row.get(4),
            valid_to_height: row.get(5),
        })
        .collect())
}

/// Whether `error` is PostgreSQL reporting SQLSTATE `code`.
fn has_code(error: &tokio_postgres::Error, code: &str) -> bool {
    error.as_db_error().is_some_and(|db| db.code().code() == code)
}
