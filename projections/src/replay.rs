//! `replay --verify`: rebuild every projection from the appended facts into a scratch schema,
//! compare it with the live one, and check the global invariants.
//!
//! Rebuilt: the withdrawal projection (folded from its event streams), the posting set (what the
//! deposit and reversal facts say the ledger must contain), and balances (a fold of every posting,
//! compared with the `account_balance` view). Checked: every transfer has postings and balances per
//! asset; every posting traces to its source fact; `custody` equals what the facts put there.
//! Everything runs in one repeatable-read transaction that is rolled back, so the scratch schema
//! never outlives the run and the database is left exactly as found.

use std::collections::BTreeMap;

use alloy_primitives::U256;
use futures::{pin_mut, TryStreamExt};
use serde::Serialize;

/// A difference between the live state and what the facts say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Difference {
    /// Which check found it.
    pub check: &'static str,
    /// What differs, naming the row.
    pub detail: String,
}

/// What a verification run found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct VerifyReport {
    /// Facts read (blocks, observations, transfers, postings, withdrawal events).
    pub facts_read: u64,
    /// Every difference found; empty means verified.
    pub differences: Vec<Difference>,
}

impl VerifyReport {
    /// Whether the live state matches the facts.
    pub fn verified(&self) -> bool {
        self.differences.is_empty()
    }
}

/// The state a withdrawal is in after an event of this type (the fold of a stream is the state of
/// its last state-changing event). `bumped` changes no state.
pub fn state_after(event_type: &str, current: Option<&str>) -> Option<String> {
    let next = match event_type {
        "requested" | "approved" => "requested",
        "unmined" => "broadcast",
        "bumped" => return current.map(str::to_owned),
        other => other,
    };
    Some(next.to_owned())
}

const SCRATCH: &str = "replay_scratch";

const SETUP: &str = "
create schema replay_scratch;
create table replay_scratch.withdrawal (id bigint primary key, state text not null, last_seq integer not null);
create table replay_scratch.balance (ledger_account text, asset text, net numeric(79,0), primary key (ledger_account, asset));
create table replay_scratch.expected_posting as
select t.id as transfer_id, t.idempotency_key, side.ledger_account, d.asset, side.direction, d.amount
  from ledger_transfer t
  join deposit_event d on d.chain = t.reference ->> 'chain' and d.tx_hash = t.reference ->> 'tx_hash'
                      and d.output_index = (t.reference ->> 'output_index')::int
                      and d.block_hash = t.reference ->> 'block_hash'
  join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash
  join wallet_address w on w.chain = d.chain and w.address = d.address and b.height >= w.valid_from_height
                       and (w.valid_to_height is null or b.height < w.valid_to_height)
 cross join lateral (values ('custody', 'debit'), ('user:' || w.account_id, 'credit')) as side (ledger_account, direction)
 where t.kind = 'deposit'
   and t.idempotency_key = 'deposit:' || d.chain || ':' || d.tx_hash || ':' || d.output_index;
insert into replay_scratch.expected_posting
select r.compensating_transfer_id, c.idempotency_key, side.ledger_account, e.asset, side.direction, e.amount
  from reversal_decision r
  join reversal_proposal p on p.id = r.proposal_id
  join ledger_transfer c on c.id = r.compensating_transfer_id
  join replay_scratch.expected_posting e on e.transfer_id = p.transfer_id and e.direction = 'credit'
 cross join lateral (values (e.ledger_account, 'debit'), ('custody', 'credit')) as side (ledger_account, direction)
 where r.decision = 'approved';";

/// Live postings of kinds whose source facts this module can rebuild, against the rebuilt set.
const POSTING_DIFF: &str = "
with actual as (
    select t.id as transfer_id, t.idempotency_key, p.ledger_account, p.asset, p.direction, p.amount
      from ledger_transfer t join ledger_posting p on p.transfer_id = t.id
     where t.kind in ('deposit', 'reversal')
)
select 'live posting not derivable from facts', a.* from (select * from actual except all select * from replay_scratch.expected_posting) a
union all
select 'posting the facts require is missing', e.* from (select * from replay_scratch.expected_posting except all select * from actual) e
order by 3, 4, 6";

const UNTRACEABLE: &str = "
select t.id, t.idempotency_key, t.kind from ledger_transfer t
 where (t.kind in ('withdrawal_hold', 'withdrawal_settle', 'withdrawal_release', 'network_fee')
        and not exists (select 1 from withdrawal_event e where e.withdrawal_id = (t.reference ->> 'withdrawal_id')::bigint))
    or t.kind = 'adjustment'
 order by t.id";

