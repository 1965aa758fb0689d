-- `available` without summing an account's whole history (#14): each customer ledger account's
-- balance per asset, kept by a trigger in the same transaction as the postings it sums (one row
-- update per account and asset a statement touches, in key order), rebuilt and compared by
-- `replay --verify`. System accounts (custody, withdrawal_holds, network_fees, treasury) are not
-- kept here: every transfer touches one of them, and a row per system account would serialise
-- every ledger write. The service reads it; only the trigger (as the owner) writes it.
create table user_balance (
    ledger_account text          not null check (ledger_account ~ '^user:[0-9]+$'),
    asset          text          not null references asset (asset),
    balance        numeric(78,0) not null,
    primary key (ledger_account, asset)
);

insert into user_balance (ledger_account, asset, balance)
select ledger_account, asset, sum(case direction when 'credit' then amount else -amount end)
  from ledger_posting
 where ledger_account like 'user:%'
 group by ledger_account, asset;

create function user_balance_add() returns trigger
language plpgsql security definer set search_path = public as $$
begin
    insert into user_balance (ledger_account, asset, balance)
    select n.ledger_account, n.asset, sum(case n.direction when 'credit' then n.amount else -n.amount end)
      from new_postings n
     where n.ledger_account like 'user:%'
     group by n.ledger_account, n.asset
     order by n.ledger_account, n.asset
    on conflict (ledger_account, asset) do update set balance = user_balance.balance + excluded.balance;
    return null;
end $$;
revoke all on function user_balance_add() from public;

create trigger ledger_posting_user_balance
    after insert on ledger_posting
    referencing new table as new_postings
    for each statement execute function user_balance_add();

grant select on user_balance to custodian_service, custodian_reader;
