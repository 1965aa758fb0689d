//! On-chain addresses, parsed and checked once at the edge.
//!
//! ETH addresses follow EIP-55: an all-lowercase address carries no checksum and is accepted, a
//! mixed-case one must match its checksum exactly. They are stored as lowercase `0x` hex and
//! shown checksummed. BTC addresses must belong to the configured network and are stored in their
//! canonical string form.

use std::fmt;
use std::str::FromStr;

use alloy_primitives::Address;

/// A valid Ethereum address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EthAddress(Address);

/// Why an ETH address string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EthAddressError {
    /// The string does not start with `0x`.
    #[error("ETH address {0:?} must start with 0x")]
    MissingPrefix(String),
    /// Not 40 hexadecimal digits after `0x`.
    #[error("ETH address {0:?} must have 40 hexadecimal digits after 0x")]
    Malformed(String),
    /// Mixed case that does not match the EIP-55 checksum: likely a typo.
    #[error("ETH address {0:?} has a wrong EIP-55 checksum (check for a typo)")]
    BadChecksum(String),
}

impl EthAddress {
    /// Parses with EIP-55 validation.
    pub fn parse(input: &str) -> Result<Self, EthAddressError> {
        let hex = input.strip_prefix("0x").ok_or_else(|| EthAddressError::MissingPrefix(input.to_owned()))?;
        if hex.len() != 40 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(EthAddressError::Malformed(input.to_owned()));
        }
        let address: Address = input.parse().map_err(|_| EthAddressError::Malformed(input.to_owned()))?;
        let lowercase = hex.bytes().all(|b| !b.is_ascii_uppercase());
        if !lowercase && address.to_checksum(None) != input {
            return Err(EthAddressError::BadChecksum(input.to_owned()));
        }
        Ok(EthAddress(address))
    }

    /// Wraps raw address bytes (from a decoded block or a derived key, already valid).
    pub const fn from_alloy(address: Address) -> Self {
        EthAddress(address)
    }

    /// The underlying alloy address.
    pub const fn as_alloy(&self) -> Address {
        self.0
    }

    /// The stored form: lowercase `0x` hex.
    pub fn to_lowercase_hex(&self) -> String {
        format!("{:#x}", self.0)
    }

    /// The EIP-55 checksummed form, for people.
    pub fn to_checksummed(&self) -> String {
        self.0.to_checksum(None)
    }
}

impl fmt::Display for EthAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_checksummed())
    }
}

impl FromStr for EthAddress {
    type Err = EthAddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EthAddress::parse(s)
    }
}

/// The Bitcoin network Custodian is configured for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BtcNetwork {
    /// Bitcoin mainnet.
    Mainnet,
    /// Testnet (version 3).
    Testnet,
    /// Signet.
    Signet,
    /// Regtest, used by the simulator and local development.
    Regtest,
}

impl BtcNetwork {
    /// The `bitcoin` crate's network value.
    pub fn to_bitcoin(self) -> bitcoin::Network {
        match self {
            BtcNetwork::Mainnet => bitcoin::Network::Bitcoin,
            BtcNetwork::Testnet => bitcoin::Network::Testnet,
            BtcNetwork::Signet => bitcoin::Network::Signet,
            BtcNetwork::Regtest => bitcoin::Network::Regtest,
        }
    }

    /// The name used in configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            BtcNetwork::Mainnet => "mainnet",
            BtcNetwork::Testnet => "testnet",
            BtcNetwork::Signet => "signet",
            BtcNetwork::Regtest => "regtest",
        }
    }
}

impl FromStr for BtcNetwork {
    type Err = BtcAddressError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "mainnet" | "bitcoin" | "main" => Ok(BtcNetwork::Mainnet),
            "testnet" | "test" => Ok(BtcNetwork::Testnet),
            "signet" => Ok(BtcNetwork::Signet),
            "regtest" => Ok(BtcNetwork::Regtest),
            other => Err(BtcAddressError::UnknownNetwork(other.to_owned())),
        }
    }
}

/// A Bitcoin address valid on the configured network.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BtcAddress(bitcoin::Address);

/// Why a BTC address string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BtcAddressError {
    /// Not a Bitcoin address at all.
    #[error("BTC address {input:?} is not valid: {reason}")]
    Invalid {
        /// The string given.
        input: String,
        /// What the parser objected to.
        reason: String,
    },
    /// A valid address, but for another network (a mainnet address on regtest, say).
    #[error("BTC address {input:?} is not a {expected} address")]
    WrongNetwork {
        /// The string given.
        input: String,
        /// The configured network.
        expected: &'static str,
    },
    /// A network name that is not one of mainnet, testnet, signet, regtest.
    #[error("unknown Bitcoin network {0:?}: expected mainnet, testnet, signet or regtest")]
    UnknownNetwork(String),
}

