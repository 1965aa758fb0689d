//! The ledger's one writer and its one reading of `available`.
//!
//! Every transfer — a deposit credited, a withdrawal's hold, release, settlement and fee, a
//! reversal or a loss decided by an operator — is written by [`write`] (or [`WRITE`] in a
//! pipeline): the transfer row unless its idempotency key exists already, and its postings, in
//! one statement. A [`Transfer`] balances per asset by construction (checked here, in Rust, when
//! it is built); the database's deferred constraint trigger checks the same at commit, so a
//! transfer that does not balance never commits whoever writes it.
//!
//! `available` — what a customer may spend of an asset — is the `available(account, asset)` SQL
//! function (`migrations/V4__ledger.sql`): the balance the `user_balance` projection keeps in the same transaction as the
//! postings it sums. Statements that need it inline call the function; [`available`] reads it.

use std::collections::BTreeMap;

use alloy_primitives::U256;
use custodian_domain::{Amount, LedgerAccount, SignedAmount};
use deadpool_postgres::GenericClient;
use tokio_postgres::types::ToSql;

/// A posting's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Direction {
    /// Money leaves the account (for `custody`: arrives in our keeping).
    Debit,
    /// Money arrives in the account.
    Credit,
}

impl Direction {
    /// As stored.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Debit => "debit",
            Direction::Credit => "credit",
        }
    }
}

/// One leg of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Posting {
    /// Whose.
    pub account: LedgerAccount,
    /// Asset key.
    pub asset: String,
    /// Which side.
    pub direction: Direction,
    /// How much, more than zero.
    pub amount: Amount,
}

/// A transfer that cannot be written: its postings do not balance, or one of them moves nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("transfer {key}: {reason}")]
pub struct Unbalanced {
    /// The transfer's idempotency key.
    pub key: String,
    /// What is wrong.
    pub reason: String,
}

/// A balanced transfer, ready to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    key: String,
    kind: &'static str,
    deposit_key: Option<String>,
    reference: serde_json::Value,
    postings: Vec<Posting>,
}

impl Transfer {
    /// A transfer of `kind` under idempotency `key`, with what it refers to, if its postings
    /// balance: per asset, debits equal credits, and no posting moves zero.
    pub fn new(
        key: impl Into<String>,
        kind: &'static str,
        reference: serde_json::Value,
        postings: Vec<Posting>,
    ) -> Result<Transfer, Unbalanced> {
        let key = key.into();
        let refuse = |reason: String| Unbalanced { key: key.clone(), reason };
        if postings.is_empty() {
            return Err(refuse("no postings".to_owned()));
        }
        let mut sums: BTreeMap<&str, (U256, U256)> = BTreeMap::new();
        for p in &postings {
            if p.amount.is_zero() {
                return Err(refuse(format!("a {} posting of zero {} to {}", p.direction.as_str(), p.asset, p.account)));
            }
            let (debits, credits) = sums.entry(p.asset.as_str()).or_default();
            let side = if p.direction == Direction::Debit { debits } else { credits };
            *side = side.checked_add(p.amount.units()).ok_or_else(|| refuse(format!("{} beyond 2^256", p.asset)))?;
        }
        if let Some((asset, (debits, credits))) = sums.iter().find(|(_, (d, c))| d != c) {
            return Err(refuse(format!("{asset}: debits {debits} and credits {credits}")));
        }
        Ok(Transfer { key, kind, deposit_key: None, reference, postings })
    }

    /// `amount` of `asset` from `debit` to `credit`: two postings, balanced by construction.
    /// `None` when the amount is zero (a transfer that moves nothing is not written).
    pub fn moving(
        key: impl Into<String>,
        kind: &'static str,
        reference: serde_json::Value,
        (debit, credit): (LedgerAccount, LedgerAccount),
        asset: &str,
        amount: Amount,
    ) -> Option<Transfer> {
        let leg = |account, direction| Posting { account, asset: asset.to_owned(), direction, amount };
        (!amount.is_zero()).then(|| {
            Transfer::new(key, kind, reference, vec![leg(debit, Direction::Debit), leg(credit, Direction::Credit)])
                .expect("BUG: two equal legs of a non-zero amount balance")
        })
    }

    /// The same transfer, tied to the deposit it moves money for.
    pub fn for_deposit(mut self, deposit_key: impl Into<String>) -> Transfer {
        self.deposit_key = Some(deposit_key.into());
        self
    }

    /// Its idempotency key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// Writes transfers whose keys do not exist yet, with their postings, in one statement; returns
/// the ids written. Parameters as [`Columns::params`] orders them.
pub const WRITE: &str = "
with transfer as (
    insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
    select * from unnest($1::text[], $2::text[], $3::text[], $4::jsonb[])
    on conflict (idempotency_key) do nothing
    returning id, idempotency_key
)
insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount)
select t.id, p.ledger_account, p.asset, p.direction, p.amount
  from unnest($5::text[], $6::text[], $7::text[], $8::text[], $9::numeric[])
       with ordinality as p (key, ledger_account, asset, direction, amount, n)
  join transfer t on t.idempotency_key = p.key
 order by p.n
returning transfer_id";

