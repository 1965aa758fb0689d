-- Audit positions: one history of every appended fact, in an order that never changes.
--
-- Auditors read the history (blocks, deposit observations, orphan marks, ledger transfers,
-- reversal decisions, withdrawal events) as one stream and resume it from a position. A sequence
-- alone cannot give a stable order: a transaction that took a smaller number may commit after a
-- reader has passed a larger one. So every fact also records the id of the transaction that wrote
-- it (xid8), and readers only return facts written by transactions older than the oldest one
-- still running (pg_snapshot_xmin): that prefix is final, and ordering it by (xid, position) gives
-- the same answer to every reader, forever.
--
-- Orphan marks are the one fact that is an update (chain_block.orphaned_at). A trigger appends
-- each mark to orphan_mark so it has a position and a transaction of its own.

create sequence fact_position_seq;

alter table chain_block
    add column fact_position bigint not null default nextval('fact_position_seq'),
    add column fact_xid xid8 not null default pg_current_xact_id();
alter table deposit_event
    add column fact_position bigint not null default nextval('fact_position_seq'),
    add column fact_xid xid8 not null default pg_current_xact_id();
alter table ledger_transfer
    add column fact_position bigint not null default nextval('fact_position_seq'),
    add column fact_xid xid8 not null default pg_current_xact_id();
alter table reversal_proposal
    add column fact_position bigint not null default nextval('fact_position_seq'),
    add column fact_xid xid8 not null default pg_current_xact_id();
alter table reversal_decision
    add column fact_position bigint not null default nextval('fact_position_seq'),
    add column fact_xid xid8 not null default pg_current_xact_id();
alter table withdrawal_event
    add column fact_position bigint not null default nextval('fact_position_seq'),
    add column fact_xid xid8 not null default pg_current_xact_id();

create table orphan_mark (
    chain         text        not null,
    block_hash    text        not null,
    orphaned_at   timestamptz not null,
    fact_position bigint      not null default nextval('fact_position_seq'),
    fact_xid      xid8        not null default pg_current_xact_id(),
    primary key (chain, block_hash),
    foreign key (chain, block_hash) references chain_block (chain, block_hash)
);

create trigger orphan_mark_append_only
    before update or delete on orphan_mark
    for each row execute function reject_mutation();
create trigger orphan_mark_no_truncate
    before truncate on orphan_mark
    for each statement execute function reject_mutation();

create function record_orphan_mark() returns trigger
language plpgsql as $$
begin
    insert into orphan_mark (chain, block_hash, orphaned_at) values (new.chain, new.block_hash, new.orphaned_at);
    return null;
end;
$$;

create trigger chain_block_orphan_mark
    after update of orphaned_at on chain_block
    for each row when (old.orphaned_at is null and new.orphaned_at is not null)
    execute function record_orphan_mark();

-- The whole history as one relation. Readers filter on fact_xid < pg_snapshot_xmin(...) and order
-- by (fact_xid, fact_position); see the header.
create view audit_event as
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
  from withdrawal_event e;

create index chain_block_fact on chain_block (fact_xid, fact_position);
create index deposit_event_fact on deposit_event (fact_xid, fact_position);
create index ledger_transfer_fact on ledger_transfer (fact_xid, fact_position);
create index withdrawal_event_fact on withdrawal_event (fact_xid, fact_position);

grant select, insert on orphan_mark to custodian_service;
grant usage on sequence fact_position_seq to custodian_service;
grant select on audit_event to custodian_service, custodian_reader;