impl BtcAddress {
    /// Parses an address and checks it belongs to `network`.
    pub fn parse(input: &str, network: BtcNetwork) -> Result<Self, BtcAddressError> {
        let unchecked = bitcoin::Address::from_str(input.trim())
            .map_err(|e| BtcAddressError::Invalid { input: input.to_owned(), reason: e.to_string() })?;
        let checked = unchecked
            .require_network(network.to_bitcoin())
            .map_err(|_| BtcAddressError::WrongNetwork { input: input.to_owned(), expected: network.as_str() })?;
        Ok(BtcAddress(checked))
    }

    /// Wraps an address already known to be on the right network (derived from our own keys).
    pub fn from_bitcoin(address: bitcoin::Address) -> Self {
        BtcAddress(address)
    }

    /// The underlying `bitcoin` address.
    pub fn as_bitcoin(&self) -> &bitcoin::Address {
        &self.0
    }
}

impl fmt::Display for BtcAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl BtcAddress {
    /// Reads back an address that was checked against the network before it was stored (the
    /// database holds only such addresses, so the network is not asked again).
    pub fn from_stored(stored: &str) -> Result<Self, BtcAddressError> {
        let unchecked = bitcoin::Address::from_str(stored)
            .map_err(|e| BtcAddressError::Invalid { input: stored.to_owned(), reason: e.to_string() })?;
        Ok(BtcAddress(unchecked.assume_checked()))
    }
}

/// An address on either chain: a withdrawal's destination, a hot wallet's address.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ChainAddress {
    /// A checksummed (or all-lowercase) Ethereum address.
    Eth(EthAddress),
    /// A standard Bitcoin address (P2PKH, P2SH, P2WPKH, P2WSH, P2TR) on the configured network.
    Btc(BtcAddress),
}

/// Why a stored address could not be read back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoredAddressError {
    /// An `0x` string that is not an ETH address.
    #[error(transparent)]
    Eth(#[from] EthAddressError),
    /// Any other string that is not a BTC address.
    #[error(transparent)]
    Btc(#[from] BtcAddressError),
}

impl ChainAddress {
    /// The chain it is on.
    pub fn chain(&self) -> crate::Chain {
        match self {
            ChainAddress::Eth(_) => crate::Chain::Eth,
            ChainAddress::Btc(_) => crate::Chain::Btc,
        }
    }

    /// As stored: lowercase hex for ETH, the address string for BTC.
    pub fn stored(&self) -> String {
        match self {
            ChainAddress::Eth(address) => address.to_lowercase_hex(),
            ChainAddress::Btc(address) => address.to_string(),
        }
    }

    /// Reads a stored address back, its chain told by its form (an ETH address starts with `0x`,
    /// which no Bitcoin address does).
    pub fn parse_stored(stored: &str) -> Result<Self, StoredAddressError> {
        Ok(if stored.starts_with("0x") {
            ChainAddress::Eth(EthAddress::parse(stored)?)
        } else {
            ChainAddress::Btc(BtcAddress::from_stored(stored)?)
        })
    }

    /// The Ethereum address; `None` on Bitcoin.
    pub fn eth(&self) -> Option<EthAddress> {
        match self {
            ChainAddress::Eth(address) => Some(*address),
            ChainAddress::Btc(_) => None,
        }
    }

    /// The Bitcoin address; `None` on Ethereum.
    pub fn btc(&self) -> Option<&BtcAddress> {
        match self {
            ChainAddress::Eth(_) => None,
            ChainAddress::Btc(address) => Some(address),
        }
    }
}

/// For people: EIP-55 for ETH, the address string for BTC.
impl fmt::Display for ChainAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChainAddress::Eth(address) => fmt::Display::fmt(address, f),
            ChainAddress::Btc(address) => fmt::Display::fmt(address, f),
        }
    }
}

/// Events and JSON carry the stored form.
impl serde::Serialize for ChainAddress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.stored())
    }
}

impl<'de> serde::Deserialize<'de> for ChainAddress {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<ChainAddress, D::Error> {
        let stored = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        ChainAddress::parse_stored(&stored).map_err(serde::de::Error::custom)
    }
}

/// JSON carries the stored form (lowercase hex), as the database does.
impl serde::Serialize for EthAddress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.to_lowercase_hex())
    }
}

/// JSON carries the address string.
impl serde::Serialize for BtcAddress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Addresses for the domain's own tests.
#[cfg(test)]
pub(crate) mod fixtures {
    use super::{Address, ChainAddress, EthAddress};

