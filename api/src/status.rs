//! How the library crates' errors become gRPC status codes (DESIGN §8): validation →
//! `INVALID_ARGUMENT`, idempotency conflict → `ALREADY_EXISTS`, insufficient funds and wrong
//! state → `FAILED_PRECONDITION`, paused lane → `PERMISSION_DENIED`, unknown ids → `NOT_FOUND`,
//! database or node down → `UNAVAILABLE`. Anything else the database refuses is a bug on our
//! side: `INTERNAL`, logged.

use custodian_projections::history::HistoryError;
use custodian_store::deposit_addresses::DepositAddressError;
use custodian_store::ownership::OwnershipError;
use custodian_withdrawals::actions::ActionError;
use custodian_withdrawals::hot_wallet::HotWalletError;
use custodian_withdrawals::RequestError;
use tonic::Status;

/// SQLSTATE classes that mean "try again": connection exceptions (08), transaction rollbacks
/// such as serialization failures and deadlocks (40), insufficient resources (53), operator
/// intervention such as a shutdown (57), system errors (58).
const TRANSIENT_SQLSTATE_CLASSES: [&str; 5] = ["08", "40", "53", "57", "58"];

/// What went wrong, with the server's message: the error's own `Display` says only "db error".
fn describe(error: &tokio_postgres::Error) -> String {
    match (error.as_db_error(), std::error::Error::source(error)) {
        (Some(db), _) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        (None, Some(source)) => format!("{error}: {source}"),
        (None, None) => error.to_string(),
    }
}

/// A database error met while `doing` something.
pub(crate) fn database(doing: &str, source: &tokio_postgres::Error) -> Status {
    let error = describe(source);
    let transient = match source.as_db_error() {
        // No answer from the server: the connection broke or timed out. (A column type that does
        // not match the code lands here too; every query's types are exercised by the tests.)
        None => true,
        Some(db) => TRANSIENT_SQLSTATE_CLASSES.iter().any(|class| db.code().code().starts_with(class)),
    };
    if transient {
        tracing::warn!(doing, %error, "database unavailable");
        Status::unavailable(format!("the database is unavailable while {doing}; retry later ({error})"))
    } else {
        tracing::error!(doing, %error, "database refused a statement");
        Status::internal(format!("database error while {doing}: {error}"))
    }
}

/// No connection could be taken from the pool.
pub(crate) fn pool(error: &deadpool_postgres::PoolError) -> Status {
    tracing::warn!(%error, "no database connection");
    Status::unavailable(format!("the database is unavailable; retry later ({error})"))
}

/// A withdrawal request's refusal.
pub(crate) fn request(error: RequestError) -> Status {
    match error {
        RequestError::Invalid(message) => Status::invalid_argument(message),
        conflict @ RequestError::Conflict { .. } => Status::already_exists(conflict.to_string()),
        short @ RequestError::InsufficientFunds { .. } => Status::failed_precondition(short.to_string()),
        paused @ RequestError::LanePaused { .. } => Status::permission_denied(paused.to_string()),
        RequestError::NoHotWallet => {
            Status::failed_precondition("no hot wallet is registered for eth: withdrawals cannot be paid out yet")
        }
        RequestError::Database(e) => database("recording the withdrawal", &e),
    }
}

/// An approval's or cancel's refusal.
pub(crate) fn action(error: ActionError) -> Status {
    match error {
        unknown @ ActionError::Unknown(_) => Status::not_found(unknown.to_string()),
        state @ ActionError::WrongState { .. } => Status::failed_precondition(state.to_string()),
        ActionError::Anonymous => Status::unauthenticated("a decision needs an authenticated principal"),
        own @ ActionError::SelfApproval { .. } => Status::permission_denied(own.to_string()),
        // The withdrawals crate keeps only the message: retrying is the safe answer, and the
        // action is idempotent.
        ActionError::Database(message) => {
            tracing::warn!(%message, "database error in a withdrawal action");
            Status::unavailable(format!("the database failed; retry later ({message})"))
        }
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
        taken @ HotWalletError::Taken { .. } => Status::already_exists(taken.to_string()),
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
