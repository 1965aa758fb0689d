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
}