    /// An ETH address ending in `n`.
    pub(crate) fn eth(n: u8) -> ChainAddress {
        ChainAddress::Eth(EthAddress::from_alloy(Address::with_last_byte(n)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eth_addresses_follow_eip55() {
        // Test vectors from EIP-55 itself.
        let valid = [
            "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed",
            "0xfB6916095ca1df60bB79Ce92cE3Ea74c37c5d359",
            "0xdbF03B407c01E7cD3CBea99509d93f8DDDC8C6FB",
            "0xD1220A0cf47c7B9Be7A2E6BA89F429762e7b9aDb",
            "0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed",
        ];
        for input in valid {
            let parsed = EthAddress::parse(input).unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(parsed.to_lowercase_hex(), input.to_lowercase());
        }
        assert_eq!(
            EthAddress::parse("0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed").expect("valid").to_string(),
            "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed"
        );

        type Expected = fn(String) -> EthAddressError;
        let invalid: [(&str, Expected); 6] = [
            ("0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAeD", EthAddressError::BadChecksum),
            ("0x5AAeb6053F3E94C9b9A09f33669435E7Ef1BeAed", EthAddressError::BadChecksum),
            ("5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed", EthAddressError::MissingPrefix),
            ("0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAe", EthAddressError::Malformed),
            ("0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAedd", EthAddressError::Malformed),
            ("0xZaAeb6053F3E94C9b9A09f33669435E7Ef1BeAed", EthAddressError::Malformed),
        ];
        for (input, error) in invalid {
            assert_eq!(EthAddress::parse(input), Err(error(input.to_owned())), "input {input}");
        }
    }

    #[test]
    fn btc_addresses_are_checked_against_the_network() {
        let mainnet_p2wpkh = "bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq";
        let regtest_p2wpkh = "bcrt1qs758ursh4q9z627kt3pp5yysm78ddny6txaqgw";
        let mainnet_p2pkh = "1BvBMSEYstWetqTFn5Au4m4GFg7xJaNVN2";

        assert_eq!(BtcAddress::parse(mainnet_p2wpkh, BtcNetwork::Mainnet).expect("valid").to_string(), mainnet_p2wpkh);
        assert_eq!(BtcAddress::parse(mainnet_p2pkh, BtcNetwork::Mainnet).expect("valid").to_string(), mainnet_p2pkh);
        assert_eq!(BtcAddress::parse(regtest_p2wpkh, BtcNetwork::Regtest).expect("valid").to_string(), regtest_p2wpkh);
        assert_eq!(
            BtcAddress::parse(mainnet_p2wpkh, BtcNetwork::Regtest),
            Err(BtcAddressError::WrongNetwork { input: mainnet_p2wpkh.into(), expected: "regtest" })
        );
        assert_eq!(
            BtcAddress::parse(regtest_p2wpkh, BtcNetwork::Mainnet),
            Err(BtcAddressError::WrongNetwork { input: regtest_p2wpkh.into(), expected: "mainnet" })
        );
        assert!(matches!(
            BtcAddress::parse("bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdx", BtcNetwork::Mainnet),
            Err(BtcAddressError::Invalid { .. })
        ));
        assert!(matches!("moonnet".parse::<BtcNetwork>(), Err(BtcAddressError::UnknownNetwork(_))));
    }

    #[test]
    fn stored_addresses_read_back_on_their_chain() {
        let eth = "0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed";
        let btc = "bcrt1qs758ursh4q9z627kt3pp5yysm78ddny6txaqgw";
        for stored in [eth, btc] {
            let address = ChainAddress::parse_stored(stored).expect("valid");
            assert_eq!(address.stored(), stored);
            let json = serde_json::to_value(&address).unwrap();
            assert_eq!(json, serde_json::json!(stored), "events keep the stored form");
            assert_eq!(serde_json::from_value::<ChainAddress>(json).expect("reads back"), address);
        }
        assert_eq!(ChainAddress::parse_stored(eth).unwrap().chain(), crate::Chain::Eth);
        assert_eq!(ChainAddress::parse_stored(eth).unwrap().to_string(), "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed");
        assert_eq!(ChainAddress::parse_stored(btc).unwrap().chain(), crate::Chain::Btc);
        assert!(matches!(ChainAddress::parse_stored("0x5aae"), Err(StoredAddressError::Eth(_))));
        assert!(matches!(ChainAddress::parse_stored("not-an-address"), Err(StoredAddressError::Btc(_))));
        assert!(serde_json::from_value::<ChainAddress>(serde_json::json!("")).is_err());
    }
}
