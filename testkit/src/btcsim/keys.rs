//! Deterministic keys: the simulator's own (it receives the coinbases and signs the payments) and
//! the fixed test keys behind [`AddrKind`] addresses. Every key is a SHA-256 of a label, so runs
//! are reproducible and no randomness is needed.

use bitcoin::hashes::{sha256, sha256d, Hash, HashEngine};
use bitcoin::secp256k1::{All, Message, Secp256k1, SecretKey};
use bitcoin::sighash::SighashCache;
use bitcoin::{
    absolute, ecdsa, transaction, Address, Amount, CompressedPublicKey, EcdsaSighashType, Network, OutPoint, PublicKey,
    ScriptBuf, Sequence, Transaction, TxIn, TxOut, Txid, Witness,
};

/// What a payment's fabricated input is worth beyond its outputs: the fee the transaction would
/// pay. Nothing checks it (there is no UTXO set); it keeps the signed amounts plausible.
const PAYMENT_FEE: Amount = Amount::from_sat(1_000);

/// The kinds of regtest address [`crate::BitcoinSim::address`] derives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddrKind {
    /// Legacy pay-to-public-key-hash (`m…`/`n…`).
    P2pkh,
    /// Pay-to-witness-public-key-hash nested in pay-to-script-hash (`2…`).
    P2shP2wpkh,
    /// Native segwit v0 key hash (`bcrt1q…`, 20-byte program).
    P2wpkh,
    /// Native segwit v0 script hash (`bcrt1q…`, 32-byte program) of `<pubkey> OP_CHECKSIG`.
    P2wsh,
    /// Taproot key-path output (`bcrt1p…`) with no script tree.
    P2tr,
}

impl AddrKind {
    /// Every kind, for tests that cover them all.
    pub const ALL: [AddrKind; 5] =
        [AddrKind::P2pkh, AddrKind::P2shP2wpkh, AddrKind::P2wpkh, AddrKind::P2wsh, AddrKind::P2tr];

    fn label(self) -> &'static str {
        match self {
            AddrKind::P2pkh => "p2pkh",
            AddrKind::P2shP2wpkh => "p2sh-p2wpkh",
            AddrKind::P2wpkh => "p2wpkh",
            AddrKind::P2wsh => "p2wsh",
            AddrKind::P2tr => "p2tr",
        }
    }
}

/// The simulator's signing context and its own key.
pub(super) struct Keys {
    secp: Secp256k1<All>,
    /// Signs every payment; its P2WPKH script is the fabricated inputs' previous output.
    funding_key: SecretKey,
    funding_pubkey: CompressedPublicKey,
    /// Where coinbases pay the block subsidy.
    coinbase_script: ScriptBuf,
}

impl Keys {
    pub(super) fn new() -> Keys {
        let secp = Secp256k1::new();
        let funding_key = secret_key("funding", 0);
        let funding_pubkey = CompressedPublicKey(funding_key.public_key(&secp));
        let coinbase_pubkey = CompressedPublicKey(secret_key("coinbase", 0).public_key(&secp));
        let coinbase_script = ScriptBuf::new_p2wpkh(&coinbase_pubkey.wpubkey_hash());
        Keys { secp, funding_key, funding_pubkey, coinbase_script }
    }

    pub(super) fn coinbase_script(&self) -> &ScriptBuf {
        &self.coinbase_script
    }

    /// The regtest address of `kind` for test key `index`; each (kind, index) has its own key.
    pub(super) fn address(&self, kind: AddrKind, index: u32) -> Address {
        let key = secret_key(kind.label(), index);
        let pubkey = CompressedPublicKey(key.public_key(&self.secp));
        match kind {
            AddrKind::P2pkh => Address::p2pkh(pubkey.pubkey_hash(), Network::Regtest),
            AddrKind::P2shP2wpkh => Address::p2shwpkh(&pubkey, Network::Regtest),
            AddrKind::P2wpkh => Address::p2wpkh(&pubkey, Network::Regtest),
            AddrKind::P2wsh => Address::p2wsh(&ScriptBuf::new_p2pk(&PublicKey::from(pubkey)), Network::Regtest),
            AddrKind::P2tr => Address::p2tr(&self.secp, key.x_only_public_key(&self.secp).0, None, Network::Regtest),
        }
    }

