//! The chains Custodian watches and pays out on.

use std::fmt;
use std::str::FromStr;

/// A blockchain Custodian supports. Stored as its lowercase name (`eth`, `btc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Chain {
    /// Ethereum (or any EVM chain reached over Ethereum JSON-RPC).
    Eth,
    /// Bitcoin, reached over Bitcoin Core's JSON-RPC.
    Btc,
}

/// A chain name that is not one Custodian supports.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown chain {0:?}: expected \"eth\" or \"btc\"")]
pub struct UnknownChain(pub String);

impl Chain {
    /// Every supported chain, in a stable order.
    pub const ALL: [Chain; 2] = [Chain::Eth, Chain::Btc];

    /// The name stored in the database and accepted on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Chain::Eth => "eth",
            Chain::Btc => "btc",
        }
    }

    /// Decimals of the chain's native asset (wei per ether is 10^18, satoshi per bitcoin 10^8).
    pub fn native_decimals(self) -> u8 {
        match self {
            Chain::Eth => 18,
            Chain::Btc => 8,
        }
    }

    /// Ticker of the chain's native asset.
    pub fn native_symbol(self) -> &'static str {
        match self {
            Chain::Eth => "ETH",
            Chain::Btc => "BTC",
        }
    }
}

impl fmt::Display for Chain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Chain {
    type Err = UnknownChain;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "eth" | "ethereum" => Ok(Chain::Eth),
            "btc" | "bitcoin" => Ok(Chain::Btc),
            _ => Err(UnknownChain(s.to_owned())),
        }
    }
}

impl serde::Serialize for Chain {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Chain {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_rejects_others() {
        for (input, expected) in [
            ("eth", Ok(Chain::Eth)),
            ("ETH", Ok(Chain::Eth)),
            ("bitcoin", Ok(Chain::Btc)),
            ("btc", Ok(Chain::Btc)),
            ("sol", Err(UnknownChain("sol".into()))),
            ("", Err(UnknownChain(String::new()))),
        ] {
            assert_eq!(input.parse::<Chain>(), expected, "input {input:?}");
        }
        assert_eq!(Chain::Eth.to_string(), "eth");
    }
}
