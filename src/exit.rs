//! Exit codes (DESIGN §8): 0 success, 1 operational error, 2 usage or validation error,
//! 3 verification failure.

/// How the process ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Everything worked.
    Success = 0,
    /// Something outside the request failed: database down, node unreachable.
    Operational = 1,
    /// The request itself was wrong; nothing was written.
    Usage = 2,
    /// `replay --verify` (or another check) found a difference.
    Verification = 3,
}

impl From<Exit> for std::process::ExitCode {
    fn from(exit: Exit) -> Self {
        std::process::ExitCode::from(exit as u8)
    }
}

/// A request refused as invalid. Commands return it (inside `anyhow`) so `main` exits with 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

/// Builds an [`Invalid`] error.
pub fn invalid(message: impl Into<String>) -> anyhow::Error {
    Invalid(message.into()).into()
}

/// Chooses the exit code for a failed command: validation anywhere in the chain means 2.
pub fn classify(error: &anyhow::Error) -> Exit {
    if error.chain().any(|cause| cause.is::<Invalid>()) {
        Exit::Usage
    } else {
        Exit::Operational
    }
}

/// `error` as one line for the operator, each cause's words once. anyhow's `{:#}` prints every
/// cause after its wrapper, and the wrappers here (ours, deadpool's, tokio-postgres's) already
/// quote their source: a refused connection read "…: Connection refused (os error 111): Error
/// occurred while creating a new object: error connecting to server: error connecting to server:
/// Connection refused (os error 111)", and a server's refusal "db error: ERROR: …" without its
/// SQLSTATE. Here a database error reads as the server put it ([`custodian_store::describe`]), a
/// cause whose words were already said is left out, and the line ends once it holds the words of
/// the root cause.
pub fn message(error: &anyhow::Error) -> String {
    let words = |cause: &(dyn std::error::Error + 'static)| {
        if let Some(postgres) = cause.downcast_ref::<tokio_postgres::Error>() {
            custodian_store::describe(postgres)
        } else if let Some(server) = cause.downcast_ref::<tokio_postgres::error::DbError>() {
            server.message().to_owned()
        } else {
            cause.to_string()
        }
    };
    let root = error.chain().last().map(words).unwrap_or_default();
    let mut line = String::new();
    for said in error.chain().map(words) {
        if said.is_empty() || line.contains(&said) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&said);
        if line.contains(&root) {
            break;
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wrapper that quotes its source in its own words, as deadpool's and ours do.
    #[derive(Debug, thiserror::Error)]
    #[error("{0}: {1}")]
    struct Quoting(&'static str, #[source] std::io::Error);

    /// A wrapper that does not.
    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct Terse(&'static str, #[source] std::io::Error);

    fn refused() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused (os error 111)")
    }

    #[test]
    fn a_cause_its_wrapper_already_quoted_is_said_once() {
        let error = anyhow::Error::new(Quoting("could not connect to PostgreSQL", refused()))
            .context("opening the ledger database");
        assert_eq!(format!("{error:#}").matches("Connection refused").count(), 2, "anyhow's own chain says it twice");
        assert_eq!(
            message(&error),
            "opening the ledger database: could not connect to PostgreSQL: Connection refused (os error 111)"
        );
    }

    #[test]
    fn a_cause_no_wrapper_quoted_is_still_said() {
        let error = anyhow::Error::new(Terse("could not connect to PostgreSQL", refused())).context("opening");
        assert_eq!(message(&error), "opening: could not connect to PostgreSQL: Connection refused (os error 111)");
        assert_eq!(message(&anyhow::anyhow!("alone")), "alone");
    }
}
