//! What operators and clients do to a withdrawal after requesting it: approve and cancel.

use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent, WithdrawalState};
use custodian_domain::Amount;

use crate::sql::{self, Movement, StoreError};

/// Why an action was refused. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    /// No such withdrawal.
    #[error("no withdrawal {0}")]
    Unknown(i64),
    /// The action does not apply in the current state.
    #[error("withdrawal {id} is {state}: {message}")]
    WrongState {
        /// Withdrawal.
        id: i64,
        /// Its state.
        state: &'static str,
        /// What would be needed.
        message: &'static str,
    },
    /// A decision needs an authenticated principal.
    #[error("a decision needs the authenticated principal making it (an API token)")]
    Anonymous,
    /// Four eyes: the requester may not approve their own withdrawal.
    #[error("withdrawal {id} was requested by {by:?}, who may not approve it: another principal must")]
    SelfApproval {
        /// Withdrawal.
        id: i64,
        /// The requester, who tried to approve.
        by: String,
    },
    /// The database failed.
    #[error("database error: {0}")]
    Database(String),
}

impl From<tokio_postgres::Error> for ActionError {
    fn from(e: tokio_postgres::Error) -> Self {
        ActionError::Database(e.to_string())
    }
}

impl From<StoreError> for ActionError {
    fn from(e: StoreError) -> Self {
        ActionError::Database(e.to_string())
    }
}

/// Records `by`'s approval of a withdrawal waiting in `awaiting_approval`. It leaves that state
/// once as many distinct principals as its `awaiting_approval` event asks for have approved,
/// none of them its requester (refused with [`ActionError::SelfApproval`]). The same principal
/// approving again changes nothing (`false`).
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn approve(
    client: &mut deadpool_postgres::Object,
    id: i64,
    by: &str,
) -> Result<(Withdrawal, bool), ActionError> {
    let by = by.trim();
    if by.is_empty() {
        return Err(ActionError::Anonymous);
    }
    let tx = client.transaction().await?;
    let mut w = sql::lock(&tx, id).await?.ok_or(ActionError::Unknown(id))?;
    if w.requested_by == by {
        return Err(ActionError::SelfApproval { id, by: by.to_owned() });
    }
    if w.approvers.iter().any(|approver| approver == by) {
        return Ok((w, false));
    }
    if w.state != WithdrawalState::AwaitingApproval {
        let approved_before = sql::events(&tx, id).await?.iter().any(|e| matches!(e, WithdrawalEvent::Approved { .. }));
        if approved_before {
            return Ok((w, false));
        }
        return Err(ActionError::WrongState {
            id,
            state: w.state.as_str(),
            message: "only a withdrawal awaiting approval can be approved",
        });
    }
    sql::append(&tx, &mut w, WithdrawalEvent::Approved { by: by.to_owned() }).await?;
    tx.commit().await?;
    Ok((w, true))
}

/// Cancels a withdrawal. Before signing it is cancelled at once and the hold released. After
/// signing, a cancel is requested: the worker signs a zero-value replacement at the same nonce,
/// and whatever mines decides. A second cancel changes nothing.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn cancel(
    client: &mut deadpool_postgres::Object,
    id: i64,
    by: &str,
) -> Result<(Withdrawal, bool), ActionError> {
    let tx = client.transaction().await?;
    let mut w = sql::lock(&tx, id).await?.ok_or(ActionError::Unknown(id))?;
    match w.state {
        WithdrawalState::Requested | WithdrawalState::AwaitingApproval => {
            let cancelled = WithdrawalEvent::Cancelled { tx_hash: None, fee: Amount::ZERO, by: Some(by.to_owned()) };
            sql::append(&tx, &mut w, cancelled).await?;
            sql::post(&tx, &w, Movement::Release, Amount::ZERO).await?;
        }
        WithdrawalState::Signed | WithdrawalState::Broadcast => {
            sql::append(&tx, &mut w, WithdrawalEvent::CancelRequested { by: by.to_owned() }).await?;
        }
        WithdrawalState::CancelRequested | WithdrawalState::Cancelled => return Ok((w, false)),
        other => {
            return Err(ActionError::WrongState { id, state: other.as_str(), message: "too late to cancel" });
        }
    }
    tx.commit().await?;
    Ok((w, true))
}
