//! The simulated block tree: every block ever mined (stale branches included, as Bitcoin Core
//! keeps them) and the active chain, built from real regtest blocks.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use bitcoin::block::{Header, Version};
use bitcoin::blockdata::constants::genesis_block;
use bitcoin::hashes::Hash;
use bitcoin::script::{Builder, PushBytesBuf};
use bitcoin::{
    absolute, opcodes, transaction, Amount, Block, BlockHash, CompactTarget, Network, OutPoint, ScriptBuf, Sequence,
    Transaction, TxIn, TxMerkleNode, TxOut, Txid, VarInt, Witness, Work,
};

use super::mempool::{Coin, Mempool};

/// Regtest's proof-of-work limit and the `bits` of every regtest block.
pub(super) const REGTEST_BITS: u32 = 0x207f_ffff;
/// The version Bitcoin Core's miner writes: the BIP9 top bits, signalling nothing.
const BLOCK_VERSION: i32 = 0x2000_0000;
/// Regtest halves the subsidy every 150 blocks.
const SUBSIDY_HALVING_INTERVAL: u64 = 150;
/// Median-time-past spans the block and its ten predecessors.
const MEDIAN_TIME_SPAN: usize = 11;
/// The coinbase witness's single item (BIP141's witness reserved value), as Bitcoin Core sets it.
const WITNESS_RESERVED_VALUE: [u8; 32] = [0; 32];
/// BIP141: a witness commitment output's script starts `OP_RETURN OP_PUSHBYTES_36 aa21a9ed`.
const WITNESS_COMMITMENT_HEADER: [u8; 4] = [0xaa, 0x21, 0xa9, 0xed];

/// A known block and what Bitcoin Core's block index keeps beside it.
pub(super) struct Entry {
    pub(super) hash: BlockHash,
    pub(super) block: Arc<Block>,
    pub(super) height: u64,
    /// Cumulative work of the chain ending at this block.
    pub(super) chainwork: Work,
    /// Median of this block's and its ten predecessors' timestamps.
    pub(super) median_time: u32,
    /// The block's txids, in order, computed once.
    pub(super) txids: Vec<Txid>,
}

/// Every block known and the active chain.
pub(super) struct Chain {
    entries: HashMap<BlockHash, Entry>,
    /// The active chain's hashes, index = height.
    active: Vec<BlockHash>,
    /// Every txid in the active chain, to refuse a block that repeats one.
    active_txids: HashSet<Txid>,
    /// Blocks mined so far, on any branch: block `n` is stamped genesis time + `n`, so timestamps
    /// are deterministic and a replacement block differs from the one it replaces.
    blocks_mined: u32,
    /// Payments built so far: the serial of each payment's fabricated outpoint.
    payments_built: u64,
    coinbase_script: ScriptBuf,
    /// Transactions accepted by `sendrawtransaction`, waiting for a block.
    pub(super) mempool: Mempool,
}

impl Chain {
    /// The chain holding only the regtest genesis block.
    pub(super) fn new(coinbase_script: ScriptBuf) -> Chain {
        let genesis = genesis_block(Network::Regtest);
        let hash = genesis.block_hash();
        let txids: Vec<Txid> = genesis.txdata.iter().map(Transaction::compute_txid).collect();
        let entry = Entry {
            hash,
            height: 0,
            chainwork: genesis.header.work(),
            median_time: genesis.header.time,
            txids: txids.clone(),
            block: Arc::new(genesis),
        };
        Chain {
            entries: HashMap::from([(hash, entry)]),
            active: vec![hash],
            active_txids: txids.into_iter().collect(),
            blocks_mined: 0,
            payments_built: 0,
            coinbase_script,
            mempool: Mempool::default(),
        }
    }

    /// The active chain's unspent outputs (OP_RETURN outputs are never coins), computed from its
    /// blocks: the fabricated inputs of [`super::BitcoinSim::pay`] spend nothing.
    pub(super) fn utxos(&self) -> HashMap<OutPoint, Coin> {
        let mut coins = HashMap::new();
        for hash in &self.active {
            let entry = &self.entries[hash];
            for (tx, txid) in entry.block.txdata.iter().zip(&entry.txids) {
                if !tx.is_coinbase() {
                    for input in &tx.input {
                        coins.remove(&input.previous_output);
                    }
                }
                for (vout, txout) in tx.output.iter().enumerate() {
                    if txout.script_pubkey.is_op_return() {
                        continue;
                    }
                    let outpoint = OutPoint { txid: *txid, vout: u32::try_from(vout).expect("BUG: vout beyond u32") };
                    coins.insert(
                        outpoint,
                        Coin { txout: txout.clone(), height: Some(entry.height), coinbase: tx.is_coinbase() },
                    );
                }
            }
        }
        coins
    }

