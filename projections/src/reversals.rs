//! Reviewed reversals: the reconciliation pass opens a discrepancy round when the ledger holds
//! money for a deposit key that the canonical chain lost; an authenticated principal decides.
//!
//! Approving debits the credited account (`{key}:reversal:{round}`: debit the user, credit
//! `custody`); rejecting books the loss to the operator (`{key}:loss:{round}`: debit `treasury`,
//! credit `custody`). Either way `custody` matches the chain again. The transfer and the decision
//! are one transaction; the decision row is append-only and unique per round, so a second
//! decision finds the first and changes nothing. A round whose money is re-mined first is closed
//! by the pass, and deciding it is refused.

use alloy_primitives::U256;
use custodian_domain::{Amount, Decision, LedgerAccount};
use custodian_store::ledger::{self, Transfer};
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// A proposal with its decision, if any.
#[derive(Debug, Clone, Serialize)]
pub struct Proposal {
    /// Proposal id.
    pub id: i64,
    /// The deposit key.
    pub deposit_key: String,
    /// The round of this key's discrepancies (1, 2, …).
    pub round: i32,
    /// The latest credit transfer of the key when the round opened.
    pub transfer_id: Option<i64>,
    /// The credited ledger account.
    pub ledger_account: String,
    /// Asset key.
    pub asset: String,
    /// Amount credited.
    pub amount: Amount,
    /// Why it was proposed.
    pub reason: String,
    /// When.
    pub proposed_at: String,
    /// Approved, rejected, closed (re-mined first), or none yet.
    pub decision: Option<Decision>,
    /// Who decided.
    pub decided_by: Option<String>,
    /// Their reason.
    pub decision_reason: Option<String>,
    /// The transfer the decision booked (reversal or loss).
    pub compensating_transfer_id: Option<i64>,
    /// The deposit is on the canonical chain again (deciding is refused then; the pass closes it).
    pub reappeared: bool,
}

/// Why a decision was refused. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum DecisionError {
    /// No such proposal.
    #[error("no reversal proposal {0}")]
    Unknown(i64),
    /// Decided already, the other way.
    #[error("proposal {id} was already {decision} by {by}")]
    AlreadyDecided {
        /// Proposal.
        id: i64,
        /// The earlier decision.
        decision: Decision,
        /// Who made it.
        by: String,
    },
    /// The deposit is canonical again: nothing to take back.
    #[error("the deposit of proposal {0} is on the canonical chain again: nothing to decide, the next posting pass closes the round")]
    Reappeared(i64),
    /// A principal is required.
    #[error("a decision needs the authenticated principal making it")]
    Anonymous,
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

const LIST: &str = "
select r.id, r.deposit_key, r.round, r.transfer_id, r.ledger_account, r.asset, r.amount, r.reason, r.proposed_at::text,
       d.decision, d.decided_by, d.reason, d.compensating_transfer_id,
       exists (select 1 from deposit_event e join chain_block b on b.chain = e.chain and b.block_hash = e.block_hash
                where b.orphaned_at is null and e.chain = r.chain and e.tx_hash = r.tx_hash and e.kind = r.kind
                  and e.output_index = r.output_index)
  from reversal_proposal r
  left join reversal_decision d on d.proposal_id = r.id
 where ($1::bigint is null or r.id = $1)
 order by r.id";

fn proposal(r: &tokio_postgres::Row) -> Proposal {
    Proposal {
        id: r.get(0),
        deposit_key: r.get(1),
        round: r.get(2),
        transfer_id: r.get(3),
        ledger_account: r.get(4),
        asset: r.get(5),
        amount: Amount::from_units(r.get::<_, U256>(6)),
        reason: r.get(7),
        proposed_at: r.get(8),
        decision: r
            .get::<_, Option<&str>>(9)
            .map(|d| d.parse().expect("BUG: reversal_decision.decision is checked by the table")),
        decided_by: r.get(10),
        decision_reason: r.get(11),
        compensating_transfer_id: r.get(12),
        reappeared: r.get(13),
    }
}

