-- Withdrawals: an event-sourced stream per withdrawal, its inline projection, and the nonce
-- allocator.
--
-- withdrawal_event is the source of truth, keyed (withdrawal_id, seq): appending with the
-- expected next seq is the optimistic concurrency check, and global_position orders all streams
-- for auditors. Ids come from withdrawal_id_seq before the first event is appended.
-- withdrawal is the current state of each stream, updated in the same transaction as the event
-- it reflects and rebuildable from the events, so it is mutable and has no foreign key from the
-- event side.
-- hot_wallet is the row whose lock serialises every withdrawal leaving one address (a lane);
-- nonce_allocation's primary key (chain, from_address, nonce) is the no-double-allocation
-- invariant, enforced in the only place that can enforce it under concurrency.
-- withdrawal_attempt keeps every signed payload (original, fee bump, cancel replacement) so a
-- timeout is answered by rebroadcasting the same bytes, never by re-signing, and settlement can
-- find whichever sibling was mined. Events, allocations and attempts are append-only.

create sequence withdrawal_id_seq;

create table withdrawal_event (
    withdrawal_id   bigint      not null,
    seq             integer     not null check (seq >= 1),
    event_type      text        not null check (event_type in (
                        'requested', 'awaiting_approval', 'approved', 'rejected', 'signed',
                        'broadcast', 'bumped', 'mined', 'unmined', 'confirmed', 'failed_onchain',
                        'cancel_requested', 'cancelled', 'needs_review')),
    payload         jsonb       not null,
    recorded_at     timestamptz not null default now(),
    global_position bigserial   unique,
    primary key (withdrawal_id, seq)
);

create trigger withdrawal_event_append_only
    before update or delete on withdrawal_event
    for each row execute function reject_mutation();
create trigger withdrawal_event_no_truncate
    before truncate on withdrawal_event
    for each statement execute function reject_mutation();

create table withdrawal (
    id               bigint        primary key,
    -- null for internal withdrawals (treasury rebalancing between hot wallets)
    account_id       bigint        null references account (id),
    -- the client's idempotency key for the request
    external_id      text          not null check (length(external_id) > 0),
    chain            text          not null check (chain in ('eth', 'btc')),
    asset            text          not null,
    destination      text          not null check (is_valid_address(chain, destination)),
    amount           numeric(78,0) not null check (amount > 0) check (is_u256(amount)),
    state            text          not null check (state in (
                         'requested', 'awaiting_approval', 'rejected', 'signed', 'broadcast',
                         'mined', 'confirmed', 'failed_onchain', 'cancel_requested', 'cancelled',
                         'needs_review')),
    lane             text          null,
    from_address     text          null check (is_valid_address(chain, from_address)),
    nonce            bigint        null check (nonce >= 0),
    tx_hash          text          null check (is_valid_hash(chain, tx_hash)),
    mined_block_hash text          null check (is_valid_hash(chain, mined_block_hash)),
    last_seq         integer       not null check (last_seq >= 1),
    requested_at     timestamptz   not null default now(),
    updated_at       timestamptz   not null default now(),
    unique (account_id, external_id),
    foreign key (chain, asset) references asset (chain, asset)
);

create index withdrawal_state on withdrawal (state);
create index withdrawal_lane_state on withdrawal (chain, lane, state);

create table hot_wallet (
    chain        text        not null check (chain in ('eth', 'btc')),
    address      text        not null check (is_valid_address(chain, address)),
    lane         text        not null check (length(lane) > 0),
    next_nonce   bigint      not null check (next_nonce >= 0),
    paused_at    timestamptz,
    pause_reason text,
    created_at   timestamptz not null default now(),
    primary key (chain, address),
    unique (chain, lane),
    -- a reason only describes a current pause; resuming clears both
    check (paused_at is not null or pause_reason is null)
);

create table nonce_allocation (
    chain         text        not null,
    from_address  text        not null,
    nonce         bigint      not null check (nonce >= 0),
    withdrawal_id bigint      not null,
    allocated_at  timestamptz not null default now(),
    primary key (chain, from_address, nonce),
    -- target for withdrawal_attempt's foreign key: an attempt may only use a nonce allocated to
    -- its own withdrawal
    unique (chain, from_address, nonce, withdrawal_id),
    foreign key (chain, from_address) references hot_wallet (chain, address)
);

create index nonce_allocation_withdrawal on nonce_allocation (withdrawal_id);

create trigger nonce_allocation_append_only
    before update or delete on nonce_allocation
    for each row execute function reject_mutation();
create trigger nonce_allocation_no_truncate
    before truncate on nonce_allocation
    for each statement execute function reject_mutation();

create table withdrawal_attempt (
    tx_hash       text          primary key,
    withdrawal_id bigint        not null,
    chain         text          not null check (chain in ('eth', 'btc')),
    from_address  text          not null,
    nonce         bigint        not null,
    kind          text          not null check (kind in ('original', 'bump', 'cancel')),
    raw_tx        bytea         not null,
    max_fee       numeric(78,0) not null check (is_u256(max_fee)),
    priority_fee  numeric(78,0) not null check (is_u256(priority_fee)),
    created_at    timestamptz   not null default now(),
    check (is_valid_hash(chain, tx_hash)),
    check (priority_fee <= max_fee),
    foreign key (chain, from_address, nonce, withdrawal_id)
        references nonce_allocation (chain, from_address, nonce, withdrawal_id)
);

-- settlement is keyed on (from_address, nonce): find every sibling at a nonce
create index withdrawal_attempt_nonce on withdrawal_attempt (chain, from_address, nonce);
create index withdrawal_attempt_withdrawal on withdrawal_attempt (withdrawal_id, created_at);

create trigger withdrawal_attempt_append_only
    before update or delete on withdrawal_attempt
    for each row execute function reject_mutation();
create trigger withdrawal_attempt_no_truncate
    before truncate on withdrawal_attempt
    for each statement execute function reject_mutation();
