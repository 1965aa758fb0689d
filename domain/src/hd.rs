//! Deposit addresses derived from an account-level extended public key (BIP-32), so the service
//! holds no private key for them.
//!
//! The operator configures one extended public key per chain, exported at the *account* level by
//! the wallet that keeps the private key offline:
//!
//! - ETH: `m/44'/60'/0'` (BIP-44). Deposit address `i` is the key at `m/44'/60'/0'/0/i`, its
//!   address the last 20 bytes of keccak256 of the uncompressed public key.
//! - BTC: `m/84'/0'/0'` on mainnet, `m/84'/1'/0'` on test networks (BIP-84). Deposit address `i`
//!   is the P2WPKH address of the key at `…/0/i`.
//!
//! Only the receive chain (`0`) is used, and only non-hardened indexes (`0..2^31`): hardened
//! children cannot be derived without the private key.
//!
//! Accepted encodings: `xpub`/`tpub` for both chains, and for BTC also the BIP-84 forms
//! `zpub`/`vpub`, which are the same key with different version bytes. `ypub`/`upub` (BIP-49,
//! P2SH-wrapped) and the multisig forms are refused: they declare a different script type than
//! the P2WPKH addresses we would derive, so the wallet holding the keys would not find the funds
//! under its own path. Extended *private* keys are refused with an error that says so, and no error
//! repeats more than the first four characters of its input, so a pasted secret never reaches a
//! log.

use std::fmt;

use alloy_primitives::Address;
use bitcoin::bip32::{ChildNumber, Xpub};
use bitcoin::hashes::{sha256, Hash, HashEngine};
use bitcoin::secp256k1::{Secp256k1, VerifyOnly};
use bitcoin::{CompressedPublicKey, NetworkKind};

use crate::{BtcAddress, BtcNetwork, Chain, ChainAddress, EthAddress};

/// Depth of an account-level key: `m / purpose' / coin_type' / account'`.
pub const ACCOUNT_DEPTH: u8 = 3;

/// The child of the account key whose children are the deposit (receive) addresses. `1` would be
/// the change chain, which deposits never use.
const RECEIVE_CHAIN: u32 = 0;

/// The first hardened index; deposit indexes lie below it.
pub const FIRST_HARDENED_INDEX: u32 = 1 << 31;

/// Why an extended public key or a derivation index was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HdError {
    /// Not a base58check string of a 78-byte extended key with a valid public key.
    #[error("extended public key starting {prefix:?} is malformed: {reason}")]
    Malformed {
        /// The first characters of the input (never the whole string).
        prefix: String,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// An extended private key (`xprv`, `zprv`, …). The service must never hold one for deposit
    /// addresses.
    #[error("{prefix}… is an extended PRIVATE key; configure the account's extended PUBLIC key instead")]
    PrivateKey {
        /// The key's type (`xprv`, `tprv`, `zprv`, …).
        prefix: &'static str,
    },
    /// A known encoding that does not fit the chain (a `ypub` for BTC P2WPKH, a `zpub` for ETH),
    /// or version bytes nobody uses.
    #[error("a {found} extended key cannot be used for {chain} deposit addresses: expected {expected}")]
    UnsupportedVersion {
        /// The key's type (`ypub`, …), or its version bytes in hex when unknown.
        found: String,
        /// The chain it was configured for.
        chain: Chain,
        /// The accepted types.
        expected: &'static str,
    },
    /// A BTC key for the other kind of network (a `tpub` on mainnet, an `xpub` on regtest).
    #[error("extended public key {found} is for {found_networks}, but Bitcoin is configured for {expected}")]
    WrongNetwork {
        /// The key's type.
        found: &'static str,
        /// The networks that type belongs to.
        found_networks: &'static str,
        /// The configured network.
        expected: &'static str,
    },
    /// Not an account-level key: deriving `0/i` from a master key or from the receive chain
    /// itself would produce addresses the wallet holding the private key never looks at.
    #[error(
        "extended public key is at depth {depth} (child {child}); expected an account-level key at \
         depth 3 such as m/44'/60'/0' (ETH) or m/84'/0'/0' (BTC)"
    )]
    NotAccountLevel {
        /// The key's depth.
        depth: u8,
        /// Its child number, `'` marking a hardened one.
        child: String,
    },
    /// An index at or above 2^31: hardened, so not derivable from a public key.
    #[error("derivation index {0} is hardened (at least 2^31); deposit addresses use indexes below 2^31")]
    HardenedIndex(u32),
    /// BIP-32 derivation is undefined at this index (probability below 2^-127); BIP-32 says to
    /// skip to the next index.
    #[error("no valid key exists at derivation index {0}")]
    InvalidChild(u32),
}

