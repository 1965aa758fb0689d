//! The names of things the database allocates or an operator chooses: a withdrawal's id, an
//! account's id, a hot-wallet lane's name. Events carry them as plain JSON numbers and strings,
//! the database as `bigint` and `text`; every conversion is here.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// An id that is not a positive integer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} {input:?} is not an id: expected a positive integer")]
pub struct IdError {
    /// Which kind of id was expected.
    pub what: &'static str,
    /// The string given.
    pub input: String,
}

macro_rules! database_id {
    ($(#[$doc:meta])* $name:ident, $what:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(i64);

        impl $name {
            /// From its `bigint` column (the database's sequence allocates it).
            pub const fn new(id: i64) -> $name {
                $name(id)
            }

            /// As its `bigint` column holds it.
            pub const fn get(self) -> i64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl FromStr for $name {
            type Err = IdError;

            /// As a person types it: a positive integer.
            fn from_str(input: &str) -> Result<$name, IdError> {
                match input.trim().parse::<i64>() {
                    Ok(id) if id > 0 => Ok($name(id)),
                    _ => Err(IdError { what: $what, input: input.to_owned() }),
                }
            }
        }
    };
}

database_id!(
    /// A withdrawal: `withdrawal.id`, also its event stream's key.
    WithdrawalId,
    "withdrawal id"
);

database_id!(
    /// A customer (or the treasury's) account: `account.id`.
    AccountId,
    "account id"
);

/// A hot wallet's lane: one signing key, one nonce sequence (ETH) or coin pool (BTC). Letters,
/// digits, `-` or `_`, chosen by the operator when the hot wallet is added.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LaneName(String);

/// A string that is not a lane name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("lane name {0:?} must be letters, digits, - or _")]
pub struct LaneNameError(pub String);

impl LaneName {
    /// Parses an operator's or a stored name.
    pub fn parse(name: &str) -> Result<LaneName, LaneNameError> {
        if !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            Ok(LaneName(name.to_owned()))
        } else {
            Err(LaneNameError(name.to_owned()))
        }
    }

    /// The name, as `hot_wallet.lane` holds it.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for LaneName {
    type Error = LaneNameError;

    fn try_from(name: String) -> Result<LaneName, LaneNameError> {
        LaneName::parse(&name)
    }
}

impl From<LaneName> for String {
    fn from(lane: LaneName) -> String {
        lane.0
    }
}

impl fmt::Display for LaneName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<str> for LaneName {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for LaneName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_positive_and_travel_as_plain_numbers() {
        assert_eq!("42".parse::<WithdrawalId>().unwrap(), WithdrawalId::new(42));
        assert!("0".parse::<WithdrawalId>().is_err());
        assert!("-3".parse::<AccountId>().is_err());
        assert_eq!(
            "x".parse::<AccountId>().unwrap_err().to_string(),
            "account id \"x\" is not an id: expected a positive integer"
        );
        assert_eq!(serde_json::to_string(&AccountId::new(7)).unwrap(), "7");
        assert_eq!(serde_json::from_str::<WithdrawalId>("9").unwrap().get(), 9);
    }

    #[test]
    fn lane_names_are_letters_digits_dashes_and_underscores() {
        assert_eq!(LaneName::parse("hot-1_a").unwrap().as_str(), "hot-1_a");
        for bad in ["", "a b", "lane/1", "ünï"] {
            assert_eq!(LaneName::parse(bad), Err(LaneNameError(bad.to_owned())));
        }
        assert_eq!(serde_json::to_string(&LaneName::parse("b0").unwrap()).unwrap(), "\"b0\"");
        assert!(serde_json::from_str::<LaneName>("\"a b\"").is_err(), "a stored name is checked too");
    }
}
