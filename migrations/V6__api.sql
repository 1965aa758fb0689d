-- The API's principals and what they did: API tokens, operator actions, webhook subscribers.
--
-- A token is 32 random bytes shown to the operator once, when it is created; only its SHA-256 is
-- stored, so a copy of this table cannot be used to call the API. The API hashes the presented
-- token and compares the hashes in constant time. A token's name is its principal: the name
-- recorded on every withdrawal it requests (withdrawal.requested_by), every decision it makes and
-- every operator action. Scopes: 'read' (balances, history, withdrawal status), 'withdraw' (the
-- client's writes: accounts, deposit addresses, withdrawal requests and cancels), 'approve'
-- (approve or reject withdrawals and decide reversals), 'admin' (lanes and webhooks).
--
-- A token is never changed or deleted, only revoked: revoked_at may be set once, from null, and
-- every other column stays as created, so the table remains the record of who held which access
-- and when it ended. Names stay unique after revocation for the same reason.
--
-- Every change an operator makes outside a withdrawal's stream (limits and policy, tokens, lanes,
-- asset registration, webhooks, resolving a withdrawal) is an operator_action with the principal
-- who made it: append-only, and part of the audit history (V7__audit.sql).
--
-- Webhooks are subscribers to the fact history. Each has a cursor over the history (audit_event,
-- read in its final order) and is delivered at least once, in order, one fact per request. A
-- subscriber row is configuration and delivery state, not a fact: the deliverer moves its cursor
-- and its retry clock; who added, paused, resumed or removed it is an operator action. Several
-- `serve` processes deliver: a subscriber is delivered by one of them at a time, the one holding
-- its lease (lease_owner until lease_until). A lease, not a row lock, because delivery calls the
-- network and no lock is held across a network call; a process that dies loses its lease when it
-- expires, and the next holder redelivers the fact in flight (at least once).

-- ------------------------------------------------------------------ tokens

create table api_token (
    id         bigserial   not null,
    name       text        not null,
    -- SHA-256 of the raw 32 token bytes
    token_hash bytea       not null,
    scopes     text[]      not null,
    created_at timestamptz not null default now(),
    revoked_at timestamptz null,
    constraint api_token_pkey primary key (id),
    constraint api_token_name_key unique (name),
    constraint api_token_token_hash_key unique (token_hash),
    constraint api_token_name_length check (length(name) between 1 and 64),
    constraint api_token_token_hash_length check (length(token_hash) = 32),
    constraint api_token_scopes_known check (scopes <@ array['read', 'withdraw', 'approve', 'admin']::text[]),
    constraint api_token_scopes_nonempty check (cardinality(scopes) > 0)
);

call append_only('api_token', set_once => 'revoked_at');

-- ------------------------------------------------------------------ operator actions

create table operator_action (
    id            bigserial   not null,
    action        text        not null,
    principal     text        not null,
    details       jsonb       not null,
    recorded_at   timestamptz not null default now(),
    fact_position bigint      not null default nextval('fact_position_seq'),
    fact_xid      xid8        not null default pg_current_xact_id(),
    constraint operator_action_pkey primary key (id),
    constraint operator_action_known check (action in (
        'limit_set', 'policy_set', 'token_created', 'token_revoked', 'lane_added',
        'lane_paused', 'lane_resumed', 'lane_resynced', 'lane_retired', 'asset_registered',
        'withdrawal_resolved', 'webhook_added', 'webhook_paused', 'webhook_resumed', 'webhook_removed')),
    constraint operator_action_principal check (length(principal) between 1 and 64)
);

call append_only('operator_action');

-- ------------------------------------------------------------------ webhooks

create table webhook_subscriber (
    id                bigserial   not null,
    url               text        not null,
    kinds             text[]      not null,
    -- The HMAC key requests are signed with. Only the service reads it (not custodian_reader).
    secret            text        not null,
    -- The last fact delivered or passed over (not of the subscriber's kinds); null: the start.
    cursor_position   bigint,
    state             text        not null default 'active',
    paused_reason     text,
    -- Failed attempts at the fact after the cursor, since it first failed.
    attempts          integer     not null default 0,
    failing_since     timestamptz,
    last_error        text,
    next_attempt_at   timestamptz not null default now(),
    delivered         bigint      not null default 0,
    last_delivered_at timestamptz,
    lease_owner       text,
    lease_until       timestamptz,
    created_by        text        not null,
    created_at        timestamptz not null default now(),
    constraint webhook_subscriber_pkey primary key (id),
    constraint webhook_subscriber_url check (url ~ '^https?://[^[:space:]]+$' and length(url) <= 2048),
    constraint webhook_subscriber_kinds check (
        cardinality(kinds) > 0
        and kinds <@ array['block', 'deposit', 'ledger', 'reversal', 'withdrawal', 'operator']::text[]),
    constraint webhook_subscriber_secret check (length(secret) between 16 and 512),
    constraint webhook_subscriber_state check (state in ('active', 'paused')),
    constraint webhook_subscriber_attempts check (attempts >= 0),
    constraint webhook_subscriber_created_by check (length(created_by) between 1 and 64),
    constraint webhook_subscriber_paused_reason check ((state = 'paused') = (paused_reason is not null)),
    constraint webhook_subscriber_lease check ((lease_owner is null) = (lease_until is null))
);

create index webhook_subscriber_due on webhook_subscriber (next_attempt_at) where state = 'active';