/// What a key's version bytes declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KeyType {
    /// A public key for the given kind of network and script family.
    Public { network: NetworkKind, script: Script },
    /// A private key: always refused.
    Private,
}

/// The script family a version declares (SLIP-132).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Script {
    /// `xpub`/`tpub`: plain BIP-32, no script declared.
    Unspecified,
    /// `ypub`/`upub`: BIP-49, P2WPKH nested in P2SH.
    NestedSegwit,
    /// `zpub`/`vpub`: BIP-84, native P2WPKH.
    NativeSegwit,
    /// `Ypub`/`Zpub`/`Upub`/`Vpub`: multisig.
    Multisig,
}

/// Version bytes of the extended-key encodings we recognise (BIP-32, SLIP-132).
const VERSIONS: [([u8; 4], &str, KeyType); 14] = {
    use KeyType::{Private, Public};
    use NetworkKind::{Main, Test};
    [
        ([0x04, 0x88, 0xb2, 0x1e], "xpub", Public { network: Main, script: Script::Unspecified }),
        ([0x04, 0x35, 0x87, 0xcf], "tpub", Public { network: Test, script: Script::Unspecified }),
        ([0x04, 0x9d, 0x7c, 0xb2], "ypub", Public { network: Main, script: Script::NestedSegwit }),
        ([0x04, 0x4a, 0x52, 0x62], "upub", Public { network: Test, script: Script::NestedSegwit }),
        ([0x04, 0xb2, 0x47, 0x46], "zpub", Public { network: Main, script: Script::NativeSegwit }),
        ([0x04, 0x5f, 0x1c, 0xf6], "vpub", Public { network: Test, script: Script::NativeSegwit }),
        ([0x02, 0x95, 0xb4, 0x3f], "Ypub", Public { network: Main, script: Script::Multisig }),
        ([0x02, 0xaa, 0x7e, 0xd3], "Zpub", Public { network: Main, script: Script::Multisig }),
        ([0x04, 0x88, 0xad, 0xe4], "xprv", Private),
        ([0x04, 0x35, 0x83, 0x94], "tprv", Private),
        ([0x04, 0x9d, 0x78, 0x78], "yprv", Private),
        ([0x04, 0x4a, 0x4e, 0x28], "uprv", Private),
        ([0x04, 0xb2, 0x43, 0x0c], "zprv", Private),
        ([0x04, 0x5f, 0x18, 0xbc], "vprv", Private),
    ]
};

/// BIP-32 version bytes the `bitcoin` crate decodes: `xpub` and `tpub`.
const PLAIN_VERSION: [(NetworkKind, [u8; 4]); 2] =
    [(NetworkKind::Main, [0x04, 0x88, 0xb2, 0x1e]), (NetworkKind::Test, [0x04, 0x35, 0x87, 0xcf])];

/// An extended public key as decoded, with the type its version bytes declared.
struct Decoded {
    xpub: Xpub,
    name: &'static str,
    network: NetworkKind,
    script: Script,
}