const UNBALANCED: &str = "
select t.id, t.idempotency_key, 'it has no postings' from ledger_transfer t
 where not exists (select 1 from ledger_posting p where p.transfer_id = t.id)
union all
select t.id, t.idempotency_key, 'debits differ from credits in ' || p.asset
  from ledger_posting p join ledger_transfer t on t.id = p.transfer_id
 group by t.id, t.idempotency_key, p.asset
having sum(case p.direction when 'debit' then p.amount else 0 end) <> sum(case p.direction when 'credit' then p.amount else 0 end)
 order by 1";

const WITHDRAWAL_DIFF: &str = "
select 'live withdrawal row not rebuilt from its events', w.* from
       (select id, state, last_seq from withdrawal except select * from replay_scratch.withdrawal) w
union all
select 'withdrawal rebuilt from events missing or different in the live projection', r.* from
       (select * from replay_scratch.withdrawal except select id, state, last_seq from withdrawal) r
order by 2";

const BALANCE_DIFF: &str = "
with live as (select 'user:' || account_id as ledger_account, asset, available as net from account_balance where available <> 0),
     rebuilt as (select ledger_account, asset, net from replay_scratch.balance where ledger_account like 'user:%' and net <> 0)
select 'live balance differs from the fold of postings', l.* from (select * from live except select * from rebuilt) l
union all
select 'balance from the fold of postings missing in the live view', r.* from (select * from rebuilt except select * from live) r
order by 2, 3";

/// custody as booked against custody as the facts put it there, per asset.
const CUSTODY: &str = "
with booked as (
    select asset, sum(case direction when 'debit' then amount else -amount end) as net
      from ledger_posting where ledger_account = 'custody' group by asset
), from_facts as (
    select asset, sum(case direction when 'debit' then amount else -amount end) as net
      from replay_scratch.expected_posting where ledger_account = 'custody' group by asset
)
select coalesce(b.asset, f.asset), coalesce(b.net, 0)::text, coalesce(f.net, 0)::text
  from booked b full join from_facts f using (asset)
 where coalesce(b.net, 0) <> coalesce(f.net, 0)
   and not exists (select 1 from ledger_transfer t where t.kind like 'withdrawal%' or t.kind = 'network_fee')";

fn cell(row: &tokio_postgres::Row, index: usize) -> String {
    if let Ok(Some(v)) = row.try_get::<_, Option<String>>(index) {
        return v;
    }
    if let Ok(Some(v)) = row.try_get::<_, Option<i64>>(index) {
        return v.to_string();
    }
    if let Ok(Some(v)) = row.try_get::<_, Option<i32>>(index) {
        return v.to_string();
    }
    if let Ok(Some(v)) = row.try_get::<_, Option<U256>>(index) {
        return v.to_string();
    }
    "null".to_owned()
}

fn describe(row: &tokio_postgres::Row, from: usize) -> String {
    (from..row.len()).map(|i| format!("{}={}", row.columns()[i].name(), cell(row, i))).collect::<Vec<_>>().join(" ")
}

async fn count(tx: &deadpool_postgres::Transaction<'_>, table: &str) -> Result<u64, tokio_postgres::Error> {
    let n: i64 = tx.query_one(&format!("select count(*) from {table}"), &[]).await?.get(0);
    Ok(u64::try_from(n).expect("BUG: negative count"))
}

