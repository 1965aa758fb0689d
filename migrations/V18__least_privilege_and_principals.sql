-- Least privilege and authenticated decisions (DESIGN §1 principles 7 and 8, §4 "Roles").
--
-- The service connects as custodian_app, a member of custodian_service; only `custodian migrate`
-- uses the schema owner (custodian_owner). This file narrows what custodian_service may change
-- to the columns its projections and operational state need, pins what a withdrawal pays, records
-- who asked for each withdrawal, adds the approval policy (distinct approvers, a rolling daily
-- total), and makes every operator action an appended fact with its principal.
--
-- What the service role can never do, whatever the code says: update or delete a fact (the
-- append-only triggers, and no such privilege), set session_replication_role (superuser only),
-- alter or drop a trigger (owner only), change an API token's scopes or hash (only revoked_at is
-- granted, and the trigger permits only that), or change what a withdrawal pays (below).

-- `custodian status` reports the schema version as the service's login.
grant select on refinery_schema_history to custodian_service;

-- ------------------------------------------------------------------ withdrawals pay what was asked

-- The principal (API token name) whose request created the withdrawal; null only for withdrawals
-- recorded before principals existed.
alter table withdrawal add column requested_by text null check (length(requested_by) between 1 and 64);

-- A withdrawal's request columns are what its `requested` event says; nobody changes them after
-- insert, the owner included (the allocator signs what the event says and compares it with this
-- row, so a changed row is caught there too).
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

-- The same rule as a privilege: the service may update only the projection's moving columns.
revoke update on withdrawal from custodian_service;
grant update (state, from_address, nonce, tx_hash, mined_block_hash, last_seq, updated_at)
    on withdrawal to custodian_service;

-- A lane's address is its key's; the service moves only its cursor and pause.
revoke update on hot_wallet from custodian_service;
grant update (next_nonce, paused_at, pause_reason) on hot_wallet to custodian_service;

-- An asset's identity (chain, contract, decimals) never changes; the policy columns do.
revoke update on asset from custodian_service;

-- ------------------------------------------------------------------ approval policy

-- approval_limit (V11): above it a withdrawal waits for approvals_required distinct principals,
-- none of them its requester. daily_limit: a rolling 24-hour total per account and asset; a
-- request that would pass it waits for approval too instead of being refused.
alter table asset
    add column approvals_required smallint not null default 1
        constraint asset_approvals_required_range check (approvals_required between 1 and 16),
    add column daily_limit numeric(78,0) null
        constraint asset_daily_limit_range check (daily_limit is null or (daily_limit >= 0 and is_u256(daily_limit)));

grant update (approval_limit, approvals_required, daily_limit) on asset to custodian_service;

-- Out of the box, large payouts need two people: above 10 ETH or 1 BTC.
update asset set approval_limit = 10000000000000000000, approvals_required = 2 where asset = 'ETH';
update asset set approval_limit = 100000000, approvals_required = 2 where asset = 'BTC';

-- the rolling daily total reads an account's recent withdrawals of one asset
create index withdrawal_account_recent on withdrawal (account_id, asset, requested_at);

-- ------------------------------------------------------------------ tokens are principals

-- 'approve': approve or reject withdrawals and decide reversals. 'admin' alone no longer does.
alter table api_token drop constraint api_token_scopes_check;
alter table api_token add constraint api_token_scopes_known
    check (scopes <@ array['read', 'withdraw', 'approve', 'admin']::text[]);

-- ------------------------------------------------------------------ operator actions are facts

-- Every change an operator makes outside a withdrawal's stream (limits and policy, tokens, lanes,
-- asset registration), with the principal who made it. Append-only; part of the audit history.
create table operator_action (
    id            bigserial   primary key,
    action        text        not null constraint operator_action_known check (action in (
                      'limit_set', 'policy_set', 'token_created', 'token_revoked', 'lane_added',
                      'lane_paused', 'lane_resumed', 'asset_registered')),
    principal     text        not null constraint operator_action_principal check (length(principal) between 1 and 64),
    details       jsonb       not null,
    recorded_at   timestamptz not null default now(),
    fact_position bigint      not null default nextval('fact_position_seq'),
    fact_xid      xid8        not null default pg_current_xact_id()
);

create index operator_action_fact on operator_action (fact_xid, fact_position);

create trigger operator_action_append_only
    before update or delete on operator_action
    for each row execute function reject_mutation();
create trigger operator_action_no_truncate
    before truncate on operator_action
    for each statement execute function reject_mutation();

grant select, insert on operator_action to custodian_service;
grant usage on sequence operator_action_id_seq to custodian_service;

-- The history (V8) with operator actions in it, kind 'operator_<action>'.
create or replace view audit_event as
select b.fact_position as position, b.fact_xid as xid, 'block' as kind, b.seen_at as recorded_at,
       jsonb_build_object('chain', b.chain, 'height', b.height, 'block_hash', b.block_hash,
                          'parent_hash', b.parent_hash) as payload
  from chain_block b
union all
select m.fact_position, m.fact_xid, 'orphan_mark', m.orphaned_at,
       jsonb_build_object('chain', m.chain, 'block_hash', m.block_hash)
  from orphan_mark m
union all
select d.fact_position, d.fact_xid, 'deposit_observed', d.observed_at,
       jsonb_build_object('chain', d.chain, 'block_hash', d.block_hash, 'tx_hash', d.tx_hash,
                          'output_index', d.output_index, 'address', d.address, 'asset', d.asset,
                          'amount', d.amount::text)
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
