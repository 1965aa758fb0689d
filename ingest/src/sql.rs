//! The queries the scanner owns: cursor, our canonical chain, the watched set, and the ingest of a
//! batch (the reorg queries live in `reorg.rs`). Each function documents which transaction it expects to run in.

use std::collections::{HashMap, HashSet};

use custodian_domain::{Asset, BlockHash, Chain, ChainAddress, EthAddress, TxHash};
use custodian_store::pipeline::{Params, Pipelined};
use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use crate::block::{DepositKind, FetchedBlock};
use crate::reader::ChainIdentity;

/// A deposit the scanner is about to record: a transfer to a watched address in a known asset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DepositRow {
    /// Block the transfer was observed in.
    pub block_hash: BlockHash,
    /// Transaction hash.
    pub tx_hash: TxHash,
    /// Where in the transaction the money was found.
    pub kind: DepositKind,
    /// Stable index within the transaction for that kind.
    pub output_index: u32,
    /// A BTC coinbase output.
    pub coinbase: bool,
    /// Watched recipient.
    pub address: ChainAddress,
    /// What moved.
    pub asset: Asset,
    /// Smallest units, as a decimal string for `numeric(78,0)`.
    pub amount: String,
}

/// What one batch ingest did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IngestOutcome {
    /// Blocks newly stored (already-known blocks are skipped).
    pub blocks_inserted: u64,
    /// Deposit observations newly stored.
    pub deposits_inserted: u64,
    /// Canonical blocks orphan-marked because the node now has another block at their height.
    pub orphaned: u64,
    /// Blocks orphaned earlier that the node's chain contains again.
    pub reinstated: u64,
}

/// Why a batch was not ingested. The transaction was rolled back; nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    /// Another scanner moved the cursor since we read it.
    #[error("{chain} cursor is at {found:?}, expected {expected}: another scanner is running")]
    CursorMoved {
        /// Chain.
        chain: Chain,
        /// Height this batch starts at.
        expected: u64,
        /// What the cursor says now.
        found: Option<u64>,
    },
    /// The first block's parent is not our canonical block below it: the node reorged.
    #[error("{chain} block {height} does not extend our block {ours} (its parent is {parent})")]
    ParentMismatch {
        /// Chain.
        chain: Chain,
        /// Height of the block that does not fit.
        height: u64,
        /// Its parent according to the node.
        parent: String,
        /// Our canonical block at `height - 1`.
        ours: String,
    },
    /// This scanner no longer holds the chain's lease (its session ended, another took over).
    #[error("{chain} scanner lease lost: another scanner may hold it now")]
    LeaseLost {
        /// Chain.
        chain: Chain,
    },
    /// The database failed.
    #[error("database error while ingesting {chain} blocks: {}", custodian_store::describe(source))]
    Database {
        /// Chain.
        chain: Chain,
        /// The error.
        source: tokio_postgres::Error,
    },
}

pub(crate) fn height_i64(height: u64) -> i64 {
    i64::try_from(height).expect("BUG: block height beyond i64")
}

pub(crate) fn height_u64(height: i64) -> u64 {
    u64::try_from(height).expect("BUG: negative height in the database (a check constraint forbids it)")
}

/// The cursor's next height, if the chain was ever scanned.
pub async fn cursor<C: GenericClient>(client: &C, chain: Chain) -> Result<Option<u64>, tokio_postgres::Error> {
    let row = client.query_opt("select next_height from scan_cursor where chain = $1", &[&chain.as_str()]).await?;
    Ok(row.map(|r| height_u64(r.get(0))))
}

/// Creates the cursor at `height` unless one exists; returns the cursor's value.
pub async fn init_cursor<C: GenericClient>(
    client: &C,
    chain: Chain,
    height: u64,
) -> Result<u64, tokio_postgres::Error> {
    client
        .execute(
            "insert into scan_cursor (chain, next_height) values ($1, $2) on conflict (chain) do nothing",
            &[&chain.as_str(), &height_i64(height)],
        )
        .await?;
    Ok(cursor(client, chain).await?.expect("BUG: cursor row vanished right after insert"))
}

/// Our tip: the highest non-orphaned block we hold, never the node's answer.
pub async fn our_tip<C: GenericClient>(
    client: &C,
    chain: Chain,
) -> Result<Option<(u64, String)>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "select height, block_hash from chain_block where chain = $1 and orphaned_at is null
             order by height desc limit 1",
            &[&chain.as_str()],
        )
        .await?;
    Ok(row.map(|r| (height_u64(r.get(0)), r.get(1))))
}