    /// Mines one block with every waiting transaction (parents first) and empties the mempool.
    pub(super) fn mine_mempool(&mut self) -> BlockHash {
        let txs = self.mempool.in_order();
        self.mine(&txs)
    }

    /// Offers the transactions of blocks that left the active chain back to the mempool, as
    /// Core does after a reorg: those still valid (and not mined again) wait for a block.
    fn resurrect(&mut self, abandoned: Vec<Transaction>) {
        let now = self.tip().block.header.time.into();
        for tx in abandoned {
            let txid = tx.compute_txid();
            if tx.is_coinbase() || self.active_txids.contains(&txid) || self.mempool.contains(&txid) {
                continue;
            }
            let utxos = self.utxos();
            if let Ok(accepted) = self.mempool.check(&tx, &utxos, self.tip_height(), None, now) {
                if accepted.replaced.is_empty() {
                    self.mempool.insert(accepted);
                }
            }
        }
    }

    /// Drops waiting transactions that spend an output neither unspent on the active chain nor
    /// made by another waiting transaction, as Core's `removeForReorg` does after a reorg took
    /// their parent away for good (a sibling of it mined instead): they could never be mined.
    fn drop_orphans(&mut self) {
        loop {
            let utxos = self.utxos();
            let waiting = self.mempool.in_order();
            let made: HashSet<Txid> = waiting.iter().map(Transaction::compute_txid).collect();
            let orphan = waiting.iter().find(|tx| {
                tx.input
                    .iter()
                    .any(|i| !utxos.contains_key(&i.previous_output) && !made.contains(&i.previous_output.txid))
            });
            match orphan {
                Some(tx) => {
                    self.mempool.remove(&tx.compute_txid());
                }
                None => return,
            }
        }
    }

    pub(super) fn tip(&self) -> &Entry {
        let hash = self.active.last().expect("BUG: the active chain always holds genesis");
        &self.entries[hash]
    }

    pub(super) fn tip_height(&self) -> u64 {
        self.tip().height
    }

    /// The active chain's block at `height`.
    pub(super) fn active_hash(&self, height: u64) -> Option<BlockHash> {
        usize::try_from(height).ok().and_then(|height| self.active.get(height)).copied()
    }

    /// Any known block, active or stale.
    pub(super) fn entry(&self, hash: &BlockHash) -> Option<&Entry> {
        self.entries.get(hash)
    }

    /// Every known block, active or stale.
    pub(super) fn entries(&self) -> impl Iterator<Item = &Entry> {
        self.entries.values()
    }

    /// Bitcoin Core's `ComputeNextBlockAndDepth`: the confirmations of a block in the active
    /// chain and the block after it; -1 and none for a stale block.
    pub(super) fn confirmations_and_next(&self, entry: &Entry) -> (i64, Option<BlockHash>) {
        if self.active_hash(entry.height) != Some(entry.hash) {
            return (-1, None);
        }
        let depth = self.tip_height() - entry.height + 1;
        (i64::try_from(depth).expect("BUG: a chain shorter than 2^63"), self.active_hash(entry.height + 1))
    }

    /// Takes the serial of the next payment's fabricated outpoint.
    pub(super) fn next_payment_serial(&mut self) -> u64 {
        let serial = self.payments_built;
        self.payments_built += 1;
        serial
    }

    /// Mines one block with `txs` on the active tip and makes it the tip.
    pub(super) fn mine(&mut self, txs: &[Transaction]) -> BlockHash {
        for txid in new_txids(txs) {
            assert!(!self.active_txids.contains(&txid), "transaction {txid} is already in the active chain");
        }
        let hash = self.extend_active(txs);
        self.mempool.remove_for_block(txs);
        hash
    }

