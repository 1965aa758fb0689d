-- The deposit lifecycle (DESIGN §4, §5 items 8–10, §6).
--
-- Block verdicts: a block's standing is its latest appended verdict (`orphaned`, `reinstated`);
-- chain_block.orphaned_at is the projection of that standing and changes only through a verdict,
-- so a block that comes back (a flip-back, a load-balanced node) is recorded, never a reason to
-- stop. Deposit kinds make keys stable: `native` (index 0), `log` (the log's position in its
-- transaction's receipt, not the block-wide index, which moves when the transaction is re-mined
-- elsewhere), `internal` (the call's position in the call tree) and `output` (BTC vout). Deposit
-- transfers carry their key; reconciliation credits, re-credits and opens discrepancy rounds per
-- key. Chain identity pins the network a database scans.

-- ------------------------------------------------------------------ block verdicts

create table block_verdict (
    chain       text        not null,
    block_hash  text        not null,
    seq         integer     not null check (seq >= 1),
    verdict     text        not null check (verdict in ('orphaned', 'reinstated')),
    reason      text        not null check (length(reason) > 0),
    recorded_at timestamptz not null default now(),
    -- the audit history's position and transaction (V8)
    fact_position bigint    not null default nextval('fact_position_seq'),
    fact_xid      xid8      not null default pg_current_xact_id(),
    primary key (chain, block_hash, seq),
    foreign key (chain, block_hash) references chain_block (chain, block_hash)
);

create index block_verdict_fact on block_verdict (fact_xid, fact_position);

create trigger block_verdict_append_only
    before update or delete on block_verdict
    for each row execute function reject_mutation();
create trigger block_verdict_no_truncate
    before truncate on block_verdict
    for each statement execute function reject_mutation();

-- Every block orphaned so far gets the verdict its mark stands for, at the mark's position in the
-- audit history, so a resumed history stream neither repeats nor skips it. The orphan_mark table
-- stops growing: a block may now be orphaned more than once.
insert into block_verdict (chain, block_hash, seq, verdict, reason, recorded_at, fact_position, fact_xid)
select b.chain, b.block_hash, 1, 'orphaned', 'orphan mark recorded before block verdicts existed', b.orphaned_at,
       coalesce(m.fact_position, nextval('fact_position_seq')), coalesce(m.fact_xid, pg_current_xact_id())
  from chain_block b left join orphan_mark m on m.chain = b.chain and m.block_hash = b.block_hash
 where b.orphaned_at is not null;
drop trigger chain_block_orphan_mark on chain_block;

-- chain_block is immutable but for orphaned_at, and orphaned_at always equals the standing of the
-- block's latest verdict: set to its time when it is `orphaned`, null when it is `reinstated` or
-- there is none. The owner cannot break the pairing either.
create function chain_block_follows_verdicts() returns trigger
language plpgsql as $$
declare
    latest block_verdict;
begin
    if tg_op = 'UPDATE' and to_jsonb(new) - 'orphaned_at' = to_jsonb(old) - 'orphaned_at'
       and new.orphaned_at is distinct from old.orphaned_at then
        select * into latest from block_verdict v
         where v.chain = new.chain and v.block_hash = new.block_hash order by v.seq desc limit 1;
        if (latest.verdict = 'orphaned' and new.orphaned_at = latest.recorded_at)
           or (coalesce(latest.verdict, 'reinstated') = 'reinstated' and new.orphaned_at is null) then
            return new;
        end if;
        raise exception 'chain_block %: orphaned_at must reflect the latest block_verdict', new.block_hash
            using errcode = 'P0001', table = tg_table_name;
    end if;
    raise exception 'append-only table %: % rejected', tg_table_name, tg_op
        using errcode = 'P0001', table = tg_table_name,
              detail = 'only orphaned_at changes, and only through a block_verdict';
end;
$$;

drop trigger chain_block_append_only on chain_block;
create trigger chain_block_append_only
    before update or delete on chain_block
    for each row execute function chain_block_follows_verdicts();

-- Appending a verdict moves the projection in the same transaction. Security definer: the
-- service appends verdicts and cannot update chain_block itself.
create function block_verdict_project() returns trigger
language plpgsql security definer set search_path = public, pg_temp as $$
begin
    update chain_block
       set orphaned_at = case new.verdict when 'orphaned' then new.recorded_at end
     where chain = new.chain and block_hash = new.block_hash
       and orphaned_at is distinct from case new.verdict when 'orphaned' then new.recorded_at end;
    return null;
end;
$$;

create trigger block_verdict_projects
    after insert on block_verdict
    for each row execute function block_verdict_project();

revoke update on chain_block from custodian_service;
grant select, insert on block_verdict to custodian_service;



-- ------------------------------------------------------------------ chain identity

create table chain_identity (
    chain        text        primary key check (chain in ('eth', 'btc')),
    network      text        not null check (length(network) > 0),
    genesis_hash text        not null,
    chain_id     bigint      null check (chain_id > 0),
    recorded_at  timestamptz not null default now(),
    check (is_valid_hash(chain, genesis_hash)),
    check ((chain = 'eth') = (chain_id is not null))
);

create trigger chain_identity_append_only
    before update or delete on chain_identity
    for each row execute function reject_mutation();
create trigger chain_identity_no_truncate
    before truncate on chain_identity
    for each statement execute function reject_mutation();

grant select, insert on chain_identity to custodian_service;

-- ------------------------------------------------------------------ deposit kinds, stable keys

alter table deposit_event
    add column kind text null check (kind in ('native', 'log', 'internal', 'output')),
    -- a BTC coinbase output: spendable, so confirmable, only after 100 blocks
    add column coinbase boolean not null default false;

-- The position of an ERC-20 log within its transaction's receipt, from the retained payload. A
-- deposit whose payload was pruned (past the window, beyond any reorg we follow) keeps its index.
create temporary table rekeyed_deposit on commit drop as
select d.id, d.chain, d.tx_hash, d.output_index as old_index, d.block_hash,
       case when d.chain = 'btc' then 'output' when d.asset = 'ETH' then 'native' else 'log' end as kind,
       coalesce(pos.position, d.output_index) as output_index
  from deposit_event d
  left join lateral (
        select (l.ordinality - 1)::integer as position
          from raw_block r
         cross join lateral jsonb_array_elements(convert_from(r.payload, 'UTF8')::jsonb -> 'receipts') rc
         cross join lateral jsonb_array_elements(rc -> 'logs') with ordinality as l (log, ordinality)
         where d.chain = 'eth' and d.asset <> 'ETH'
           and r.chain = d.chain and r.block_hash = d.block_hash
           and lower(rc ->> 'transactionHash') = d.tx_hash
           and ('x' || lpad(substr(l.log ->> 'logIndex', 3), 16, '0'))::bit(64)::bigint = d.output_index
         limit 1
  ) pos on true;

alter table deposit_event disable trigger deposit_event_append_only;
update deposit_event d set kind = r.kind, output_index = r.output_index
  from rekeyed_deposit r where r.id = d.id;
alter table deposit_event enable trigger deposit_event_append_only;

alter table deposit_event alter column kind set not null;
alter table deposit_event drop constraint deposit_event_chain_tx_hash_output_index_block_hash_key;
alter table deposit_event add constraint deposit_event_key unique (chain, tx_hash, kind, output_index, block_hash);
alter table deposit_event add constraint deposit_event_kind_matches_chain
    check ((chain = 'btc') = (kind = 'output') and (kind <> 'native' or output_index = 0) and (not coinbase or chain = 'btc'));

-- ------------------------------------------------------------------ transfers carry their deposit key

alter table ledger_transfer add column deposit_key text null
    check (deposit_key ~ '^deposit:(eth|btc):[^:]+:(native|log|internal|output):[0-9]+$');
create index ledger_transfer_deposit_key on ledger_transfer (deposit_key) where deposit_key is not null;

alter table ledger_transfer drop constraint ledger_transfer_kind_check;
alter table ledger_transfer add constraint ledger_transfer_kind_check check (kind in (
    'deposit', 'withdrawal_hold', 'withdrawal_settle', 'withdrawal_release', 'network_fee', 'reversal',
    'deposit_loss', 'adjustment'));

-- Old keys: 'deposit:{chain}:{tx}:{index}' (credit) and 'reversal:deposit:{chain}:{tx}:{index}'.
-- New: '{deposit_key}:credit:1' and '{deposit_key}:reversal:1', deposit_key naming the kind.
create temporary table rekeyed_transfer on commit drop as
select t.id,
       'deposit:' || r.chain || ':' || r.tx_hash || ':' || r.kind || ':' || r.output_index as deposit_key,
       t.kind, r.kind as deposit_kind, r.output_index,
       'deposit:' || r.chain || ':' || r.tx_hash || ':' || r.old_index as old_key
  from ledger_transfer t
  join rekeyed_deposit r on r.chain = t.reference ->> 'chain' and r.tx_hash = t.reference ->> 'tx_hash'
                        and r.old_index = (t.reference ->> 'output_index')::integer
                        and r.block_hash = t.reference ->> 'block_hash'
 where t.kind = 'deposit';

alter table ledger_transfer disable trigger ledger_transfer_append_only;
update ledger_transfer t
   set deposit_key = r.deposit_key,
       idempotency_key = r.deposit_key || ':credit:1',
       reference = t.reference || jsonb_build_object('kind', r.deposit_kind, 'output_index', r.output_index)
  from rekeyed_transfer r where r.id = t.id;
update ledger_transfer t
   set deposit_key = r.deposit_key,
       idempotency_key = r.deposit_key || ':reversal:1',
       reference = t.reference || jsonb_build_object('deposit_key', r.deposit_key)
  from rekeyed_transfer r where t.kind = 'reversal' and t.idempotency_key = 'reversal:' || r.old_key;
alter table ledger_transfer enable trigger ledger_transfer_append_only;

-- ------------------------------------------------------------------ discrepancy rounds

-- A reversal proposal is one round of a deposit key's discrepancy: the ledger holds more under the
-- key than the canonical chain. Rounds are numbered per key; a later change opens the next.
alter table reversal_proposal
    add column round integer not null default 1 check (round >= 1),
    add column chain text null,
    add column tx_hash text null,
    add column kind text null,
    add column output_index integer null,
    add column ledger_account text null,
    add column asset text null,
    add column amount numeric(78,0) null check (amount > 0);
alter table reversal_proposal alter column transfer_id drop not null;
alter table reversal_proposal drop constraint reversal_proposal_deposit_key_key;
alter table reversal_proposal drop constraint reversal_proposal_deposit_key_check;

alter table reversal_proposal disable trigger reversal_proposal_append_only;
update reversal_proposal p
   set deposit_key = r.deposit_key, chain = t.reference ->> 'chain', tx_hash = t.reference ->> 'tx_hash',
       kind = r.deposit_kind, output_index = r.output_index,
       ledger_account = c.ledger_account, asset = c.asset, amount = c.amount
  from rekeyed_transfer r
  join ledger_transfer t on t.id = r.id
  join ledger_posting c on c.transfer_id = r.id and c.direction = 'credit'
 where r.id = p.transfer_id;
alter table reversal_proposal enable trigger reversal_proposal_append_only;

alter table reversal_proposal
    alter column chain set not null, alter column tx_hash set not null, alter column kind set not null,
    alter column output_index set not null, alter column ledger_account set not null,
    alter column asset set not null, alter column amount set not null,
    add constraint reversal_proposal_round unique (deposit_key, round),
    add constraint reversal_proposal_key_matches check (
        deposit_key = 'deposit:' || chain || ':' || tx_hash || ':' || kind || ':' || output_index);
create index reversal_proposal_deposit on reversal_proposal (chain, tx_hash, kind, output_index);

-- Decisions: `approved` (the user is debited), `rejected` (the loss is booked to treasury; rounds
-- rejected before this migration booked nothing), `closed` (the money was re-mined before anyone
-- decided; recorded by the service, moving nothing).
alter table reversal_decision drop constraint reversal_decision_check;
alter table reversal_decision drop constraint reversal_decision_decision_check;
alter table reversal_decision
    add constraint reversal_decision_decision_check check (decision in ('approved', 'rejected', 'closed')),
    add constraint reversal_decision_books check (
        (decision = 'approved' and compensating_transfer_id is not null)
        or decision = 'rejected'
        or (decision = 'closed' and compensating_transfer_id is null));

-- ------------------------------------------------------------------ deposit_status and balances

drop view account_balance;
drop view deposit_status;

-- One row per observation. The tier is chosen by what the observation's transaction pays the same
-- account in the same asset in that block (splitting a payment does not make it faster), from the
-- asset's own tiers; an asset without tiers uses the chain's deepest tier; a coinbase output needs
-- 100 blocks whatever the tier. The key's ledger columns sum every transfer under the key.
create view deposit_status as
with observed as (
    select d.id, d.chain, d.tx_hash, d.kind, d.output_index,
           'deposit:' || d.chain || ':' || d.tx_hash || ':' || d.kind || ':' || d.output_index as deposit_key,
           d.block_hash, b.height, d.address, d.asset, d.amount, d.coinbase, owner.account_id,
           b.orphaned_at is not null as orphaned,
           case when b.orphaned_at is null then tip.height - b.height + 1 else 0 end as confirmations
      from deposit_event d
      join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash
      left join chain_tip tip on tip.chain = d.chain
      left join lateral (
            select w.account_id
              from wallet_address w
             where w.chain = d.chain and w.address = d.address and w.valid_from_height <= b.height
               and (w.valid_to_height is null or b.height < w.valid_to_height)
             order by w.valid_from_height desc
             limit 1
      ) owner on true
), paid as (
    select o.*,
           sum(o.amount) over (partition by o.chain, o.block_hash, o.tx_hash, o.asset, o.account_id) as tx_amount
      from observed o
)
select p.id, p.chain, p.tx_hash, p.output_index, p.block_hash, p.height, p.address, p.asset, p.amount,
       p.account_id, p.orphaned, p.confirmations,
       required.confirmations as required_confirmations,
       coalesce(not p.orphaned and p.confirmations >= required.confirmations, false) as confirmed,
       coalesce(k.custody, 0) > 0 as posted,
       p.kind, p.deposit_key, p.coinbase, p.tx_amount,
       coalesce(k.credited, 0) as credited,
       coalesce(k.reversed, 0) as reversed,
       coalesce(k.recredited, 0) as recredited,
       coalesce(k.custody, 0) as custody_posted,
       coalesce(k.treasury, 0) as treasury_posted,
       coalesce(k.credits, 0) as credits,
       k.credited_account,
       k.last_credit_id
  from paid p
  left join lateral (
        select cp.confirmations from confirmation_policy cp
         where cp.chain = p.chain and cp.asset = p.asset and cp.min_amount <= p.tx_amount
         order by cp.min_amount desc limit 1
  ) own on true
  left join lateral (
        select max(cp.confirmations) as confirmations from confirmation_policy cp
         where cp.chain = p.chain and cp.asset = case p.chain when 'eth' then 'ETH' else 'BTC' end
  ) deepest on true
  cross join lateral (
        select greatest(coalesce(own.confirmations, deepest.confirmations), case when p.coinbase then 100 end)
               as confirmations
  ) required
  left join lateral (
        select sum(case when x.ledger_account = 'custody' then
                       case x.direction when 'debit' then x.amount else -x.amount end end) as custody,
               sum(case when x.ledger_account = 'treasury' then
                       case x.direction when 'credit' then x.amount else -x.amount end end) as treasury,
               sum(x.amount) filter (where x.ledger_account = 'custody' and x.direction = 'debit'
                                       and x.idempotency_key = p.deposit_key || ':credit:1') as credited,
               sum(x.amount) filter (where x.ledger_account = 'custody' and x.direction = 'debit'
                                       and x.idempotency_key <> p.deposit_key || ':credit:1') as recredited,
               sum(x.amount) filter (where x.ledger_account = 'custody' and x.direction = 'credit') as reversed,
               count(distinct x.transfer_id) filter (where x.kind = 'deposit') as credits,
               (array_agg(x.ledger_account order by x.transfer_id desc)
                    filter (where x.kind = 'deposit' and x.direction = 'credit'))[1] as credited_account,
               max(x.transfer_id) filter (where x.kind = 'deposit') as last_credit_id
          from (select t.id as transfer_id, t.kind, t.idempotency_key, lp.ledger_account, lp.direction, lp.amount
                  from ledger_transfer t join ledger_posting lp on lp.transfer_id = t.id
                 where t.deposit_key = p.deposit_key) x
  ) k on true;

-- Balances per account and asset, as before; pending counts each key once: observed on a
-- canonical block, attributed, not yet confirmed, and holding nothing in the ledger.
create view account_balance as
with ledger as (
    select substr(p.ledger_account, 6)::bigint as account_id,
           p.asset,
           sum(case p.direction when 'credit' then p.amount else -p.amount end) as net
      from ledger_posting p
     where p.ledger_account like 'user:%'
     group by 1, 2
), held as (
    select w.account_id, w.asset, sum(w.amount) as held
      from withdrawal w
     where w.account_id is not null
       and w.state in ('requested', 'awaiting_approval', 'signed', 'broadcast', 'mined',
                       'cancel_requested', 'needs_review')
     group by 1, 2
), pending as (
    select u.account_id, u.asset, sum(u.amount) as pending
      from (select distinct on (s.deposit_key) s.account_id, s.asset, s.amount
              from deposit_status s
             where s.account_id is not null and not s.orphaned and s.custody_posted = 0
             order by s.deposit_key, s.height desc) u
     group by 1, 2
)
select account_id,
       asset,
       coalesce(l.net, 0) + coalesce(h.held, 0) as confirmed,
       coalesce(p.pending, 0) as pending,
       coalesce(h.held, 0) as held,
       coalesce(l.net, 0) as available
  from ledger l
  full join held h using (account_id, asset)
  full join pending p using (account_id, asset);

grant select on account_balance, deposit_status to custodian_reader, custodian_service;

-- Keys whose every observation is on an orphaned block, with the grace period the reconciliation
-- waits before opening a discrepancy: the canonical chain must have built the key's own
-- confirmation count in blocks beyond the old chain's tip (the highest block orphaned together
-- with the key's block), so money re-mined soon after a reorg never raises a discrepancy.
create index block_verdict_orphaning on block_verdict (chain, recorded_at) where verdict = 'orphaned';

create view deposit_lost as
select s.deposit_key, s.chain, s.tx_hash, s.kind, s.output_index, s.block_hash, s.height, s.asset,
       s.required_confirmations, s.custody_posted, s.credited_account, s.last_credit_id,
       lost.old_tip, tip.height as tip,
       coalesce(tip.height - lost.old_tip >= s.required_confirmations, false) as grace_passed
  from (select distinct on (o.deposit_key) o.*
          from deposit_status o where o.orphaned
         order by o.deposit_key, o.height desc) s
  join chain_tip tip on tip.chain = s.chain
  cross join lateral (
        select max(b2.height) as old_tip
          from (select v.chain, v.recorded_at from block_verdict v
                 where v.chain = s.chain and v.block_hash = s.block_hash
                 order by v.seq desc limit 1) latest
          join block_verdict v2 on v2.chain = latest.chain and v2.verdict = 'orphaned'
                               and v2.recorded_at = latest.recorded_at
          join chain_block b2 on b2.chain = v2.chain and b2.block_hash = v2.block_hash
  ) lost
 where not exists (select 1 from deposit_event d join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash
                    where d.chain = s.chain and d.tx_hash = s.tx_hash and d.kind = s.kind
                      and d.output_index = s.output_index and b.orphaned_at is null);

grant select on deposit_lost to custodian_reader, custodian_service;

-- The history with block verdicts in place of orphan marks ('orphan_mark' keeps its name;
-- 'block_reinstated' is new), and deposit kinds.
create or replace view audit_event as
select b.fact_position as position, b.fact_xid as xid, 'block' as kind, b.seen_at as recorded_at,
       jsonb_build_object('chain', b.chain, 'height', b.height, 'block_hash', b.block_hash,
                          'parent_hash', b.parent_hash) as payload
  from chain_block b
union all
select v.fact_position, v.fact_xid, case v.verdict when 'orphaned' then 'orphan_mark' else 'block_reinstated' end,
       v.recorded_at, jsonb_build_object('chain', v.chain, 'block_hash', v.block_hash, 'seq', v.seq, 'reason', v.reason)
  from block_verdict v
union all
select d.fact_position, d.fact_xid, 'deposit_observed', d.observed_at,
       jsonb_build_object('chain', d.chain, 'block_hash', d.block_hash, 'tx_hash', d.tx_hash,
                          'output_index', d.output_index, 'address', d.address, 'asset', d.asset,
                          'amount', d.amount::text, 'kind', d.kind)
  from deposit_event d
union all
select t.fact_position, t.fact_xid, 'ledger_transfer', t.created_at,
       jsonb_build_object('transfer_id', t.id, 'idempotency_key', t.idempotency_key, 'kind', t.kind,
                          'reference', t.reference,
                          'postings', (select jsonb_agg(jsonb_build_object(
                                                  'ledger_account', p.ledger_account, 'asset', p.asset,
                                                  'direction', p.direction, 'amount', p.amount::text)
                                                  order by p.id)
                                         from ledger_posting p where p.transfer_id = t.id))
  from ledger_transfer t
union all
select r.fact_position, r.fact_xid, 'reversal_proposed', r.proposed_at,
       jsonb_build_object('proposal_id', r.id, 'deposit_key', r.deposit_key, 'transfer_id', r.transfer_id,
                          'reason', r.reason)
  from reversal_proposal r
union all
select r.fact_position, r.fact_xid, 'reversal_' || r.decision, r.decided_at,
       jsonb_build_object('proposal_id', r.proposal_id, 'decided_by', r.decided_by, 'reason', r.reason,
                          'compensating_transfer_id', r.compensating_transfer_id)
  from reversal_decision r
union all
select e.fact_position, e.fact_xid, 'withdrawal_' || e.event_type, e.recorded_at,
       jsonb_build_object('withdrawal_id', e.withdrawal_id, 'seq', e.seq) || e.payload
  from withdrawal_event e
union all
select o.fact_position, o.fact_xid, 'operator_' || o.action, o.recorded_at,
       jsonb_build_object('action_id', o.id, 'principal', o.principal) || o.details
  from operator_action o;
