//! Pure types and rules of Custodian: chains, assets, amounts, addresses and hashes.
//!
//! Nothing here performs I/O, knows about PostgreSQL or tokio, or is shaped by a wire format.
//! Every type is a parsed value: once it exists, it is valid.

pub mod address;
pub mod amount;
pub mod asset;
pub mod chain;
pub mod decision;
pub mod external_id;
pub mod hash;
pub mod hd;
pub mod ids;
pub mod ledger_account;
pub mod nonce;
pub mod posting_rules;
pub mod withdrawal;

/// The tests' BIP-39 seed, shared with `custodian-testkit` (which this crate cannot depend on).
#[cfg(test)]
#[path = "../../testkit/src/bip39.rs"]
mod bip39;

pub use address::{
    BtcAddress, BtcAddressError, BtcNetwork, ChainAddress, EthAddress, EthAddressError, StoredAddressError,
};
pub use amount::{Amount, AmountError, ParseAmountError, SignedAmount};
pub use asset::{Asset, AssetError};
pub use chain::{Chain, UnknownChain};
pub use decision::Decision;
pub use external_id::{ExternalId, ExternalIdError};
pub use hash::{BlockHash, HashError, TxHash};
pub use ids::{AccountId, IdError, LaneName, LaneNameError, WithdrawalId};
pub use ledger_account::LedgerAccount;
pub use nonce::Nonce;
