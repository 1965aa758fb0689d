-- Withdrawals: an event-sourced stream per withdrawal, its inline projection, the nonce allocator
-- of ETH lanes and the coin reservations of BTC lanes.
--
-- withdrawal_event is the source of truth, keyed (withdrawal_id, seq): appending with the
-- expected next seq is the optimistic concurrency check, and global_position orders all streams
-- for auditors. Ids come from withdrawal_id_seq before the first event is appended.
-- withdrawal is the current state of each stream, updated in the same transaction as the event
-- it reflects and rebuildable from the events, so it is mutable and has no foreign key from the
-- event side. Its request columns (who asked, for what, to where) are what the `requested` event
-- says and never change after insert, so a withdrawal pays what was asked.
--
-- A lane is one hot wallet (hot_wallet, V3__ownership.sql) whose row lock serialises every
-- withdrawal leaving its address. Approval policy lives on the asset (approval_limit,
-- approvals_required, daily_limit): a request above it waits in awaiting_approval.
--
-- ETH: nonce_allocation's primary key (chain, from_address, nonce) is the no-double-allocation
-- invariant, enforced in the only place that can enforce it under concurrency.
-- withdrawal_attempt keeps every signed payload (original, fee bump, cancel replacement) so a
-- timeout is answered by rebroadcasting the same bytes, never by re-signing, and settlement can
-- find whichever sibling was mined. Every attempt carries its intent: `payout` (what the
-- requested event pays) or `cancel` (a zero-value transfer to ourselves), with the destination,
-- value and calldata it was signed for; a bump copies the intent of the attempt it replaces, and
-- settlement decodes the mined bytes and compares them with the intents instead of trusting a
-- label.
--
-- BTC: the scarce resource is the unspent output, so the reservation plays the part of the nonce
-- allocation. btc_spend is one spend of a set of our coins paying a batch of withdrawals; its
-- attempts (the original, replacements with higher fees, a cancel) are siblings that spend the
-- same coins, so at most one of them can ever be mined. btc_spend_payout says which withdrawal
-- each customer output of the spend pays, with that output's weight (the fee of the mined sibling
-- is split by it). utxo_reservation holds the coins a spend uses, inserted in the same transaction
-- that stores its signed bytes. Unique per coin among live reservations: the database, not the
-- code, makes spending one of our coins twice impossible. A reservation is only released by an
-- operator resolving a spend that can never be mined.
--
-- Events, allocations, attempts, spends, payouts and reservations are append-only.

create sequence withdrawal_id_seq;

-- ------------------------------------------------------------------ events and projection

create table withdrawal_event (
    withdrawal_id   bigint      not null,
    seq             integer     not null,
    -- `fee_cap_reached`: the lowest open nonce cannot be bumped within the configured maximum fee
    -- (an alert, shown as withdrawal.stuck_at_cap until a bump or the chain moves it on).
    -- `resolved`: an operator settled a `needs_review` withdrawal with the evidence (`paid` by a
    -- transaction checked on chain, or `not_paid`, releasing the hold).
    event_type      text        not null,
    payload         jsonb       not null,
    recorded_at     timestamptz not null default now(),
    global_position bigserial   not null,
    fact_position   bigint      not null default nextval('fact_position_seq'),
    fact_xid        xid8        not null default pg_current_xact_id(),
    constraint withdrawal_event_pkey primary key (withdrawal_id, seq),
    constraint withdrawal_event_global_position_key unique (global_position),
    constraint withdrawal_event_seq_positive check (seq >= 1),
    constraint withdrawal_event_event_type_known check (event_type in (
        'requested', 'awaiting_approval', 'approved', 'rejected', 'signed', 'broadcast', 'bumped', 'mined',
        'unmined', 'confirmed', 'failed_onchain', 'cancel_requested', 'cancelled', 'needs_review',
        'fee_cap_reached', 'resolved'))
);

call append_only('withdrawal_event');

