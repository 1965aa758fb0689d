-- The audit history: one stream of every appended fact in an order that never changes, a hash
-- chain sealing it, and finance's record of deposit discrepancies.
--
-- Auditors read the history (blocks, block verdicts, deposit observations, ledger transfers,
-- reversal rounds and decisions, withdrawal events, operator actions) as one relation,
-- audit_event, and resume it from a position. Readers filter on
-- fact_xid < pg_snapshot_xmin(pg_current_snapshot()) and order by (fact_xid, fact_position): the
-- facts of transactions older than every running one are final, so the order is the same for
-- every reader, forever (see fact_position_seq in V1__shared_checks.sql). Webhooks deliver the
-- same history.
--
-- Fact seals: every fact of the history, once final (the same horizon), gets a seal in history
-- order: the SHA-256 of its kind, position and content, and a chain hash covering the previous
-- seal's. A fact edited or deleted afterwards no longer matches its seal, even when everything
-- derived from it was changed to match; a seal removed or altered breaks the chain at the next
-- one. `replay --verify` checks both. Seals are appended by the service after its writes
-- (seal_facts); replay only reads.
--
-- This file comes after every fact table it reads (V2..V6).

-- ------------------------------------------------------------------ the history

-- The history reader's order, per fact table.
create index chain_block_fact on chain_block (fact_xid, fact_position);
create index block_verdict_fact on block_verdict (fact_xid, fact_position);
create index deposit_event_fact on deposit_event (fact_xid, fact_position);
create index ledger_transfer_fact on ledger_transfer (fact_xid, fact_position);
create index withdrawal_event_fact on withdrawal_event (fact_xid, fact_position);
create index operator_action_fact on operator_action (fact_xid, fact_position);

-- The whole history as one relation. A block's verdicts appear as 'orphan_mark' (orphaned) and
-- 'block_reinstated'; withdrawal events as 'withdrawal_<event_type>'; operator actions as
-- 'operator_<action>'.
create view audit_event as
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

-- ------------------------------------------------------------------ seals

create table fact_seal (
    position   bigint      not null,
    xid        xid8        not null,
    kind       text        not null,
    digest     bytea       not null,
    chain_hash bytea       not null,
    sealed_at  timestamptz not null default now(),
    constraint fact_seal_pkey primary key (position),
    constraint fact_seal_digest_length check (length(digest) = 32),
    constraint fact_seal_chain_hash_length check (length(chain_hash) = 32)
);
create unique index fact_seal_order on fact_seal (xid, position);

call append_only('fact_seal');

-- The digest of one fact as the history shows it.
create function fact_digest(fact_kind text, fact_position bigint, fact_payload jsonb) returns bytea
language sql immutable strict parallel safe
return sha256(convert_to(fact_kind || ':' || fact_position::text || ':' || fact_payload::text, 'UTF8'));

-- Seals up to max_facts final facts after the last seal, in history order; returns how many.
-- One sealer at a time (a transaction-scoped advisory lock); a second waits, then finds less.
create function seal_facts(max_facts integer) returns integer
language plpgsql as $$
declare
    last_xid xid8;
    last_position bigint;
    previous bytea;
    fact record;
    digest bytea;
    sealed integer := 0;
begin
    perform pg_advisory_xact_lock(x'7365616c'::int);
    select s.xid, s.position, s.chain_hash into last_xid, last_position, previous
      from fact_seal s order by s.xid desc, s.position desc limit 1;
    previous := coalesce(previous, sha256(''::bytea));
    for fact in
        select a.position, a.xid, a.kind, a.payload
          from audit_event a
         where a.xid < pg_snapshot_xmin(pg_current_snapshot())
           and (last_xid is null or (a.xid, a.position) > (last_xid, last_position))
         order by a.xid, a.position
         limit max_facts
    loop
        digest := fact_digest(fact.kind, fact.position, fact.payload);
        previous := sha256(previous || digest);
        insert into fact_seal (position, xid, kind, digest, chain_hash)
        values (fact.position, fact.xid, fact.kind, digest, previous);
        sealed := sealed + 1;
    end loop;
    return sealed;
end;
$$;

-- Every sealed fact against its seal and the chain, in history order: what was changed, deleted,
-- or unsealed. Reads only.
create function verify_seals() returns table (seal_position bigint, problem text)
language plpgsql stable as $$
declare
    previous bytea := sha256(''::bytea);
    s record;
begin
    for s in
        select f.position, f.xid, f.kind, f.digest, f.chain_hash, a.kind as fact_kind, a.payload
          from fact_seal f left join audit_event a on a.position = f.position
         order by f.xid, f.position
    loop
        previous := sha256(previous || s.digest);
        if previous <> s.chain_hash then
            seal_position := s.position;
            problem := 'the seal chain breaks before this seal: a seal was removed or altered';
            return next;
            previous := s.chain_hash;
        end if;
        if s.fact_kind is null then
            seal_position := s.position;
            problem := 'the sealed ' || s.kind || ' fact is gone';
            return next;
        elsif fact_digest(s.fact_kind, s.position, s.payload) <> s.digest then
            seal_position := s.position;
            problem := 'the sealed ' || s.kind || ' fact was changed after it was sealed';
            return next;
        end if;
    end loop;
end;
$$;

-- ------------------------------------------------------------------ discrepancies

-- Finance sees every deposit discrepancy round: what the ledger held beyond the canonical chain
-- for a deposit key, and how it was settled — approved (the customer debited), rejected (the loss
-- booked to treasury), closed (the money was re-mined first) or still open.
create view deposit_discrepancy as
select r.id, r.deposit_key, r.round, r.chain, r.tx_hash, r.kind, r.output_index, r.ledger_account, r.asset, r.amount,
       r.reason, r.proposed_at, d.proposal_id is null as open, d.decision, d.decided_by, d.decided_at,
       d.reason as decision_reason, d.compensating_transfer_id
  from reversal_proposal r
  left join reversal_decision d on d.proposal_id = r.id;
