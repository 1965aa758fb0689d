//! Reorgs: how the scanner finds that the node's chain left ours, and what it does then. Nothing
//! is ever deleted: a block the node retracted gets an `orphaned` verdict (a trigger of `migrations/V2__chain_observations.sql` moves
//! `chain_block.orphaned_at`), and every observation in it — deposits, spends of our coins — drops
//! out of the canonical views by the same join; a block that comes back gets a `reinstated`
//! verdict. Postings follow in the posting pass (`projections::posting`), never here.
//!
//! Three ways a reorg shows:
//! - **A batch's first parent is not our block below it** (`Scanner::step`, through
//!   `sql::ingest_batch`): the walk-back ([`Scanner::reconcile`]) compares our canonical blocks
//!   with the node's, from our tip down, at most `retention_blocks` + 1 of them; orphans
//!   everything above the highest match and moves the cursor just above it, in one transaction
//!   under the scanner's lease ([`orphan_above`]). No match within the window stops the scanner
//!   (`ScanError::DeepReorg`) for an operator; a match at our own tip means the node contradicted
//!   itself (`ScanError::NodeInconsistent`), reported and backed off from, never spun on.
//! - **Caught up, but our tip's hash differs from the node's at that height** (a reorg that did
//!   not lengthen the chain): [`Scanner::check_tip`] starts the same walk-back.
//! - **A batch brings different blocks at heights we hold** (the node's chain replaced ours and
//!   the parent check passed below): the batch's own transaction orphans what it replaces
//!   ([`ORPHAN_REPLACED`]) and reinstates the blocks of ours it brings back ([`REINSTATE`]).
//!
//! Every node call happens before the one transaction that marks.

use custodian_domain::Chain;
use deadpool_postgres::GenericClient;

use crate::reader::ChainReader;
use crate::scanner::{ScanError, ScanReport, Scanner, Step};
use crate::sql::{self, IngestError, LeaseId};

impl<R: ChainReader> Scanner<R> {
    /// Caught up: a reorg that replaced our tip without lengthening the chain shows only as a
    /// different hash at our tip's height. A node that lacks that height (lagging, resyncing) says
    /// nothing about it and moves nothing.
    pub(crate) async fn check_tip(
        &self,
        lease: LeaseId,
        node_tip: u64,
        report: &mut ScanReport,
    ) -> Result<Step, ScanError> {
        let ours = sql::our_tip(&self.pool.get().await?, self.chain()).await?;
        self.record_lag(node_tip, ours.as_ref().map(|(h, _)| *h));
        let Some((our_tip, ours)) = ours else {
            return Ok(Step::CaughtUp);
        };
        if our_tip > node_tip {
            return Ok(Step::CaughtUp);
        }
        let theirs = self.with_retry("checking our tip", || self.reader.block_hash(our_tip)).await?;
        match theirs {
            Some(theirs) if theirs != ours => {
                self.reconcile(lease, our_tip + 1, report).await?;
                self.stepped().await;
                Ok(Step::Stored)
            }
            _ => Ok(Step::CaughtUp),
        }
    }

    /// Walks back from our tip comparing hashes with the node, orphan-marks what diverged and
    /// moves the cursor to just above the fork point, under the lease and only if our tip is
    /// still the one compared. All node calls happen before the one transaction that marks. A
    /// walk-back that finds our tip on the node's chain orphans nothing: the node contradicted
    /// itself, which is reported (and backed off from), never spun on.
    pub(crate) async fn reconcile(
        &self,
        lease: LeaseId,
        mismatch_height: u64,
        report: &mut ScanReport,
    ) -> Result<(), ScanError> {
        let chain = self.chain();
        let window = self.config.retention_blocks;
        let ours = canonical_desc(&self.pool.get().await?, chain, window + 1).await?;
        let Some((our_tip, tip_hash)) = ours.first().cloned() else { return Ok(()) };
        let mut fork = None;
        for (height, hash) in &ours {
            let theirs = self.with_retry("comparing block hashes", || self.reader.block_hash(*height)).await?;
            if theirs.as_deref() == Some(hash.as_str()) {
                fork = Some(*height);
                break;
            }
        }
        let lowest = ours.last().map_or(0, |(h, _)| *h);
        if fork.is_none() && ours.len() as u64 > window {
            return Err(ScanError::DeepReorg { chain, window, our_tip, lowest_checked: lowest });
        }
        if fork == Some(our_tip) {
            metrics::counter!("custodian_scanner_node_inconsistencies_total", "chain" => chain.as_str()).increment(1);
            return Err(ScanError::NodeInconsistent { chain, height: mismatch_height, below: our_tip });
        }
        // Everything we hold diverges but we hold less than the window: the fork is below our
        // first block, which is where scanning started.
        let fork_height = fork.or_else(|| lowest.checked_sub(1));
        let reason = format!(
            "reorg: the node's chain leaves ours above height {}",
            fork_height.map_or("-1".to_owned(), |h| h.to_string())
        );
        let orphaned =
            match orphan_above(&mut self.pool.get().await?, chain, lease, fork_height, &tip_hash, &reason).await? {
                Orphaned::Blocks(n) => n,
                Orphaned::TipMoved => {
                    tracing::warn!(%chain, "our tip moved during the walk-back; comparing again");
                    return Ok(());
                }
            };
        report.reorgs += 1;
        report.orphaned += orphaned;
        record_reorg(chain, orphaned);
        tracing::warn!(%chain, mismatch_height, fork_height = ?fork_height, orphaned,
            "reorg: orphan-marked {orphaned} blocks above the fork point; re-scanning from there");
        Ok(())
    }
}

