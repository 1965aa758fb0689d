-- A BTC payout's reference to its withdrawal, checked once per statement instead of row by row
-- (#13), as V11 did for its reference to the spend.
--
-- auto_explain over the BTC allocation bench (40 batches of fifty at one tip): the foreign key from
-- btc_spend_payout to withdrawal ran fifty SPI queries a batch, each probing and key-share locking
-- its withdrawal, the largest part of the write after the projection update. In pgbench (fifty
-- withdrawals moved to signed and their fifty payouts inserted, three runs each) 1.56-1.62 ms with
-- the foreign key, 1.42-1.45 ms with one set-based check per statement.
--
-- What the foreign key guarded on the withdrawal's side is made to hold for every withdrawal: a
-- withdrawal row is never deleted (nor the table truncated), and its id never changes (it joins the
-- request columns the immutability trigger guards). A withdrawal row is the projection of an
-- event stream that only grows; nothing in the service deletes one, and the service has no
-- privilege to. So a withdrawal that exists when a payout naming it is inserted exists for good, and
-- one check at insert says all the foreign key said, without a lock.

-- Refuses the statement's inserted payouts (transition table `inserted`) if any names a withdrawal
-- that does not exist (SQLSTATE 23503, the foreign key's name as before); the statement's writes
-- are undone. Their spend stays checked by V11's btc_spend_referenced(), which fires first (after-
-- triggers fire in name order).
create function btc_spend_payout_withdrawal_referenced() returns trigger
language plpgsql as $$
declare
    missing bigint;
begin
    select n.withdrawal_id into missing
      from inserted n
     where not exists (select from withdrawal w where w.id = n.withdrawal_id)
     limit 1;
    if found then
        raise exception 'insert on table "btc_spend_payout" violates foreign key constraint "%"',
                        'btc_spend_payout_withdrawal_id_fkey'
              using errcode = 'foreign_key_violation', table = 'btc_spend_payout',
                    constraint = 'btc_spend_payout_withdrawal_id_fkey',
                    detail = format('Key (withdrawal_id)=(%s) is not present in table "withdrawal".', missing);
    end if;
    return null;
end;
$$;

alter table btc_spend_payout drop constraint btc_spend_payout_withdrawal_id_fkey;
create trigger btc_spend_payout_withdrawal_exists
    after insert on btc_spend_payout referencing new table as inserted
    for each statement execute function btc_spend_payout_withdrawal_referenced();

-- A withdrawal is never deleted, row by row or by truncation, by anyone: its events say what
-- became of it.
create function reject_withdrawal_delete() returns trigger
language plpgsql as $$
begin
    raise exception 'withdrawal: % rejected; a withdrawal is never deleted, its events say what became of it', tg_op
        using errcode = 'insufficient_privilege', table = 'withdrawal';
end;
$$;

create trigger withdrawal_never_deleted
    before delete on withdrawal for each row execute function reject_withdrawal_delete();
create trigger withdrawal_never_truncated
    before truncate on withdrawal for each statement execute function reject_withdrawal_delete();

-- And its id joins the columns that never change.
create or replace function reject_withdrawal_request_change() returns trigger
language plpgsql as $$
begin
    if (new.id, new.account_id, new.external_id, new.chain, new.asset, new.destination, new.amount, new.requested_by)
       is distinct from
       (old.id, old.account_id, old.external_id, old.chain, old.asset, old.destination, old.amount, old.requested_by)
    then
        raise exception 'withdrawal %: its id, account, asset, destination, amount, external id and requester never change',
                        old.id
              using errcode = 'insufficient_privilege';
    end if;
    return new;
end;
$$;

drop trigger withdrawal_request_immutable on withdrawal;
create trigger withdrawal_request_immutable
    before update of id, account_id, external_id, chain, asset, destination, amount, requested_by on withdrawal
    for each row execute function reject_withdrawal_request_change();