/// Every address ever assigned on `chain` (attribution to accounts happens later, by height), and
/// the BTC hot wallets' change addresses, which belong to no account: their outputs are our own
/// coins coming back, observed so they can be spent and reconciled, never credited.
pub async fn watched_addresses<C: GenericClient>(
    client: &C,
    chain: Chain,
) -> Result<HashSet<ChainAddress>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select address from wallet_address where chain = $1
             union select address from btc_change_address where chain = $1",
            &[&chain.as_str()],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| ChainAddress::parse_stored(r.get(0)).expect("BUG: wallet_address.address is checked by the table"))
        .collect())
}

/// Registered ERC-20 contracts and their assets.
pub async fn registered_tokens<C: GenericClient>(
    client: &C,
) -> Result<HashMap<EthAddress, Asset>, tokio_postgres::Error> {
    let rows =
        client.query("select contract, asset from asset where chain = 'eth' and contract is not null", &[]).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let contract = EthAddress::parse(r.get(0)).expect("BUG: asset.contract is checked by the table");
            (contract, Asset::parse_key(r.get(1)).expect("BUG: asset.asset is checked by the table"))
        })
        .collect())
}

pub(crate) const LOCK_CURSOR: &str = "select next_height from scan_cursor where chain = $1 for update";

const INSERT_BLOCKS: &str = "
insert into chain_block (chain, height, block_hash, parent_hash)
select $1, n.height, n.block_hash, n.parent_hash
  from unnest($2::bigint[], $3::text[], $4::text[]) as n(height, block_hash, parent_hash)
on conflict (chain, block_hash) do nothing";

/// The cursor (locked), our canonical block just below the batch ($2, null below height 0), and
/// whether this session's lease ($3, $4, held by backend $5) is still held, in one statement.
const OPEN_BATCH: &str = "
with cursor as (select next_height from scan_cursor where chain = $1 for update)
select (select next_height from cursor),
       (select block_hash from chain_block where chain = $1 and height = $2 and orphaned_at is null),
       exists (select 1 from pg_locks l
                where l.locktype = 'advisory' and l.classid = $3::int::oid and l.objid = $4::int::oid
                  and l.objsubid = 2 and l.pid = $5 and l.granted)";

const INSERT_RAW: &str = "
insert into raw_block (chain, block_hash, payload)
select $1, n.block_hash, n.payload from unnest($2::text[], $3::bytea[]) as n(block_hash, payload)
on conflict (chain, block_hash) do nothing";

const INSERT_DEPOSITS: &str = "
insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, coinbase, address, asset, amount)
select $1, n.block_hash, n.tx_hash, n.kind, n.output_index, n.coinbase, n.address, n.asset, n.amount::numeric(78,0)
  from unnest($2::text[], $3::text[], $4::text[], $5::int[], $6::bool[], $7::text[], $8::text[], $9::text[])
       as n(block_hash, tx_hash, kind, output_index, coinbase, address, asset, amount)
on conflict (chain, tx_hash, kind, output_index, block_hash) do nothing";

/// The spends of outputs we hold (stored as observations, in this batch or before), keyed by
/// the spent output and the block: $1 chain, $2..$6 the batch's inputs.
const INSERT_SPENDS: &str = "
insert into output_spend (chain, tx_hash, output_index, spending_tx, input_index, block_hash)
select $1, s.prev_tx, s.prev_vout, s.spending_tx, s.input_index, s.block_hash
  from unnest($2::text[], $3::int[], $4::text[], $5::int[], $6::text[])
       as s(prev_tx, prev_vout, spending_tx, input_index, block_hash)
 where exists (select 1 from deposit_event d
                where d.chain = $1 and d.tx_hash = s.prev_tx and d.kind = 'output' and d.output_index = s.prev_vout)
on conflict (chain, tx_hash, output_index, block_hash) do nothing";

/// Every input of `blocks` as the column arrays `INSERT_SPENDS` takes.
struct SpendColumns {
    prev_txs: Vec<String>,
    prev_vouts: Vec<i32>,
    spending: Vec<String>,
    inputs: Vec<i32>,
    blocks: Vec<String>,
}

impl SpendColumns {
    fn new(blocks: &[FetchedBlock]) -> Self {
        let mut columns =
            SpendColumns { prev_txs: vec![], prev_vouts: vec![], spending: vec![], inputs: vec![], blocks: vec![] };
        for block in blocks {
            for spend in &block.spends {
                columns.prev_txs.push(spend.prev_tx.to_string());
                columns.prev_vouts.push(i32::try_from(spend.prev_vout).expect("BUG: vout beyond i32"));
                columns.spending.push(spend.tx_hash.to_string());
                columns.inputs.push(i32::try_from(spend.input_index).expect("BUG: input index beyond i32"));
                columns.blocks.push(block.hash.to_string());
            }
        }
        columns
    }

