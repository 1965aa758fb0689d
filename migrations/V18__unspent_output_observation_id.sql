-- unspent_output (V2__chain_observations.sql) also names the observation it reads: the
-- deposit_event row's id, appended as the view's last column (the view is otherwise unchanged, and
-- so are its grants).
--
-- The BTC worker reads a lane's spendable coins largest first, ties broken by this id (the first
-- observed first). It used to break them by tx hash and output index: sorting 10,000 coins of one
-- amount (the BTC allocation bench's pool) compared the hashes as collated text and cost as much
-- as the join that found the coins.
create or replace view unspent_output as
select d.chain, d.tx_hash, d.output_index, d.address, d.amount, d.coinbase, b.height, b.block_hash, d.id
  from deposit_event d
  join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash and b.orphaned_at is null
 where d.chain = 'btc' and d.kind = 'output'
   and not exists (select 1 from output_spend s
                     join chain_block sb on sb.chain = s.chain and sb.block_hash = s.block_hash
                                        and sb.orphaned_at is null
                    where s.chain = d.chain and s.tx_hash = d.tx_hash and s.output_index = d.output_index);
