-- Attribution (which account owned an address at a height) is a lookup in wallet_address for
-- every deposit. As a plain range match the planner probes the exclusion constraint's GiST index,
-- about ten times slower per probe than a btree (measured: 35 µs against 4 µs). The lookup now
-- asks for the latest range starting at or below the height (at most one matches: the exclusion
-- constraint guarantees it), answered by a covering btree index without touching the table.
-- deposit_status keeps the same columns and answers.

create index wallet_address_lookup
    on wallet_address (chain, address, valid_from_height desc) include (account_id, valid_to_height);

create or replace view deposit_status as
select d.id,
       d.chain,
       d.tx_hash,
       d.output_index,
       d.block_hash,
       b.height,
       d.address,
       d.asset,
       d.amount,
       owner.account_id,
       b.orphaned_at is not null as orphaned,
       case when b.orphaned_at is null then tip.height - b.height + 1 else 0 end as confirmations,
       tier.confirmations as required_confirmations,
       coalesce(b.orphaned_at is null
                and tip.height - b.height + 1 >= tier.confirmations, false) as confirmed,
       exists (
           select 1
             from ledger_transfer lt
            where lt.idempotency_key
                  = 'deposit:' || d.chain || ':' || d.tx_hash || ':' || d.output_index
       ) as posted
  from deposit_event d
  join chain_block b
    on b.chain = d.chain and b.block_hash = d.block_hash
  left join chain_tip tip
    on tip.chain = d.chain
  left join lateral (
        select w.account_id
          from wallet_address w
         where w.chain = d.chain
           and w.address = d.address
           and w.valid_from_height <= b.height
           and (w.valid_to_height is null or b.height < w.valid_to_height)
         order by w.valid_from_height desc
         limit 1
  ) owner on true
  left join lateral (
        select cp.confirmations
          from confirmation_policy cp
         where cp.chain = d.chain
           and cp.asset = case
                   when exists (select 1
                                  from confirmation_policy own
                                 where own.chain = d.chain and own.asset = d.asset)
                   then d.asset
                   else case d.chain when 'eth' then 'ETH' when 'btc' then 'BTC' end
               end
           and cp.min_amount <= d.amount
         order by cp.min_amount desc
         limit 1
  ) tier on true;