    /// Abandons the top `depth` blocks (they stay known, as stale) and mines one block per entry
    /// of `replacement` on the block below them. Checks everything before changing anything.
    pub(super) fn reorg(&mut self, depth: usize, replacement: &[Vec<Transaction>]) -> Vec<BlockHash> {
        assert!(
            replacement.len() > depth,
            "reorg({depth}, …) needs more than {depth} replacement blocks: Bitcoin Core only switches to a \
             branch with more work"
        );
        assert!(depth < self.active.len(), "cannot reorg {depth} blocks below a chain of height {}", self.tip_height());
        let fork = self.active.len() - depth;
        let abandoned: HashSet<Txid> =
            self.active[fork..].iter().flat_map(|hash| self.entries[hash].txids.iter().copied()).collect();
        let mut replacing = HashSet::new();
        for txid in replacement.iter().flat_map(|txs| new_txids(txs)) {
            let below_fork = self.active_txids.contains(&txid) && !abandoned.contains(&txid);
            assert!(!below_fork, "transaction {txid} is already in the active chain below the fork");
            assert!(replacing.insert(txid), "transaction {txid} is twice in the replacement");
        }
        let abandoned_txs: Vec<Transaction> =
            self.active[fork..].iter().flat_map(|hash| self.entries[hash].block.txdata.clone()).collect();
        self.active_txids.retain(|txid| !abandoned.contains(txid));
        self.active.truncate(fork);
        let mined: Vec<BlockHash> = replacement.iter().map(|txs| self.extend_active(txs)).collect();
        for txs in replacement {
            self.mempool.remove_for_block(txs);
        }
        self.resurrect(abandoned_txs);
        self.drop_orphans();
        mined
    }

    /// Mines one block per entry of `blocks` on `parent` (any known block, a stale one included).
    /// When the branch ends with more work than the active chain, Bitcoin Core switches to it:
    /// so does the simulator, and blocks abandoned earlier come back. Returns the new hashes.
    pub(super) fn mine_branch(&mut self, parent: BlockHash, blocks: &[Vec<Transaction>]) -> Vec<BlockHash> {
        assert!(self.entries.contains_key(&parent), "unknown parent block {parent}");
        let mut tip = parent;
        let mut mined = Vec::new();
        for txs in blocks {
            new_txids(txs);
            tip = self.mine_on(tip, txs);
            mined.push(tip);
        }
        if self.entries[&tip].chainwork > self.tip().chainwork {
            let mut branch = Vec::new();
            let mut cursor = Some(tip);
            while let Some(hash) = cursor {
                branch.push(hash);
                let entry = &self.entries[&hash];
                cursor = (entry.height > 0).then_some(entry.block.header.prev_blockhash);
            }
            branch.reverse();
            let kept: HashSet<BlockHash> = branch.iter().copied().collect();
            let abandoned_txs: Vec<Transaction> = self
                .active
                .iter()
                .filter(|hash| !kept.contains(*hash))
                .flat_map(|hash| self.entries[hash].block.txdata.clone())
                .collect();
            self.active = branch;
            self.active_txids = self.active.iter().flat_map(|h| self.entries[h].txids.iter().copied()).collect();
            for txs in blocks {
                self.mempool.remove_for_block(txs);
            }
            self.resurrect(abandoned_txs);
            self.drop_orphans();
        }
        mined
    }

    /// Mines one block on the active tip whose coinbase pays `script` (a pool paying a miner).
    pub(super) fn mine_coinbase_to(&mut self, script: &ScriptBuf, txs: &[Transaction]) -> BlockHash {
        let saved = std::mem::replace(&mut self.coinbase_script, script.clone());
        let hash = self.mine(txs);
        self.coinbase_script = saved;
        hash
    }

    /// Mines a block with `txs` on the tip and appends it to the active chain.
    fn extend_active(&mut self, txs: &[Transaction]) -> BlockHash {
        let hash = self.mine_on(self.tip().hash, txs);
        self.active_txids.extend(self.entries[&hash].txids.iter().copied());
        self.active.push(hash);
        hash
    }

    fn mine_on(&mut self, parent: BlockHash, txs: &[Transaction]) -> BlockHash {
        self.blocks_mined += 1;
        let parent = &self.entries[&parent];
        let height = parent.height + 1;
        let time = self.entries[&self.active[0]].block.header.time + self.blocks_mined;
        let block = build_block(parent.hash, height, time, &self.coinbase_script, txs);
        let hash = block.block_hash();
        let entry = Entry {
            hash,
            height,
            chainwork: parent.chainwork + block.header.work(),
            median_time: self.median_time_past(time, parent.hash),
            txids: block.txdata.iter().map(Transaction::compute_txid).collect(),
            block: Arc::new(block),
        };
        let replaced = self.entries.insert(hash, entry);
        assert!(replaced.is_none(), "BUG: block {hash} mined twice");
        hash
    }

