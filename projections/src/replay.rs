//! `replay --verify`: rebuild every projection from the appended facts, compare it with the live
//! one, and check the global invariants.
//!
//! Rebuilt: the withdrawal projection (folded from its event streams, every column including what
//! it pays), what the ledger must hold under each deposit key (from observations, ownership, tiers
//! and the recorded rounds and decisions — never from the transfers' own references), the
//! withdrawal movements, and every column of `account_balance` (a fold of every posting, the
//! rebuilt holds, the pending observations). Checked: every transfer has postings and balances per
//! asset; every posting traces to its source fact; `custody` equals confirmed deposits minus
//! settled withdrawals and fees, per asset. Everything runs in one read-only repeatable-read
//! transaction: no scratch table, no transaction id, so a long replay never holds back the
//! history stream. The binary adds the re-parse of retained raw blocks and the fact seals.

use std::collections::BTreeMap;

use alloy_primitives::U256;
use custodian_domain::posting_rules::{self, Booking};
use custodian_domain::withdrawal::{Withdrawal, WithdrawalEvent};
use custodian_domain::{Amount, LedgerAccount, Nonce, SignedAmount};
use custodian_domain::{ChainAddress, WithdrawalId};
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

    /// Records a difference found by `check`.
    fn differ(&mut self, check: &'static str, detail: String) {
        self.differences.push(Difference { check, detail });
    }
}

/// Deposits, per key: what the ledger must hold under each key, derived from observations,
/// ownership, tiers and the recorded rounds and decisions, never from the transfers' own
/// references. An open round holds its amount; otherwise the canonical confirmed amount. Keys in
/// motion are excused, with the booked amount taken as expected: a canonical observation not (or
/// no longer) confirmed holding at most its amount, money lost within its grace period, and keys
/// whose latest round was rejected before losses were booked.
const DEPOSIT_KEYS: &str = "
with observed as materialized (
    select s.deposit_key, s.asset, s.amount, s.account_id, s.orphaned, s.confirmed, s.height from deposit_status s
), booked as materialized (
    select t.deposit_key, p.asset,
           sum(case when p.ledger_account = 'custody' then case p.direction when 'debit' then p.amount else -p.amount end
               else 0 end) as custody
      from ledger_transfer t join ledger_posting p on p.transfer_id = t.id
     where t.deposit_key is not null
     group by t.deposit_key, p.asset
), keys as (
    select deposit_key, asset from observed union select deposit_key, asset from booked
), canonical as (
    select distinct on (deposit_key) deposit_key, amount, confirmed and account_id is not null as credit_due
      from observed where not orphaned
     order by deposit_key, confirmed desc, height
), lost as (
    select deposit_key, not grace_passed as in_grace from deposit_lost
), rounds as (
    select distinct on (r.deposit_key) r.deposit_key, r.amount, d.decision, d.compensating_transfer_id
      from reversal_proposal r left join reversal_decision d on d.proposal_id = r.id
     order by r.deposit_key, r.round desc
)
select k.deposit_key, k.asset, coalesce(b.custody, 0) as booked,
       case when r.deposit_key is not null and r.decision is null then r.amount
            when c.credit_due then c.amount
            when c.deposit_key is not null and coalesce(b.custody, 0) between 0 and c.amount then coalesce(b.custody, 0)
            when c.deposit_key is null and l.in_grace then coalesce(b.custody, 0)
            when r.decision = 'rejected' and r.compensating_transfer_id is null then coalesce(b.custody, 0)
            else 0 end as expected
  from keys k
  left join booked b using (deposit_key, asset)
  left join canonical c using (deposit_key)
  left join lost l using (deposit_key)
  left join rounds r using (deposit_key)";

/// Every credit transfer names an observation of its own key and credits only that observation's
/// owner or treasury; every reversal or loss is the booking of a recorded decision, for the round's
/// amount, from the round's account (or treasury); every approval has its transfer.
const DEPOSIT_SHAPE: &str = "
select t.id, t.idempotency_key, 'credit names no observation of its key' as problem
  from ledger_transfer t
 where t.kind = 'deposit'
   and not exists (select 1 from deposit_event d
                    where d.chain = t.reference ->> 'chain' and d.tx_hash = t.reference ->> 'tx_hash'
                      and d.kind = t.reference ->> 'kind' and d.output_index = (t.reference ->> 'output_index')::int
                      and d.block_hash = t.reference ->> 'block_hash'
                      and deposit_key(d.chain, d.tx_hash, d.kind, d.output_index) = t.deposit_key)
