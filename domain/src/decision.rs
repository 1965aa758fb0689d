//! What a person (or, for a round whose money came back, the service) decided about a
//! discrepancy round: the names `reversal_decision.decision` stores.

use std::fmt;

use serde::Serialize;

/// A discrepancy round's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    /// The credited account gives the money back (a reversal transfer).
    Approved,
    /// The operator absorbs the loss (a loss transfer to treasury).
    Rejected,
    /// The money was re-mined before anyone decided: nothing is booked.
    Closed,
}

impl Decision {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Approved => "approved",
            Decision::Rejected => "rejected",
            Decision::Closed => "closed",
        }
    }

    /// What an operator's approval (`true`) or rejection (`false`) decides.
    pub fn of_review(approve: bool) -> Decision {
        if approve {
            Decision::Approved
        } else {
            Decision::Rejected
        }
    }
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Decision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Decision::Approved, Decision::Rejected, Decision::Closed]
            .into_iter()
            .find(|d| d.as_str() == s)
            .ok_or_else(|| format!("unknown decision {s:?}: approved, rejected or closed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_round_trip_through_their_stored_names() {
        for d in [Decision::Approved, Decision::Rejected, Decision::Closed] {
            assert_eq!(d.as_str().parse::<Decision>(), Ok(d));
            assert_eq!(serde_json::to_value(d).unwrap(), serde_json::json!(d.as_str()));
        }
        assert!("maybe".parse::<Decision>().is_err());
        assert_eq!(Decision::of_review(true), Decision::Approved);
        assert_eq!(Decision::of_review(false), Decision::Rejected);
    }
}
