//! A client's idempotency key for a withdrawal, as the CLI and the API both accept it.

/// Trimmed, 1 to [`ExternalId::MAX_BYTES`] bytes, no control characters. Two requests with the
/// same key (after trimming) for one account are the same request.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ExternalId(String);

/// Why a string is not an external id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExternalIdError {
    /// Nothing but whitespace.
    #[error("the external id is empty")]
    Empty,
    /// Longer than the limit, in bytes.
    #[error("the external id is {0} bytes; at most {max} are allowed", max = ExternalId::MAX_BYTES)]
    TooLong(usize),
    /// A control character (a newline, a tab, NUL) inside.
    #[error("the external id holds a control character")]
    Unprintable,
}

impl ExternalId {
    /// The longest key, in bytes of UTF-8.
    pub const MAX_BYTES: usize = 128;

    /// Parses `raw`, trimming surrounding whitespace.
    pub fn parse(raw: &str) -> Result<ExternalId, ExternalIdError> {
        let trimmed = raw.trim();
        if trimmed.is_empty() {
            return Err(ExternalIdError::Empty);
        }
        if trimmed.len() > Self::MAX_BYTES {
            return Err(ExternalIdError::TooLong(trimmed.len()));
        }
        if trimmed.chars().any(char::is_control) {
            return Err(ExternalIdError::Unprintable);
        }
        Ok(ExternalId(trimmed.to_owned()))
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ExternalId {
    type Error = ExternalIdError;

    fn try_from(raw: String) -> Result<ExternalId, ExternalIdError> {
        ExternalId::parse(&raw)
    }
}

impl From<ExternalId> for String {
    fn from(key: ExternalId) -> String {
        key.0
    }
}

impl std::fmt::Display for ExternalId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_trimmed_bounded_and_printable() {
        assert_eq!(ExternalId::parse("  inv-42 ").unwrap().as_str(), "inv-42");
        assert_eq!(ExternalId::parse("überweisung №7").unwrap().as_str(), "überweisung №7");
        assert_eq!(ExternalId::parse(" \t "), Err(ExternalIdError::Empty));
        assert!(ExternalId::parse(&"x".repeat(128)).is_ok());
        assert_eq!(ExternalId::parse(&"x".repeat(129)), Err(ExternalIdError::TooLong(129)));
        assert_eq!(ExternalId::parse(&"é".repeat(65)), Err(ExternalIdError::TooLong(130)), "bytes, not characters");
        assert_eq!(ExternalId::parse("a\nb"), Err(ExternalIdError::Unprintable));
        assert_eq!(ExternalId::parse("a\0b"), Err(ExternalIdError::Unprintable));
        assert_eq!(serde_json::to_string(&ExternalId::parse("inv-42").unwrap()).unwrap(), "\"inv-42\"");
        assert!(serde_json::from_str::<ExternalId>("\"a\\nb\"").is_err(), "a stored key is checked too");
    }
}