    /// The median of `time` and the timestamps of `parent` and its ancestors, eleven in all.
    fn median_time_past(&self, time: u32, parent: BlockHash) -> u32 {
        let mut times = vec![time];
        let mut cursor = self.entries.get(&parent);
        while let Some(entry) = cursor.filter(|_| times.len() < MEDIAN_TIME_SPAN) {
            times.push(entry.block.header.time);
            cursor = self.entries.get(&entry.block.header.prev_blockhash);
        }
        times.sort_unstable();
        times[times.len() / 2]
    }
}

/// The txids of `txs`, refusing (panicking on) a coinbase or a transaction given twice: Bitcoin
/// Core would reject such a block.
fn new_txids(txs: &[Transaction]) -> Vec<Txid> {
    let mut seen = HashSet::new();
    txs.iter()
        .map(|tx| {
            assert!(!tx.is_coinbase(), "the simulator writes the coinbase itself; pass only payments");
            let txid = tx.compute_txid();
            assert!(seen.insert(txid), "transaction {txid} is twice in one block");
            txid
        })
        .collect()
}

/// A regtest block at `height` on `parent`: Bitcoin Core's coinbase (BIP34 height, subsidy to
/// `coinbase_script`, witness commitment), then `txs`, the merkle root, and a nonce that meets the
/// target.
fn build_block(parent: BlockHash, height: u64, time: u32, coinbase_script: &ScriptBuf, txs: &[Transaction]) -> Block {
    let mut txdata = Vec::with_capacity(txs.len() + 1);
    txdata.push(coinbase(height, coinbase_script));
    txdata.extend_from_slice(txs);
    let mut block = Block {
        header: Header {
            version: Version::from_consensus(BLOCK_VERSION),
            prev_blockhash: parent,
            merkle_root: TxMerkleNode::all_zeros(),
            time,
            bits: CompactTarget::from_consensus(REGTEST_BITS),
            nonce: 0,
        },
        txdata,
    };
    // Bitcoin Core commits to the witnesses in every block once segwit is active (always, on
    // regtest), even when no transaction has a witness. The coinbase's own wtxid counts as zero,
    // so the commitment can be computed before it is added.
    let witness_root = block.witness_root().expect("BUG: a block has a coinbase");
    let commitment = Block::compute_witness_commitment(&witness_root, &WITNESS_RESERVED_VALUE);
    let mut script = WITNESS_COMMITMENT_HEADER.to_vec();
    script.extend_from_slice(commitment.as_byte_array());
    let push = PushBytesBuf::try_from(script).expect("BUG: 36 bytes fit one push");
    block.txdata[0].output.push(TxOut { value: Amount::ZERO, script_pubkey: ScriptBuf::new_op_return(push) });
    block.header.merkle_root = block.compute_merkle_root().expect("BUG: a block has a coinbase");
    // Half of all hashes meet the regtest target, so this takes two tries on average.
    while block.header.validate_pow(block.header.target()).is_err() {
        block.header.nonce = block.header.nonce.checked_add(1).expect("BUG: no regtest nonce in 2^32 tries");
    }
    block
}

/// The coinbase Bitcoin Core's miner writes: `<height> OP_0` as script_sig (BIP34), the witness
/// reserved value as its witness, the subsidy to `script`. Fees are not added: the payments'
/// inputs are fabricated, so their fees are unknown to the chain.
fn coinbase(height: u64, script: &ScriptBuf) -> Transaction {
    let height_push = i64::try_from(height).expect("BUG: a height below 2^63");
    Transaction {
        version: transaction::Version::TWO,
        lock_time: absolute::LockTime::ZERO,
        input: vec![TxIn {
            previous_output: OutPoint::null(),
            script_sig: Builder::new().push_int(height_push).push_opcode(opcodes::OP_0).into_script(),
            sequence: Sequence::MAX,
            witness: Witness::from_slice(&[WITNESS_RESERVED_VALUE]),
        }],
        output: vec![TxOut { value: subsidy(height), script_pubkey: script.clone() }],
    }
}

/// Regtest's block subsidy: 50 BTC, halved every 150 blocks.
fn subsidy(height: u64) -> Amount {
    let halvings = height / SUBSIDY_HALVING_INTERVAL;
    if halvings >= 64 {
        return Amount::ZERO;
    }
    Amount::from_sat(Amount::from_int_btc(50).to_sat() >> halvings)
}

/// A block's size without witness data, as `getblock` reports `strippedsize`.
pub(super) fn stripped_size(block: &Block) -> usize {
    Header::SIZE
        + VarInt::from(block.txdata.len()).size()
        + block.txdata.iter().map(Transaction::base_size).sum::<usize>()
}

