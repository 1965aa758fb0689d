-- Fact seals: a hash chain over the audit history (DESIGN §6, replay).
--
-- Every fact of the history (audit_event), once final (written by a transaction older than any
-- still running, the same horizon the history stream uses), gets a seal in history order: the
-- SHA-256 of its kind, position and content, and a chain hash covering the previous seal's. A fact
-- edited or deleted afterwards no longer matches its seal, even when everything derived from it
-- was changed to match; a seal removed or altered breaks the chain at the next one.
-- `replay --verify` checks both. Seals are appended by the service after its writes
-- (seal_facts); replay only reads.

create table fact_seal (
    position   bigint      primary key,
    xid        xid8        not null,
    kind       text        not null,
    digest     bytea       not null check (length(digest) = 32),
    chain_hash bytea       not null check (length(chain_hash) = 32),
    sealed_at  timestamptz not null default now()
);
create unique index fact_seal_order on fact_seal (xid, position);

create trigger fact_seal_append_only
    before update or delete on fact_seal
    for each row execute function reject_mutation();
create trigger fact_seal_no_truncate
    before truncate on fact_seal
    for each statement execute function reject_mutation();

-- The digest of one fact as the history shows it.
create function fact_digest(fact_kind text, fact_position bigint, fact_payload jsonb) returns bytea
language sql immutable strict parallel safe
return sha256(convert_to(fact_kind || ':' || fact_position::text || ':' || fact_payload::text, 'UTF8'));

-- Seals up to max_facts final facts after the last seal, in history order; returns how many.
-- One sealer at a time (a transaction-scoped advisory lock); a second waits, then finds less.
create function seal_facts(max_facts integer) returns integer
language plpgsql as $$
declare
    last_xid xid8;
    last_position bigint;
    previous bytea;
    fact record;
    digest bytea;
    sealed integer := 0;
begin
    perform pg_advisory_xact_lock(x'7365616c'::int);
    select s.xid, s.position, s.chain_hash into last_xid, last_position, previous
      from fact_seal s order by s.xid desc, s.position desc limit 1;
    previous := coalesce(previous, sha256(''::bytea));
    for fact in
        select a.position, a.xid, a.kind, a.payload
          from audit_event a
         where a.xid < pg_snapshot_xmin(pg_current_snapshot())
           and (last_xid is null or (a.xid, a.position) > (last_xid, last_position))
         order by a.xid, a.position
         limit max_facts
    loop
        digest := fact_digest(fact.kind, fact.position, fact.payload);
        previous := sha256(previous || digest);
        insert into fact_seal (position, xid, kind, digest, chain_hash)
        values (fact.position, fact.xid, fact.kind, digest, previous);
        sealed := sealed + 1;
    end loop;
    return sealed;
end;
$$;

-- Every sealed fact against its seal and the chain, in history order: what was changed, deleted,
-- or unsealed. Reads only.
create function verify_seals() returns table (seal_position bigint, problem text)
language plpgsql stable as $$
declare
    previous bytea := sha256(''::bytea);
    s record;
begin
    for s in
        select f.position, f.xid, f.kind, f.digest, f.chain_hash, a.kind as fact_kind, a.payload
          from fact_seal f left join audit_event a on a.position = f.position
         order by f.xid, f.position
    loop
        previous := sha256(previous || s.digest);
        if previous <> s.chain_hash then
            seal_position := s.position;
            problem := 'the seal chain breaks before this seal: a seal was removed or altered';
            return next;
            previous := s.chain_hash;
        end if;
        if s.fact_kind is null then
            seal_position := s.position;
            problem := 'the sealed ' || s.kind || ' fact is gone';
            return next;
        elsif fact_digest(s.fact_kind, s.position, s.payload) <> s.digest then
            seal_position := s.position;
            problem := 'the sealed ' || s.kind || ' fact was changed after it was sealed';
            return next;
        end if;
    end loop;
end;
$$;

grant select, insert on fact_seal to custodian_service;
grant execute on function seal_facts(integer), verify_seals(), fact_digest(text, bigint, jsonb) to custodian_service;