pub(crate) fn record_reorg(chain: Chain, depth: u64) {
    metrics::counter!("custodian_reorgs_total", "chain" => chain.as_str()).increment(1);
    metrics::gauge!("custodian_reorg_last_depth_blocks", "chain" => chain.as_str()).set(depth as f64);
}

/// Our canonical blocks from the tip down, at most `limit` of them.
pub async fn canonical_desc<C: GenericClient>(
    client: &C,
    chain: Chain,
    limit: u64,
) -> Result<Vec<(u64, String)>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select height, block_hash from chain_block where chain = $1 and orphaned_at is null
             order by height desc limit $2",
            &[&chain.as_str(), &sql::height_i64(limit)],
        )
        .await?;
    Ok(rows.iter().map(|r| (sql::height_u64(r.get(0)), r.get(1))).collect())
}

/// Orphans canonical blocks at or above the first height where the batch brings a different
/// block, by appending an `orphaned` verdict to each (the verdict trigger moves `orphaned_at`).
/// Only reached after the parent check passed, so the batch extends our chain below it.
pub(crate) const ORPHAN_REPLACED: &str = "
insert into block_verdict (chain, block_hash, seq, verdict, reason)
select c.chain, c.block_hash, next_verdict_seq(c.chain, c.block_hash), 'orphaned', $4
  from chain_block c
 where c.chain = $1 and c.orphaned_at is null
   and c.height >= (select min(n.height)
                      from unnest($2::bigint[], $3::text[]) as n(height, block_hash)
                      join chain_block o on o.chain = $1 and o.height = n.height
                                        and o.orphaned_at is null and o.block_hash <> n.block_hash)";

/// Blocks of the batch we orphaned earlier are on the node's chain again: a `reinstated` verdict
/// each. Runs after [`ORPHAN_REPLACED`] has orphaned their rivals, so one block per height stays
/// canonical.
pub(crate) const REINSTATE: &str = "
insert into block_verdict (chain, block_hash, seq, verdict, reason)
select c.chain, c.block_hash, next_verdict_seq(c.chain, c.block_hash), 'reinstated', $3
  from chain_block c
 where c.chain = $1 and c.block_hash = any($2::text[]) and c.orphaned_at is not null";

/// What a walk-back's orphaning did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Orphaned {
    /// This many blocks were orphaned and the cursor moved to just above the fork.
    Blocks(u64),
    /// Our tip changed since the walk-back read it (another writer): nothing was written.
    TipMoved,
}

/// Orphans every canonical block above `fork_height` (an `orphaned` verdict each) and moves the
/// cursor to `fork_height + 1`, in one transaction, provided this session still holds the lease
/// and our tip is still `expected_tip`, the one the walk-back compared with the node.
///
/// # Cancel safety
/// One transaction; a cancelled call changes nothing.
pub async fn orphan_above(
    client: &mut deadpool_postgres::Object,
    chain: Chain,
    lease: LeaseId,
    fork_height: Option<u64>,
    expected_tip: &str,
    reason: &str,
) -> Result<Orphaned, IngestError> {
    let db = |source| IngestError::Database { chain, source };
    let name = chain.as_str();
    let tx = client.transaction().await.map_err(db)?;
    tx.query_opt(sql::LOCK_CURSOR, &[&name]).await.map_err(db)?;
    let (class, object) = lease.key();
    let leased: bool = tx
        .query_one(
            "select exists (select 1 from pg_locks l
                             where l.locktype = 'advisory' and l.classid = $1::int::oid and l.objid = $2::int::oid
                               and l.objsubid = 2 and l.pid = $3 and l.granted)",
            &[&class, &object, &lease.pid],
        )
        .await
        .map_err(db)?
        .get(0);
    if !leased {
        return Err(IngestError::LeaseLost { chain });
    }
    if sql::our_tip(&tx, chain).await.map_err(db)?.map(|(_, hash)| hash).as_deref() != Some(expected_tip) {
        return Ok(Orphaned::TipMoved);
    }
    let above = fork_height.map_or(-1, sql::height_i64);
    let orphaned = tx
        .execute(
            "insert into block_verdict (chain, block_hash, seq, verdict, reason)
             select c.chain, c.block_hash, next_verdict_seq(c.chain, c.block_hash), 'orphaned', $3
               from chain_block c where c.chain = $1 and c.orphaned_at is null and c.height > $2",
            &[&name, &above, &reason],
        )
        .await
        .map_err(db)?;
    tx.execute(sql::ADVANCE_CURSOR, &[&name, &(above + 1)]).await.map_err(db)?;
    tx.commit().await.map_err(db)?;
    Ok(Orphaned::Blocks(orphaned))
}
