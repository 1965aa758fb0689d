-- The double-entry ledger and reviewed reversals.
--
-- ledger_transfer is one movement of money, idempotent on a key that describes the money
-- ('deposit:{chain}:{tx_hash}:{output_index}', 'withdrawal:{id}:hold', ...), never the delivery.
-- ledger_posting holds its legs: direction is a column, amounts are unsigned. A deferred
-- constraint trigger rejects, at commit, a transfer with no postings or whose debits and credits
-- differ for any asset; the Rust side asserts the same before writing.
-- Ledger accounts are text: 'user:{account_id}' (what we owe a customer), 'custody' (what is
-- on-chain under our keys), 'withdrawal_holds' (reserved for withdrawals in flight),
-- 'network_fees' and 'treasury' (the operator's own funds).
--
-- A posted deposit whose every observation was orphaned becomes a reversal_proposal; a named
-- person's reversal_decision approves (with the compensating transfer) or rejects it. Taking
-- money back is never automatic. All four tables are append-only.

create table ledger_transfer (
    id              bigserial   primary key,
    idempotency_key text        not null unique check (length(idempotency_key) > 0),
    kind            text        not null check (kind in (
                        'deposit', 'withdrawal_hold', 'withdrawal_settle', 'withdrawal_release',
                        'network_fee', 'reversal', 'adjustment')),
    reference       jsonb       not null default '{}',
    created_at      timestamptz not null default now()
);

create table ledger_posting (
    id             bigserial     primary key,
    transfer_id    bigint        not null references ledger_transfer (id),
    ledger_account text          not null check (
                       ledger_account ~ '^(user:[0-9]+|custody|withdrawal_holds|network_fees|treasury)$'),
    asset          text          not null references asset (asset),
    direction      text          not null check (direction in ('debit', 'credit')),
    amount         numeric(78,0) not null check (amount > 0) check (is_u256(amount))
);

create index ledger_posting_account on ledger_posting (ledger_account, asset);
create index ledger_posting_transfer on ledger_posting (transfer_id);

-- Runs at commit for every inserted transfer and posting. Raises check_violation (23514) with
-- constraint name ledger_transfer_balanced so callers can classify it.
create function check_transfer_balanced() returns trigger
language plpgsql as $$
declare
    checked_id bigint;
    unbalanced record;
begin
    if tg_table_name = 'ledger_transfer' then
        checked_id := new.id;
    else
        checked_id := new.transfer_id;
    end if;

    if not exists (select 1 from ledger_posting where transfer_id = checked_id) then
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

create trigger ledger_transfer_append_only
    before update or delete on ledger_transfer
    for each row execute function reject_mutation();
create trigger ledger_transfer_no_truncate
    before truncate on ledger_transfer
    for each statement execute function reject_mutation();
create trigger ledger_posting_append_only
    before update or delete on ledger_posting
    for each row execute function reject_mutation();
create trigger ledger_posting_no_truncate
    before truncate on ledger_posting
    for each statement execute function reject_mutation();

create table reversal_proposal (
    id          bigserial   primary key,
    -- the posted deposit's idempotency key, 'deposit:{chain}:{tx_hash}:{output_index}'
    deposit_key text        not null unique check (deposit_key ~ '^deposit:(eth|btc):[^:]+:[0-9]+$'),
    -- the deposit transfer that would be reversed
    transfer_id bigint      not null references ledger_transfer (id),
    reason      text        not null,
    proposed_at timestamptz not null default now()
);

create table reversal_decision (
    proposal_id              bigint      primary key references reversal_proposal (id),
    decision                 text        not null check (decision in ('approved', 'rejected')),
    decided_by               text        not null check (length(decided_by) > 0),
    reason                   text,
    compensating_transfer_id bigint      null unique references ledger_transfer (id),
    decided_at               timestamptz not null default now(),
    -- an approval is recorded together with the transfer that takes the money back; a rejection
    -- moves nothing. The row is append-only, so the transfer cannot be attached later.
    check ((decision = 'approved') = (compensating_transfer_id is not null))
);

create trigger reversal_proposal_append_only
    before update or delete on reversal_proposal
    for each row execute function reject_mutation();
create trigger reversal_proposal_no_truncate
    before truncate on reversal_proposal
    for each statement execute function reject_mutation();
create trigger reversal_decision_append_only
    before update or delete on reversal_decision
    for each row execute function reject_mutation();
create trigger reversal_decision_no_truncate
    before truncate on reversal_decision
    for each statement execute function reject_mutation();
