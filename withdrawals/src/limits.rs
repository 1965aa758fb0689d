//! Withdrawal limits per asset: above `approval_limit` a withdrawal waits for
//! `approvals_required` distinct approvers (none of them its requester); past `daily_limit`, the
//! rolling 24-hour total per account, it waits too. The CLI and the API set them through [`set`],
//! which records the change as an operator action with its principal.

use alloy_primitives::U256;
use custodian_store::operator::{self, Action};
use serde::Serialize;

/// The most approvers a limit may require (the table checks the same).
pub const MAX_APPROVALS: u32 = 16;

/// An asset's limits as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Asset key.
    pub asset: String,
    /// Above this amount a withdrawal needs approval (smallest units); none means never.
    pub approval_limit: Option<U256>,
    /// Distinct approvers such a withdrawal needs.
    pub approvals_required: u32,
    /// Rolling 24-hour total per account (smallest units); none means unlimited.
    pub daily_limit: Option<U256>,
}

/// What to change; `None` leaves a field as it is, `Some(None)` removes a limit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LimitChange {
    /// The approval limit.
    pub approval_limit: Option<Option<U256>>,
    /// Distinct approvers (1 to [`MAX_APPROVALS`]).
    pub approvals_required: Option<u32>,
    /// The daily limit.
    pub daily_limit: Option<Option<U256>>,
}

/// Why limits were not changed. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// No such asset.
    #[error("unknown asset {0:?}")]
    UnknownAsset(String),
    /// Nothing to change, or an approver count out of range.
    #[error("{0}")]
    Invalid(String),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

const UPDATE_LIMITS: &str = "
update asset
   set approval_limit = case when $2 then $3 else approval_limit end,
       approvals_required = coalesce($4, approvals_required),
       daily_limit = case when $5 then $6 else daily_limit end
 where asset = $1
returning approval_limit, approvals_required, daily_limit";

/// Applies `change` to `asset`'s limits on `by`'s authority and returns them as they are now.
///
/// # Cancel safety
/// One transaction; cancelled, it changes nothing.
pub async fn set(
    client: &mut deadpool_postgres::Object,
    asset: &str,
    change: &LimitChange,
    by: &str,
) -> Result<Limits, LimitError> {
    if *change == LimitChange::default() {
        return Err(LimitError::Invalid("nothing to change: give --amount, --approvals or --daily".into()));
    }
    if let Some(n) = change.approvals_required.filter(|n| !(1..=MAX_APPROVALS).contains(n)) {
        return Err(LimitError::Invalid(format!("--approvals must be 1 to {MAX_APPROVALS}, not {n}")));
    }
    let approvals = change.approvals_required.map(|n| i16::try_from(n).expect("BUG: approvals checked above"));
    let tx = client.transaction().await?;
    let row = tx
        .query_opt(
            UPDATE_LIMITS,
            &[
                &asset,
                &change.approval_limit.is_some(),
                &change.approval_limit.flatten(),
                &approvals,
                &change.daily_limit.is_some(),
                &change.daily_limit.flatten(),
            ],
        )
        .await?
        .ok_or_else(|| LimitError::UnknownAsset(asset.to_owned()))?;
    let limits = Limits {
        asset: asset.to_owned(),
        approval_limit: row.get(0),
        approvals_required: u32::try_from(row.get::<_, i16>(1)).expect("BUG: approvals_required is checked positive"),
        daily_limit: row.get(2),
    };
    let details = serde_json::json!({
        "asset": asset,
        "approval_limit": limits.approval_limit.map(|v| v.to_string()),
        "approvals_required": limits.approvals_required,
        "daily_limit": limits.daily_limit.map(|v| v.to_string()),
    });
    operator::record(&tx, Action::LimitSet, by, &details).await?;
    tx.commit().await?;
    Ok(limits)
}