/// Decodes any recognised public encoding into an [`Xpub`], refusing private keys, and checks
/// the key is account-level. Which types a chain accepts is decided by the caller.
fn decode(input: &str, chain: Chain) -> Result<Decoded, HdError> {
    let input = input.trim();
    let prefix: String = input.chars().take(4).collect();
    let malformed = |reason| HdError::Malformed { prefix: prefix.clone(), reason };
    let mut bytes = bitcoin::base58::decode_check(input)
        .map_err(|_| malformed("not base58check (a wrong character or a typo breaking the checksum)"))?;
    if bytes.len() != 78 {
        return Err(malformed("not 78 bytes long, so not a BIP-32 extended key"));
    }
    let version: [u8; 4] = bytes[..4].try_into().expect("BUG: 78 bytes have a 4-byte prefix");
    let (name, network, script) = match VERSIONS.iter().find(|(bytes, _, _)| *bytes == version) {
        Some((_, name, KeyType::Private)) => return Err(HdError::PrivateKey { prefix: name }),
        Some((_, name, KeyType::Public { network, script })) => (*name, *network, *script),
        None => {
            return Err(HdError::UnsupportedVersion {
                found: format!("version {:02x}{:02x}{:02x}{:02x}", version[0], version[1], version[2], version[3]),
                chain,
                expected: expected_types(chain),
            })
        }
    };
    // zpub and vpub differ from xpub and tpub only in these four bytes.
    let plain = PLAIN_VERSION.iter().find(|(kind, _)| *kind == network).expect("BUG: every network kind has one");
    bytes[..4].copy_from_slice(&plain.1);
    let xpub = Xpub::decode(&bytes).map_err(|_| malformed("its public key is not a point on secp256k1"))?;
    if xpub.depth != ACCOUNT_DEPTH || !xpub.child_number.is_hardened() {
        return Err(HdError::NotAccountLevel { depth: xpub.depth, child: xpub.child_number.to_string() });
    }
    Ok(Decoded { xpub, name, network, script })
}

/// The types a chain accepts, for error messages.
fn expected_types(chain: Chain) -> &'static str {
    match chain {
        Chain::Eth => "xpub or tpub",
        Chain::Btc => "xpub or zpub (mainnet), tpub or vpub (test networks)",
    }
}

/// The part of a key shared by both chains: the receive chain's extended key, ready to derive
/// children, and the fingerprint of the account key.
#[derive(Clone)]
struct ReceiveChain {
    receive: Xpub,
    fingerprint: String,
    secp: Secp256k1<VerifyOnly>,
}

impl ReceiveChain {
    fn new(account: Xpub, prefix: &str) -> Result<Self, HdError> {
        let secp = Secp256k1::verification_only();
        let receive = account.ckd_pub(&secp, ChildNumber::Normal { index: RECEIVE_CHAIN }).map_err(|_| {
            HdError::Malformed { prefix: prefix.to_owned(), reason: "its receive chain (child 0) is not derivable" }
        })?;
        // Exactly what determines the derived addresses (chain code and public key), and nothing
        // else: the xpub and zpub forms of one key share a fingerprint, while depth and parent
        // metadata do not count. A hash rather than the key, so storing it reveals no addresses.
        let mut engine = sha256::Hash::engine();
        engine.input(account.chain_code.as_bytes());
        engine.input(&account.public_key.serialize());
        let fingerprint = sha256::Hash::from_engine(engine).to_string();
        Ok(ReceiveChain { receive, fingerprint, secp })
    }

    /// The public key of deposit index `index`.
    fn child(&self, index: u32) -> Result<bitcoin::secp256k1::PublicKey, HdError> {
        let number = ChildNumber::from_normal_idx(index).map_err(|_| HdError::HardenedIndex(index))?;
        let child = self.receive.ckd_pub(&self.secp, number).map_err(|_| HdError::InvalidChild(index))?;
        Ok(child.public_key)
    }
}

impl fmt::Debug for ReceiveChain {
    // The key itself is not secret, but it links every deposit address: keep it out of logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceiveChain").field("fingerprint", &self.fingerprint).finish_non_exhaustive()
    }
}

/// The ETH deposit key: the account-level extended public key at `m/44'/60'/0'`.
#[derive(Clone, Debug)]
pub struct EthDepositKey(ReceiveChain);

impl EthDepositKey {
    /// Parses an `xpub` (or `tpub`; the network byte means nothing on Ethereum).
    pub fn parse(input: &str) -> Result<Self, HdError> {
        let decoded = decode(input, Chain::Eth)?;
        if decoded.script != Script::Unspecified {
            return Err(HdError::UnsupportedVersion {
                found: decoded.name.to_owned(),
                chain: Chain::Eth,
                expected: expected_types(Chain::Eth),
            });
        }
        ReceiveChain::new(decoded.xpub, decoded.name).map(EthDepositKey)
    }