create table withdrawal (
    id               bigint        not null,
    -- null for internal withdrawals (treasury rebalancing between hot wallets)
    account_id       bigint        null,
    -- the client's idempotency key for the request
    external_id      text          not null,
    chain            text          not null,
    asset            text          not null,
    destination      text          not null,
    amount           numeric(78,0) not null,
    state            text          not null,
    lane             text          null,
    from_address     text          null,
    nonce            bigint        null,
    tx_hash          text          null,
    mined_block_hash text          null,
    last_seq         integer       not null,
    requested_at     timestamptz   not null default now(),
    updated_at       timestamptz   not null default now(),
    -- the principal (API token name) whose request created the withdrawal; null when none was
    -- recorded
    requested_by     text          null,
    -- see withdrawal_event's `fee_cap_reached`
    stuck_at_cap     boolean       not null default false,
    constraint withdrawal_pkey primary key (id),
    constraint withdrawal_account_id_external_id_key unique (account_id, external_id),
    constraint withdrawal_account_id_fkey foreign key (account_id) references account (id),
    constraint withdrawal_chain_asset_fkey foreign key (chain, asset) references asset (chain, asset),
    constraint withdrawal_external_id_nonempty check (length(external_id) > 0),
    constraint withdrawal_chain_known check (chain in ('eth', 'btc')),
    constraint withdrawal_destination_format check (is_valid_address(chain, destination)),
    constraint withdrawal_amount_positive check (amount > 0),
    constraint withdrawal_amount_u256 check (is_u256(amount)),
    constraint withdrawal_state_known check (state in (
        'requested', 'awaiting_approval', 'rejected', 'signed', 'broadcast', 'mined', 'confirmed',
        'failed_onchain', 'cancel_requested', 'cancelled', 'needs_review')),
    constraint withdrawal_from_address_format check (is_valid_address(chain, from_address)),
    constraint withdrawal_nonce_nonnegative check (nonce >= 0),
    constraint withdrawal_tx_hash_format check (is_valid_hash(chain, tx_hash)),
    constraint withdrawal_mined_block_hash_format check (is_valid_hash(chain, mined_block_hash)),
    constraint withdrawal_last_seq_positive check (last_seq >= 1),
    constraint withdrawal_requested_by_length check (length(requested_by) between 1 and 64)
);

-- One index on a withdrawal's state. Every state change is a non-HOT update that inserts into
-- each index on the column, so there is one: with state leading, it answers the worker's per-lane
-- queries (equalities on all three columns, state = any(...) included) and listings by state
-- (its prefix).
create index withdrawal_state_lane on withdrawal (state, chain, lane);

-- The rolling 24-hour total reads an account's recent withdrawals of one asset. The index leads
-- with the asset, so the one index leading with the account is the unique (account_id,
-- external_id): a request's idempotency lookup can only be planned as the single-row probe it is,
-- even on tables not yet analysed, instead of walking every withdrawal the account ever made.
create index withdrawal_asset_account_recent on withdrawal (asset, account_id, requested_at);

-- A withdrawal's request columns are what its `requested` event says; nobody changes them after
-- insert, the owner included (the allocator signs what the event says and compares it with this
-- row, so a changed row is caught there too). The service's column privileges say the same.
create function reject_withdrawal_request_change() returns trigger
language plpgsql as $$
begin
    if (new.account_id, new.external_id, new.chain, new.asset, new.destination, new.amount, new.requested_by)
       is distinct from
       (old.account_id, old.external_id, old.chain, old.asset, old.destination, old.amount, old.requested_by) then
        raise exception 'withdrawal %: its account, asset, destination, amount, external id and requester never change',
                        old.id
              using errcode = 'insufficient_privilege';
    end if;
    return new;
end;
$$;

create trigger withdrawal_request_immutable
    before update on withdrawal
    for each row execute function reject_withdrawal_request_change();

-- The account-side checks of a withdrawal request, under the account's row lock, in one call: a
-- request sends BEGIN, this call, its writes and COMMIT in one round trip
-- (withdrawals/src/request.rs), so the account's lock is held for the statements and the commit
-- only, never for a client round trip.
--
-- A volatile function's statements each take a fresh snapshot: the reads after the lock see
-- whatever committed before it was granted (the request that held it a moment ago included).
-- A refusal raises, which aborts the transaction: the writes behind it fail and COMMIT ends it
-- as a rollback, so nothing is written.
--   CW001 the account does not exist
--   CW002 a withdrawal with this external id committed while the request waited (detail: its id)
--   CW003 the available balance (available(), V4__ledger.sql) is short (detail: the balance, in
--         smallest units)
create function withdrawal_request_check(p_account bigint, p_external_id text, p_asset text, p_amount numeric)
returns void
language plpgsql volatile
as $$
declare
    earlier bigint;
    spendable numeric;
begin
    perform 1 from account where id = p_account for update;
    if not found then
        raise exception 'unknown account %', p_account using errcode = 'CW001';
    end if;
    select id into earlier from withdrawal where account_id = p_account and external_id = p_external_id;
    if found then
        raise exception 'withdrawal % has external id %', earlier, p_external_id
            using errcode = 'CW002', detail = earlier::text;
    end if;
    spendable := available(p_account, p_asset);
    if spendable < p_amount then
        raise exception 'insufficient funds: % requested, % available', p_amount, spendable
            using errcode = 'CW003', detail = spendable::text;
    end if;
