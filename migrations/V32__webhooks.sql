-- Webhooks (DESIGN §8): subscribers to the fact history. Each has a cursor over the history
-- (`audit_event`, read in its final order) and is delivered at least once, in order, one fact per
-- request. A subscriber row is configuration and delivery state, not a fact: the deliverer moves
-- its cursor and its retry clock; who added, paused, resumed or removed it is an operator action.
--
-- Several `serve` processes deliver: a subscriber is delivered by one of them at a time, the one
-- holding its lease (`lease_owner` until `lease_until`). A lease, not a row lock, because delivery
-- calls the network and no lock is held across a network call; a process that dies loses its
-- lease when it expires, and the next holder redelivers the fact in flight (at least once).

create table webhook_subscriber (
    id              bigserial   primary key,
    url             text        not null
                    constraint webhook_subscriber_url check (url ~ '^https?://[^[:space:]]+$' and length(url) <= 2048),
    kinds           text[]      not null
                    constraint webhook_subscriber_kinds check (
                        cardinality(kinds) > 0
                        and kinds <@ array['block', 'deposit', 'ledger', 'reversal', 'withdrawal', 'operator']::text[]),
    -- The HMAC key requests are signed with. Only the service reads it (not custodian_reader).
    secret          text        not null constraint webhook_subscriber_secret check (length(secret) between 16 and 512),
    -- The last fact delivered or passed over (not of the subscriber's kinds); null: the start.
    cursor_position bigint,
    state           text        not null default 'active'
                    constraint webhook_subscriber_state check (state in ('active', 'paused')),
    paused_reason   text,
    -- Failed attempts at the fact after the cursor, since it first failed.
    attempts        integer     not null default 0 constraint webhook_subscriber_attempts check (attempts >= 0),
    failing_since   timestamptz,
    last_error      text,
    next_attempt_at timestamptz not null default now(),
    delivered       bigint      not null default 0,
    last_delivered_at timestamptz,
    lease_owner     text,
    lease_until     timestamptz,
    created_by      text        not null constraint webhook_subscriber_created_by check (length(created_by) between 1 and 64),
    created_at      timestamptz not null default now(),
    constraint webhook_subscriber_paused_reason check ((state = 'paused') = (paused_reason is not null)),
    constraint webhook_subscriber_lease check ((lease_owner is null) = (lease_until is null))
);

create index webhook_subscriber_due on webhook_subscriber (next_attempt_at) where state = 'active';

grant select, insert, update, delete on webhook_subscriber to custodian_service;
grant usage on sequence webhook_subscriber_id_seq to custodian_service;

alter table operator_action drop constraint operator_action_known;
alter table operator_action add constraint operator_action_known check (action in (
    'limit_set', 'policy_set', 'token_created', 'token_revoked', 'lane_added',
    'lane_paused', 'lane_resumed', 'lane_resynced', 'lane_retired', 'asset_registered',
    'withdrawal_resolved', 'webhook_added', 'webhook_paused', 'webhook_resumed', 'webhook_removed'));