    /// The deposit address at `m/44'/60'/0'/0/{index}`.
    pub fn address(&self, index: u32) -> Result<EthAddress, HdError> {
        let public_key = self.0.child(index)?;
        let uncompressed = public_key.serialize_uncompressed();
        // Without the 0x04 tag: Ethereum hashes the bare 64-byte point.
        Ok(EthAddress::from_alloy(Address::from_raw_public_key(&uncompressed[1..])))
    }

    /// Identifies the key (see [`DepositKey::fingerprint`]).
    pub fn fingerprint(&self) -> &str {
        &self.0.fingerprint
    }
}

/// The BTC deposit key: the account-level extended public key at `m/84'/0'/0'` (mainnet) or
/// `m/84'/1'/0'` (test networks), with the network its addresses are for.
#[derive(Clone, Debug)]
pub struct BtcDepositKey {
    keys: ReceiveChain,
    network: BtcNetwork,
}

impl BtcDepositKey {
    /// Parses an `xpub`/`zpub` (mainnet) or `tpub`/`vpub` (testnet, signet, regtest) for
    /// `network`.
    pub fn parse(input: &str, network: BtcNetwork) -> Result<Self, HdError> {
        let decoded = decode(input, Chain::Btc)?;
        if !matches!(decoded.script, Script::Unspecified | Script::NativeSegwit) {
            return Err(HdError::UnsupportedVersion {
                found: decoded.name.to_owned(),
                chain: Chain::Btc,
                expected: expected_types(Chain::Btc),
            });
        }
        if decoded.network != NetworkKind::from(network.to_bitcoin()) {
            return Err(HdError::WrongNetwork {
                found: decoded.name,
                found_networks: match decoded.network {
                    NetworkKind::Main => "mainnet",
                    NetworkKind::Test => "test networks",
                },
                expected: network.as_str(),
            });
        }
        Ok(BtcDepositKey { keys: ReceiveChain::new(decoded.xpub, decoded.name)?, network })
    }

    /// The P2WPKH deposit address at `…/0/{index}` on the configured network.
    pub fn address(&self, index: u32) -> Result<BtcAddress, HdError> {
        let public_key = CompressedPublicKey(self.keys.child(index)?);
        Ok(BtcAddress::from_bitcoin(bitcoin::Address::p2wpkh(&public_key, self.network.to_bitcoin())))
    }

    /// The network the addresses are for.
    pub fn network(&self) -> BtcNetwork {
        self.network
    }

    /// Identifies the key (see [`DepositKey::fingerprint`]).
    pub fn fingerprint(&self) -> &str {
        &self.keys.fingerprint
    }
}

/// A deposit key of either chain, for code that allocates addresses without caring which.
#[derive(Clone, Debug)]
pub enum DepositKey {
    /// Ethereum.
    Eth(EthDepositKey),
    /// Bitcoin.
    Btc(BtcDepositKey),
}

impl DepositKey {
    /// The chain the addresses are on.
    pub fn chain(&self) -> Chain {
        match self {
            DepositKey::Eth(_) => Chain::Eth,
            DepositKey::Btc(_) => Chain::Btc,
        }
    }

    /// Identifies the key: lowercase hex SHA-256 of its chain code and compressed public key,
    /// exactly the inputs that determine the derived addresses. Two encodings of one key (`xpub`
    /// and `zpub`) share it; a different key does not.
    pub fn fingerprint(&self) -> &str {
        match self {
            DepositKey::Eth(key) => key.fingerprint(),
            DepositKey::Btc(key) => key.fingerprint(),
        }
    }

    /// The deposit address at `index`.
    pub fn address(&self, index: u32) -> Result<ChainAddress, HdError> {
        match self {
            DepositKey::Eth(key) => key.address(index).map(ChainAddress::Eth),
            DepositKey::Btc(key) => key.address(index).map(ChainAddress::Btc),
        }
    }
}

impl From<EthDepositKey> for DepositKey {
    fn from(key: EthDepositKey) -> Self {
        DepositKey::Eth(key)
    }
}

impl From<BtcDepositKey> for DepositKey {
    fn from(key: BtcDepositKey) -> Self {
        DepositKey::Btc(key)
    }
}

