-- Balances are customers': the treasury's account (which owns the hot wallets) shows no row in
-- account_balance. Its money is the `treasury` ledger account; its rebalances in flight and its
-- unconfirmed top-ups are not a customer's held or pending.
create or replace view account_balance as
select b.* from (
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
       and (w.state <> 'needs_review'
            or not exists (select 1 from ledger_transfer t
                            where t.idempotency_key in ('withdrawal:' || w.id || ':settle',
                                                        'withdrawal:' || w.id || ':release')))
     group by 1, 2
), pending as (
    select u.account_id, u.asset, sum(u.amount) as pending
      from (select distinct on (s.deposit_key) s.account_id, s.asset, s.amount
              from deposit_status s
             where s.account_id is not null and not s.orphaned and s.custody_posted = 0
             order by s.deposit_key, s.height desc) u
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
  full join pending p using (account_id, asset)
) b
 where b.account_id <> all (select id from account where treasury);