    /// A version-2 transaction paying exactly `outputs` (vout = index), spending one fabricated
    /// P2WPKH outpoint whose txid is derived from `serial`, signed for real: ECDSA over the BIP143
    /// sighash with the funding key. A deterministic function of its arguments.
    pub(super) fn payment(&self, serial: u64, outputs: &[(Address, Amount)]) -> Transaction {
        assert!(!outputs.is_empty(), "a transaction needs at least one output (Bitcoin Core rejects it otherwise)");
        let paid = outputs.iter().try_fold(Amount::ZERO, |sum, (_, amount)| sum.checked_add(*amount));
        let input_value = paid
            .and_then(|paid| paid.checked_add(PAYMENT_FEE))
            .filter(|value| *value <= Amount::MAX_MONEY)
            .expect("the outputs of a payment must add up to at most 21 million BTC");
        let mut tx = Transaction {
            version: transaction::Version::TWO,
            lock_time: absolute::LockTime::ZERO,
            input: vec![TxIn {
                previous_output: OutPoint { txid: fabricated_txid(serial), vout: 0 },
                script_sig: ScriptBuf::new(),
                // What Bitcoin Core's wallet sends: opted in to replacement, no relative lock.
                sequence: Sequence::ENABLE_RBF_NO_LOCKTIME,
                witness: Witness::new(),
            }],
            output: outputs
                .iter()
                .map(|(address, amount)| TxOut { value: *amount, script_pubkey: address.script_pubkey() })
                .collect(),
        };
        let spent_script = ScriptBuf::new_p2wpkh(&self.funding_pubkey.wpubkey_hash());
        let sighash = SighashCache::new(&tx)
            .p2wpkh_signature_hash(0, &spent_script, input_value, EcdsaSighashType::All)
            .expect("BUG: the funding script is P2WPKH and input 0 exists");
        let signature = self.secp.sign_ecdsa(&Message::from(sighash), &self.funding_key);
        tx.input[0].witness = Witness::p2wpkh(
            &ecdsa::Signature { signature, sighash_type: EcdsaSighashType::All },
            &self.funding_pubkey.0,
        );
        tx
    }

    /// A transaction spending `coins` (outpoints of the P2WPKH address `index`, with their
    /// values) to `outputs`, signed (BIP143) by that address's key: what its holder would send.
    pub(super) fn spend_p2wpkh(
        &self,
        index: u32,
        coins: &[(OutPoint, Amount)],
        outputs: &[(Address, Amount)],
    ) -> Transaction {
        let key = secret_key(AddrKind::P2wpkh.label(), index);
        let pubkey = CompressedPublicKey(key.public_key(&self.secp));
        let mut tx = Transaction {
            version: transaction::Version::TWO,
            lock_time: absolute::LockTime::ZERO,
            input: coins
                .iter()
                .map(|(outpoint, _)| TxIn {
                    previous_output: *outpoint,
                    script_sig: ScriptBuf::new(),
                    sequence: Sequence::ENABLE_RBF_NO_LOCKTIME,
                    witness: Witness::new(),
                })
                .collect(),
            output: outputs
                .iter()
                .map(|(address, amount)| TxOut { value: *amount, script_pubkey: address.script_pubkey() })
                .collect(),
        };
        let spent_script = ScriptBuf::new_p2wpkh(&pubkey.wpubkey_hash());
        for (i, (_, value)) in coins.iter().enumerate() {
            let sighash = SighashCache::new(&tx)
                .p2wpkh_signature_hash(i, &spent_script, *value, EcdsaSighashType::All)
                .expect("BUG: input i exists");
            let signature = self.secp.sign_ecdsa(&Message::from(sighash), &key);
            tx.input[i].witness =
                Witness::p2wpkh(&ecdsa::Signature { signature, sighash_type: EcdsaSighashType::All }, &pubkey.0);
        }
        tx
    }

    #[cfg(test)]
    pub(super) fn funding_check(&self) -> (&Secp256k1<All>, CompressedPublicKey) {
        (&self.secp, self.funding_pubkey)
    }
}