#[cfg(test)]
mod tests {
    use bitcoin::bip32::{DerivationPath, Xpriv};
    use proptest::prelude::*;

    use super::*;
    use crate::bip39::bip39_seed;

    /// Anvil's and Hardhat's development mnemonic.
    const DEV_MNEMONIC: &str = "test test test test test test test test test test test junk";
    /// Its account key at m/44'/60'/0' (the store's tests use it too).
    const DEV_ETH_XPUB: &str =
        "xpub6Ce9NcJvTk36xtLSrJLZqE7wtgA5deCeYs7rSQtreh4cj6ByPtrg9sD7V2FNFLPnf8heNP3FGkeV9qwfzvZNSd54JoNXVsXFYSYwHsnJxqP";
    /// The BIP-84 test vector's mnemonic, account 0 key and first two receive addresses.
    const BIP84_MNEMONIC: &str =
        "abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon about";
    const BIP84_ZPUB: &str =
        "zpub6rFR7y4Q2AijBEqTUquhVz398htDFrtymD9xYYfG1m4wAcvPhXNfE3EfH1r1ADqtfSdVCToUG868RvUUkgDKf31mGDtKsAYz2oz2AGutZYs";

    fn account_xpriv(mnemonic: &str, network: NetworkKind, path: &str) -> Xpriv {
        let secp = Secp256k1::new();
        let master = Xpriv::new_master(network, &bip39_seed(mnemonic)).expect("valid seed");
        master.derive_priv(&secp, &path.parse::<DerivationPath>().expect("valid path")).expect("derivable")
    }

    fn account_xpub(mnemonic: &str, network: NetworkKind, path: &str) -> Xpub {
        Xpub::from_priv(&Secp256k1::new(), &account_xpriv(mnemonic, network, path))
    }

    /// `xpub` re-encoded with other version bytes (`zpub`, `ypub`, `xprv`-lookalike, …).
    fn with_version(xpub: &Xpub, version: [u8; 4]) -> String {
        let mut bytes = xpub.encode();
        bytes[..4].copy_from_slice(&version);
        bitcoin::base58::encode_check(&bytes)
    }

    fn version_of(name: &str) -> [u8; 4] {
        VERSIONS.iter().find(|(_, n, _)| *n == name).expect("known version").0
    }

    #[test]
    fn bip39_seed_matches_the_reference_vector() {
        // From the BIP-39 reference implementation's vectors (trezor/python-mnemonic), with an
        // empty passphrase as produced by every wallet.
        let seed = bip39_seed(BIP84_MNEMONIC);
        assert_eq!(
            bitcoin::hex::DisplayHex::to_lower_hex_string(&seed[..]),
            "5eb00bbddcf069084889a8ab9155568165f5c453ccb85e70811aaed6f6da5fc19a5ac40b389cd370d086206dec8aa6c43daea6690f20ad3d8d48b2d2ce9e38e4"
        );
    }

    #[test]
    fn eth_addresses_match_anvils_dev_accounts() {
        let xpub = account_xpub(DEV_MNEMONIC, NetworkKind::Main, "m/44'/60'/0'");
        assert_eq!(xpub.to_string(), DEV_ETH_XPUB);
        let key = EthDepositKey::parse(DEV_ETH_XPUB).expect("valid xpub");
        let expected = [
            "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266",
            "0x70997970C51812dc3A010C7d01b50e0d17dc79C8",
            "0x3C44CdDdB6a900fa2b585dd299e03d12FA4293BC",
        ];
        for (index, expected) in (0..).zip(expected) {
            assert_eq!(key.address(index).expect("derivable").to_string(), expected, "index {index}");
        }
        // The tpub form of the same key derives the same addresses.
        let tpub = with_version(&xpub, version_of("tpub"));
        assert_eq!(EthDepositKey::parse(&tpub).expect("valid tpub").address(1), key.address(1));
        assert_eq!(DepositKey::from(key).address(0).unwrap().stored(), "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266");
    }

