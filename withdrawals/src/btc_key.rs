//! A BTC hot wallet's key: an account-level BIP-84 extended private key (`m/84'/coin'/account'`,
//! as `xprv`/`tprv` or `zprv`/`vprv`) read from a file only its owner can read. Its funding
//! address is `…/0/0`, its change addresses `…/1/i`, all P2WPKH. The key is erased on drop and
//! never printed; what the database keeps is the account's extended public key.

use std::fmt;
use std::path::Path;

use bitcoin::bip32::{ChildNumber, Xpriv, Xpub};
use bitcoin::hashes::Hash;
use bitcoin::secp256k1::{All, Message, Secp256k1};
use bitcoin::sighash::{EcdsaSighashType, SighashCache};
use bitcoin::{Address, CompressedPublicKey, NetworkKind, ScriptBuf, Transaction, Witness};
use custodian_domain::BtcNetwork;
use zeroize::Zeroizing;

/// Version bytes of the private encodings a P2WPKH account key may come in, and the plain BIP-32
/// version the `bitcoin` crate decodes for each.
const PRIVATE_VERSIONS: [([u8; 4], &str, NetworkKind, [u8; 4]); 4] = [
    ([0x04, 0x88, 0xad, 0xe4], "xprv", NetworkKind::Main, [0x04, 0x88, 0xad, 0xe4]),
    ([0x04, 0xb2, 0x43, 0x0c], "zprv", NetworkKind::Main, [0x04, 0x88, 0xad, 0xe4]),
    ([0x04, 0x35, 0x83, 0x94], "tprv", NetworkKind::Test, [0x04, 0x35, 0x83, 0x94]),
    ([0x04, 0x5f, 0x18, 0xbc], "vprv", NetworkKind::Test, [0x04, 0x35, 0x83, 0x94]),
];

/// Depth of an account-level key (`m / purpose' / coin' / account'`).
const ACCOUNT_DEPTH: u8 = 3;

/// Why a BTC hot-wallet key was refused.
#[derive(Debug, thiserror::Error)]
pub enum BtcKeyError {
    /// Other users can read the file.
    #[error("key file {0} is readable by other users (mode {1:o}); chmod 600 it")]
    TooOpen(String, u32),
    /// The file cannot be read.
    #[error("cannot read key file {0}: {1}")]
    Unreadable(String, std::io::Error),
    /// Not an extended private key of a kind a P2WPKH hot wallet uses.
    #[error("the key file holds no BIP-84 account key: {0}")]
    Malformed(&'static str),
    /// A key for the other kind of network.
    #[error("the key is a {found} (for {found_networks}), but Bitcoin is configured for {expected}")]
    WrongNetwork {
        /// `xprv`, `tprv`, …
        found: &'static str,
        /// mainnet or test networks.
        found_networks: &'static str,
        /// The configured network.
        expected: &'static str,
    },
    /// Not at the account level (depth 3, hardened).
    #[error(
        "the key is at depth {depth} (child {child}); a hot wallet needs the account-level key m/84'/coin'/account'"
    )]
    NotAccountLevel {
        /// Its depth.
        depth: u8,
        /// Its child number.
        child: String,
    },
}

/// A BTC hot wallet's account key.
pub struct BtcHotKey {
    account: Xpriv,
    /// The account's public key, derived once (every address is derived from it).
    xpub: Xpub,
    /// `…/0/0`, derived once: most coins a lane spends are its funding address's.
    funding: ChildKey,
    network: BtcNetwork,
    secp: Secp256k1<All>,
}

/// One derived P2WPKH key: its private key (erased by its owner), public key and script.
struct ChildKey {
    private: bitcoin::secp256k1::SecretKey,
    public: CompressedPublicKey,
    script: ScriptBuf,
}

/// A transaction's inputs from this many on are signed on two threads: a signature costs tens of
/// microseconds, a thread about as much as one.
const PARALLEL_SIGNING_FROM: usize = 8;

