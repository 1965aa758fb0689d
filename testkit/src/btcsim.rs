//! A stand-in for Bitcoin Core in tests: an HTTP JSON-RPC server on 127.0.0.1 that serves real
//! regtest blocks built with the `bitcoin` crate and answers the methods Custodian uses as
//! Bitcoin Core (v28–v29) does — same JSON shapes, error codes, messages and HTTP statuses.
//!
//! Served: `getblockcount`, `getbestblockhash`, `getblockhash`, `getblock` (verbosity 0 and 1,
//! or a boolean), `getblockheader`, `getblockchaininfo`, and a mempool: `sendrawtransaction`,
//! `testmempoolaccept` (one transaction), `getrawmempool` (not verbose), `getmempoolentry`,
//! `estimatesmartfee` (what the test set); anything else is -32601 "Method not found". The
//! mempool accepts as Core 28 does with default policy — inputs from the active chain's UTXO set
//! or the mempool, coinbase maturity, value, dust, minimum relay fee, full replace-by-fee with
//! Core's fee rules — and verifies every input script with Bitcoin Core's own interpreter
//! (`bitcoinconsensus`), refusing with Core's codes and reasons. Blocks take what waits with
//! [`BitcoinSim::mine_mempool`]; a reorg offers the abandoned blocks' transactions back to it. Legacy JSON-RPC (HTTP 500/404/400 on errors), JSON-RPC 2.0 (HTTP 200, 204 for
//! notifications), batches, named arguments, Basic auth by user/password or `.cookie`.
//!
//! What is real: every block is a valid regtest block on the real regtest genesis (BIP34
//! coinbase, subsidy, a witness commitment in every block as Core's miner writes one, merkle
//! root, proof of work against `0x207fffff`); every payment is a consensus-encoded version-2
//! transaction whose P2WPKH input carries a valid BIP143 ECDSA signature by the simulator's key. What is simulated: each [`BitcoinSim::pay`]
//! payment spends a fabricated outpoint (a txid derived from a counter) that no block created,
//! and coinbases claim the subsidy only, since the fabricated inputs' fees are unknown. Blocks
//! are stamped genesis time + n for the n-th block mined, so runs are reproducible.
//!
//! Not served as Core does: `getblock` verbosity 2 and 3 (an error, -8); a wrong argument count
//! carries the first paragraphs of Core's help text rather than all of it.

mod chain;
mod http;
mod keys;
mod mempool;
mod rpc;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use bitcoin::hashes::{sha256, Hash};
use bitcoin::hex::DisplayHex;
use bitcoin::{Address, Amount, Block, BlockHash, Transaction};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use chain::Chain;
pub use keys::AddrKind;
use keys::Keys;

/// The fixed RPC user name (`-rpcuser`).
const RPC_USER: &str = "custodian";
/// The fixed RPC password (`-rpcpassword`).
const RPC_PASSWORD: &str = "simulator";
/// The user name of cookie authentication, as Bitcoin Core writes it.
const COOKIE_USER: &str = "__cookie__";

/// A running simulated Bitcoin Core node on regtest. Dropping it stops the server (open
/// connections included) and removes its cookie file.
pub struct BitcoinSim {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
    cookie_file: PathBuf,
    server: JoinHandle<()>,
}

/// State shared by the test API and the server's connection tasks.
struct Shared {
    chain: Mutex<Chain>,
    keys: Keys,
    unavailable: AtomicBool,
    calls: AtomicU64,
    /// Connections and requests dropped unanswered during an outage.
    refused: AtomicU64,
    /// The `user:password` pairs Basic auth accepts.
    credentials: [String; 2],
    /// What `estimatesmartfee` answers, sat/kvB (`None`: "Insufficient data").
    fee_rate: Mutex<Option<u64>>,
}