end;
$$;

-- ------------------------------------------------------------------ ETH: nonces and attempts

-- No index on withdrawal_id: a withdrawal's nonce is on its projection row.
create table nonce_allocation (
    chain         text        not null,
    from_address  text        not null,
    nonce         bigint      not null,
    withdrawal_id bigint      not null,
    allocated_at  timestamptz not null default now(),
    constraint nonce_allocation_pkey primary key (chain, from_address, nonce),
    -- target for withdrawal_attempt's foreign key: an attempt may only use a nonce allocated to
    -- its own withdrawal
    constraint nonce_allocation_chain_from_address_nonce_withdrawal_id_key
        unique (chain, from_address, nonce, withdrawal_id),
    constraint nonce_allocation_chain_from_address_fkey
        foreign key (chain, from_address) references hot_wallet (chain, address),
    constraint nonce_allocation_nonce_nonnegative check (nonce >= 0)
);

call append_only('nonce_allocation');

create table withdrawal_attempt (
    tx_hash       text          not null,
    withdrawal_id bigint        not null,
    chain         text          not null,
    from_address  text          not null,
    nonce         bigint        not null,
    kind          text          not null,
    raw_tx        bytea         not null,
    max_fee       numeric(78,0) not null,
    priority_fee  numeric(78,0) not null,
    created_at    timestamptz   not null default now(),
    intent        text          not null,
    -- what the attempt was signed to pay, all three or none
    intent_to     text          null,
    intent_value  numeric(78,0) null,
    intent_data   bytea         null,
    constraint withdrawal_attempt_pkey primary key (tx_hash),
    constraint withdrawal_attempt_chain_from_address_nonce_withdrawal_id_fkey
        foreign key (chain, from_address, nonce, withdrawal_id)
        references nonce_allocation (chain, from_address, nonce, withdrawal_id),
    constraint withdrawal_attempt_chain_known check (chain in ('eth', 'btc')),
    constraint withdrawal_attempt_kind_known check (kind in ('original', 'bump', 'cancel')),
    constraint withdrawal_attempt_max_fee_u256 check (is_u256(max_fee)),
    constraint withdrawal_attempt_priority_fee_u256 check (is_u256(priority_fee)),
    constraint withdrawal_attempt_tx_hash_format check (is_valid_hash(chain, tx_hash)),
    constraint withdrawal_attempt_priority_fee_within_max_fee check (priority_fee <= max_fee),
    constraint withdrawal_attempt_intent_known check (intent in ('payout', 'cancel')),
    constraint withdrawal_attempt_intent_to_format check (is_valid_address(chain, intent_to)),
    constraint withdrawal_attempt_intent_value_u256 check (is_u256(intent_value)),
    constraint withdrawal_attempt_intent_whole
        check ((intent_to is null) = (intent_value is null) and (intent_to is null) = (intent_data is null))
);

-- Settlement is keyed on (from_address, nonce), answered by nonce_allocation's primary key. The
-- foreign key to nonce_allocation ties every attempt at a nonce to the one withdrawal that nonce
-- was allocated to, so "every sibling at a nonce" is "every attempt of that withdrawal", which
-- this index serves. Neither table allows updates or deletes, so no referential action needs the
-- referencing side indexed.
create index withdrawal_attempt_withdrawal on withdrawal_attempt (withdrawal_id, created_at);

call append_only('withdrawal_attempt');

-- ------------------------------------------------------------------ BTC: spends and reservations

create table btc_spend (
    id         bigserial   not null,
    chain      text        not null default 'btc',
    lane       text        not null,
    created_at timestamptz not null default now(),
    constraint btc_spend_pkey primary key (id),
    constraint btc_spend_chain_lane_fkey foreign key (chain, lane) references btc_hot_wallet (chain, lane),
    constraint btc_spend_chain_btc check (chain = 'btc')
);

create table btc_spend_payout (
    spend_id      bigint  not null,
    withdrawal_id bigint  not null,
    output_index  integer not null,
    weight        integer not null,
    constraint btc_spend_payout_pkey primary key (spend_id, withdrawal_id),
    constraint btc_spend_payout_spend_id_output_index_key unique (spend_id, output_index),
    -- a withdrawal is paid by one spend only
    constraint btc_spend_payout_withdrawal_id_key unique (withdrawal_id),
    constraint btc_spend_payout_spend_id_fkey foreign key (spend_id) references btc_spend (id),
    constraint btc_spend_payout_withdrawal_id_fkey foreign key (withdrawal_id) references withdrawal (id),
    constraint btc_spend_payout_output_index_nonnegative check (output_index >= 0),
    constraint btc_spend_payout_weight_positive check (weight > 0)
);

