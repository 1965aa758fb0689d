-- deposit_lost, as V4 defines it, except that it derives the status of the observations on
-- orphaned blocks only, one observation at a time, instead of every observation the chains ever
-- had, filtered.
--
-- `orphaned` is computed above deposit_status's window, so a filter on it cannot reach the scan
-- of deposit_event: every read of deposit_lost derived the owner, tier and confirmations of every
-- deposit ever observed, on every chain (a filter on `chain` stops at the DISTINCT ON as well).
-- The posting pass reads it after every scan step of each chain: 1.0 s a pass at 200,000 deposits,
-- for the bitcoin pass of a ledger whose deposits were all ether. Here the observations on
-- orphaned blocks are found by a join of deposit_event with the orphaned blocks, and each is
-- derived through deposit_status by its chain, block and transaction (columns the view's window
-- is partitioned by, so they reach deposit_event's unique index): `offset 0` keeps the lateral
-- subquery parameterised instead of joined whole. A key observed on two orphaned blocks of one
-- height (a height reorged twice) now keeps the later observation; V4 left the choice to the plan.

create or replace view deposit_lost as
select s.deposit_key, s.chain, s.tx_hash, s.kind, s.output_index, s.block_hash, s.height, s.asset,
       s.required_confirmations, s.custody_posted, s.credited_account, s.last_credit_id,
       lost.old_tip, tip.height as tip,
       coalesce(tip.height - lost.old_tip >= s.required_confirmations, false) as grace_passed
  from (select distinct on (o.deposit_key) o.*
          from deposit_event d
          join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash and b.orphaned_at is not null
         cross join lateral (
               select * from deposit_status o
                where o.chain = d.chain and o.block_hash = d.block_hash and o.tx_hash = d.tx_hash and o.id = d.id
               offset 0
         ) o
         order by o.deposit_key, o.height desc, o.id desc) s
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
