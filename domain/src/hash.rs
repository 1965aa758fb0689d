//! Block and transaction hashes: fixed-size values tagged with their chain.
//!
//! ETH hashes are stored as lowercase `0x` hex; BTC hashes as plain hex in Bitcoin's customary
//! (byte-reversed) display order, exactly as Bitcoin Core prints them.

use std::fmt;
use std::str::FromStr;

use alloy_primitives::B256;

use crate::chain::Chain;

/// A hash string that is not a 32-byte hash in the chain's format.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{chain} hash {input:?} is malformed: expected {expected}")]
pub struct HashError {
    /// The chain whose format was expected.
    pub chain: Chain,
    /// The string given.
    pub input: String,
    /// A description of the format.
    pub expected: &'static str,
}

fn parse_eth(chain: Chain, input: &str) -> Result<B256, HashError> {
    let error = || HashError { chain, input: input.to_owned(), expected: "0x and 64 hexadecimal digits" };
    let hex = input.strip_prefix("0x").ok_or_else(error)?;
    if hex.len() != 64 {
        return Err(error());
    }
    B256::from_str(input).map_err(|_| error())
}

fn parse_btc<T: FromStr>(input: &str) -> Result<T, HashError> {
    let error = || HashError { chain: Chain::Btc, input: input.to_owned(), expected: "64 hexadecimal digits" };
    if input.len() != 64 {
        return Err(error());
    }
    T::from_str(input).map_err(|_| error())
}

/// The hash of a block on some chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// An Ethereum block hash.
    Eth(B256),
    /// A Bitcoin block hash.
    Btc(bitcoin::BlockHash),
}

/// The hash (txid) of a transaction on some chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TxHash {
    /// An Ethereum transaction hash.
    Eth(B256),
    /// A Bitcoin txid.
    Btc(bitcoin::Txid),
}

impl BlockHash {
    /// Parses the stored or user-given form for `chain`.
    pub fn parse(chain: Chain, input: &str) -> Result<Self, HashError> {
        match chain {
            Chain::Eth => parse_eth(chain, input).map(BlockHash::Eth),
            Chain::Btc => parse_btc(input).map(BlockHash::Btc),
        }
    }

    /// The chain this hash belongs to.
    pub fn chain(&self) -> Chain {
        match self {
            BlockHash::Eth(_) => Chain::Eth,
            BlockHash::Btc(_) => Chain::Btc,
        }
    }
}

impl TxHash {
    /// Parses the stored or user-given form for `chain`.
    pub fn parse(chain: Chain, input: &str) -> Result<Self, HashError> {
        match chain {
            Chain::Eth => parse_eth(chain, input).map(TxHash::Eth),
            Chain::Btc => parse_btc(input).map(TxHash::Btc),
        }
    }

    /// The chain this hash belongs to.
    pub fn chain(&self) -> Chain {
        match self {
            TxHash::Eth(_) => Chain::Eth,
            TxHash::Btc(_) => Chain::Btc,
        }
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockHash::Eth(h) => write!(f, "{h:#x}"),
            BlockHash::Btc(h) => write!(f, "{h}"),
        }
    }
}

impl fmt::Display for TxHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TxHash::Eth(h) => write!(f, "{h:#x}"),
            TxHash::Btc(h) => write!(f, "{h}"),
        }
    }
}

/// The chain a stored hash belongs to, told by its form: ETH's carry `0x`, BTC's do not.
fn chain_of_stored(input: &str) -> Chain {
    if input.starts_with("0x") {
        Chain::Eth
    } else {
        Chain::Btc
    }
}

impl TxHash {
    /// The Ethereum hash; `None` for a Bitcoin txid.
    pub fn eth(self) -> Option<B256> {
        match self {
            TxHash::Eth(h) => Some(h),
            TxHash::Btc(_) => None,
        }
    }

    /// Reads a stored hash back, its chain told by its form (events carry hashes without their
    /// chain).
    pub fn parse_stored(input: &str) -> Result<Self, HashError> {
        TxHash::parse(chain_of_stored(input), input)
    }
}

impl BlockHash {
    /// The Ethereum hash; `None` for a Bitcoin block.
    pub fn eth(self) -> Option<B256> {
        match self {
            BlockHash::Eth(h) => Some(h),
            BlockHash::Btc(_) => None,
        }
    }

    /// Reads a stored hash back, its chain told by its form.
    pub fn parse_stored(input: &str) -> Result<Self, HashError> {
        BlockHash::parse(chain_of_stored(input), input)
    }
}

macro_rules! stored_form_serde {
    ($name:ident) => {
        /// Events carry the stored form.
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_str(self)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<$name, D::Error> {
                let stored = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                $name::parse_stored(&stored).map_err(serde::de::Error::custom)
            }
        }
    };
}

stored_form_serde!(TxHash);
stored_form_serde!(BlockHash);

/// Hashes for the domain's own tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::{BlockHash, TxHash, B256};

    /// An ETH transaction hash ending in `n`.
    pub(crate) fn tx(n: u8) -> TxHash {
        TxHash::Eth(B256::with_last_byte(n))
    }

    /// An ETH block hash ending in `n`.
    pub(crate) fn block(n: u8) -> BlockHash {
        BlockHash::Eth(B256::with_last_byte(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_round_trip_in_their_stored_form() {
        let eth = "0x88e96d4537bea4d9c05d12549907b32561d3bf31f45aae734cdc119f13406cb6";
        let btc_genesis = "000000000019d6689c085ae165831e934ff763ae46a2a6c172b3f1b60a8ce26f";
        assert_eq!(BlockHash::parse(Chain::Eth, eth).expect("valid").to_string(), eth);
        assert_eq!(
            BlockHash::parse(Chain::Eth, &eth.to_uppercase().replace("0X", "0x")).expect("valid").to_string(),
            eth,
            "stored lowercase whatever the input case"
        );
        assert_eq!(BlockHash::parse(Chain::Btc, btc_genesis).expect("valid").to_string(), btc_genesis);
        assert_eq!(TxHash::parse(Chain::Btc, btc_genesis).expect("valid").chain(), Chain::Btc);
        for stored in [eth, btc_genesis] {
            let json = serde_json::to_value(TxHash::parse_stored(stored).expect("valid")).unwrap();
            assert_eq!(json, serde_json::json!(stored), "events keep the stored form");
            assert_eq!(serde_json::from_value::<BlockHash>(json).expect("reads back").to_string(), stored);
        }
        assert!(serde_json::from_value::<TxHash>(serde_json::json!("0x88e9")).is_err());
        for (chain, bad) in [
            (Chain::Eth, "88e96d4537bea4d9c05d12549907b32561d3bf31f45aae734cdc119f13406cb6"),
            (Chain::Eth, "0x88e9"),
            (Chain::Btc, eth),
            (Chain::Btc, "zz0000000019d6689c085ae165831e934ff763ae46a2a6c172b3f1b60a8ce26f"),
        ] {
            assert!(TxHash::parse(chain, bad).is_err(), "{chain} {bad}");
            assert!(BlockHash::parse(chain, bad).is_err(), "{chain} {bad}");
        }
    }
}
