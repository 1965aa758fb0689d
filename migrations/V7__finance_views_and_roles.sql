-- The read side for finance, and the database roles.
--
-- Balances, confirmation counts and withdrawal states are never stored; these views derive them
-- from the appended facts on every read. Finance reads only these views, through the read-only
-- role custodian_reader, which has no privilege on any base table: the views run with their
-- owner's privileges (security_invoker is left at its default, false), so the role needs none.
--
-- custodian_service is the role the service runs as. It can append to append-only tables but
-- holds no UPDATE or DELETE on them (beyond the two column-level updates the triggers also
-- permit, and pruning raw_block), so a bug meets the privilege check before the trigger.
--
-- Roles are cluster-global while this migration runs once per database (and test suites create
-- many databases), so role creation tolerates the role already existing, including a concurrent
-- migration creating it at the same moment. Grants are per database.

-- Our tip per chain: the highest non-orphaned block we hold, not the node's answer, so a node
-- that lags or resyncs never moves projections backwards. One index probe per chain.
create view chain_tip as
select c.chain, t.height
  from (values ('eth'), ('btc')) as c (chain)
  cross join lateral (
        select max(b.height) as height
          from chain_block b
         where b.chain = c.chain
           and b.orphaned_at is null
  ) t
 where t.height is not null;

-- One row per deposit observation. A deposit in an orphaned block shows orphaned = true and 0
-- confirmations. The owner is whoever held the address at the block's height. The required
-- confirmations come from the asset's own policy tiers, or from the chain's native asset's tiers
-- when the asset has none; with no applicable tier the deposit never counts as confirmed.
create view deposit_status as
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
  -- the exclusion constraint on wallet_address guarantees at most one match
  left join lateral (
        select w.account_id
          from wallet_address w
         where w.chain = d.chain
           and w.address = d.address
           and w.valid_from_height <= b.height
           and (w.valid_to_height is null or b.height < w.valid_to_height)
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

-- Every posting with its transfer, for auditors and the ledger-entries API.
create view ledger_entries as
select t.id as transfer_id,
       t.idempotency_key,
       t.kind,
       t.reference,
       t.created_at,
       p.ledger_account,
       p.asset,
       p.direction,
       p.amount,
       p.id as posting_id
  from ledger_transfer t
  join ledger_posting p on p.transfer_id = t.id;

-- Balances per account and asset.
--   held      = amounts of the account's withdrawals still holding funds (in flight).
--   confirmed = posted funds: the net of the account's user:{id} postings plus held. A
--               withdrawal request already debits user:{id} into withdrawal_holds, so the
--               ledger balance alone is what remains spendable; adding the holds back keeps
--               "available = confirmed - held" from subtracting a withdrawal twice.
--   available = confirmed - held, i.e. the net of the user:{id} postings.
--   pending   = observed deposits attributed to the account, in a non-orphaned block and not
--               yet posted (counted once per deposit key, even if seen in two blocks).
create view account_balance as
with ledger as (
    select substr(p.ledger_account, 6)::bigint as account_id,
           p.asset,
           sum(case p.direction when 'credit' then p.amount else -p.amount end) as net
      from ledger_posting p
     where p.ledger_account like 'user:%'
     group by 1, 2
), held as (
    select w.account_id, w.asset, sum(w.amount) as held
      from withdrawal w
     where w.account_id is not null
       and w.state in ('requested', 'awaiting_approval', 'signed', 'broadcast', 'mined',
                       'cancel_requested', 'needs_review')
     group by 1, 2
), pending as (
    select u.account_id, u.asset, sum(u.amount) as pending
      from (select distinct on (s.chain, s.tx_hash, s.output_index)
                   s.account_id, s.asset, s.amount
              from deposit_status s
             where s.account_id is not null
               and not s.orphaned
               and not s.posted
             order by s.chain, s.tx_hash, s.output_index, s.height desc) u
     group by 1, 2
)
select account_id,
       asset,
       coalesce(l.net, 0) + coalesce(h.held, 0) as confirmed,
       coalesce(p.pending, 0) as pending,
       coalesce(h.held, 0) as held,
       coalesce(l.net, 0) as available
  from ledger l
  full join held h using (account_id, asset)
  full join pending p using (account_id, asset);

-- The withdrawal projection with its signed attempts: how many, and the most recent hash.
create view withdrawal_status as
select w.*,
       coalesce(a.attempt_count, 0) as attempt_count,
       a.latest_attempt_tx_hash
  from withdrawal w
  left join lateral (
        select count(*) as attempt_count,
               (array_agg(wa.tx_hash order by wa.created_at desc, wa.tx_hash desc))[1]
                   as latest_attempt_tx_hash
          from withdrawal_attempt wa
         where wa.withdrawal_id = w.id
  ) a on true;

do $$
declare
    role_name text;
begin
    foreach role_name in array array['custodian_reader', 'custodian_service'] loop
        if not exists (select 1 from pg_roles where rolname = role_name) then
            begin
                execute format('create role %I nologin', role_name);
            exception
                -- another database's migration created it between our check and our create
                when duplicate_object or unique_violation then null;
            end;
        end if;
    end loop;
end;
$$;

-- Finance: the four views and nothing else.
grant usage on schema public to custodian_reader;
grant select on account_balance, deposit_status, withdrawal_status, ledger_entries
    to custodian_reader;

-- The service.
grant usage on schema public to custodian_service;
grant usage on all sequences in schema public to custodian_service;
grant select on chain_tip, account_balance, deposit_status, withdrawal_status, ledger_entries
    to custodian_service;

-- append-only: read and append only
grant select, insert on
    chain_block, raw_block, deposit_event, wallet_address, ledger_transfer, ledger_posting,
    reversal_proposal, reversal_decision, withdrawal_event, nonce_allocation, withdrawal_attempt
    to custodian_service;
-- the permitted changes: orphan a block, close an ownership range, prune raw blocks
grant update (orphaned_at) on chain_block to custodian_service;
grant update (valid_to_height) on wallet_address to custodian_service;
grant delete on raw_block to custodian_service;

-- mutable state and configuration
grant select, insert, update on
    scan_cursor, withdrawal, hot_wallet, confirmation_policy, asset
    to custodian_service;

-- accounts are never changed; the column-level update exists only because PostgreSQL requires
-- UPDATE privilege for `select ... for update`, which locks the account row while a withdrawal
-- request computes its available balance
grant select, insert on account to custodian_service;
grant update (external_ref) on account to custodian_service;
