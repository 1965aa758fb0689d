-- The cluster-wide roles of Custodian (DESIGN §4 "Roles"), created by a superuser: by
-- scripts/setup.sh on a fresh machine and by testkit before it builds a template. Idempotent, and
-- safe when two sessions run it at once (a role another session created meanwhile is accepted).
--
--   custodian_owner    owns the ledger databases and their schema; the only role `custodian
--                      migrate` uses. May create databases (the demo's and the tests'), nothing
--                      more: no superuser, no role creation, no replication, no row-level bypass.
--   custodian_service  what the running service is (no login): the grants in migrations/.
--   custodian_app      the service's login, a member of custodian_service and nothing else.
--   custodian_reader   finance's read-only login: the finance views and nothing else.
--
-- A password is not set here: local development trusts these roles on loopback (setup.sh says
-- which lines of pg_hba.conf it adds); a deployment sets passwords or certificates itself.
do $$
declare
    spec record;
begin
    for spec in
        select * from (values
            ('custodian_owner', 'login createdb'),
            ('custodian_service', 'nologin nocreatedb'),
            ('custodian_app', 'login nocreatedb'),
            ('custodian_reader', 'login nocreatedb')
        ) as s (name, options)
    loop
        if not exists (select 1 from pg_roles where rolname = spec.name) then
            begin
                execute format('create role %I %s', spec.name, spec.options);
            exception
                when duplicate_object or unique_violation then null;
            end;
        end if;
        -- whatever created the role before, it holds no power beyond its line above
        execute format('alter role %I nosuperuser nocreaterole noreplication nobypassrls %s',
                       spec.name, spec.options);
    end loop;
end;
$$;

grant custodian_service to custodian_app;
