-- Shared building blocks used by every later migration.
--
-- * Append-only guards. Observations (what a chain said) and decisions (ledger transfers,
--   withdrawal events, signed attempts) are facts: they are appended, never changed or removed,
--   so every projection can be rebuilt from them and audited after an incident. The guards below
--   are attached as triggers to each append-only table; the service role also lacks the
--   privileges (see V8__finance_views_and_roles.sql), so a bug meets two walls, not one.
-- * The U256 range of amounts.
-- * Chain-dependent formats of hashes and addresses, so a value written in the wrong form (a
--   checksummed ETH address, a BTC hash with a 0x prefix) fails at insert instead of silently
--   never matching in a join. ETH: lowercase 0x-hex. BTC: plain lowercase hex hashes and
--   base58/bech32 address strings.
-- * The position of a fact in the audit history, which every fact table carries.
--
-- Each format and range rule is written once, in the functions below, and every check constraint
-- calls them. PostgreSQL prepares a table's check constraints afresh for every insert or update
-- statement, so what a check costs is paid per statement, and for the one-row statements of
-- allocation and ingestion that is most of the work. Two things keep it cheap:
--   - The functions are plain SQL expressions and deliberately not declared strict: the planner
--     inlines a non-strict SQL function into the check that calls it, so the check runs as the
--     bare expression. A strict function whose body is a CASE or an AND cannot be inlined and is
--     called through the SQL-function executor, planning its body, for every statement (about
--     three times the cost of the bare expression). Inlining is not free either: fetching and
--     substituting the body costs a few microseconds per call, per statement; that is the price
--     of writing each rule once instead of in every check. A null value still gives null, so a
--     null column passes a check, as with any check.
--   - A length test plus an unbounded character class instead of a counted repetition: the regex
--     engine expands [0-9a-f]{64} into 64 copies of its automaton, rebuilt on every match (about
--     7 µs per check). Both forms accept exactly the same strings (the classes admit only one-byte
--     characters, so characters and bytes agree).

-- Rejects UPDATE, DELETE and TRUNCATE on an append-only table. Attach as a before-row trigger
-- for update/delete and a before-statement trigger for truncate.
create function reject_mutation() returns trigger
language plpgsql as $$
begin
    raise exception 'append-only table %: % rejected', tg_table_name, tg_op
        using errcode = 'P0001',
              table = tg_table_name,
              hint = 'append a new fact instead of changing an old one';
end;
$$;

-- Makes `tbl` append-only: `<tbl>_append_only` rejects UPDATE and DELETE row by row (but the one
-- permitted update of `set_once`, when named: reject_mutation_except_set_once below),
-- `<tbl>_no_truncate` rejects TRUNCATE. Every fact table is made so by one call.
create procedure append_only(tbl text, set_once text default null)
language plpgsql as $$
begin
    if set_once is null then
        execute format('create trigger %I before update or delete on %I for each row execute function reject_mutation()',
                       tbl || '_append_only', tbl);
    else
        execute format('create trigger %I before update or delete on %I for each row '
                       'execute function reject_mutation_except_set_once(%L)', tbl || '_append_only', tbl, set_once);
    end if;
    execute format('create trigger %I before truncate on %I for each statement execute function reject_mutation()',
                   tbl || '_no_truncate', tbl);
end;
$$;
-- Only migrations (the schema owner) attach guards.
revoke execute on procedure append_only(text, text) from public;

-- Like reject_mutation(), except for one permitted update: the column named by the trigger's
-- argument may go from null to a value, once, with every other column unchanged. Used for
-- wallet_address.valid_to_height (a reassignment closes an ownership range),
-- api_token.revoked_at (a token is revoked once) and utxo_reservation.released_at (an operator
-- releases a reservation whose spend can never be mined). Comparing whole rows as jsonb keeps the
-- guard correct whatever columns the table has.
create function reject_mutation_except_set_once() returns trigger
language plpgsql as $$
declare
    settable text := tg_argv[0];
begin
    if tg_op = 'UPDATE'
       and to_jsonb(old) ->> settable is null
       and to_jsonb(new) ->> settable is not null
       and to_jsonb(new) - settable = to_jsonb(old) - settable then
        return new;
    end if;
    raise exception 'append-only table %: % rejected', tg_table_name, tg_op
        using errcode = 'P0001',
              table = tg_table_name,
              detail = format('the only permitted change is setting %I once, from null, '
                              'with every other column unchanged', settable);
end;
$$;

-- Fits alloy_primitives::U256, the Rust type of every amount. numeric(78,0) alone admits values
-- up to 10^78 - 1, above U256::MAX, which would make the row unreadable by the service.
create function is_u256(value numeric) returns boolean
language sql immutable parallel safe
return value >= 0
   and value <= 115792089237316195423570985008687907853269984665640564039457584007913129639935;

-- A transaction or block hash in the chain's canonical text form.
create function is_valid_hash(chain text, value text) returns boolean
language sql immutable parallel safe
return case chain
    when 'eth' then length(value) = 66 and value ~ '^0x[0-9a-f]+$'
    when 'btc' then length(value) = 64 and value ~ '^[0-9a-f]+$'
    else false
end;

-- An address in the chain's canonical text form. BTC addresses are parsed and checked against
-- the network in Rust; here we only keep obvious garbage (whitespace, prefixes) out.
create function is_valid_address(chain text, value text) returns boolean
language sql immutable parallel safe
return case chain
    when 'eth' then length(value) = 42 and value ~ '^0x[0-9a-f]+$'
    when 'btc' then length(value) between 14 and 90 and value ~ '^[A-Za-z0-9]+$'
    else false
end;

-- Audit positions: auditors read every appended fact (blocks, block verdicts, deposit
-- observations, ledger transfers, reversal rounds and decisions, withdrawal events, operator
-- actions) as one history and resume it from a position (V7__audit.sql). A sequence alone cannot
-- give a stable order: a transaction that took a smaller number may commit after a reader has
-- passed a larger one. So every fact table carries
--     fact_position bigint not null default nextval('fact_position_seq'),
--     fact_xid      xid8   not null default pg_current_xact_id()
-- the fact's number and the id of the transaction that wrote it, and readers only return facts
-- written by transactions older than the oldest one still running (pg_snapshot_xmin): that prefix
-- is final, and ordering it by (xid, position) gives the same answer to every reader, forever.
-- The sequence is here, not with the history in V7, because every fact table's default names it.
create sequence fact_position_seq;