create table btc_attempt (
    tx_hash       text          not null,
    spend_id      bigint        not null,
    kind          text          not null,
    raw_tx        bytea         not null,
    -- inputs minus outputs, satoshis
    fee           numeric(78,0) not null,
    vsize         integer       not null,
    -- the output paying us back (change, or everything for a cancel), if any, and the change
    -- address's index
    change_output integer       null,
    change_index  integer       null,
    created_at    timestamptz   not null default now(),
    constraint btc_attempt_pkey primary key (tx_hash),
    constraint btc_attempt_spend_id_fkey foreign key (spend_id) references btc_spend (id),
    constraint btc_attempt_tx_hash_format check (is_valid_hash('btc', tx_hash)),
    constraint btc_attempt_kind_known check (kind in ('original', 'bump', 'cancel')),
    constraint btc_attempt_fee_positive check (fee > 0),
    constraint btc_attempt_vsize_positive check (vsize > 0),
    constraint btc_attempt_change_output_nonnegative check (change_output >= 0),
    constraint btc_attempt_change_whole check ((change_output is null) = (change_index is null))
);

create index btc_attempt_spend on btc_attempt (spend_id, created_at);

create table utxo_reservation (
    chain        text          not null default 'btc',
    tx_hash      text          not null,
    output_index integer       not null,
    spend_id     bigint        not null,
    amount       numeric(78,0) not null,
    -- which key spends it: null for the funding address …/0/0, else change …/1/change_index
    change_index integer       null,
    reserved_at  timestamptz   not null default now(),
    released_at  timestamptz   null,
    constraint utxo_reservation_pkey primary key (spend_id, tx_hash, output_index),
    constraint utxo_reservation_spend_id_fkey foreign key (spend_id) references btc_spend (id),
    constraint utxo_reservation_chain_btc check (chain = 'btc'),
    constraint utxo_reservation_tx_hash_format check (is_valid_hash('btc', tx_hash)),
    constraint utxo_reservation_output_index_nonnegative check (output_index >= 0),
    constraint utxo_reservation_amount_positive check (amount > 0),
    constraint utxo_reservation_change_index_nonnegative check (change_index >= 0)
);

create unique index utxo_reservation_live on utxo_reservation (chain, tx_hash, output_index)
    where released_at is null;

call append_only('btc_spend');
call append_only('btc_spend_payout');
call append_only('btc_attempt');
create trigger utxo_reservation_release_once
    before update or delete on utxo_reservation
    for each row execute function reject_mutation_except_set_once('released_at');
create trigger utxo_reservation_no_truncate
    before truncate on utxo_reservation for each statement execute function reject_mutation();

-- A BTC lane's coins, one home for what the worker may spend and what `hot-wallet list` shows:
-- every unspent output on the canonical chain at the lane's funding address or one of its change
-- addresses, with its state:
--   reserved    a live reservation holds it for a signed spend;
--   spendable   our own change (one confirmation: it is in a canonical block), or a coin the
--               ledger credited to custody (confirmed by the deposit tiers and posted);
--   unconfirmed paid to the funding address while the treasury owned it, not credited yet;
--   not_custody anything else (paid before registration, or to a change address by a stranger).
create view btc_lane_coin as
with lane_address as (
    select lane, address, null::integer as change_index from btc_hot_wallet
    union all
    select lane, address, derivation_index from btc_change_address
)
select a.lane, u.tx_hash, u.output_index, u.amount, a.change_index, u.height,
       case
           when exists (select 1 from utxo_reservation r
                         where r.chain = 'btc' and r.tx_hash = u.tx_hash and r.output_index = u.output_index
                           and r.released_at is null) then 'reserved'
           when a.change_index is not null then
               case when exists (select 1 from btc_attempt t where t.tx_hash = u.tx_hash) then 'spendable'
                    else 'not_custody' end
           when exists (select 1 from ledger_transfer t
                         where t.deposit_key = deposit_key('btc', u.tx_hash, 'output', u.output_index)
                           and t.kind = 'deposit') then 'spendable'
           when exists (select 1 from wallet_address w join account o on o.id = w.account_id and o.treasury
                         where w.chain = 'btc' and w.address = u.address and w.valid_from_height <= u.height
                           and (w.valid_to_height is null or u.height < w.valid_to_height)) then 'unconfirmed'
           else 'not_custody'
       end as state
  from lane_address a
  join unspent_output u on u.chain = 'btc' and u.address = a.address;