    fn is_empty(&self) -> bool {
        self.prev_txs.is_empty()
    }

    fn params<'p>(&'p self, chain: &'p &'p str) -> [&'p (dyn ToSql + Sync); 6] {
        [chain, &self.prev_txs, &self.prev_vouts, &self.spending, &self.inputs, &self.blocks]
    }
}

/// Inserts re-derived spends of outputs we hold; existing ones are left as they are.
pub async fn insert_spends<C: GenericClient>(
    client: &C,
    chain: Chain,
    blocks: &[FetchedBlock],
) -> Result<u64, tokio_postgres::Error> {
    let columns = SpendColumns::new(blocks);
    if columns.is_empty() {
        return Ok(0);
    }
    let name = chain.as_str();
    client.execute(INSERT_SPENDS, &columns.params(&name)).await
}

pub(crate) const ADVANCE_CURSOR: &str = "update scan_cursor set next_height = $2, updated_at = now() where chain = $1";

/// Deletes retained payloads of blocks below `$2`: the only deletion in the system.
const PRUNE_RAW: &str = "
delete from raw_block r using chain_block b
 where r.chain = $1 and b.chain = r.chain and b.block_hash = r.block_hash and b.height < $2";

/// Stores `blocks` (consecutive, each the parent of the next) and their deposits, advances the
/// cursor past them and prunes payloads older than `retention_blocks`, all in one transaction.
///
/// Two round trips ([`Pipelined`]): the cursor lock and checks, then every write with the commit.
///
/// # Cancel safety
/// Everything happens in one transaction; a cancelled call rolls back, writes nothing and closes
/// the connection rather than pooling it.
pub async fn ingest_batch(
    client: deadpool_postgres::Object,
    chain: Chain,
    lease: LeaseId,
    blocks: &[FetchedBlock],
    deposits: &[DepositRow],
    retention_blocks: u64,
) -> Result<IngestOutcome, IngestError> {
    let db = |source| IngestError::Database { chain, source };
    let (Some(first), Some(last)) = (blocks.first(), blocks.last()) else { return Ok(IngestOutcome::default()) };
    let name = chain.as_str();
    let heights: Vec<i64> = blocks.iter().map(|b| height_i64(b.height)).collect();
    let hashes: Vec<String> = blocks.iter().map(|b| b.hash.to_string()).collect();
    let parents: Vec<String> = blocks.iter().map(|b| b.parent_hash.to_string()).collect();
    let payloads: Vec<&[u8]> = blocks.iter().map(|b| b.payload.as_slice()).collect();
    let columns = DepositColumns::new(deposits);
    let deposit_params = columns.params(&name);
    let spend_columns = SpendColumns::new(blocks);
    let spend_params = spend_columns.params(&name);
    let below: Option<i64> = first.height.checked_sub(1).map(height_i64);
    let next_height = height_i64(last.height + 1);
    let horizon: Option<i64> = last.height.checked_sub(retention_blocks).map(height_i64);

    // Prepared once per connection: no statement costs a round trip of its own after the first.
    let (open, orphan, reinstate, insert_blocks, insert_raw, insert_deposits, insert_spends, advance, prune) =
        futures::try_join!(
            client.prepare_cached(OPEN_BATCH),
            client.prepare_cached(crate::reorg::ORPHAN_REPLACED),
            client.prepare_cached(crate::reorg::REINSTATE),
            client.prepare_cached(INSERT_BLOCKS),
            client.prepare_cached(INSERT_RAW),
            client.prepare_cached(INSERT_DEPOSITS),
            client.prepare_cached(INSERT_SPENDS),
            client.prepare_cached(ADVANCE_CURSOR),
            client.prepare_cached(PRUNE_RAW),
        )
        .map_err(db)?;

    // First round trip: BEGIN, the cursor lock and the checks.
    let (class, object) = lease.key();
    let (tx, rows) =
        Pipelined::begin_with(client, &open, &[&name, &below, &class, &object, &lease.pid]).await.map_err(db)?;
    let row = rows.first().expect("BUG: a scalar select returned no row");
    let found = row.get::<_, Option<i64>>(0).map(height_u64);
    let ours: Option<String> = row.get(1);
    let leased: bool = row.get(2);
    let refused = if !leased {
        Some(IngestError::LeaseLost { chain })
    } else if found != Some(first.height) {
        Some(IngestError::CursorMoved { chain, expected: first.height, found })
    } else {
        let parent = first.parent_hash.to_string();
        ours.filter(|ours| *ours != parent).map(|ours| IngestError::ParentMismatch {
            chain,
            height: first.height,
            parent,
            ours,
        })
    };
    if let Some(refused) = refused {
        tx.rollback().await.map_err(db)?;
        return Err(refused);
    }

    // Second round trip: every write and COMMIT.
    let orphan_reason = format!("the node's chain has another block at this height (batch from {})", first.height);
    let reinstate_reason = format!("the node's chain contains this block again (batch from {})", first.height);
    let orphan_params: [&(dyn ToSql + Sync); 4] = [&name, &heights, &hashes, &orphan_reason];
    let reinstate_params: [&(dyn ToSql + Sync); 3] = [&name, &hashes, &reinstate_reason];
    let block_params: [&(dyn ToSql + Sync); 4] = [&name, &heights, &hashes, &parents];
    let raw_params: [&(dyn ToSql + Sync); 3] = [&name, &hashes, &payloads];
    let advance_params: [&(dyn ToSql + Sync); 2] = [&name, &next_height];
    let prune_params: [&(dyn ToSql + Sync); 2] = [&name, &horizon];
    let mut writes: Vec<(&tokio_postgres::Statement, Params<'_>)> = vec![
        (&orphan, &orphan_params),
        (&reinstate, &reinstate_params),
        (&insert_blocks, &block_params),
        (&insert_raw, &raw_params),
        (&insert_deposits, &deposit_params),
    ];
    // After the deposits, so a coin received and spent within one batch is recorded spent.
    if !spend_columns.is_empty() {
        writes.push((&insert_spends, &spend_params));
    }
    writes.push((&advance, &advance_params));
    if horizon.is_some() {
        writes.push((&prune, &prune_params));
    }
    let affected = tx.commit_with(&writes).await.map_err(db)?;
    Ok(IngestOutcome {
        orphaned: affected[0],
        reinstated: affected[1],
        blocks_inserted: affected[2],
        deposits_inserted: affected[4],
    })
}

