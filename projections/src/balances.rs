//! Balances per account and asset: confirmed (posted), pending (observed, not yet confirmed),
//! held (withdrawals in flight) and available = confirmed − held.
//!
//! Finance reads the same figures from the `account_balance` view; this module answers for one
//! account with every filter pushed into each part, so it stays fast however large the ledger.

use std::str::FromStr;

use custodian_domain::SignedAmount;
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// One account's position in one asset. Amounts are signed integer strings in smallest units: an
/// approved reversal can leave a customer owing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Balance {
    /// Account id.
    pub account_id: i64,
    /// Account reference.
    pub account_ref: String,
    /// Asset key.
    pub asset: String,
    /// Asset symbol.
    pub symbol: String,
    /// Posted to the account, including what withdrawals hold.
    pub confirmed: String,
    /// Observed but not yet posted.
    pub pending: String,
    /// Held by withdrawals in flight.
    pub held: String,
    /// What may be withdrawn now.
    pub available: String,
    /// The same four in whole units.
    pub display: BalanceDisplay,
    /// Each pending deposit with its confirmations so far and required.
    pub pending_deposits: Vec<PendingDeposit>,
}

/// Balance figures in whole units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BalanceDisplay {
    /// Confirmed.
    pub confirmed: String,
    /// Pending.
    pub pending: String,
    /// Held.
    pub held: String,
    /// Available.
    pub available: String,
}

/// A deposit on its way to being confirmed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PendingDeposit {
    /// Transaction hash.
    pub tx_hash: String,
    /// vout or log index.
    pub output_index: i32,
    /// Smallest units.
    pub amount: String,
    /// Confirmations so far.
    pub confirmations: i64,
    /// Confirmations the policy requires.
    pub required_confirmations: Option<i32>,
}

/// Formats a signed integer string of smallest units in whole units.
pub fn signed_display(units: &str, decimals: u8) -> String {
    let balance = SignedAmount::from_str(units).expect("BUG: the database returned a non-integer amount");
    balance.to_decimal_string(decimals)
}

const BALANCES: &str = "
with ledger as (
    -- every asset the account has a `user_balance` row for: the row is what `available` reads (`migrations/V4__ledger.sql`)
    select b.asset, b.balance as net from user_balance b where b.ledger_account = 'user:' || $1::bigint
), held as (
    select w.asset, sum(w.amount) as held from withdrawal w
     where w.account_id = $1 and w.state in ('requested', 'awaiting_approval', 'signed', 'broadcast', 'mined',
                                             'cancel_requested', 'needs_review')
       -- in review after its hold was settled (a payment reorged out past the depth): nothing held
       and (w.state <> 'needs_review'
            or not exists (select 1 from ledger_transfer t
                            where t.idempotency_key in ('withdrawal:' || w.id || ':settle',
                                                        'withdrawal:' || w.id || ':release')))
     group by w.asset
), observed as (
    select distinct on (d.chain, d.tx_hash, d.kind, d.output_index) d.chain, d.tx_hash, d.kind, d.output_index,
           d.asset, d.amount
      from wallet_address w
      join deposit_event d on d.chain = w.chain and d.address = w.address
      join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash and b.orphaned_at is null
     where w.account_id = $1 and b.height >= w.valid_from_height
       and (w.valid_to_height is null or b.height < w.valid_to_height)
       and coalesce((select sum(case p.direction when 'debit' then p.amount else -p.amount end)
                       from ledger_transfer t join ledger_posting p on p.transfer_id = t.id and p.ledger_account = 'custody'
                      where t.deposit_key = deposit_key(d.chain, d.tx_hash, d.kind, d.output_index)),
                    0) = 0
     order by d.chain, d.tx_hash, d.kind, d.output_index, b.height desc
), pending as (
    select asset, sum(amount) as pending from observed group by asset
)
select asset, a.symbol, a.decimals,
       (coalesce(l.net, 0) + coalesce(h.held, 0))::text, coalesce(p.pending, 0)::text,
       coalesce(h.held, 0)::text, coalesce(l.net, 0)::text
  from ledger l full join held h using (asset) full join pending p using (asset)
  join asset a using (asset)
 order by asset";

/// Balances of one account, one row per asset it has any figure in.
pub async fn for_account<C: GenericClient>(
    client: &C,
    account_id: i64,
    account_ref: &str,
) -> Result<Vec<Balance>, tokio_postgres::Error> {
    // Prepared once per connection: planning this query costs about as much as running it.
    let statement = client.prepare_cached(BALANCES).await?;
    let rows = client.query(&statement, &[&account_id]).await?;
    let mut balances = Vec::with_capacity(rows.len());
    for r in rows {
        let asset: String = r.get(0);
        let decimals = u8::try_from(r.get::<_, i16>(2)).expect("BUG: decimals outside 0..=77");
        let [confirmed, pending, held, available]: [String; 4] = [r.get(3), r.get(4), r.get(5), r.get(6)];
        let pending_deposits =
            if pending == "0" { Vec::new() } else { pending_deposits(client, account_id, &asset).await? };
        balances.push(Balance {
            account_id,
            account_ref: account_ref.to_owned(),
            display: BalanceDisplay {
                confirmed: signed_display(&confirmed, decimals),
                pending: signed_display(&pending, decimals),
                held: signed_display(&held, decimals),
                available: signed_display(&available, decimals),
            },
            asset,
            symbol: r.get(1),
            confirmed,
            pending,
            held,
            available,
            pending_deposits,
        });
    }
    Ok(balances)
}

async fn pending_deposits<C: GenericClient>(
    client: &C,
    account_id: i64,
    asset: &str,
) -> Result<Vec<PendingDeposit>, tokio_postgres::Error> {
    let rows = client
        .query(
            "select tx_hash, output_index, amount::text, confirmations, required_confirmations
               from deposit_status
              where account_id = $1 and asset = $2 and not orphaned and not posted
              order by height, tx_hash, output_index",
            &[&account_id, &asset],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| PendingDeposit {
            tx_hash: r.get(0),
            output_index: r.get(1),
            amount: r.get(2),
            confirmations: r.get::<_, Option<i64>>(3).unwrap_or(0),
            required_confirmations: r.get(4),
        })
        .collect())
}

/// Accounts with any ledger posting, deposit address or withdrawal, by id.
pub async fn accounts<C: GenericClient>(client: &C) -> Result<Vec<(i64, String)>, tokio_postgres::Error> {
    let rows = client.query("select id, external_ref from account order by id", &[]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
