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
