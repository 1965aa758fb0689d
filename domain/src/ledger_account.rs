//! `LedgerAccount`: the accounts of the double-entry ledger, and the text the `ledger_posting`
//! column holds for each (its check constraint allows exactly these).

use std::fmt;

/// Where a posting moves money to or from (DESIGN §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LedgerAccount {
    /// What we owe the customer account with this id (`user:{id}`).
    User(i64),
    /// What our addresses hold on chain.
    Custody,
    /// Held for withdrawals in flight.
    WithdrawalHolds,
    /// Paid to miners and validators.
    NetworkFees,
    /// The operator's own funds.
    Treasury,
}

impl LedgerAccount {
    /// Whose funds a withdrawal from `account_id` moves: the treasury's for an internal one
    /// (rebalancing between our own wallets), the customer's otherwise.
    pub fn payer(account_id: i64, treasury: bool) -> LedgerAccount {
        if treasury {
            LedgerAccount::Treasury
        } else {
            LedgerAccount::User(account_id)
        }
    }
}

impl fmt::Display for LedgerAccount {
    /// The stored name.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerAccount::User(id) => write!(f, "user:{id}"),
            LedgerAccount::Custody => f.write_str("custody"),
            LedgerAccount::WithdrawalHolds => f.write_str("withdrawal_holds"),
            LedgerAccount::NetworkFees => f.write_str("network_fees"),
            LedgerAccount::Treasury => f.write_str("treasury"),
        }
    }
}

impl std::str::FromStr for LedgerAccount {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || format!("unknown ledger account {s:?}");
        Ok(match s {
            "custody" => LedgerAccount::Custody,
            "withdrawal_holds" => LedgerAccount::WithdrawalHolds,
            "network_fees" => LedgerAccount::NetworkFees,
            "treasury" => LedgerAccount::Treasury,
            _ => {
                let id = s.strip_prefix("user:").ok_or_else(unknown)?;
                if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(unknown());
                }
                LedgerAccount::User(id.parse().map_err(|_| unknown())?)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_account_round_trips_through_its_stored_name_and_nothing_else_parses() {
        for account in [
            LedgerAccount::User(42),
            LedgerAccount::Custody,
            LedgerAccount::WithdrawalHolds,
            LedgerAccount::NetworkFees,
            LedgerAccount::Treasury,
        ] {
            assert_eq!(account.to_string().parse::<LedgerAccount>(), Ok(account));
        }
        assert_eq!(LedgerAccount::User(7).to_string(), "user:7");
        for bad in ["user:", "user:-1", "user:+1", "user:1x", "Custody", "holds"] {
            assert!(bad.parse::<LedgerAccount>().is_err(), "{bad}");
        }
        assert_eq!(LedgerAccount::payer(3, true), LedgerAccount::Treasury);
        assert_eq!(LedgerAccount::payer(3, false), LedgerAccount::User(3));
    }
}