/// Identifies a held scanner lease: the chain and the backend holding the session lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseId {
    /// The chain leased.
    pub chain: Chain,
    /// `pg_backend_pid()` of the session holding the lock.
    pub pid: i32,
}

/// First key of the scanner lease's advisory lock ("sc").
pub const LEASE_CLASS: i32 = 0x7363;

impl LeaseId {
    /// The advisory lock's two keys.
    pub fn key(self) -> (i32, i32) {
        (LEASE_CLASS, lease_object(self.chain))
    }
}

/// Second key of a chain's lease.
pub fn lease_object(chain: Chain) -> i32 {
    match chain {
        Chain::Eth => 1,
        Chain::Btc => 2,
    }
}

/// The backend holding `chain`'s lease, if any.
pub async fn lease_holder<C: GenericClient>(client: &C, chain: Chain) -> Result<Option<i32>, tokio_postgres::Error> {
    let row = client
        .query_opt(
            "select pid from pg_locks
              where locktype = 'advisory' and classid = $1::int::oid and objid = $2::int::oid and objsubid = 2
                and granted and database = (select oid from pg_database where datname = current_database())
              limit 1",
            &[&LEASE_CLASS, &lease_object(chain)],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// The identity recorded for `chain`, if it was ever scanned.
pub async fn chain_identity<C: GenericClient>(
    client: &C,
    chain: Chain,
) -> Result<Option<ChainIdentity>, tokio_postgres::Error> {
    let row = client
        .query_opt("select network, genesis_hash, chain_id from chain_identity where chain = $1", &[&chain.as_str()])
        .await?;
    Ok(row.map(|r| ChainIdentity {
        network: r.get(0),
        genesis_hash: r.get(1),
        chain_id: r.get::<_, Option<i64>>(2).map(|id| u64::try_from(id).expect("BUG: a check keeps chain_id positive")),
    }))
}

/// Records `identity` for `chain` unless one is recorded; returns what is recorded now.
pub async fn record_identity<C: GenericClient>(
    client: &C,
    chain: Chain,
    identity: &ChainIdentity,
) -> Result<ChainIdentity, tokio_postgres::Error> {
    let chain_id = identity.chain_id.map(|id| i64::try_from(id).unwrap_or(i64::MAX));
    client
        .execute(
            "insert into chain_identity (chain, network, genesis_hash, chain_id) values ($1, $2, $3, $4)
             on conflict (chain) do nothing",
            &[&chain.as_str(), &identity.network, &identity.genesis_hash, &chain_id],
        )
        .await?;
    Ok(chain_identity(client, chain).await?.expect("BUG: the identity row vanished right after insert"))
}

/// Why a rewind was refused.
#[derive(Debug, thiserror::Error)]
pub enum RewindError {
    /// The chain was never scanned.
    #[error("{0} has never been scanned: nothing to rewind")]
    NeverScanned(Chain),
    /// Rewinding forward would skip blocks.
    #[error("{chain} cannot be rewound to {to}: the cursor is at {cursor} (our tip is {})", tip.map_or("none".to_owned(), |t| t.to_string()))]
    AboveTip {
        /// Chain.
        chain: Chain,
        /// Requested height.
        to: u64,
        /// Our tip.
        tip: Option<u64>,
        /// The cursor.
        cursor: u64,
    },
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Moves the cursor back to `to_height` so the next scan re-reads from there. Nothing is deleted
/// or orphaned: re-ingesting a block we hold is a no-op.
pub async fn rewind(client: &mut deadpool_postgres::Object, chain: Chain, to_height: u64) -> Result<u64, RewindError> {
    let name = chain.as_str();
    let tx = client.transaction().await?;
    let Some(row) = tx.query_opt(LOCK_CURSOR, &[&name]).await? else { return Err(RewindError::NeverScanned(chain)) };
    let cursor = height_u64(row.get(0));
    if to_height > cursor {
        let tip = our_tip(&tx, chain).await?.map(|(h, _)| h);
        return Err(RewindError::AboveTip { chain, to: to_height, tip, cursor });
    }
    tx.execute(ADVANCE_CURSOR, &[&name, &height_i64(to_height)]).await?;
    tx.commit().await?;
    Ok(cursor)
}

/// Canonical blocks from `from_height` up with their retained payloads, in height order, at most
/// `limit` starting at `from_height`.
pub async fn retained_blocks<C: GenericClient>(
    client: &C,
    chain: Chain,
    from_height: u64,
    limit: u64,
) -> Result<Vec<(u64, String, Vec<u8>)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select b.height, b.block_hash, r.payload from chain_block b
               join raw_block r on r.chain = b.chain and r.block_hash = b.block_hash
              where b.chain = $1 and b.orphaned_at is null and b.height >= $2
              order by b.height limit $3",
            &[&chain.as_str(), &height_i64(from_height), &height_i64(limit)],
        )
        .await?;
    Ok(rows.iter().map(|r| (height_u64(r.get(0)), r.get(1), r.get(2))).collect())
}

/// Inserts re-derived deposit observations; existing ones are left as they are.
pub async fn insert_deposits<C: GenericClient>(
    client: &C,
    chain: Chain,
    deposits: &[DepositRow],
) -> Result<u64, tokio_postgres::Error> {
    if deposits.is_empty() {
        return Ok(0);
    }
    let name = chain.as_str();
    let columns = DepositColumns::new(deposits);
    client.execute(INSERT_DEPOSITS, &columns.params(&name)).await
}

/// Deposit rows as the column arrays `INSERT_DEPOSITS` takes.
struct DepositColumns<'a> {
    block_hashes: Vec<String>,
    tx_hashes: Vec<String>,
    kinds: Vec<&'static str>,
    indexes: Vec<i32>,
    coinbases: Vec<bool>,
    addresses: Vec<String>,
    assets: Vec<String>,
    amounts: Vec<&'a str>,
}