union all
select t.id, t.idempotency_key, 'credit to ' || p.ledger_account || ', who owned no observation of the key'
  from ledger_transfer t join ledger_posting p on p.transfer_id = t.id and p.direction = 'credit'
 where t.kind = 'deposit' and p.ledger_account <> 'treasury'
   and not exists (select 1 from deposit_status o
                    where o.deposit_key = t.deposit_key and 'user:' || o.account_id = p.ledger_account)
union all
select t.id, t.idempotency_key, 'a ' || t.kind || ' transfer without the decision it books'
  from ledger_transfer t
 where t.kind in ('reversal', 'deposit_loss')
   and not exists (select 1 from reversal_decision d join reversal_proposal r on r.id = d.proposal_id
                    where d.compensating_transfer_id = t.id and r.deposit_key = t.deposit_key
                      and d.decision = case t.kind when 'reversal' then 'approved' else 'rejected' end
                      and exists (select 1 from ledger_posting p where p.transfer_id = t.id and p.direction = 'debit'
                                     and p.amount = r.amount and p.asset = r.asset
                                     and p.ledger_account = case t.kind when 'reversal' then r.ledger_account
                                                                        else 'treasury' end)
                      and exists (select 1 from ledger_posting p where p.transfer_id = t.id and p.direction = 'credit'
                                     and p.ledger_account = 'custody' and p.amount = r.amount))
union all
select d.compensating_transfer_id, r.deposit_key, 'an approval without its reversal transfer'
  from reversal_decision d join reversal_proposal r on r.id = d.proposal_id
 where d.decision = 'approved'
   and not exists (select 1 from ledger_transfer t where t.id = d.compensating_transfer_id and t.kind = 'reversal')
order by 1";

/// What the withdrawals' events say the ledger must hold, as the posting rules book them
/// (`custodian_domain::posting_rules::bookings`, the rules the live path posts by): each
/// booking's two legs ($1 key, $2 ledger account, $3 asset, $4 direction, $5 amount), with the
/// transfer that holds its key, if any.
const EXPECTED_MOVEMENTS: &str = "
select t.id as transfer_id, m.key as idempotency_key, m.ledger_account, m.asset, m.direction, m.amount
  from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::numeric[])
       as m (key, ledger_account, asset, direction, amount)
  left join ledger_transfer t on t.idempotency_key = m.key";

/// The legs of `bookings`, as [`EXPECTED_MOVEMENTS`]'s parameters.
#[derive(Default)]
struct Legs {
    keys: Vec<String>,
    accounts: Vec<String>,
    assets: Vec<String>,
    directions: Vec<&'static str>,
    amounts: Vec<U256>,
}

impl Legs {
    fn of(bookings: &[Booking]) -> Legs {
        let mut legs = Legs::default();
        for b in bookings {
            for (account, direction) in [(&b.debit, "debit"), (&b.credit, "credit")] {
                legs.keys.push(b.key.clone());
                legs.accounts.push(account.to_string());
                legs.assets.push(b.asset.key());
                legs.directions.push(direction);
                legs.amounts.push(b.amount.units());
            }
        }
        legs
    }

    fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 5] {
        [&self.keys, &self.accounts, &self.assets, &self.directions, &self.amounts]
    }
}

/// Live postings of withdrawal kinds against what the events require, as a hash full join (a
/// duplicated posting unbalances its transfer, which the balance check reports).
fn posting_diff() -> String {
    format!(
        "with expected as ({EXPECTED_MOVEMENTS}), actual as (
    select t.id as transfer_id, t.idempotency_key, p.ledger_account, p.asset, p.direction, p.amount
      from ledger_transfer t join ledger_posting p on p.transfer_id = t.id
     where t.kind in ('withdrawal_hold', 'withdrawal_settle', 'withdrawal_release', 'network_fee')
)
select case when e.idempotency_key is null then 'live posting not derivable from facts'
            else 'posting the facts require is missing' end as difference,
       coalesce(a.transfer_id, e.transfer_id) as transfer_id, coalesce(a.idempotency_key, e.idempotency_key) as idempotency_key,
       coalesce(a.ledger_account, e.ledger_account) as ledger_account, coalesce(a.asset, e.asset) as asset,
       coalesce(a.direction, e.direction) as direction, coalesce(a.amount, e.amount) as amount
  from actual a
  full join expected e
    on e.transfer_id = a.transfer_id and e.ledger_account = a.ledger_account
   and e.asset = a.asset and e.direction = a.direction and e.amount = a.amount
 where a.idempotency_key is null or e.idempotency_key is null
 order by 3, 4, 6"
    )
}

