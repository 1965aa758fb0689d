-- `available`, defined once (#16): what a customer may spend of an asset is V29's `user_balance`
-- row for their ledger account, zero when they have none. The request path's statement, the
-- balances read and `store::ledger::available` all call this function; being one SQL expression,
-- it is inlined into the statement that calls it (no plan of its own, the same index probe).
-- V33's `withdrawal_request_check` still reads the row itself: the schema's fold (#16 item 4)
-- defines the check once, calling this.
create function available(account_id bigint, asset text) returns numeric(78,0)
language sql stable parallel safe as $$
    select coalesce((select b.balance from user_balance b
                      where b.ledger_account = 'user:' || account_id and b.asset = available.asset), 0)
$$;
grant execute on function available(bigint, text) to custodian_service, custodian_reader;