/// The txid of the `serial`th payment's fabricated previous transaction.
pub(super) fn fabricated_txid(serial: u64) -> Txid {
    let mut preimage = b"custodian-btcsim/funding".to_vec();
    preimage.extend_from_slice(&serial.to_be_bytes());
    Txid::from_raw_hash(sha256d::Hash::hash(&preimage))
}

/// The secret key named `label` and `index`: SHA-256 of both.
fn secret_key(label: &str, index: u32) -> SecretKey {
    let mut engine = sha256::Hash::engine();
    engine.input(b"custodian-btcsim/key/");
    engine.input(label.as_bytes());
    engine.input(&index.to_be_bytes());
    let digest = sha256::Hash::from_engine(engine);
    // Fails only for a digest of zero or at least the curve order: probability about 2^-128.
    SecretKey::from_slice(digest.as_byte_array()).expect("BUG: a SHA-256 digest is a valid secret key")
}

#[cfg(test)]
mod tests {
    use super::*;
    use bitcoin::AddressType;

    #[test]
    fn addresses_have_their_kind_and_differ_by_index() {
        let keys = Keys::new();
        let expected = [
            (AddrKind::P2pkh, AddressType::P2pkh),
            (AddrKind::P2shP2wpkh, AddressType::P2sh),
            (AddrKind::P2wpkh, AddressType::P2wpkh),
            (AddrKind::P2wsh, AddressType::P2wsh),
            (AddrKind::P2tr, AddressType::P2tr),
        ];
        for (kind, address_type) in expected {
            let first = keys.address(kind, 0);
            assert_eq!(first.address_type(), Some(address_type), "{kind:?}");
            assert!(first.as_unchecked().is_valid_for_network(Network::Regtest), "{kind:?}: {first}");
            assert_eq!(first, Keys::new().address(kind, 0), "{kind:?} is deterministic");
            assert_ne!(first, keys.address(kind, 1), "{kind:?} differs by index");
        }
        assert!(keys.address(AddrKind::P2wpkh, 0).to_string().starts_with("bcrt1q"));
        assert!(keys.address(AddrKind::P2tr, 0).to_string().starts_with("bcrt1p"));
    }

    #[test]
    fn payment_is_deterministic_unique_per_serial_and_signed() {
        let keys = Keys::new();
        let to = keys.address(AddrKind::P2tr, 7);
        let outputs = [(to.clone(), Amount::from_sat(12_345)), (keys.address(AddrKind::P2pkh, 1), Amount::ONE_BTC)];
        let tx = keys.payment(0, &outputs);
        assert_eq!(tx, Keys::new().payment(0, &outputs));
        assert_ne!(tx.compute_txid(), keys.payment(1, &outputs).compute_txid());
        assert_eq!(tx.version, transaction::Version::TWO);
        assert_eq!(tx.output.len(), 2);
        assert_eq!(tx.output[0].script_pubkey, to.script_pubkey());
        assert_eq!(tx.output[0].value, Amount::from_sat(12_345));

        // The witness is a valid BIP143 signature by the funding key over the fabricated input.
        let (secp, funding_pubkey) = keys.funding_check();
        let witness: Vec<&[u8]> = tx.input[0].witness.iter().collect();
        assert_eq!(witness.len(), 2);
        assert_eq!(witness[1], funding_pubkey.to_bytes().as_slice());
        let signature = ecdsa::Signature::from_slice(witness[0]).expect("a DER signature with a sighash byte");
        assert_eq!(signature.sighash_type, EcdsaSighashType::All);
        let value = Amount::from_sat(12_345) + Amount::ONE_BTC + PAYMENT_FEE;
        let sighash = SighashCache::new(&tx)
            .p2wpkh_signature_hash(
                0,
                &ScriptBuf::new_p2wpkh(&funding_pubkey.wpubkey_hash()),
                value,
                signature.sighash_type,
            )
            .expect("sighash");
        secp.verify_ecdsa(&Message::from(sighash), &signature.signature, &funding_pubkey.0).expect("valid signature");
    }
}
