//! The history of every appended fact, in the order an auditor reads it.
//!
//! Only facts written by transactions older than the oldest still running are returned, ordered
//! by (transaction id, position): that prefix can no longer change, so resuming after a position
//! never skips or repeats a fact (see `migrations/V7__audit.sql`).

use deadpool_postgres::GenericClient;
use serde::Serialize;

/// Facts returned per call at most.
pub const MAX_PAGE: i64 = 10_000;

/// One fact.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Fact {
    /// Its position: pass it back as `after` to continue.
    pub position: i64,
    /// What kind of fact (`block`, `orphan_mark`, `deposit_observed`, `ledger_transfer`,
    /// `reversal_proposed`, `reversal_approved`, `reversal_rejected`, `withdrawal_<event>`).
    pub kind: String,
    /// When it was recorded.
    pub recorded_at: String,
    /// What it says.
    pub payload: serde_json::Value,
}

/// Why a page could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    /// The position given is not one the history has (yet).
    #[error("position {0} is not in the history")]
    UnknownPosition(i64),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

const PAGE: &str = "
with settled as (select pg_snapshot_xmin(pg_current_snapshot()) as horizon)
select e.position, e.kind, e.recorded_at::text, e.payload
  from audit_event e, settled
 where e.xid < settled.horizon
   and ($1::text is null or (e.xid, e.position) > ($1::text::xid8, $2::bigint))
 order by e.xid, e.position
 limit $3";

/// Up to `limit` facts after `after` (from the beginning when `None`).
pub async fn page<C: GenericClient>(client: &C, after: Option<i64>, limit: i64) -> Result<Vec<Fact>, HistoryError> {
    let anchor: Option<String> = match after {
        None => None,
        Some(position) => Some(
            client
                .query_opt("select xid::text from audit_event where position = $1", &[&position])
                .await?
                .ok_or(HistoryError::UnknownPosition(position))?
                .get(0),
        ),
    };
    let rows = client.query(PAGE, &[&anchor, &after.unwrap_or(0), &limit.clamp(1, MAX_PAGE)]).await?;
    Ok(rows
        .iter()
        .map(|r| Fact { position: r.get(0), kind: r.get(1), recorded_at: r.get(2), payload: r.get(3) })
        .collect())
}
