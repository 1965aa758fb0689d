-- Hot wallets are watched (DESIGN §7 item 8): money arriving at a hot-wallet address from
-- outside (a top-up, the arrival of a rebalance) is a deposit credited to `treasury`, so custody
-- equals what our addresses hold. One account, the treasury's, owns every hot-wallet address from
-- the block after its registration; the posting pass credits its deposits to the `treasury`
-- ledger account instead of a customer's.
alter table account add column treasury boolean not null default false;
create unique index account_one_treasury on account (treasury) where treasury;
-- id 0, outside the sequence, so customers' ids are as they were
insert into account (id, external_ref, treasury) values (0, '@treasury', true);

-- The ledger account a deposit owned by `account_id` is credited to.
create function ledger_account_of(account_id bigint) returns text
language sql stable parallel safe
return case when exists (select 1 from account a where a.id = account_id and a.treasury) then 'treasury'
            else 'user:' || account_id end;

grant execute on function ledger_account_of(bigint) to custodian_service;

-- Hot wallets registered before this migration are watched from the block after our tip. A hot
-- wallet whose address is also a customer's deposit address fails this migration (the exclusion
-- constraint names it): its top-ups would be credited to that customer; an operator must retire
-- one of the two first.
insert into wallet_address (chain, address, account_id, valid_from_height)
select h.chain, h.address, (select id from account where treasury),
       coalesce((select max(b.height) + 1 from chain_block b where b.chain = h.chain and b.orphaned_at is null), 0)
  from hot_wallet h;
