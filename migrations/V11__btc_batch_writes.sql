-- What one BTC allocation writes per payout, made cheaper without weakening what is enforced.
--
-- A batch of fifty payouts writes fifty `btc_spend_payout` rows and a reservation per coin, all
-- naming the spend inserted by the same statement (withdrawals/src/btc/mod.rs, WRITE_ALLOCATION).
-- As foreign keys, each of those rows ran its own probe of btc_spend, taking a key-share lock on
-- the spend row it had just inserted: 14-16 µs a row by EXPLAIN ANALYZE, a quarter of the
-- statement. btc_spend is append-only (no update, delete or truncate, V5), so after the insert
-- there is nothing left for the reference to guard; one check per statement, over the rows it
-- inserted, says all the foreign key said. The reference to the withdrawal stays a foreign key:
-- withdrawal rows are updated and could be deleted by their owner.
--
-- btc_spend_payout's primary key (spend_id, withdrawal_id) was a second index over what the
-- unique withdrawal_id already keys (a withdrawal is paid by one spend only): withdrawal_id alone
-- becomes the primary key, and each payout inserts into two indexes instead of three.

-- Refuses the statement's inserted rows (transition table `inserted`) if any names a spend that
-- does not exist, as the foreign key did (SQLSTATE 23503); the statement's writes are undone.
create function btc_spend_referenced() returns trigger
language plpgsql as $$
declare
    missing bigint;
begin
    select n.spend_id into missing
      from (select distinct spend_id from inserted) n
     where not exists (select from btc_spend s where s.id = n.spend_id)
     limit 1;
    if found then
        raise exception 'insert on table "%" names spend %, which is not in btc_spend', tg_table_name, missing
              using errcode = 'foreign_key_violation',
                    table = tg_table_name;
    end if;
    return null;
end;
$$;

alter table btc_spend_payout drop constraint btc_spend_payout_spend_id_fkey;
alter table utxo_reservation drop constraint utxo_reservation_spend_id_fkey;

create trigger btc_spend_payout_spend_exists
    after insert on btc_spend_payout referencing new table as inserted
    for each statement execute function btc_spend_referenced();
create trigger utxo_reservation_spend_exists
    after insert on utxo_reservation referencing new table as inserted
    for each statement execute function btc_spend_referenced();

alter table btc_spend_payout
    drop constraint btc_spend_payout_pkey,
    drop constraint btc_spend_payout_withdrawal_id_key,
    add constraint btc_spend_payout_pkey primary key (withdrawal_id);