/// Bitcoin Core's `GetDifficulty`: the difficulty-1 target over the block's, as a double, rounded
/// to the 16 significant digits Core writes it with (so the JSON text is the same as Core's).
#[allow(clippy::float_arithmetic, reason = "Bitcoin Core reports difficulty as a double; this is its formula")]
pub(super) fn difficulty(bits: u32) -> f64 {
    let mut shift = (bits >> 24) & 0xff;
    let mut difficulty = f64::from(0x0000_ffff_u32) / f64::from(bits & 0x00ff_ffff);
    while shift < 29 {
        difficulty *= 256.0;
        shift += 1;
    }
    while shift > 29 {
        difficulty /= 256.0;
        shift -= 1;
    }
    format!("{difficulty:.15e}").parse().expect("BUG: a formatted double parses")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::btcsim::keys::Keys;

    fn chain() -> Chain {
        Chain::new(Keys::new().coinbase_script().clone())
    }

    #[test]
    fn starts_at_the_regtest_genesis_block() {
        let chain = chain();
        assert_eq!(chain.tip_height(), 0);
        assert_eq!(
            chain.tip().hash.to_string(),
            "0f9188f13cb7b2c71f2a335e3a4fc328bf5beb436012afca590b1a11466e2206",
            "regtest genesis"
        );
        assert_eq!(chain.tip().block.header.bits.to_consensus(), REGTEST_BITS);
    }

    #[test]
    fn difficulty_matches_bitcoin_core_for_regtest_and_mainnet_genesis() {
        assert_eq!(difficulty(REGTEST_BITS), 4.656542373906925e-10);
        assert_eq!(difficulty(0x1d00_ffff), 1.0);
    }

    #[test]
    fn mined_blocks_are_valid_and_commit_to_their_height() {
        let keys = Keys::new();
        let mut chain = Chain::new(keys.coinbase_script().clone());
        let payment = keys.payment(0, &[(keys.address(crate::btcsim::AddrKind::P2wpkh, 0), Amount::ONE_BTC)]);
        for height in 1..=20_u64 {
            let txs = if height == 17 { vec![payment.clone()] } else { vec![] };
            let hash = chain.mine(&txs);
            let entry = chain.entry(&hash).expect("mined block is known");
            let block = &entry.block;
            assert_eq!(entry.height, height);
            assert_eq!(block.header.validate_pow(block.header.target()), Ok(hash));
            assert!(block.check_merkle_root());
            assert!(block.check_witness_commitment());
            assert!(block.txdata[0].is_coinbase());
            // Heights 1–16 are pushed as OP_1…OP_16, as Bitcoin Core does; rust-bitcoin's BIP34
            // reader expects a data push, so check the script directly.
            let expected_sig = Builder::new().push_int(height as i64).push_opcode(opcodes::OP_0).into_script();
            assert_eq!(block.txdata[0].input[0].script_sig, expected_sig);
            if height > 16 {
                assert_eq!(block.bip34_block_height(), Ok(height));
            }
            assert_eq!(block.txdata[0].output[0].value, Amount::from_int_btc(50));
        }
        assert_eq!(chain.tip_height(), 20);
        assert!(chain.tip().median_time < chain.tip().block.header.time);
    }

    #[test]
    #[should_panic(expected = "is already in the active chain")]
    fn a_transaction_cannot_be_mined_twice_on_one_chain() {
        let keys = Keys::new();
        let mut chain = Chain::new(keys.coinbase_script().clone());
        let payment = keys.payment(0, &[(keys.address(crate::btcsim::AddrKind::P2pkh, 0), Amount::ONE_SAT)]);
        chain.mine(std::slice::from_ref(&payment));
        chain.mine(&[payment]);
    }

    #[test]
    fn coinbases_follow_the_halving_schedule() {
        let mut chain = chain();
        for _ in 0..150 {
            chain.mine(&[]);
        }
        assert_eq!(chain.tip().block.txdata[0].output[0].value, Amount::from_int_btc(25));
        assert_eq!(
            chain.entry(&chain.active_hash(149).unwrap()).unwrap().block.txdata[0].output[0].value,
            Amount::from_int_btc(50)
        );
    }

    #[test]
    fn subsidy_halves_every_150_blocks() {
        assert_eq!(subsidy(149), Amount::from_int_btc(50));
        assert_eq!(subsidy(150), Amount::from_int_btc(25));
        assert_eq!(subsidy(300), Amount::from_sat(1_250_000_000));
        assert_eq!(subsidy(150 * 64), Amount::ZERO);
    }
}
