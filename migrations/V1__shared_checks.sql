-- Shared building blocks used by every later migration.
--
-- * Append-only guards. Observations (what a chain said) and decisions (ledger transfers,
--   withdrawal events, signed attempts) are facts: they are appended, never changed or removed,
--   so every projection can be rebuilt from them and audited after an incident. The guards below
--   are attached as triggers to each append-only table; the service role also lacks the
--   privileges (see the roles migration), so a bug meets two walls, not one.
-- * The U256 range of amounts.
-- * Chain-dependent formats of hashes and addresses, so a value written in the wrong form (a
--   checksummed ETH address, a BTC hash with a 0x prefix) fails at insert instead of silently
--   never matching in a join. ETH: lowercase 0x-hex. BTC: plain lowercase hex hashes and
--   base58/bech32 address strings.

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

-- Like reject_mutation(), except for one permitted update: the column named by the trigger's
-- argument may go from null to a value, once, with every other column unchanged. Used for
-- chain_block.orphaned_at (a reorg marks a block) and wallet_address.valid_to_height (a
-- reassignment closes an ownership range). Comparing whole rows as jsonb keeps the guard correct
-- if a later migration adds columns.
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
language sql immutable strict parallel safe
return value >= 0
   and value <= 115792089237316195423570985008687907853269984665640564039457584007913129639935;

-- A transaction or block hash in the chain's canonical text form.
create function is_valid_hash(chain text, value text) returns boolean
language sql immutable strict parallel safe
return case chain
    when 'eth' then value ~ '^0x[0-9a-f]{64}$'
    when 'btc' then value ~ '^[0-9a-f]{64}$'
    else false
end;

-- An address in the chain's canonical text form. BTC addresses are parsed and checked against
-- the network in Rust; here we only keep obvious garbage (whitespace, prefixes) out.
create function is_valid_address(chain text, value text) returns boolean
language sql immutable strict parallel safe
return case chain
    when 'eth' then value ~ '^0x[0-9a-f]{40}$'
    when 'btc' then value ~ '^[A-Za-z0-9]{14,90}$'
    else false
end;
