-- The double-entry ledger, the customers' balances it implies, and the deposit lifecycle that
-- feeds it.
--
-- ledger_transfer is one movement of money, idempotent on a key that describes the money, never
-- the delivery: '{deposit key}:credit:{n}' (a deposit credited, or re-credited after a reorg),
-- '{deposit key}:reversal:{round}' and '{deposit key}:loss:{round}' (a discrepancy round
-- decided), 'withdrawal:{id}:hold', 'withdrawal:{id}:settle', 'withdrawal:{id}:release', ...
-- Deposit transfers also carry their deposit key (deposit_key(), V2__chain_observations.sql), so
-- everything booked under one key is one index probe. ledger_posting holds a transfer's legs:
-- direction is a column, amounts are unsigned. A deferred constraint trigger rejects, at commit, a
-- transfer with no postings or whose debits and credits differ for any asset; the Rust side
-- asserts the same before writing. Ledger accounts are text: 'user:{account_id}' (what we owe a
-- customer), 'custody' (what is on-chain under our keys), 'withdrawal_holds' (reserved for
-- withdrawals in flight), 'network_fees' and 'treasury' (the operator's own funds, including what
-- arrives at our hot wallets).
--
-- user_balance keeps each customer ledger account's balance per asset, so `available` never sums
-- an account's whole history; available() is the one definition of what a customer may spend.
--
-- Reconciliation works per deposit key: it credits, re-credits, and opens discrepancy rounds.
-- A round (reversal_proposal) is opened when the ledger holds more under a key than the canonical
-- chain does, typically a posted deposit whose every observation was orphaned; a named person's
-- reversal_decision approves it (the customer is debited), rejects it (the loss is booked to
-- treasury), or the service closes it because the money was re-mined first. Taking money back is
-- never automatic. Transfers, postings, rounds and decisions are append-only.

-- ------------------------------------------------------------------ transfers and postings

create table ledger_transfer (
    id              bigserial   not null,
    idempotency_key text        not null,
    kind            text        not null,
    reference       jsonb       not null default '{}',
    created_at      timestamptz not null default now(),
    fact_position   bigint      not null default nextval('fact_position_seq'),
    fact_xid        xid8        not null default pg_current_xact_id(),
    -- the deposit key a deposit, reversal or loss transfer books under; null for the others
    deposit_key     text        null,
    constraint ledger_transfer_pkey primary key (id),
    constraint ledger_transfer_idempotency_key_key unique (idempotency_key),
    constraint ledger_transfer_idempotency_key_nonempty check (length(idempotency_key) > 0),
    constraint ledger_transfer_kind_known check (kind in (
        'deposit', 'withdrawal_hold', 'withdrawal_settle', 'withdrawal_release', 'network_fee', 'reversal',
        'deposit_loss', 'adjustment')),
    constraint ledger_transfer_deposit_key_format
        check (deposit_key ~ '^deposit:(eth|btc):[^:]+:(native|log|internal|output):[0-9]+$')
);

create index ledger_transfer_deposit_key on ledger_transfer (deposit_key) where deposit_key is not null;

create table ledger_posting (
    id             bigserial     not null,
    transfer_id    bigint        not null,
    ledger_account text          not null,
    asset          text          not null,
    direction      text          not null,
    amount         numeric(78,0) not null,
    constraint ledger_posting_pkey primary key (id),
    constraint ledger_posting_transfer_id_fkey foreign key (transfer_id) references ledger_transfer (id),
    constraint ledger_posting_asset_fkey foreign key (asset) references asset (asset),
    constraint ledger_posting_ledger_account_known
        check (ledger_account ~ '^(user:[0-9]+|custody|withdrawal_holds|network_fees|treasury)$'),
    constraint ledger_posting_direction_known check (direction in ('debit', 'credit')),
    constraint ledger_posting_amount_positive check (amount > 0),
    constraint ledger_posting_amount_u256 check (is_u256(amount))
);

-- Covering index for one account's balance and history: its postings are answered from the index
-- alone once vacuum has marked the pages all-visible (see deposit_event_address_covering).
create index ledger_posting_account_covering
    on ledger_posting (ledger_account, asset) include (direction, amount);
create index ledger_posting_transfer on ledger_posting (transfer_id);