impl Shared {
    /// Locks the chain. A panic under the lock (the API's checks run before any change) leaves
    /// the chain consistent, so a poisoned lock is still used.
    fn chain(&self) -> MutexGuard<'_, Chain> {
        self.chain.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn fee_rate(&self) -> Option<u64> {
        *self.fee_rate.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn is_unavailable(&self) -> bool {
        self.unavailable.load(Ordering::SeqCst)
    }

    fn count_refused(&self) {
        self.refused.fetch_add(1, Ordering::SeqCst);
    }

    fn count_call(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }

    /// Bitcoin Core's `RPCAuthorized`: `Basic `, then base64 of `user:password`, trimmed.
    fn authorized(&self, authorization: &str) -> bool {
        let Some(encoded) = authorization.strip_prefix("Basic ") else { return false };
        let Some(decoded) = http::base64_decode(encoded.trim()) else { return false };
        self.credentials.iter().any(|credential| credential.as_bytes() == decoded)
    }
}

impl BitcoinSim {
    /// Starts a regtest node holding only the genesis block, listening on an ephemeral port of
    /// 127.0.0.1 inside the caller's tokio runtime.
    ///
    /// # Panics
    /// If the listener cannot be bound or the cookie file cannot be written.
    pub async fn start() -> BitcoinSim {
        let listener = TcpListener::bind(("127.0.0.1", 0)).await.expect("binding the Bitcoin simulator to 127.0.0.1");
        let local_addr = listener.local_addr().expect("the Bitcoin simulator's listening address");
        let cookie_password = cookie_password(local_addr.port());
        let cookie_file = write_cookie_file(local_addr.port(), &cookie_password);
        let keys = Keys::new();
        let shared = Arc::new(Shared {
            chain: Mutex::new(Chain::new(keys.coinbase_script().clone())),
            keys,
            unavailable: AtomicBool::new(false),
            refused: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            credentials: [format!("{RPC_USER}:{RPC_PASSWORD}"), format!("{COOKIE_USER}:{cookie_password}")],
            fee_rate: Mutex::new(None),
        });
        let server = tokio::spawn(http::serve(listener, Arc::clone(&shared)));
        BitcoinSim { shared, local_addr, cookie_file, server }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.local_addr)
    }

    /// The listening port.
    pub fn port(&self) -> u16 {
        self.local_addr.port()
    }

    /// The RPC user name.
    pub fn user(&self) -> &str {
        RPC_USER
    }

    /// The RPC password.
    pub fn password(&self) -> &str {
        RPC_PASSWORD
    }

    /// A Bitcoin Core style cookie file (`__cookie__:<64 hex digits>`); its credentials are
    /// accepted as well as [`user`](Self::user)/[`password`](Self::password).
    pub fn cookie_file(&self) -> &Path {
        &self.cookie_file
    }

    /// Builds (does not mine) a signed transaction paying exactly `outputs`, in order (vout =
    /// index), and nothing else. Its one input spends a fabricated outpoint (see the module
    /// docs); each call spends a different one, so two calls never share a txid.
    ///
    /// # Panics
    /// If `outputs` is empty or adds up to more than 21 million BTC.
    pub fn pay(&self, outputs: &[(Address, Amount)]) -> Transaction {
        let serial = self.shared.chain().next_payment_serial();
        self.shared.keys.payment(serial, outputs)
    }

    /// Builds (does not send) a transaction spending `coins` — outputs to
    /// `address(AddrKind::P2wpkh, index)`, with their values — to `outputs`, signed by that
    /// address's key.
    pub fn spend_p2wpkh(
        &self,
        index: u32,
        coins: &[(bitcoin::OutPoint, Amount)],
        outputs: &[(Address, Amount)],
    ) -> Transaction {
        self.shared.keys.spend_p2wpkh(index, coins, outputs)
    }

    /// Mines one block on the active tip with `txs` after the coinbase; returns its hash.
    ///
    /// # Panics
    /// If `txs` repeats a transaction, holds a coinbase, or holds one already in the active chain.
    pub fn mine(&self, txs: &[Transaction]) -> BlockHash {
        self.shared.chain().mine(txs)
    }

    /// Mines one block holding every transaction waiting in the mempool (parents first).
    pub fn mine_mempool(&self) -> BlockHash {
        self.shared.chain().mine_mempool()
    }

    /// The txids waiting in the mempool, in the order they were accepted.
    pub fn mempool(&self) -> Vec<bitcoin::Txid> {
        self.shared.chain().mempool.in_order().iter().map(Transaction::compute_txid).collect()
    }

    /// Evicts `txid` from the mempool (as a node restart or a full mempool does); whether it
    /// was there.
    pub fn evict(&self, txid: bitcoin::Txid) -> bool {
        self.shared.chain().mempool.remove(&txid).is_some()
    }

    /// Sets what `estimatesmartfee` answers, in sat/vB (`None`: no estimate).
    pub fn set_fee_rate(&self, sat_per_vb: Option<u64>) {
        *self.shared.fee_rate.lock().unwrap_or_else(PoisonError::into_inner) = sat_per_vb.map(|r| r * 1000);
    }