/// Some transfers as [`WRITE`]'s columns, owned so a caller can pipeline the statement.
#[derive(Debug, Clone, Default)]
pub struct Columns {
    keys: Vec<String>,
    kinds: Vec<&'static str>,
    deposit_keys: Vec<Option<String>>,
    references: Vec<serde_json::Value>,
    posting_keys: Vec<String>,
    accounts: Vec<String>,
    assets: Vec<String>,
    directions: Vec<&'static str>,
    amounts: Vec<U256>,
}

impl Columns {
    /// `transfers` as columns. Postings go in the order of their ledger accounts (as text) and
    /// assets, the order in which every writer touches `user_balance` rows: concurrent writers
    /// queue for those rows instead of deadlocking.
    pub fn of<'a>(transfers: impl IntoIterator<Item = &'a Transfer>) -> Columns {
        let mut c = Columns::default();
        let mut postings = Vec::new();
        for t in transfers {
            c.keys.push(t.key.clone());
            c.kinds.push(t.kind);
            c.deposit_keys.push(t.deposit_key.clone());
            c.references.push(t.reference.clone());
            postings.extend(t.postings.iter().map(|p| (p.account.to_string(), p, t.key.as_str())));
        }
        postings.sort_by(|(a, p, _), (b, q, _)| (a, &p.asset).cmp(&(b, &q.asset)));
        for (account, p, key) in postings {
            c.posting_keys.push(key.to_owned());
            c.accounts.push(account);
            c.assets.push(p.asset.clone());
            c.directions.push(p.direction.as_str());
            c.amounts.push(p.amount.units());
        }
        c
    }

    /// Whether there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// In [`WRITE`]'s order.
    pub fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        [
            &self.keys,
            &self.kinds,
            &self.deposit_keys,
            &self.references,
            &self.posting_keys,
            &self.accounts,
            &self.assets,
            &self.directions,
            &self.amounts,
        ]
    }
}

/// Writes `transfers` (those whose keys exist already are skipped, postings and all); returns the
/// ids of those written.
pub async fn write<C: GenericClient>(client: &C, transfers: &[Transfer]) -> Result<Vec<i64>, tokio_postgres::Error> {
    let columns = Columns::of(transfers);
    if columns.is_empty() {
        return Ok(Vec::new());
    }
    let statement = client.prepare_cached(WRITE).await?;
    let rows = client.query(&statement, &columns.params()).await?;
    let mut ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// What `account` may spend of `asset`: the SQL function `available(account, asset)`.
pub async fn available<C: GenericClient>(
    client: &C,
    account: i64,
    asset: &str,
) -> Result<SignedAmount, tokio_postgres::Error> {
    let row = client.query_one("select available($1, $2)::text", &[&account, &asset]).await?;
    Ok(row.get::<_, &str>(0).parse().expect("BUG: the database returned a non-integer balance"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leg(account: LedgerAccount, asset: &str, direction: Direction, units: u64) -> Posting {
        Posting { account, asset: asset.to_owned(), direction, amount: Amount::from_u64(units) }
    }

    #[test]
    fn a_transfer_balances_per_asset_or_is_refused() {
        use Direction::{Credit, Debit};
        use LedgerAccount::{Custody, Treasury, User};
        let ok = Transfer::new(
            "k",
            "deposit",
            serde_json::Value::Null,
            vec![leg(Custody, "ETH", Debit, 10), leg(Treasury, "ETH", Credit, 4), leg(User(7), "ETH", Credit, 6)],
        );
        assert!(ok.is_ok());
        let cases = [
            (vec![], "no postings"),
            (vec![leg(Custody, "ETH", Debit, 10), leg(User(7), "ETH", Credit, 9)], "debits 10 and credits 9"),
            (vec![leg(Custody, "ETH", Debit, 10), leg(User(7), "BTC", Credit, 10)], "BTC: debits 0 and credits 10"),
            (vec![leg(Custody, "ETH", Debit, 0), leg(User(7), "ETH", Credit, 0)], "a debit posting of zero ETH"),
        ];
        for (postings, reason) in cases {
            let refused = Transfer::new("k", "deposit", serde_json::Value::Null, postings).unwrap_err();
            assert!(refused.reason.contains(reason), "{refused} should say {reason:?}");
        }
    }

    #[test]
    fn moving_nothing_is_no_transfer_and_postings_go_in_account_order() {
        let none = Transfer::moving(
            "k",
            "withdrawal_hold",
            serde_json::Value::Null,
            (LedgerAccount::User(1), LedgerAccount::WithdrawalHolds),
            "ETH",
            Amount::ZERO,
        );
        assert!(none.is_none());
        let hold = Transfer::moving(
            "withdrawal:9:hold",
            "withdrawal_hold",
            serde_json::Value::Null,
            (LedgerAccount::User(1), LedgerAccount::WithdrawalHolds),
            "ETH",
            Amount::from_u64(5),
        )
        .unwrap();
        let columns = Columns::of([&hold]);
        assert_eq!(columns.accounts, ["user:1", "withdrawal_holds"]);
        assert_eq!(columns.directions, ["debit", "credit"]);
        assert_eq!(columns.posting_keys, ["withdrawal:9:hold", "withdrawal:9:hold"]);
    }
}