impl BtcHotKey {
    /// Reads the key from `path`, which only its owner may read.
    pub fn from_file(path: &Path, network: BtcNetwork) -> Result<BtcHotKey, BtcKeyError> {
        let shown = path.display().to_string();
        let metadata = std::fs::metadata(path).map_err(|e| BtcKeyError::Unreadable(shown.clone(), e))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(BtcKeyError::TooOpen(shown, mode));
            }
        }
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(|e| BtcKeyError::Unreadable(shown, e))?);
        BtcHotKey::parse(&text, network)
    }

    /// Parses an account-level `xprv`/`zprv` (mainnet) or `tprv`/`vprv` (test networks).
    pub fn parse(text: &str, network: BtcNetwork) -> Result<BtcHotKey, BtcKeyError> {
        let mut bytes = Zeroizing::new(
            bitcoin::base58::decode_check(text.trim())
                .map_err(|_| BtcKeyError::Malformed("not base58check (a wrong character or a broken checksum)"))?,
        );
        if bytes.len() != 78 {
            return Err(BtcKeyError::Malformed("not 78 bytes long, so not a BIP-32 extended key"));
        }
        let version: [u8; 4] = bytes[..4].try_into().expect("BUG: 78 bytes have a 4-byte prefix");
        let Some((_, name, kind, plain)) = PRIVATE_VERSIONS.iter().find(|(v, ..)| *v == version) else {
            return Err(BtcKeyError::Malformed(
                "expected an extended private key: xprv or zprv (mainnet), tprv or vprv (test networks)",
            ));
        };
        if *kind != NetworkKind::from(network.to_bitcoin()) {
            return Err(BtcKeyError::WrongNetwork {
                found: name,
                found_networks: if *kind == NetworkKind::Main { "mainnet" } else { "test networks" },
                expected: network.as_str(),
            });
        }
        bytes[..4].copy_from_slice(plain);
        let account = Xpriv::decode(&bytes).map_err(|_| BtcKeyError::Malformed("its private key is not valid"))?;
        if account.depth != ACCOUNT_DEPTH || !account.child_number.is_hardened() {
            return Err(BtcKeyError::NotAccountLevel { depth: account.depth, child: account.child_number.to_string() });
        }
        let secp = Secp256k1::new();
        let xpub = Xpub::from_priv(&secp, &account);
        let funding = derive(&secp, &account, KeyPath::Funding);
        Ok(BtcHotKey { account, xpub, funding, network, secp })
    }

    /// The account's extended public key, as the database keeps it (`xpub`/`tpub` form).
    pub fn account_xpub(&self) -> Xpub {
        self.xpub
    }

    /// The P2WPKH address at `…/{chain}/{index}` (chain 0: receive, 1: change).
    fn address(&self, chain: u32, index: u32) -> Address {
        let child = self
            .xpub
            .derive_pub(&self.secp, &[ChildNumber::Normal { index: chain }, ChildNumber::Normal { index }])
            .expect("BUG: normal derivation of a valid key fails with probability 2^-127");
        Address::p2wpkh(&CompressedPublicKey(child.public_key), self.network.to_bitcoin())
    }

    /// The funding address, `…/0/0`: where the hot wallet is topped up.
    pub fn funding_address(&self) -> Address {
        self.address(0, 0)
    }

    /// The change address `…/1/{index}`.
    pub fn change_address(&self, index: u32) -> Address {
        self.address(1, index)
    }

    /// The address a coin of this account pays.
    pub fn address_of(&self, path: KeyPath) -> Address {
        let (chain, index) = path.steps();
        self.address(chain, index)
    }

    /// Signs every input of `tx`, each spending a P2WPKH coin of this account worth `value` at
    /// `path` (BIP-143, `SIGHASH_ALL`); a transaction of [`PARALLEL_SIGNING_FROM`] inputs or more
    /// on two threads. Keys other than the funding key are derived for this transaction and
    /// erased after use.
    pub fn sign(&self, tx: &mut Transaction, prevouts: &[(KeyPath, bitcoin::Amount)]) {
        assert_eq!(tx.input.len(), prevouts.len(), "BUG: one prevout per input");
        // Each change key derived once per transaction.
        let mut change: Vec<(KeyPath, ChildKey)> = Vec::new();
        for (path, _) in prevouts {
            if *path != KeyPath::Funding && !change.iter().any(|(p, _)| p == path) {
                change.push((*path, derive(&self.secp, &self.account, *path)));
            }
        }
        let key_of = |path: &KeyPath| -> &ChildKey {
            match path {
                KeyPath::Funding => &self.funding,
                _ => &change.iter().find(|(p, _)| p == path).expect("BUG: derived above").1,
            }
        };
        let mut cache = SighashCache::new(&*tx);
        let messages: Vec<(Message, &ChildKey)> = prevouts
            .iter()
            .enumerate()
            .map(|(input, (path, value))| {
                let key = key_of(path);
                let sighash = cache
                    .p2wpkh_signature_hash(input, &key.script, *value, EcdsaSighashType::All)
                    .expect("BUG: every input has a prevout and the script is P2WPKH");
                (Message::from_digest(sighash.to_byte_array()), key)
            })
            .collect();
        let witness = |(message, key): &(Message, &ChildKey)| {
            let signature = bitcoin::ecdsa::Signature {
                signature: self.secp.sign_ecdsa(message, &key.private),
                sighash_type: EcdsaSighashType::All,
            };
            Witness::p2wpkh(&signature, &key.public.0)
        };
        let witnesses: Vec<Witness> = if messages.len() < PARALLEL_SIGNING_FROM {
            messages.iter().map(witness).collect()
        } else {
            let (first, second) = messages.split_at(messages.len() / 2);
            std::thread::scope(|scope| {
                let other = scope.spawn(|| second.iter().map(witness).collect::<Vec<_>>());
                let mut witnesses: Vec<Witness> = first.iter().map(witness).collect();
                witnesses.extend(other.join().expect("BUG: a signing thread panicked"));
                witnesses
            })
        };
        drop(messages);
        for (_, mut key) in change {
            key.private.non_secure_erase();
        }
        for (input, witness) in tx.input.iter_mut().zip(witnesses) {
            input.witness = witness;
        }
    }
}

