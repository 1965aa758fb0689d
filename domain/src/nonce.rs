//! `Nonce`: an Ethereum account's transaction sequence number. Events carry it as a JSON number,
//! the database as `bigint` (checked `>= 0`), the node as a quantity; every conversion is here.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The position of a transaction in its sender's sequence: the node mines nonce `n` only after
/// `n - 1`, so each is allocated once and never skipped (DESIGN §7).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Nonce(u64);

impl Nonce {
    /// The first nonce of an account.
    pub const ZERO: Nonce = Nonce(0);

    /// The nonce `n`, as the node counts.
    pub const fn new(n: u64) -> Nonce {
        Nonce(n)
    }

    /// As the node counts.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The nonce after this one.
    pub fn next(self) -> Nonce {
        Nonce(self.0.checked_add(1).expect("BUG: a nonce beyond 2^64"))
    }

    /// `count` nonces after this one.
    pub fn plus(self, count: u64) -> Nonce {
        Nonce(self.0.checked_add(count).expect("BUG: a nonce beyond 2^64"))
    }

    /// As a `bigint` column holds it.
    pub fn stored(self) -> i64 {
        i64::try_from(self.0).expect("BUG: a nonce beyond 2^63")
    }

    /// From a `bigint` column, whose check constraint keeps it `>= 0`.
    pub fn from_stored(n: i64) -> Nonce {
        Nonce(u64::try_from(n).expect("BUG: a negative nonce in the database"))
    }
}

impl fmt::Display for Nonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nonce_travels_as_a_plain_number_and_round_trips_through_its_column() {
        assert_eq!(serde_json::to_string(&Nonce::new(7)).unwrap(), "7");
        assert_eq!(serde_json::from_str::<Nonce>("7").unwrap(), Nonce::new(7));
        assert_eq!(Nonce::from_stored(Nonce::new(41).next().stored()), Nonce::new(42));
        assert_eq!(Nonce::ZERO.plus(3), Nonce::new(3));
    }
}