    #[test]
    fn btc_addresses_match_the_bip84_vector() {
        let key = BtcDepositKey::parse(BIP84_ZPUB, BtcNetwork::Mainnet).expect("valid zpub");
        assert_eq!(key.address(0).unwrap().to_string(), "bc1qcr8te4kr609gcawutmrza0j4xv80jy8z306fyu");
        assert_eq!(key.address(1).unwrap().to_string(), "bc1qnjg0jd8228aq7egyzacy8cys3knf9xvrerkf9g");

        // The vector's zpub is the key our own BIP-39 and BIP-32 derivation finds, and its xpub
        // form is the same key.
        let xpub = account_xpub(BIP84_MNEMONIC, NetworkKind::Main, "m/84'/0'/0'");
        assert_eq!(with_version(&xpub, version_of("zpub")), BIP84_ZPUB);
        let from_xpub = BtcDepositKey::parse(&xpub.to_string(), BtcNetwork::Mainnet).expect("valid xpub");
        assert_eq!(from_xpub.fingerprint(), key.fingerprint());
        assert_eq!(from_xpub.address(1), key.address(1));
    }

    #[test]
    fn test_network_keys_derive_test_network_addresses() {
        let xpub = account_xpub(BIP84_MNEMONIC, NetworkKind::Test, "m/84'/1'/0'");
        let vpub = with_version(&xpub, version_of("vpub"));
        assert!(vpub.starts_with("vpub"), "{vpub}");
        for network in [BtcNetwork::Regtest, BtcNetwork::Testnet, BtcNetwork::Signet] {
            let key = BtcDepositKey::parse(&vpub, network).expect("valid vpub");
            let address = key.address(0).unwrap();
            assert_eq!(BtcAddress::parse(&address.to_string(), network), Ok(address.clone()));
            assert_eq!(BtcDepositKey::parse(&xpub.to_string(), network).unwrap().address(0), Ok(address));
        }
        // The testnet address commonly cited for the same mnemonic at m/84'/1'/0'/0/0.
        let testnet = BtcDepositKey::parse(&vpub, BtcNetwork::Testnet).unwrap();
        assert_eq!(testnet.address(0).unwrap().to_string(), "tb1q6rz28mcfaxtmd6v789l9rrlrusdprr9pqcpvkl");
        let regtest = BtcDepositKey::parse(&vpub, BtcNetwork::Regtest).unwrap();
        assert!(regtest.address(0).unwrap().to_string().starts_with("bcrt1q"));
    }

    #[test]
    fn unusable_keys_are_refused_with_a_reason() {
        let main = account_xpub(BIP84_MNEMONIC, NetworkKind::Main, "m/84'/0'/0'");
        let test = account_xpub(BIP84_MNEMONIC, NetworkKind::Test, "m/84'/1'/0'");
        let secp = Secp256k1::new();
        let master =
            Xpub::from_priv(&secp, &Xpriv::new_master(NetworkKind::Main, &bip39_seed(BIP84_MNEMONIC)).unwrap());
        let receive_chain = main.ckd_pub(&secp, ChildNumber::Normal { index: 0 }).unwrap();
        let xprv = account_xpriv(BIP84_MNEMONIC, NetworkKind::Main, "m/84'/0'/0'").to_string();
        let mut typo = BIP84_ZPUB.to_owned();
        typo.replace_range(20..21, "X");

        let eth = |input: &str| EthDepositKey::parse(input).map(|_| ());
        let btc = |input: &str, network| BtcDepositKey::parse(input, network).map(|_| ());
        let malformed = |prefix: &str, reason| Err(HdError::Malformed { prefix: prefix.into(), reason });
        let unsupported = |found: &str, chain| {
            Err(HdError::UnsupportedVersion { found: found.into(), chain, expected: expected_types(chain) })
        };
        let cases: Vec<(Result<(), HdError>, Result<(), HdError>)> = vec![
            (
                eth("not a key"),
                malformed("not ", "not base58check (a wrong character or a typo breaking the checksum)"),
            ),
            (
                btc(&typo, BtcNetwork::Mainnet),
                malformed("zpub", "not base58check (a wrong character or a typo breaking the checksum)"),
            ),
            (
                eth("1BvBMSEYstWetqTFn5Au4m4GFg7xJaNVN2"),
                malformed("1BvB", "not 78 bytes long, so not a BIP-32 extended key"),
            ),
            (eth(&xprv), Err(HdError::PrivateKey { prefix: "xprv" })),
            (
                btc(&with_version(&main, version_of("zprv")), BtcNetwork::Mainnet),
                Err(HdError::PrivateKey { prefix: "zprv" }),
            ),
            (eth(BIP84_ZPUB), unsupported("zpub", Chain::Eth)),
            (btc(&with_version(&main, version_of("ypub")), BtcNetwork::Mainnet), unsupported("ypub", Chain::Btc)),
            (btc(&with_version(&main, version_of("Zpub")), BtcNetwork::Mainnet), unsupported("Zpub", Chain::Btc)),
            (btc(&with_version(&main, [1, 2, 3, 4]), BtcNetwork::Mainnet), unsupported("version 01020304", Chain::Btc)),
            (
                btc(&test.to_string(), BtcNetwork::Mainnet),
                Err(HdError::WrongNetwork { found: "tpub", found_networks: "test networks", expected: "mainnet" }),
            ),
            (
                btc(BIP84_ZPUB, BtcNetwork::Regtest),
                Err(HdError::WrongNetwork { found: "zpub", found_networks: "mainnet", expected: "regtest" }),
            ),
            (eth(&master.to_string()), Err(HdError::NotAccountLevel { depth: 0, child: "0".into() })),
            (
                btc(&receive_chain.to_string(), BtcNetwork::Mainnet),
                Err(HdError::NotAccountLevel { depth: 4, child: "0".into() }),
            ),
        ];
        for (index, (got, expected)) in cases.into_iter().enumerate() {
            assert_eq!(got, expected, "case {index}");
        }
        // No error message repeats a private key.
        let message = EthDepositKey::parse(&xprv).unwrap_err().to_string();
        assert!(!message.contains(&xprv[4..12]), "{message}");
        let message = EthDepositKey::parse(&xprv[..xprv.len() - 1]).unwrap_err().to_string();
        assert!(!message.contains(&xprv[4..12]), "{message}");
    }