/// Deposit keys whose booked custody differs from what observations, tiers and decisions say
/// (`key`: the key, its asset, booked, expected), then custody as booked against custody as the
/// facts put it there, per asset: the keys' expected amounts plus the withdrawal movements
/// (`custody`: the asset, booked, expected). One statement, so that the keys are derived once: at
/// 200,000 deposits each derivation reads every observation through `deposit_status` (4.2 s).
fn keys_and_custody() -> String {
    format!(
        "with keys as materialized ({DEPOSIT_KEYS}), movements as ({EXPECTED_MOVEMENTS}), booked as (
    select asset, sum(case direction when 'debit' then amount else -amount end) as net
      from ledger_posting where ledger_account = 'custody' group by asset
), from_facts as (
    select asset, sum(net) as net from (
        select asset, sum(case direction when 'debit' then amount else -amount end) as net
          from movements where ledger_account = 'custody' group by asset
        union all
        select asset, sum(expected) from keys group by asset) f
     group by asset
)
select 'key', deposit_key, asset, booked::text, expected::text from keys where booked <> expected
union all
select 'custody', null, coalesce(b.asset, f.asset), coalesce(b.net, 0)::text, coalesce(f.net, 0)::text
  from booked b full join from_facts f using (asset)
 where coalesce(b.net, 0) <> coalesce(f.net, 0)
order by 1, 2, 3"
    )
}

/// The rebuilt withdrawals ($1..$13, from the Rust fold) against every column of the projection.
const WITHDRAWAL_DIFF: &str = "
with rebuilt as (
    select * from unnest($1::bigint[], $2::text[], $3::int[], $4::text[], $5::text[], $6::bigint[], $7::text[],
                         $8::text[], $9::bigint[], $10::text[], $11::text[], $12::text[], $13::bool[])
           as r(id, state, last_seq, lane, from_address, nonce, tx_hash, mined_block_hash, account_id, asset,
                destination, amount, stuck_at_cap)
), live as (
    select id, state, last_seq, lane, from_address, nonce, tx_hash, mined_block_hash, account_id, asset, destination,
           amount::text, stuck_at_cap
      from withdrawal
)
select 'live withdrawal row not rebuilt from its events', w.* from (select * from live except select * from rebuilt) w
union all
select 'withdrawal rebuilt from events missing or different in the live projection', r.*
  from (select * from rebuilt except select * from live) r
order by 2";

/// The live `user_balance` rows against the fold of every posting ($1..$3, customer accounts).
const USER_BALANCE_DIFF: &str = "
with folded as (
    select a as ledger_account, s as asset, n::numeric as balance
      from unnest($1::text[], $2::text[], $3::text[]) as u(a, s, n) where a like 'user:%'
)
select coalesce(l.ledger_account, f.ledger_account), coalesce(l.asset, f.asset),
       coalesce(l.balance::text, 'no row'), coalesce(f.balance::text, 'nothing')
  from user_balance l full join folded f using (ledger_account, asset)
 where l.balance is distinct from f.balance
   and not (l.ledger_account is null and f.balance = 0)
 order by 1, 2";