-- Runs at commit for every inserted transfer and posting. Raises check_violation (23514) with
-- constraint name ledger_transfer_balanced so callers can classify it.
--
-- A transfer and its postings are normally inserted by one transaction. A posting's trigger skips
-- transfers created by the same transaction (their own trigger checks them at commit, after every
-- posting is in), so a two-legged transfer is checked once, not three times, and the check itself
-- is one aggregate. A posting added later to an older transfer is still checked by its own trigger.
create function check_transfer_balanced() returns trigger
language plpgsql as $$
declare
    checked_id bigint;
    legs bigint;
    unbalanced record;
begin
    if tg_table_name = 'ledger_transfer' then
        checked_id := new.id;
    else
        checked_id := new.transfer_id;
        if exists (select 1 from ledger_transfer t
                    where t.id = checked_id and t.fact_xid = pg_current_xact_id()) then
            return null;
        end if;
    end if;

    select count(*) into legs from ledger_posting where transfer_id = checked_id;
    if legs = 0 then
        raise exception 'ledger transfer % has no postings', checked_id
            using errcode = '23514',
                  constraint = 'ledger_transfer_balanced',
                  table = 'ledger_transfer';
    end if;

    select p.asset,
           coalesce(sum(p.amount) filter (where p.direction = 'debit'), 0) as debits,
           coalesce(sum(p.amount) filter (where p.direction = 'credit'), 0) as credits
      into unbalanced
      from ledger_posting p
     where p.transfer_id = checked_id
     group by p.asset
    having coalesce(sum(p.amount) filter (where p.direction = 'debit'), 0)
        <> coalesce(sum(p.amount) filter (where p.direction = 'credit'), 0)
     order by p.asset
     limit 1;

    if found then
        raise exception 'ledger transfer % does not balance for asset %: debits %, credits %',
                checked_id, unbalanced.asset, unbalanced.debits, unbalanced.credits
            using errcode = '23514',
                  constraint = 'ledger_transfer_balanced',
                  table = 'ledger_transfer';
    end if;
    return null;
end;
$$;

create constraint trigger ledger_transfer_balanced
    after insert on ledger_transfer
    deferrable initially deferred
    for each row execute function check_transfer_balanced();
create constraint trigger ledger_posting_balanced
    after insert on ledger_posting
    deferrable initially deferred
    for each row execute function check_transfer_balanced();

call append_only('ledger_transfer');
call append_only('ledger_posting');

-- ------------------------------------------------------------------ customers' balances

-- Each customer ledger account's balance per asset, kept by a trigger in the same transaction as
-- the postings it sums (one row update per account and asset a statement touches, in key order),
-- rebuilt and compared by `replay --verify`. System accounts (custody, withdrawal_holds,
-- network_fees, treasury) are not kept here: every transfer touches one of them, and a row per
-- system account would serialise every ledger write. The service reads it; only the trigger (as
-- the owner) writes it.
create table user_balance (
    ledger_account text          not null,
    asset          text          not null,
    balance        numeric(78,0) not null,
    constraint user_balance_pkey primary key (ledger_account, asset),
    constraint user_balance_asset_fkey foreign key (asset) references asset (asset),
    constraint user_balance_ledger_account_format check (ledger_account ~ '^user:[0-9]+$')
);

create function user_balance_add() returns trigger
language plpgsql security definer set search_path = public as $$
begin
    insert into user_balance (ledger_account, asset, balance)
    select n.ledger_account, n.asset, sum(case n.direction when 'credit' then n.amount else -n.amount end)
      from new_postings n
     where n.ledger_account like 'user:%'
     group by n.ledger_account, n.asset
     order by n.ledger_account, n.asset
    on conflict (ledger_account, asset) do update set balance = user_balance.balance + excluded.balance;
    return null;
end $$;

create trigger ledger_posting_user_balance
    after insert on ledger_posting
    referencing new table as new_postings
    for each statement execute function user_balance_add();

-- What a customer may spend of an asset: the user_balance row of their ledger account, zero when
-- they have none. The withdrawal request check (withdrawal_request_check, V5__withdrawals.sql),
-- the balances read and `store::ledger::available` all call this function; being one SQL
-- expression, it is inlined into the statement that calls it (no plan of its own, the same index
-- probe).
create function available(account_id bigint, asset text) returns numeric(78,0)
language sql stable parallel safe as $$
    select coalesce((select b.balance from user_balance b
                      where b.ledger_account = 'user:' || account_id and b.asset = available.asset), 0)
$$;

-- The ledger account a deposit owned by `account_id` is credited to: the treasury's account
-- (which owns the hot wallets) is credited to `treasury`, every other to its customer account.
create function ledger_account_of(account_id bigint) returns text
language sql stable parallel safe
return case when exists (select 1 from account a where a.id = account_id and a.treasury) then 'treasury'
            else 'user:' || account_id end;

