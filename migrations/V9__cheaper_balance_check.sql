-- The balance check, made cheaper without weakening it.
--
-- A transfer and its postings are normally inserted by one transaction, and the deferred trigger
-- used to run once per posting as well as once per transfer: three identical checks for a
-- two-legged transfer. Now a posting's trigger skips transfers created by the same transaction
-- (their own trigger checks them at commit, after every posting is in), and the check itself is
-- one aggregate. A posting added later to an older transfer is still checked by its own trigger.

create or replace function check_transfer_balanced() returns trigger
language plpgsql as $$
declare
    checked_id bigint;
    legs bigint;
    unbalanced record;
begin
    if tg_table_name = 'ledger_transfer' then
        checked_id := new.id;
    else
        checked_id := new.transfer_id;
        if exists (select 1 from ledger_transfer t
                    where t.id = checked_id and t.fact_xid = pg_current_xact_id()) then
            return null;
        end if;
    end if;

    select count(*) into legs from ledger_posting where transfer_id = checked_id;
    if legs = 0 then
        raise exception 'ledger transfer % has no postings', checked_id
            using errcode = '23514',
                  constraint = 'ledger_transfer_balanced',
                  table = 'ledger_transfer';
    end if;

    select p.asset,
           coalesce(sum(p.amount) filter (where p.direction = 'debit'), 0) as debits,
           coalesce(sum(p.amount) filter (where p.direction = 'credit'), 0) as credits
      into unbalanced
      from ledger_posting p
     where p.transfer_id = checked_id
     group by p.asset
    having coalesce(sum(p.amount) filter (where p.direction = 'debit'), 0)
        <> coalesce(sum(p.amount) filter (where p.direction = 'credit'), 0)
     order by p.asset
     limit 1;

    if found then
        raise exception 'ledger transfer % does not balance for asset %: debits %, credits %',
                checked_id, unbalanced.asset, unbalanced.debits, unbalanced.credits
            using errcode = '23514',
                  constraint = 'ledger_transfer_balanced',
                  table = 'ledger_transfer';
    end if;
    return null;
end;
$$;
