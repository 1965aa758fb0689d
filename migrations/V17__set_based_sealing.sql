-- Fact seals (V7__audit.sql) appended by one statement instead of one per fact.
--
-- seal_facts walked the unsealed facts in a PL/pgSQL loop and inserted each seal with a statement
-- of its own: about 20 µs a fact, 23 µs in a copy of a migrated database with 50,000 withdrawal
-- events. A burst of 1,280 withdrawals appends some 11,000 facts (each withdrawal's events and
-- ledger transfers), so the service's sealer kept one of this machine's two cores busy for about a
-- quarter of a second after each burst, while requests were being answered (the request path
-- bench, #14). The same seals are now one INSERT … SELECT: the chain is a running aggregate over
-- the facts in history order, seeded with the last seal's chain hash. 20,000 facts: 268 ms
-- against 406 ms; 30,000 more: 376 ms against 603 ms; verify_seals found nothing to report after
-- either.
--
-- Every seal is byte for byte what the loop wrote: digest = fact_digest(kind, position, payload),
-- chain_hash = sha256(previous chain_hash || digest), the first previous being sha256('') when
-- nothing is sealed yet. One sealer at a time, as before (the advisory lock), and the same
-- horizon: facts of transactions older than every running one.

-- One link of the chain: the previous link (the seed before the first fact) and this digest.
create function seal_chain_step(previous bytea, digest bytea, seed bytea) returns bytea
language plpgsql immutable parallel safe as $$
begin
    return sha256(coalesce(previous, seed) || digest);
end;
$$;

-- The chain hash after the digests aggregated so far, in the window's order, from `seed`.
create aggregate seal_chain(digest bytea, seed bytea) (sfunc = seal_chain_step, stype = bytea);

create or replace function seal_facts(max_facts integer) returns integer
language plpgsql as $$
declare
    last_xid xid8;
    last_position bigint;
    previous bytea;
    sealed integer;
begin
    perform pg_advisory_xact_lock(x'7365616c'::int);
    select s.xid, s.position, s.chain_hash into last_xid, last_position, previous
      from fact_seal s order by s.xid desc, s.position desc limit 1;
    previous := coalesce(previous, sha256(''::bytea));
    insert into fact_seal (position, xid, kind, digest, chain_hash)
    select f.position, f.xid, f.kind, f.digest,
           seal_chain(f.digest, previous) over (order by f.xid, f.position rows unbounded preceding)
      from (select a.position, a.xid, a.kind, fact_digest(a.kind, a.position, a.payload) as digest
              from audit_event a
             where a.xid < pg_snapshot_xmin(pg_current_snapshot())
               and (last_xid is null or (a.xid, a.position) > (last_xid, last_position))
             order by a.xid, a.position
             limit max_facts) f;
    get diagnostics sealed = row_count;
    return sealed;
end;
$$;

grant execute on function seal_chain_step(bytea, bytea, bytea), seal_chain(bytea, bytea) to custodian_service;