-- ------------------------------------------------------------------ discrepancy rounds

-- One round of a deposit key's discrepancy: the ledger holds more under the key than the canonical
-- chain, by `amount` in `ledger_account`. Rounds are numbered per key; a later change opens the
-- next.
create table reversal_proposal (
    id             bigserial     not null,
    deposit_key    text          not null,
    -- the credit transfer the round is about, when there is one
    transfer_id    bigint        null,
    reason         text          not null,
    proposed_at    timestamptz   not null default now(),
    fact_position  bigint        not null default nextval('fact_position_seq'),
    fact_xid       xid8          not null default pg_current_xact_id(),
    round          integer       not null default 1,
    chain          text          not null,
    tx_hash        text          not null,
    kind           text          not null,
    output_index   integer       not null,
    ledger_account text          not null,
    asset          text          not null,
    amount         numeric(78,0) not null,
    constraint reversal_proposal_pkey primary key (id),
    constraint reversal_proposal_round unique (deposit_key, round),
    constraint reversal_proposal_transfer_id_fkey foreign key (transfer_id) references ledger_transfer (id),
    constraint reversal_proposal_round_positive check (round >= 1),
    constraint reversal_proposal_amount_positive check (amount > 0),
    constraint reversal_proposal_key_matches check (deposit_key = deposit_key(chain, tx_hash, kind, output_index))
);

create index reversal_proposal_deposit on reversal_proposal (chain, tx_hash, kind, output_index);

-- A round's decision: `approved` (the customer is debited, by the compensating transfer),
-- `rejected` (the loss is booked to treasury by the compensating transfer; a rejection recorded
-- without one moved nothing), `closed` (the money was re-mined before anyone decided; recorded by
-- the service, moving nothing). The row is append-only, so a transfer cannot be attached later.
create table reversal_decision (
    proposal_id              bigint      not null,
    decision                 text        not null,
    decided_by               text        not null,
    reason                   text,
    compensating_transfer_id bigint      null,
    decided_at               timestamptz not null default now(),
    fact_position            bigint      not null default nextval('fact_position_seq'),
    fact_xid                 xid8        not null default pg_current_xact_id(),
    constraint reversal_decision_pkey primary key (proposal_id),
    constraint reversal_decision_proposal_id_fkey foreign key (proposal_id) references reversal_proposal (id),
    constraint reversal_decision_compensating_transfer_id_key unique (compensating_transfer_id),
    constraint reversal_decision_compensating_transfer_id_fkey
        foreign key (compensating_transfer_id) references ledger_transfer (id),
    constraint reversal_decision_decision_known check (decision in ('approved', 'rejected', 'closed')),
    constraint reversal_decision_decided_by_nonempty check (length(decided_by) > 0),
    constraint reversal_decision_books check (
        (decision = 'approved' and compensating_transfer_id is not null)
        or decision = 'rejected'
        or (decision = 'closed' and compensating_transfer_id is null))
);

call append_only('reversal_proposal');
call append_only('reversal_decision');

-- ------------------------------------------------------------------ deposit lifecycle

-- One row per deposit observation. An observation in an orphaned block shows orphaned = true and
-- 0 confirmations. The owner is whoever held the address at the block's height (the latest range
-- starting at or below it, see wallet_address_lookup). The tier is chosen by what the
-- observation's transaction pays the same account in the same asset in that block (splitting a
-- payment does not make it faster), from the asset's own tiers; an asset without tiers uses the
-- chain's deepest tier; a coinbase output needs 100 blocks whatever the tier; with no applicable
-- tier the deposit never counts as confirmed. The key's ledger columns sum every transfer booked
-- under the key.
create view deposit_status as
with observed as (
    select d.id, d.chain, d.tx_hash, d.kind, d.output_index,
           deposit_key(d.chain, d.tx_hash, d.kind, d.output_index) as deposit_key,
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

-- The latest orphaning verdicts of a chain, for deposit_lost's old tip.
create index block_verdict_orphaning on block_verdict (chain, recorded_at) where verdict = 'orphaned';

-- Keys whose every observation is on an orphaned block, with the grace period the reconciliation
-- waits before opening a discrepancy: the canonical chain must have built the key's own
-- confirmation count in blocks beyond the old chain's tip (the highest block orphaned together
-- with the key's block), so money re-mined soon after a reorg never raises a discrepancy.
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
