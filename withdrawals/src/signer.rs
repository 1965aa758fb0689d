//! Signing hot-wallet transactions. Keys stay in memory only as long as a signer lives, are
//! zeroized on drop, and are never printed; a KMS or HSM can stand in through [`Signer`].

use std::fmt;
use std::path::Path;

use alloy::consensus::{SignableTransaction, TxEip1559, TxEnvelope};
use alloy::eips::eip2718::Encodable2718;
use alloy_primitives::{Address, Signature, B256};
use secp256k1::{Message, PublicKey, Secp256k1, SecretKey, SignOnly};
use zeroize::Zeroizing;

/// A signed transaction: the exact bytes to broadcast and their hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedTx {
    /// EIP-2718 encoded bytes.
    pub raw: Vec<u8>,
    /// Transaction hash.
    pub hash: B256,
}

/// Why a key could not be loaded or a transaction signed.
#[derive(Debug, thiserror::Error)]
pub enum SignerError {
    /// The key file is readable by group or others.
    #[error("key file {0} is readable by other users (mode {1:o}); chmod 600 it")]
    KeyFileTooOpen(String, u32),
    /// The key file could not be read.
    #[error("cannot read key file {0}: {1}")]
    KeyFile(String, std::io::Error),
    /// Not a 32-byte hex private key.
    #[error("the key is not a 32-byte hex private key")]
    BadKey,
    /// No randomness to blind the signing context with.
    #[error("cannot read randomness for the signing context from /dev/urandom: {0}")]
    Entropy(std::io::Error),
    /// Signing failed.
    #[error("signing failed: {0}")]
    Sign(String),
}

/// Something that signs EIP-1559 transactions for one address.
pub trait Signer: Send + Sync {
    /// The address whose transactions this signs.
    fn address(&self) -> Address;
    /// Signs `tx`.
    fn sign(&self, tx: TxEip1559) -> Result<SignedTx, SignerError>;
}

/// A key held in process memory, signing with libsecp256k1 (the C library Bitcoin Core uses,
/// already built for the `bitcoin` crate): about two and a half times faster here than the
/// pure-Rust k256 behind alloy's signer, which matters because a lane's row stays locked while its
/// batch is signed. Signatures are RFC 6979 and low-S, byte for byte what alloy's signer gives.
pub struct LocalSigner {
    key: SecretKey,
    address: Address,
    context: Secp256k1<SignOnly>,
}

impl LocalSigner {
    /// From a hex private key (with or without `0x`). The text is zeroized by the caller's
    /// `Zeroizing` wrapper; the parsed key is zeroized when the signer drops.
    pub fn from_hex(key: &str) -> Result<LocalSigner, SignerError> {
        let hex = key.trim().trim_start_matches("0x");
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(SignerError::BadKey);
        }
        let mut bytes = Zeroizing::new([0u8; 32]);
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| SignerError::BadKey)?;
        }
        let key = SecretKey::from_slice(&bytes[..]).map_err(|_| SignerError::BadKey)?;
        let mut context = Secp256k1::signing_only();
        // Blinds the context's precomputed tables with a fresh secret, as libsecp256k1
        // recommends, so that signing leaks less through side channels.
        let mut seed = Zeroizing::new([0u8; 32]);
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut seed[..]))
            .map_err(SignerError::Entropy)?;
        context.seeded_randomize(&seed);
        let public = PublicKey::from_secret_key(&context, &key).serialize_uncompressed();
        Ok(LocalSigner { key, address: Address::from_raw_public_key(&public[1..]), context })
    }

    /// From a key file holding a hex private key; refuses a file others can read.
    pub fn from_file(path: &Path) -> Result<LocalSigner, SignerError> {
        let shown = path.display().to_string();
        let metadata = std::fs::metadata(path).map_err(|e| SignerError::KeyFile(shown.clone(), e))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = metadata.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(SignerError::KeyFileTooOpen(shown, mode));
            }
        }
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(|e| SignerError::KeyFile(shown, e))?);
        LocalSigner::from_hex(&text)
    }
}

impl fmt::Debug for LocalSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LocalSigner({:#x}, key: ***)", self.address)
    }
}

impl Drop for LocalSigner {
    fn drop(&mut self) {
        self.key.non_secure_erase();
    }
}

impl Signer for LocalSigner {
    fn address(&self) -> Address {
        self.address
    }

    fn sign(&self, tx: TxEip1559) -> Result<SignedTx, SignerError> {
        let digest = Message::from_digest(tx.signature_hash().0);
        let (recovery, compact) = self.context.sign_ecdsa_recoverable(&digest, &self.key).serialize_compact();
        let signature = Signature::from_bytes_and_parity(&compact, recovery.to_i32() == 1);
        let envelope = TxEnvelope::from(tx.into_signed(signature));
        Ok(SignedTx { raw: envelope.encoded_2718(), hash: *envelope.tx_hash() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// anvil's first dev key: a well-known test key, never a real one.
    const DEV_KEY: &str = "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";

    #[test]
    fn keys_parse_sign_and_never_print() {
        let signer = LocalSigner::from_hex(DEV_KEY).expect("valid key");
        assert_eq!(format!("{:#x}", signer.address()), "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266");
        let debug = format!("{signer:?}");
        assert!(!debug.contains(&DEV_KEY[2..]) && !debug.contains("ac0974"), "{debug}");
        let tx = TxEip1559 { chain_id: 31337, nonce: 0, gas_limit: 21_000, max_fee_per_gas: 2, ..Default::default() };
        let signed = signer.sign(tx.clone()).expect("signs");
        assert_eq!(signed, signer.sign(tx).expect("signs"), "deterministic (RFC 6979)");
        assert_eq!(signed.raw[0], 0x02, "EIP-1559 envelope");
        for bad in ["", "0x12", &"zz".repeat(32), &"0".repeat(64)] {
            assert!(matches!(LocalSigner::from_hex(bad), Err(SignerError::BadKey)));
        }
    }

    #[test]
    fn signs_exactly_as_alloys_signer() {
        use alloy::signers::local::PrivateKeySigner;
        use alloy::signers::SignerSync;
        let reference: PrivateKeySigner = DEV_KEY.parse().expect("valid key");
        let signer = LocalSigner::from_hex(DEV_KEY).expect("valid key");
        assert_eq!(signer.address(), reference.address());
        for nonce in 0..64 {
            let tx = TxEip1559 {
                chain_id: 31337,
                nonce,
                gas_limit: 21_000 + nonce,
                max_fee_per_gas: 2_000_000_000 + u128::from(nonce),
                max_priority_fee_per_gas: 1_000_000_000,
                to: alloy_primitives::TxKind::Call(Address::repeat_byte(0xbe)),
                value: alloy_primitives::U256::from(nonce * 1_000),
                ..Default::default()
            };
            let expected = reference.sign_hash_sync(&tx.signature_hash()).expect("signs");
            let expected = TxEnvelope::from(tx.clone().into_signed(expected));
            let ours = signer.sign(tx).expect("signs");
            assert_eq!(ours.raw, expected.encoded_2718(), "nonce {nonce}");
            assert_eq!(ours.hash, *expected.tx_hash());
        }
    }

    #[test]
    fn a_key_file_readable_by_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("custodian-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("hot.key");
        std::fs::write(&path, DEV_KEY).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(LocalSigner::from_file(&path), Err(SignerError::KeyFileTooOpen(_, 0o644))));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        assert!(LocalSigner::from_file(&path).is_ok());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