/// Every column of the live `account_balance` view against the rebuild: available from the fold
/// of postings ($1..$3), held from the rebuilt withdrawals ($4..$6), confirmed their sum, pending
/// from the canonical observations whose key holds nothing.
const BALANCE_DIFF: &str = "
with available as (
    select substr(a, 6)::bigint as account_id, s as asset, n::numeric as available
      from unnest($1::text[], $2::text[], $3::text[]) as u(a, s, n) where a like 'user:%'
), held as (
    select account_id, asset, sum(amount::numeric) as held
      from unnest($4::bigint[], $5::text[], $6::text[]) as h(account_id, asset, amount) group by 1, 2
), pending as (
    select u.account_id, u.asset, sum(u.amount) as pending
      from (select distinct on (s.deposit_key) s.account_id, s.asset, s.amount from deposit_status s
             where s.account_id is not null and not s.orphaned and s.custody_posted = 0
             order by s.deposit_key, s.height desc) u
     where u.account_id <> all (select id from account where treasury)
     group by 1, 2
), rebuilt as (
    select account_id, asset, (coalesce(a.available, 0) + coalesce(h.held, 0))::text as confirmed,
           coalesce(p.pending, 0)::text as pending, coalesce(h.held, 0)::text as held,
           coalesce(a.available, 0)::text as available
      from available a full join held h using (account_id, asset) full join pending p using (account_id, asset)
), live as (
    select account_id, asset, confirmed::text, pending::text, held::text, available::text from account_balance
)
select 'live account_balance row differs from the rebuild', l.* from (select * from live except select * from rebuilt) l
union all
select 'rebuilt balance missing or different in account_balance', r.* from (select * from rebuilt except select * from live) r
order by 2, 3";

/// Adjustments have no source fact the system records; any is reported.
const UNTRACEABLE: &str =
    "select t.id, t.idempotency_key, t.kind from ledger_transfer t where t.kind = 'adjustment' order by t.id";

/// Transfers without a single posting.
const WITHOUT_POSTINGS: &str = "
select t.id, t.idempotency_key from ledger_transfer t
 where not exists (select 1 from ledger_posting p where p.transfer_id = t.id)
 order by t.id";

/// Debits and credits per asset of one transfer at a time, from postings ordered by transfer.
#[derive(Default)]
struct TransferFold {
    current: Option<i64>,
    /// (asset, debits, credits) of the current transfer; a transfer rarely has more than one.
    legs: Vec<(String, U256, U256)>,
    /// (transfer, asset) whose debits and credits differ.
    unbalanced: Vec<(i64, String)>,
}

impl TransferFold {
    fn add(&mut self, transfer: i64, asset: &str, credit: bool, amount: U256) {
        if self.current != Some(transfer) {
            self.finish();
            self.current = Some(transfer);
        }
        let index = match self.legs.iter().position(|(a, _, _)| a == asset) {
            Some(index) => index,
            None => {
                self.legs.push((asset.to_owned(), U256::ZERO, U256::ZERO));
                self.legs.len() - 1
            }
        };
        let leg = &mut self.legs[index];
        let side = if credit { &mut leg.2 } else { &mut leg.1 };
        *side = side.checked_add(amount).expect("BUG: postings of one transfer sum beyond 2^256");
    }

    /// Closes the current transfer.
    fn finish(&mut self) {
        if let Some(transfer) = self.current.take() {
            for (asset, debits, credits) in self.legs.drain(..) {
                if debits != credits {
                    self.unbalanced.push((transfer, asset));
                }
            }
        }
    }
}

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

/// The first `N` cells of `row`, as text.
fn cells<const N: usize>(row: &tokio_postgres::Row) -> [String; N] {
    std::array::from_fn(|i| cell(row, i))
}

/// A row of a diff query: its key, then every other column by name.
fn keyed(row: &tokio_postgres::Row) -> String {
    format!("{}: {}", cell(row, 0), describe(row, 1))
}

fn describe(row: &tokio_postgres::Row, from: usize) -> String {
    (from..row.len()).map(|i| format!("{}={}", row.columns()[i].name(), cell(row, i))).collect::<Vec<_>>().join(" ")
}

async fn count(tx: &deadpool_postgres::Transaction<'_>, table: &str) -> Result<u64, tokio_postgres::Error> {
    let n: i64 = tx.query_one(&format!("select count(*) from {table}"), &[]).await?.get(0);
    Ok(u64::try_from(n).expect("BUG: negative count"))
}

/// Streams the rows of `sql`, a query without parameters, through `each`; returns how many there were.
async fn for_each_row(
    tx: &deadpool_postgres::Transaction<'_>,
    sql: &str,
    mut each: impl FnMut(tokio_postgres::Row),
) -> Result<u64, tokio_postgres::Error> {
    let rows = tx.query_raw(sql, &[] as &[&str; 0]).await?;
    pin_mut!(rows);
    let mut n = 0;
    while let Some(row) = rows.try_next().await? {
        n += 1;
        each(row);
    }
    Ok(n)
}

