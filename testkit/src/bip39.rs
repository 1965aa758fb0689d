//! The BIP-39 seed of a mnemonic, for tests that derive keys from a known wallet. Plain `bitcoin`
//! and nothing else, so that `custodian-domain`'s own tests include this file too (by `#[path]`).

use bitcoin::hashes::{hmac, sha512, Hash, HashEngine};

/// BIP-39 seed of a mnemonic with an empty passphrase: PBKDF2-HMAC-SHA512, 2048 rounds, salt
/// "mnemonic", one 64-byte block.
pub fn bip39_seed(mnemonic: &str) -> [u8; 64] {
    let prf = |parts: &[&[u8]]| {
        let mut engine = hmac::HmacEngine::<sha512::Hash>::new(mnemonic.as_bytes());
        for part in parts {
            engine.input(part);
        }
        hmac::Hmac::<sha512::Hash>::from_engine(engine).to_byte_array()
    };
    let mut block = prf(&[b"mnemonic", &1u32.to_be_bytes()]);
    let mut seed = block;
    for _ in 1..2048 {
        block = prf(&[&block]);
        seed.iter_mut().zip(block).for_each(|(s, b)| *s ^= b);
    }
    seed
}