/// Rebuilds and compares. Differences are returned, not raised: the caller decides the exit code.
///
/// # Cancel safety
/// One transaction, always rolled back; cancelling it leaves nothing behind.
pub async fn verify(client: &mut deadpool_postgres::Object) -> Result<VerifyReport, tokio_postgres::Error> {
    let tx = client.build_transaction().isolation_level(tokio_postgres::IsolationLevel::RepeatableRead).start().await?;
    let mut report = VerifyReport::default();
    tx.batch_execute(&format!("drop schema if exists {SCRATCH} cascade")).await?;
    tx.batch_execute(SETUP).await?;

    // Withdrawals: fold every stream.
    let mut folded: BTreeMap<i64, (Option<String>, i32)> = BTreeMap::new();
    let events = tx
        .query_raw(
            "select withdrawal_id, seq, event_type from withdrawal_event order by withdrawal_id, seq",
            &[] as &[&str; 0],
        )
        .await?;
    pin_mut!(events);
    while let Some(row) = events.try_next().await? {
        report.facts_read += 1;
        let (id, seq, event_type): (i64, i32, String) = (row.get(0), row.get(1), row.get(2));
        let entry = folded.entry(id).or_insert((None, 0));
        if seq != entry.1 + 1 {
            report.differences.push(Difference {
                check: "withdrawal streams",
                detail: format!("withdrawal {id}: event {seq} follows {}", entry.1),
            });
        }
        entry.0 = state_after(&event_type, entry.0.as_deref());
        entry.1 = seq;
    }
    let (ids, states, seqs): (Vec<i64>, Vec<String>, Vec<i32>) = folded
        .into_iter()
        .filter_map(|(id, (state, seq))| state.map(|s| (id, s, seq)))
        .fold((Vec::new(), Vec::new(), Vec::new()), |(mut a, mut b, mut c), (id, s, seq)| {
            a.push(id);
            b.push(s);
            c.push(seq);
            (a, b, c)
        });
    tx.execute(
        "insert into replay_scratch.withdrawal select * from unnest($1::bigint[], $2::text[], $3::int[])",
        &[&ids, &states, &seqs],
    )
    .await?;
    for row in tx.query(WITHDRAWAL_DIFF, &[]).await? {
        report.differences.push(Difference {
            check: "withdrawal projection",
            detail: format!("{}: {}", cell(&row, 0), describe(&row, 1)),
        });
    }

    // Balances: fold every posting.
    let mut balances: BTreeMap<(String, String), (U256, U256)> = BTreeMap::new();
    let postings = tx
        .query_raw("select ledger_account, asset, direction, amount from ledger_posting order by id", &[] as &[&str; 0])
        .await?;
    pin_mut!(postings);
    while let Some(row) = postings.try_next().await? {
        report.facts_read += 1;
        let (account, asset, direction, amount): (String, String, String, U256) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let entry = balances.entry((account, asset)).or_insert((U256::ZERO, U256::ZERO));
        let side = if direction == "credit" { &mut entry.0 } else { &mut entry.1 };
        *side = side.checked_add(amount).expect("BUG: postings of one account sum beyond 2^256");
    }
    let mut accounts = Vec::new();
    let mut assets = Vec::new();
    let mut nets = Vec::new();
    for ((account, asset), (credits, debits)) in balances {
        // user accounts are liabilities (credit-normal); the rest are assets (debit-normal).
        let (plus, minus) = if account.starts_with("user:") { (credits, debits) } else { (debits, credits) };
        let net = if plus >= minus { (plus - minus).to_string() } else { format!("-{}", minus - plus) };
        accounts.push(account);
        assets.push(asset);
        nets.push(net);
    }
    tx.execute(
        "insert into replay_scratch.balance select a, s, n::numeric from unnest($1::text[], $2::text[], $3::text[]) as u(a, s, n)",
        &[&accounts, &assets, &nets],
    )
    .await?;
    for row in tx.query(BALANCE_DIFF, &[]).await? {
        report
            .differences
            .push(Difference { check: "balances", detail: format!("{}: {}", cell(&row, 0), describe(&row, 1)) });
    }

    // The posting set and the invariants.
    for row in tx.query(POSTING_DIFF, &[]).await? {
        report
            .differences
            .push(Difference { check: "posting set", detail: format!("{}: {}", cell(&row, 0), describe(&row, 1)) });
    }
    for row in tx.query(UNTRACEABLE, &[]).await? {
        report.differences.push(Difference {
            check: "postings trace to facts",
            detail: format!(
                "transfer {} ({}, kind {}) has no source fact",
                cell(&row, 0),
                cell(&row, 1),
                cell(&row, 2)
            ),
        });
    }
    for row in tx.query(UNBALANCED, &[]).await? {
        report.differences.push(Difference {
            check: "transfers balance",
            detail: format!("transfer {} ({}): {}", cell(&row, 0), cell(&row, 1), cell(&row, 2)),
        });
    }
    for row in tx.query(CUSTODY, &[]).await? {
        report.differences.push(Difference {
            check: "custody",
            detail: format!(
                "{}: custody booked {} but the facts put {} there",
                cell(&row, 0),
                cell(&row, 1),
                cell(&row, 2)
            ),
        });
    }
    for table in ["chain_block", "deposit_event", "ledger_transfer", "reversal_decision"] {
        report.facts_read += count(&tx, table).await?;
    }
    tx.rollback().await?;
    Ok(report)
}
