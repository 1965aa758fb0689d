-- A BTC lane's coins, one home for what the worker may spend and what `hot-wallet list` shows
-- (DESIGN §7b): every unspent output on the canonical chain at the lane's funding address or one
-- of its change addresses, with its state:
--   reserved    a live reservation holds it for a signed spend;
--   spendable   our own change (one confirmation: it is in a canonical block), or a coin the
--               ledger credited to custody (confirmed by the deposit tiers and posted);
--   unconfirmed paid to the funding address while the treasury owned it, not credited yet;
--   not_custody anything else (paid before registration, or to a change address by a stranger).
create view btc_lane_coin as
with lane_address as (
    select lane, address, null::integer as change_index from btc_hot_wallet
    union all
    select lane, address, derivation_index from btc_change_address
)
select a.lane, u.tx_hash, u.output_index, u.amount, a.change_index, u.height,
       case
           when exists (select 1 from utxo_reservation r
                         where r.chain = 'btc' and r.tx_hash = u.tx_hash and r.output_index = u.output_index
                           and r.released_at is null) then 'reserved'
           when a.change_index is not null then
               case when exists (select 1 from btc_attempt t where t.tx_hash = u.tx_hash) then 'spendable'
                    else 'not_custody' end
           when exists (select 1 from ledger_transfer t
                         where t.deposit_key = 'deposit:btc:' || u.tx_hash || ':output:' || u.output_index
                           and t.kind = 'deposit') then 'spendable'
           when exists (select 1 from wallet_address w join account o on o.id = w.account_id and o.treasury
                         where w.chain = 'btc' and w.address = u.address and w.valid_from_height <= u.height
                           and (w.valid_to_height is null or u.height < w.valid_to_height)) then 'unconfirmed'
           else 'not_custody'
       end as state
  from lane_address a
  join unspent_output u on u.chain = 'btc' and u.address = a.address;

grant select on btc_lane_coin to custodian_service, custodian_reader;