impl<'a> DepositColumns<'a> {
    fn new(deposits: &'a [DepositRow]) -> Self {
        let stored = |f: fn(&DepositRow) -> String| deposits.iter().map(f).collect::<Vec<_>>();
        DepositColumns {
            block_hashes: stored(|d| d.block_hash.to_string()),
            tx_hashes: stored(|d| d.tx_hash.to_string()),
            kinds: deposits.iter().map(|d| d.kind.as_str()).collect(),
            coinbases: deposits.iter().map(|d| d.coinbase).collect(),
            indexes: deposits
                .iter()
                .map(|d| i32::try_from(d.output_index).expect("BUG: output index beyond i32"))
                .collect(),
            addresses: stored(|d| d.address.stored()),
            assets: stored(|d| d.asset.key()),
            amounts: deposits.iter().map(|d| d.amount.as_str()).collect(),
        }
    }

    /// The statement's parameters, the chain's name first.
    fn params<'p>(&'p self, chain: &'p &'p str) -> [&'p (dyn ToSql + Sync); 9] {
        [
            chain,
            &self.block_hashes,
            &self.tx_hashes,
            &self.kinds,
            &self.indexes,
            &self.coinbases,
            &self.addresses,
            &self.assets,
            &self.amounts,
        ]
    }
}