/// Rebuilds and compares. Differences are returned, not raised: the caller decides the exit code.
///
/// # Cancel safety
/// One transaction, always rolled back; cancelling it leaves nothing behind.
pub async fn verify(client: &mut deadpool_postgres::Object) -> Result<VerifyReport, tokio_postgres::Error> {
    // Read only: replay never takes a transaction id, so it never holds back the history stream
    // (whose readers wait for every running writer).
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    let mut report = VerifyReport::default();

    // Withdrawals: fold every stream with the domain's fold.
    let mut streams: BTreeMap<i64, Vec<WithdrawalEvent>> = BTreeMap::new();
    let events = "select withdrawal_id, seq, event_type, payload from withdrawal_event order by withdrawal_id, seq";
    report.facts_read += for_each_row(&tx, events, |row| {
        let (id, seq, event_type, payload): (i64, i32, String, serde_json::Value) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let stream = streams.entry(id).or_default();
        if usize::try_from(seq).ok() != Some(stream.len() + 1) {
            report.differ("withdrawal streams", format!("withdrawal {id}: event {seq} follows {}", stream.len()));
        }
        match WithdrawalEvent::from_stored(&event_type, &payload) {
            Ok(event) => stream.push(event),
            Err(e) => report.differ(
                "withdrawal streams",
                format!("withdrawal {id}: event {seq} ({event_type}) does not decode: {e}"),
            ),
        }
    })
    .await?;
    let mut rebuilt = Vec::with_capacity(streams.len());
    let mut bookings = Vec::new();
    for (id, events) in &streams {
        bookings.extend(posting_rules::bookings(WithdrawalId::new(*id), events));
        match Withdrawal::fold(WithdrawalId::new(*id), events) {
            Some(w) => rebuilt.push(w),
            None => report
                .differ("withdrawal streams", format!("withdrawal {id}: its stream does not start with requested")),
        }
    }
    let column = |f: fn(&Withdrawal) -> Option<String>| rebuilt.iter().map(f).collect::<Vec<_>>();
    let ids: Vec<i64> = rebuilt.iter().map(|w| w.id().get()).collect();
    let seqs: Vec<i32> = rebuilt.iter().map(|w| w.last_seq()).collect();
    let nonces: Vec<Option<i64>> = rebuilt.iter().map(|w| w.nonce().map(Nonce::stored)).collect();
    let accounts: Vec<i64> = rebuilt.iter().map(|w| w.account_id().get()).collect();
    let stuck: Vec<bool> = rebuilt.iter().map(|w| w.stuck_at_cap()).collect();
    let rebuilt_params: [&(dyn tokio_postgres::types::ToSql + Sync); 13] = [
        &ids,
        &column(|w| Some(w.state().as_str().to_owned())),
        &seqs,
        &column(|w| Some(w.lane().to_string())),
        &column(|w| w.from_address().map(ChainAddress::stored)),
        &nonces,
        &column(|w| w.tx_hash().map(|h| h.to_string())),
        &column(|w| w.mined_block_hash().map(|h| h.to_string())),
        &accounts,
        &column(|w| Some(w.asset().key())),
        &column(|w| Some(w.destination().stored())),
        &column(|w| Some(w.amount().to_string())),
        &stuck,
    ];
    for row in tx.query(WITHDRAWAL_DIFF, &rebuilt_params).await? {
        report.differ("withdrawal projection", keyed(&row));
    }
    // What the rebuilt withdrawals hold: those still in flight.
    // Customers' only: the treasury's rebalances are not a customer's held balance.
    let in_flight: Vec<&Withdrawal> = rebuilt.iter().filter(|w| w.holds_funds() && !w.treasury()).collect();
    let held_accounts: Vec<i64> = in_flight.iter().map(|w| w.account_id().get()).collect();
    let held_assets: Vec<String> = in_flight.iter().map(|w| w.asset().key()).collect();
    let held_amounts: Vec<String> = in_flight.iter().map(|w| w.amount().to_string()).collect();

    // Balances and the balance of every transfer: fold every posting, a transfer at a time.
    let mut balances: BTreeMap<(String, String), (U256, U256)> = BTreeMap::new();
    let mut fold = TransferFold::default();
    let postings =
        "select transfer_id, ledger_account, asset, direction, amount from ledger_posting order by transfer_id";
    report.facts_read += for_each_row(&tx, postings, |row| {
        let (transfer, account, asset, direction, amount): (i64, String, String, String, U256) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        let credit = direction == "credit";
        fold.add(transfer, &asset, credit, amount);
        let entry = balances.entry((account, asset)).or_insert((U256::ZERO, U256::ZERO));
        let side = if credit { &mut entry.0 } else { &mut entry.1 };
        *side = side.checked_add(amount).expect("BUG: postings of one account sum beyond 2^256");
    })
    .await?;
    fold.finish();
    let mut accounts = Vec::new();
    let mut assets = Vec::new();
    let mut nets = Vec::new();
    for ((account, asset), (credits, debits)) in balances {
        // customers' accounts are liabilities (credit-normal); the rest are assets (debit-normal).
        let customer = matches!(account.parse::<LedgerAccount>(), Ok(LedgerAccount::User(_)));
        let (plus, minus) = if customer { (credits, debits) } else { (debits, credits) };
        let net = SignedAmount::difference(Amount::from_units(plus), Amount::from_units(minus)).to_string();
        accounts.push(account);
        assets.push(asset);
        nets.push(net);
    }
    for row in tx.query(BALANCE_DIFF, &[&accounts, &assets, &nets, &held_accounts, &held_assets, &held_amounts]).await?
    {
        report.differ("balances", keyed(&row));
    }

    // The balance projection the request path reads, against the same fold.
    for row in tx.query(USER_BALANCE_DIFF, &[&accounts, &assets, &nets]).await? {
        let [account, asset, live, folded] = cells(&row);
        report.differ(
            "user balances",
            format!("{account} {asset}: user_balance says {live}, the postings sum to {folded}"),
        );
    }

    // The posting set and the invariants.
    let legs = Legs::of(&bookings);
    for row in tx.query(&posting_diff(), &legs.params()).await? {
        report.differ("posting set", keyed(&row));
    }
    // Custody's differences are reported after the transfers' balance they follow from, as before.
    let mut custody = Vec::new();
    for row in tx.query(&keys_and_custody(), &legs.params()).await? {
        let [check, key, asset, booked, expected] = cells(&row);
        if check == "key" {
            let detail = format!(
                "{key} ({asset}): the ledger holds {booked} under the key, the chain and the decisions say {expected}"
            );
            report.differ("deposit keys", detail);
        } else {
            custody.push(format!("{asset}: custody booked {booked} but the facts put {expected} there"));
        }
    }
    for row in tx.query(DEPOSIT_SHAPE, &[]).await? {
        let [transfer, key, problem] = cells(&row);
        report.differ("postings trace to facts", format!("transfer {transfer} ({key}): {problem}"));
    }
    for row in tx.query(UNTRACEABLE, &[]).await? {
        let [transfer, key, kind] = cells(&row);
        report
            .differ("postings trace to facts", format!("transfer {transfer} ({key}, kind {kind}) has no source fact"));
    }
    let mut unbalanced: Vec<(i64, String, String)> = Vec::new();
    for row in tx.query(WITHOUT_POSTINGS, &[]).await? {
        unbalanced.push((row.get(0), row.get(1), "it has no postings".to_owned()));
    }
    if !fold.unbalanced.is_empty() {
        let ids: Vec<i64> = fold.unbalanced.iter().map(|(id, _)| *id).collect();
        let keys: BTreeMap<i64, String> = tx
            .query("select id, idempotency_key from ledger_transfer where id = any($1)", &[&ids])
            .await?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        for (id, asset) in &fold.unbalanced {
            let key = keys.get(id).cloned().unwrap_or_else(|| "no such transfer".to_owned());
            unbalanced.push((*id, key, format!("debits differ from credits in {asset}")));
        }
    }
    unbalanced.sort();
    for (id, key, problem) in unbalanced {
        report.differ("transfers balance", format!("transfer {id} ({key}): {problem}"));
    }
    for detail in custody {
        report.differ("custody", detail);
    }
    report.differences.extend(crate::btc_spends::verify(&tx).await?);
    for (position, problem) in crate::seals::broken(&tx).await? {
        report.differ("fact seals", format!("history position {position}: {problem}"));
    }
    for table in ["chain_block", "deposit_event", "ledger_transfer", "reversal_decision"] {
        report.facts_read += count(&tx, table).await?;
    }
    tx.rollback().await?;
    Ok(report)
}