/// Every proposal with its decision.
pub async fn list<C: GenericClient>(client: &C) -> Result<Vec<Proposal>, tokio_postgres::Error> {
    Ok(client.query(LIST, &[&None::<i64>]).await?.iter().map(proposal).collect())
}

/// One proposal.
pub async fn get<C: GenericClient>(client: &C, id: i64) -> Result<Option<Proposal>, tokio_postgres::Error> {
    Ok(client.query_opt(LIST, &[&Some(id)]).await?.as_ref().map(proposal))
}

/// The first key of the advisory lock deciders of one proposal take ("rv").
const DECISION_LOCK_CLASS: i32 = 0x7276;

/// Records a decision. Approving posts the compensating transfer in the same transaction.
/// Repeating the same decision returns the recorded one and writes nothing.
///
/// # Cancel safety
/// One transaction; cancelled, it writes nothing.
pub async fn decide(
    client: &mut deadpool_postgres::Object,
    id: i64,
    approve: bool,
    by: &str,
    reason: Option<&str>,
) -> Result<(Proposal, bool), DecisionError> {
    let by = by.trim();
    if by.is_empty() {
        return Err(DecisionError::Anonymous);
    }
    let tx = client.transaction().await?;
    // The proposal row is a fact the service may not update, so it cannot be row-locked either;
    // a transaction-scoped advisory lock on its id serialises deciders instead.
    tx.execute("select pg_advisory_xact_lock($1, hashint8($2))", &[&DECISION_LOCK_CLASS, &id]).await?;
    if tx.query_opt("select 1 from reversal_proposal where id = $1", &[&id]).await?.is_none() {
        return Err(DecisionError::Unknown(id));
    }
    let current = proposal(&tx.query_one(LIST, &[&Some(id)]).await?);
    let wanted = Decision::of_review(approve);
    if let Some(decision) = &current.decision {
        if *decision == wanted {
            return Ok((current, false));
        }
        return Err(DecisionError::AlreadyDecided {
            id,
            decision: *decision,
            by: current.decided_by.unwrap_or_default(),
        });
    }
    if current.reappeared {
        return Err(DecisionError::Reappeared(id));
    }
    // Debiting a customer takes their account lock, as a withdrawal request does: a request
    // cannot spend, between its balance check and its commit, what this decision takes back.
    let credited: LedgerAccount = current.ledger_account.parse().expect("BUG: a proposal names a ledger account");
    if let (true, LedgerAccount::User(account)) = (approve, credited) {
        tx.query_opt("select 1 from account where id = $1 for update", &[&account]).await?;
    }
    // Approve: the credited account gives the money back. Reject: the operator absorbs the loss.
    let (key, kind, debited) = if approve {
        (format!("{}:reversal:{}", current.deposit_key, current.round), "reversal", credited)
    } else {
        (format!("{}:loss:{}", current.deposit_key, current.round), "deposit_loss", LedgerAccount::Treasury)
    };
    let reference = serde_json::json!({
        "proposal_id": id, "deposit_key": current.deposit_key, "round": current.round,
        "decision": wanted.as_str(), "decided_by": by,
    });
    let transfer =
        Transfer::moving(key, kind, reference, (debited, LedgerAccount::Custody), &current.asset, current.amount)
            .expect("BUG: a discrepancy round is opened for a positive amount only")
            .for_deposit(current.deposit_key.clone());
    let written = ledger::write(&tx, &[transfer]).await?;
    let &[transfer] = written.as_slice() else {
        // The same decision committed while this one waited for the key: it is the answer.
        let decided = proposal(&tx.query_one(LIST, &[&Some(id)]).await?);
        tx.commit().await?;
        return Ok((decided, false));
    };
    let compensating = Some(transfer);
    tx.execute(
        "insert into reversal_decision (proposal_id, decision, decided_by, reason, compensating_transfer_id)
         values ($1, $2, $3, $4, $5)",
        &[&id, &wanted.as_str(), &by, &reason, &compensating],
    )
    .await?;
    let decided = proposal(&tx.query_one(LIST, &[&Some(id)]).await?);
    tx.commit().await?;
    Ok((decided, true))
}
