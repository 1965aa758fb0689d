//! Assets: a chain's native coin or an ERC-20 contract on Ethereum.

use std::fmt;

use crate::address::{EthAddress, EthAddressError};
use crate::chain::Chain;

/// What is being counted. The stored key is `ETH`, `BTC`, or `eth:0x<lowercase contract>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Asset {
    /// The chain's own coin (ether, bitcoin).
    Native(Chain),
    /// An ERC-20 token, identified by its contract.
    Erc20(EthAddress),
}

/// An asset key that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssetError {
    /// Not `ETH`, `BTC` or `eth:0x…`.
    #[error("unknown asset {0:?}: expected ETH, BTC or eth:0x<token contract>")]
    Unknown(String),
    /// An `eth:` key whose contract is not a valid address.
    #[error("asset {key:?} names an invalid contract: {source}")]
    BadContract {
        /// The key given.
        key: String,
        /// Why the contract address was refused.
        source: EthAddressError,
    },
}

impl Asset {
    /// The chain the asset lives on.
    pub fn chain(self) -> Chain {
        match self {
            Asset::Native(chain) => chain,
            Asset::Erc20(_) => Chain::Eth,
        }
    }

    /// The key stored in `asset.asset` and every table that references it.
    pub fn key(self) -> String {
        match self {
            Asset::Native(chain) => chain.native_symbol().to_owned(),
            Asset::Erc20(contract) => format!("eth:{}", contract.to_lowercase_hex()),
        }
    }

    /// Reads a stored key back.
    pub fn parse_key(key: &str) -> Result<Asset, AssetError> {
        match key {
            "ETH" => Ok(Asset::Native(Chain::Eth)),
            "BTC" => Ok(Asset::Native(Chain::Btc)),
            _ => {
                let contract = key.strip_prefix("eth:").ok_or_else(|| AssetError::Unknown(key.to_owned()))?;
                let contract = EthAddress::parse(contract)
                    .map_err(|source| AssetError::BadContract { key: key.to_owned(), source })?;
                Ok(Asset::Erc20(contract))
            }
        }
    }
}

impl fmt::Display for Asset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key())
    }
}

/// Events carry the stored key.
impl serde::Serialize for Asset {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.key())
    }
}

impl<'de> serde::Deserialize<'de> for Asset {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Asset, D::Error> {
        let key = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        Asset::parse_key(&key).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip() {
        let token = Asset::Erc20(EthAddress::parse("0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed").expect("valid"));
        for asset in [Asset::Native(Chain::Eth), Asset::Native(Chain::Btc), token] {
            assert_eq!(Asset::parse_key(&asset.key()), Ok(asset));
        }
        assert_eq!(token.key(), "eth:0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed");
        assert_eq!(token.chain(), Chain::Eth);
        assert_eq!(Asset::parse_key("DOGE"), Err(AssetError::Unknown("DOGE".into())));
        assert!(matches!(Asset::parse_key("eth:0x12"), Err(AssetError::BadContract { .. })));
    }
}
