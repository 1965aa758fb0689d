-- What the request path bench (#14) showed costing on every write or every block, whatever the
-- table statistics say.
--
-- 1. The format checks of V1 (is_u256, is_valid_address, is_valid_hash) as PL/pgSQL functions, with
-- the same results (NULL for a NULL value, so a NULL column passes its CHECK as before).
--
-- Written in SQL, each was inlined into every CHECK constraint that calls it, and PostgreSQL
-- prepares a table's CHECK expressions afresh for every INSERT or UPDATE statement it executes:
-- each statement re-read each function's body and re-planned it, on every row-at-a-time write.
-- Profiled under the request path bench (#14), ExecConstraints was 12% of all CPU on the machine,
-- most of it planning these bodies; measured alone (pgbench, 20 single-row inserts per
-- transaction into a table with four such checks), 0.34 ms per insert inlined, 0.16 ms as
-- PL/pgSQL, 0.12 ms with no check at all. A PL/pgSQL function is compiled once per connection
-- and called per row, so the CHECK costs its evaluation and no planning.

create or replace function is_u256(value numeric) returns boolean
language plpgsql immutable parallel safe as $$
begin
    return value >= 0
       and value <= 115792089237316195423570985008687907853269984665640564039457584007913129639935;
end;
$$;

create or replace function is_valid_hash(chain text, value text) returns boolean
language plpgsql immutable parallel safe as $$
begin
    return case chain
        when 'eth' then length(value) = 66 and value ~ '^0x[0-9a-f]+$'
        when 'btc' then length(value) = 64 and value ~ '^[0-9a-f]+$'
        else false
    end;
end;
$$;

create or replace function is_valid_address(chain text, value text) returns boolean
language plpgsql immutable parallel safe as $$
begin
    return case chain
        when 'eth' then length(value) = 42 and value ~ '^0x[0-9a-f]+$'
        when 'btc' then length(value) between 14 and 90 and value ~ '^[A-Za-z0-9]+$'
        else false
    end;
end;
$$;

-- 2. deposit_status, as V4 defines it, except that a key's postings are read per transfer through
-- ledger_posting's transfer index (`lateral … offset 0`, as the request path's idempotency lookup
-- does). Joined whole, the plan chosen while ledger_posting looked small hashes the key's
-- transfers and scans every posting the ledger holds, once per deposit: the deposit posting pass
-- after every scan step read the whole ledger once per deposit (seen at 130-490 ms a pass, two
-- passes a block, behind 4,000 withdrawals and 64 deposits), growing with every withdrawal paid.
create or replace view deposit_status as
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
                  from ledger_transfer t
                 cross join lateral (select l.ledger_account, l.direction, l.amount from ledger_posting l
                                      where l.transfer_id = t.id offset 0) lp
                 where t.deposit_key = p.deposit_key) x
  ) k on true;