/// The P2WPKH key at `path` below `account`.
fn derive(secp: &Secp256k1<All>, account: &Xpriv, path: KeyPath) -> ChildKey {
    let (chain, index) = path.steps();
    let mut child = account
        .derive_priv(secp, &[ChildNumber::Normal { index: chain }, ChildNumber::Normal { index }])
        .expect("BUG: normal derivation of a valid key fails with probability 2^-127");
    let private = child.private_key;
    child.private_key.non_secure_erase();
    let public = CompressedPublicKey(private.public_key(secp));
    ChildKey { private, public, script: ScriptBuf::new_p2wpkh(&public.wpubkey_hash()) }
}

/// Which of a hot wallet's addresses a coin pays: its funding address `…/0/0` or change `…/1/i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyPath {
    /// `…/0/0`.
    Funding,
    /// `…/1/{index}`.
    Change(u32),
}

impl KeyPath {
    fn steps(self) -> (u32, u32) {
        match self {
            KeyPath::Funding => (0, 0),
            KeyPath::Change(index) => (1, index),
        }
    }
}

impl fmt::Debug for BtcHotKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BtcHotKey({}, key: ***)", self.funding_address())
    }
}

impl Drop for BtcHotKey {
    fn drop(&mut self) {
        self.account.private_key.non_secure_erase();
        self.funding.private.non_secure_erase();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bitcoin::bip32::DerivationPath;
    use std::str::FromStr;

    /// The BIP-84 test vector's mnemonic ("abandon … about"), as an account key at m/84'/0'/0'
    /// and, for regtest, at m/84'/1'/0'.
    fn account(path: &str, network: bitcoin::Network) -> Xpriv {
        let seed = custodian_test_seed();
        let master = Xpriv::new_master(network, &seed).unwrap();
        master.derive_priv(&Secp256k1::new(), &DerivationPath::from_str(path).unwrap()).unwrap()
    }

    /// BIP-39 seed of "abandon abandon … about" with an empty passphrase (BIP-84's vector).
    fn custodian_test_seed() -> [u8; 64] {
        let hex = "5eb00bbddcf069084889a8ab9155568165f5c453ccb85e70811aaed6f6da5fc19a5ac40b389cd370d086206dec8aa6c43daea6690f20ad3d8d48b2d2ce9e38e4";
        let mut seed = [0u8; 64];
        for (i, byte) in seed.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
        }
        seed
    }

    fn with_version(key: &Xpriv, version: [u8; 4]) -> String {
        let mut bytes = key.encode().to_vec();
        bytes[..4].copy_from_slice(&version);
        bitcoin::base58::encode_check(&bytes)
    }

    #[test]
    fn a_bip84_account_key_gives_the_vectors_funding_and_change_addresses() {
        let key = account("m/84'/0'/0'", bitcoin::Network::Bitcoin);
        for text in [key.to_string(), with_version(&key, [0x04, 0xb2, 0x43, 0x0c])] {
            let hot = BtcHotKey::parse(&text, BtcNetwork::Mainnet).unwrap();
            // BIP-84's test vectors: first receive and first change address of this account.
            assert_eq!(hot.funding_address().to_string(), "bc1qcr8te4kr609gcawutmrza0j4xv80jy8z306fyu");
            assert_eq!(hot.change_address(0).to_string(), "bc1q8c6fshw2dlwun7ekn9qwf37cu2rn755upcp6el");
            assert!(!format!("{hot:?}").contains(&text), "the key is never printed");
        }
    }

    #[test]
    fn public_keys_other_networks_and_other_levels_are_refused() {
        let key = account("m/84'/1'/0'", bitcoin::Network::Regtest);
        assert!(BtcHotKey::parse(&key.to_string(), BtcNetwork::Regtest).is_ok());
        let vprv = with_version(&key, [0x04, 0x5f, 0x18, 0xbc]);
        assert!(BtcHotKey::parse(&vprv, BtcNetwork::Regtest).is_ok());
        assert!(matches!(
            BtcHotKey::parse(&key.to_string(), BtcNetwork::Mainnet),
            Err(BtcKeyError::WrongNetwork { found: "tprv", .. })
        ));
        let public = Xpub::from_priv(&Secp256k1::new(), &key).to_string();
        assert!(matches!(BtcHotKey::parse(&public, BtcNetwork::Regtest), Err(BtcKeyError::Malformed(_))));
        let deeper = account("m/84'/1'/0'/0", bitcoin::Network::Regtest);
        assert!(matches!(
            BtcHotKey::parse(&deeper.to_string(), BtcNetwork::Regtest),
            Err(BtcKeyError::NotAccountLevel { depth: 4, .. })
        ));
        assert!(matches!(BtcHotKey::parse("tprv8zzz", BtcNetwork::Regtest), Err(BtcKeyError::Malformed(_))));
    }
}
