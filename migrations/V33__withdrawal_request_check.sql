-- The account-side checks of a withdrawal request, under the account's row lock, in one call: a
-- request sends BEGIN, this call, its writes and COMMIT in one round trip
-- (withdrawals/src/request.rs), so the account's lock is held for the statements and the commit
-- only, never for a client round trip.
--
-- A volatile function's statements each take a fresh snapshot: the reads after the lock see
-- whatever committed before it was granted (the request that held it a moment ago included).
-- A refusal raises, which aborts the transaction: the writes behind it fail and COMMIT ends it
-- as a rollback, so nothing is written.
--   CW001 the account does not exist
--   CW002 a withdrawal with this external id committed while the request waited (detail: its id)
--   CW003 the available balance is short (detail: the balance, in smallest units)
create function withdrawal_request_check(p_account bigint, p_external_id text, p_asset text, p_amount numeric)
returns void
language plpgsql volatile
as $$
declare
    earlier bigint;
    available numeric;
begin
    perform 1 from account where id = p_account for update;
    if not found then
        raise exception 'unknown account %', p_account using errcode = 'CW001';
    end if;
    select id into earlier from withdrawal where account_id = p_account and external_id = p_external_id;
    if found then
        raise exception 'withdrawal % has external id %', earlier, p_external_id
            using errcode = 'CW002', detail = earlier::text;
    end if;
    available := coalesce(
        (select balance from user_balance where ledger_account = 'user:' || p_account and asset = p_asset), 0);
    if available < p_amount then
        raise exception 'insufficient funds: % requested, % available', p_amount, available
            using errcode = 'CW003', detail = available::text;
    end if;
end;
$$;

grant execute on function withdrawal_request_check(bigint, text, text, numeric) to custodian_service;

-- The rolling 24-hour total's index leads with the asset, so the one index leading with the
-- account is the unique (account_id, external_id): a request's idempotency lookup (here and in
-- the request path) can only be planned as the single-row probe it is, even on tables not yet
-- analysed, instead of walking every withdrawal the account ever made.
drop index withdrawal_account_recent;
create index withdrawal_asset_account_recent on withdrawal (asset, account_id, requested_at);