    #[test]
    fn hardened_indexes_are_refused() {
        let eth = DepositKey::from(EthDepositKey::parse(DEV_ETH_XPUB).unwrap());
        let btc = DepositKey::from(BtcDepositKey::parse(BIP84_ZPUB, BtcNetwork::Mainnet).unwrap());
        for key in [eth, btc] {
            assert!(key.address(FIRST_HARDENED_INDEX - 1).is_ok());
            for index in [FIRST_HARDENED_INDEX, FIRST_HARDENED_INDEX + 1, u32::MAX] {
                assert_eq!(key.address(index), Err(HdError::HardenedIndex(index)), "{:?}", key.chain());
            }
        }
    }

    #[test]
    fn fingerprints_tell_keys_apart() {
        let eth = EthDepositKey::parse(DEV_ETH_XPUB).unwrap();
        let btc = BtcDepositKey::parse(BIP84_ZPUB, BtcNetwork::Mainnet).unwrap();
        assert_eq!(eth.fingerprint().len(), 64);
        assert!(eth.fingerprint().bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        assert_ne!(eth.fingerprint(), btc.fingerprint());
        let other_account = account_xpub(DEV_MNEMONIC, NetworkKind::Main, "m/44'/60'/1'");
        assert_ne!(EthDepositKey::parse(&other_account.to_string()).unwrap().fingerprint(), eth.fingerprint());
        assert!(!format!("{eth:?}").contains(&DEV_ETH_XPUB[4..20]), "Debug keeps the key out of logs");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Public derivation finds the same key as the wallet holding the private key, at any
        /// non-hardened index.
        #[test]
        fn public_derivation_agrees_with_private_derivation(index in 0..FIRST_HARDENED_INDEX) {
            let secp = Secp256k1::new();
            let account = account_xpriv(DEV_MNEMONIC, NetworkKind::Main, "m/44'/60'/0'");
            let child = account
                .derive_priv(&secp, &[ChildNumber::Normal { index: 0 }, ChildNumber::Normal { index }])
                .unwrap();
            let public_key = child.private_key.public_key(&secp).serialize_uncompressed();
            let key = EthDepositKey::parse(DEV_ETH_XPUB).unwrap();
            prop_assert_eq!(key.address(index).unwrap().as_alloy(), Address::from_raw_public_key(&public_key[1..]));
        }
    }
}
