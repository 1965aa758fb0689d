//! How the library crates' errors become gRPC status codes (DESIGN §8): validation →
//! `INVALID_ARGUMENT`, idempotency conflict → `ALREADY_EXISTS`, insufficient funds and wrong
//! state → `FAILED_PRECONDITION`, paused lane → `PERMISSION_DENIED`, unknown ids → `NOT_FOUND`,
//! database or node down → `UNAVAILABLE`. Anything else the database refuses is a bug on our
//! side: `INTERNAL`, logged.

use custodian_projections::history::HistoryError;
use custodian_store::deposit_addresses::DepositAddressError;
use custodian_store::describe;
use custodian_store::ownership::OwnershipError;
use custodian_withdrawals::actions::ActionError;
use custodian_withdrawals::hot_wallet::HotWalletError;
use custodian_withdrawals::RequestError;
use tonic::Status;

/// SQLSTATE classes that mean "try again": connection exceptions (08), transaction rollbacks
/// such as serialization failures and deadlocks (40), insufficient resources (53), operator
/// intervention such as a shutdown (57), system errors (58).
const TRANSIENT_SQLSTATE_CLASSES: [&str; 5] = ["08", "40", "53", "57", "58"];

/// How long a client is told to wait before retrying a transient failure.
const RETRY_AFTER_MS: u64 = 1_000;

/// An id for one logged failure: the client is told the id, the log holds the text (which may
/// name tables, constraints or values the client has no business seeing).
fn error_id() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{:x}-{n:x}", since_epoch.as_secs())
}

/// `UNAVAILABLE` with the retry hint in the message and in `retry-after-ms` metadata.
fn retry_later(message: String) -> Status {
    let mut status = Status::unavailable(format!("{message}; retry in {RETRY_AFTER_MS} ms"));
    status.metadata_mut().insert("retry-after-ms", RETRY_AFTER_MS.into());
    status
}

/// A database error met while `doing` something. Its text is logged under an id; the client gets
/// the id.
pub(crate) fn database(doing: &str, source: &tokio_postgres::Error) -> Status {
    let error = describe(source);
    let id = error_id();
    let transient = match source.as_db_error() {
        // No answer from the server: the connection broke or timed out. (A column type that does
        // not match the code lands here too; every query's types are exercised by the tests.)
        None => true,
        Some(db) => TRANSIENT_SQLSTATE_CLASSES.iter().any(|class| db.code().code().starts_with(class)),
    };
    if transient {
        tracing::warn!(error_id = %id, doing, %error, "database unavailable");
        retry_later(format!("the database is unavailable while {doing} (error id {id})"))
    } else {
        tracing::error!(error_id = %id, doing, %error, "database refused a statement");
        Status::internal(format!("database error while {doing} (error id {id})"))
    }
}

/// No connection could be taken from the pool in time: the API's connections are all busy, or
/// the database does not answer.
pub(crate) fn pool(error: &deadpool_postgres::PoolError) -> Status {
    let id = error_id();
    tracing::warn!(error_id = %id, %error, "no database connection");
    metrics::counter!("custodian_api_pool_timeouts_total").increment(1);
    retry_later(format!("no database connection is free (error id {id})"))
}

/// A withdrawal request's refusal.
pub(crate) fn request(error: RequestError) -> Status {
    match error {
        RequestError::Invalid(message) => Status::invalid_argument(message),
        conflict @ RequestError::Conflict { .. } => Status::already_exists(conflict.to_string()),
        short @ RequestError::InsufficientFunds { .. } => Status::failed_precondition(short.to_string()),
        paused @ RequestError::LanePaused { .. } => Status::permission_denied(paused.to_string()),
        RequestError::NoHotWallet(chain) => Status::failed_precondition(format!(
            "no hot wallet is registered for {chain}: withdrawals cannot be paid out yet"
        )),
        RequestError::Database(e) => database("recording the withdrawal", &e),
        RequestError::Unavailable(e) => pool(&e),
        RequestError::ShuttingDown => Status::unavailable("the service is shutting down; retry elsewhere"),
    }
}

/// An approval's or cancel's refusal.
pub(crate) fn action(error: ActionError) -> Status {
    match error {
        unknown @ ActionError::Unknown(_) => Status::not_found(unknown.to_string()),
        state @ ActionError::WrongState { .. } => Status::failed_precondition(state.to_string()),
        ActionError::Anonymous => Status::unauthenticated("a decision needs an authenticated principal"),
        own @ ActionError::SelfApproval { .. } => Status::permission_denied(own.to_string()),
        evidence @ ActionError::Evidence { .. } => Status::failed_precondition(evidence.to_string()),
        ActionError::Node(message) => Status::unavailable(format!("the Ethereum node failed: {message}")),
        ActionError::Database(e) => database("deciding on the withdrawal", &e),
        conflict @ ActionError::Conflict(_) => Status::aborted(format!("{conflict}; retry the call")),
    }
}

/// A deposit address allocation's refusal.
pub(crate) fn deposit_address(error: DepositAddressError) -> Status {
    match error {
        unknown @ DepositAddressError::UnknownAccount(_) => Status::not_found(unknown.to_string()),
        DepositAddressError::Database(e) => database("allocating a deposit address", &e),
        // A changed key, a taken index or address, an exhausted key: an operator has to act, and
        // retrying the same request cannot help.
        refusal => {
            tracing::error!(%refusal, "deposit address allocation refused");
            Status::failed_precondition(refusal.to_string())
        }
    }
}

/// An account operation's refusal.
pub(crate) fn ownership(error: OwnershipError) -> Status {
    match error {
        unknown @ OwnershipError::UnknownAccount(_) => Status::not_found(unknown.to_string()),
        OwnershipError::Database(e) => database("reading or writing the account", &e),
        refusal => Status::failed_precondition(refusal.to_string()),
    }
}

/// A lane change's refusal.
pub(crate) fn hot_wallet(error: HotWalletError) -> Status {
    match error {
        HotWalletError::UnknownLane(lane) => Status::not_found(format!("no hot-wallet lane named {lane:?}")),
        HotWalletError::Database(e) => database("changing the lane", &e),
        HotWalletError::Node(e) => Status::unavailable(format!("the Ethereum node failed: {e}")),
        bad @ HotWalletError::BadLaneName(_) => Status::invalid_argument(bad.to_string()),
        taken @ HotWalletError::Taken { .. } => Status::already_exists(taken.to_string()),
        resync @ HotWalletError::NeedsResync(_) => Status::failed_precondition(resync.to_string()),
        last @ HotWalletError::LastOpenLane(_) => Status::failed_precondition(last.to_string()),
        owned @ HotWalletError::CustomerAddress { .. } => Status::failed_precondition(owned.to_string()),
    }
}

/// A history page's refusal.
pub(crate) fn history(error: HistoryError, field: &str) -> Status {
    match error {
        HistoryError::UnknownPosition(position) => Status::not_found(format!(
            "{field} {position} is not a position in the history: resume after a position a stream returned"
        )),
        HistoryError::Database(e) => database("reading the history", &e),
    }
}

/// A webhook operation's refusal.
pub(crate) fn webhook(error: crate::webhooks::WebhookError) -> Status {
    use crate::webhooks::WebhookError;
    match error {
        WebhookError::Invalid(message) => Status::invalid_argument(message),
        missing @ WebhookError::NotFound(_) => Status::not_found(missing.to_string()),
        WebhookError::Database(e) => database("changing webhook subscribers", &e),
        WebhookError::Pool(e) => pool(&e),
        WebhookError::History(e) => history(e, "cursor"),
        other => Status::internal(other.to_string()),
    }
}