    /// The active chain's unspent output at `outpoint`, if any.
    pub fn utxo(&self, outpoint: bitcoin::OutPoint) -> Option<bitcoin::TxOut> {
        self.shared.chain().utxos().remove(&outpoint).map(|coin| coin.txout)
    }

    /// Mines `n` blocks holding only their coinbase.
    pub fn mine_empty(&self, n: usize) -> Vec<BlockHash> {
        let mut chain = self.shared.chain();
        (0..n).map(|_| chain.mine(&[])).collect()
    }

    /// Abandons the top `depth` blocks — they stay known as stale blocks, served with
    /// confirmations -1 — and mines one block per entry of `replacement` (with those
    /// transactions) on the block at height tip − `depth`. Replacement blocks always differ from
    /// the blocks they replace (later timestamps), even with the same transactions.
    ///
    /// # Panics
    /// Unless `replacement.len() > depth` (Bitcoin Core only switches to a branch with more
    /// work) and `depth` ≤ the height; or if a block's transactions are invalid as for [`mine`](Self::mine).
    pub fn reorg(&self, depth: usize, replacement: &[Vec<Transaction>]) -> Vec<BlockHash> {
        self.shared.chain().reorg(depth, replacement)
    }

    /// Mines one block per entry of `blocks` on `parent`, any known block (a stale one too);
    /// the branch becomes the active chain when it ends with more work, as in Bitcoin Core, and
    /// blocks abandoned by an earlier reorg come back (a flip-back).
    pub fn mine_branch(&self, parent: BlockHash, blocks: &[Vec<Transaction>]) -> Vec<BlockHash> {
        self.shared.chain().mine_branch(parent, blocks)
    }

    /// Mines one block on the active tip whose coinbase pays `address` its subsidy.
    pub fn mine_coinbase_to(&self, address: &Address, txs: &[Transaction]) -> BlockHash {
        self.shared.chain().mine_coinbase_to(&address.script_pubkey(), txs)
    }

    /// The active tip's height.
    pub fn height(&self) -> u64 {
        self.shared.chain().tip_height()
    }

    /// The active chain's block at `height`.
    pub fn block_hash(&self, height: u64) -> Option<BlockHash> {
        self.shared.chain().active_hash(height)
    }

    /// Any known block, active or stale.
    pub fn block(&self, hash: BlockHash) -> Option<Block> {
        self.shared.chain().entry(&hash).map(|entry| Block::clone(&entry.block))
    }

    /// While true, the node is down: new connections are closed on accept and connections kept
    /// alive are closed when their next request arrives, unanswered.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.shared.unavailable.store(unavailable, Ordering::SeqCst);
    }

    /// JSON-RPC requests served so far (each member of a batch counts; requests refused before
    /// JSON-RPC parsing — bad credentials, unparseable bodies — do not).
    pub fn call_count(&self) -> u64 {
        self.shared.calls.load(Ordering::SeqCst)
    }

    /// Connections and requests dropped unanswered while unavailable: how a test sees that a
    /// client kept trying through an outage.
    pub fn refused_count(&self) -> u64 {
        self.shared.refused.load(Ordering::SeqCst)
    }

    /// The deterministic regtest address of `kind` for fixed test key `index`.
    pub fn address(&self, kind: AddrKind, index: u32) -> Address {
        self.shared.keys.address(kind, index)
    }
}

impl Drop for BitcoinSim {
    fn drop(&mut self) {
        self.server.abort();
        // Best effort: a leftover file in the temporary directory harms nothing.
        let _ = std::fs::remove_file(&self.cookie_file);
        if let Some(dir) = self.cookie_file.parent() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A cookie password unique to this process, port and moment. Bitcoin Core's is random; this
/// only needs to differ between simulators.
fn cookie_password(port: u16) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |elapsed| elapsed.as_nanos());
    let seed = format!("custodian-btcsim/cookie/{}/{port}/{nanos}", std::process::id());
    sha256::Hash::hash(seed.as_bytes()).as_byte_array().to_lower_hex_string()
}

/// Writes `<tmp>/custodian-btcsim-<pid>-<port>/.cookie`, unique while the listener holds the port.
fn write_cookie_file(port: u16, password: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("custodian-btcsim-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the Bitcoin simulator's cookie directory");
    let path = dir.join(".cookie");
    std::fs::write(&path, format!("{COOKIE_USER}:{password}")).expect("writing the Bitcoin simulator's cookie file");
    path
}
