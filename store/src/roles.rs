//! Which database role a command runs as (DESIGN §1 principle 8, §4 "Roles").
//!
//! The service and every command except `custodian migrate` connect as `custodian_app`, a login
//! in `custodian_service`; `migrate` uses the schema owner. A connection that could undo what the
//! database enforces — a superuser (it can `set session_replication_role = replica` and skip every
//! trigger), the owner of the database or of any table in its schema (it can disable triggers and
//! grant itself anything), or a role that bypasses row security — is refused before it is used.

use deadpool_postgres::GenericClient;

/// The login the service runs as.
pub const APP_ROLE: &str = "custodian_app";

/// The role that owns the schema; only `custodian migrate` connects as it.
pub const OWNER_ROLE: &str = "custodian_owner";

/// What the connected role is allowed to undo, if anything. The schema is named (`public`) as
/// well as taken from the search path, which a connection string can change.
const ROLE_POWERS: &str = "
select r.rolname::text,
       r.rolsuper,
       r.rolbypassrls,
       pg_has_role(current_user, d.datdba, 'MEMBER') as owns_database,
       exists (select 1
                 from pg_class c
                 join pg_namespace n on n.oid = c.relnamespace
                where n.nspname in ('public', current_schema())
                  and pg_has_role(current_user, c.relowner, 'MEMBER'))
       or exists (select 1
                    from pg_proc p
                    join pg_namespace n on n.oid = p.pronamespace
                   where n.nspname in ('public', current_schema())
                     and pg_has_role(current_user, p.proowner, 'MEMBER')) as owns_objects,
       r.rolcreaterole,
       r.rolreplication,
       has_parameter_privilege(current_user, 'session_replication_role', 'SET') as may_skip_triggers
  from pg_roles r, pg_database d
 where r.rolname = current_user
   and d.datname = current_database()";

/// Why the connected role may not run the service.
#[derive(Debug, thiserror::Error)]
pub enum RoleError {
    /// The role could undo what the database enforces.
    #[error(
        "refusing to run as the database role {role:?}, which {power}: connect as {APP_ROLE} \
         (--database-url / CUSTODIAN_DATABASE_URL, e.g. postgres://{APP_ROLE}@127.0.0.1:5432/custodian); \
         only `custodian migrate` uses the schema owner {OWNER_ROLE}"
    )]
    TooPowerful {
        /// The connected role.
        role: String,
        /// What it could do.
        power: &'static str,
    },
    /// The check itself failed.
    #[error("could not read the connected role's privileges: {}", crate::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Refuses a connection whose role is a superuser, owns the database or its schema's tables or
/// functions, bypasses row-level security, can create roles, replicates, or was granted the right
/// to set `session_replication_role`.
pub async fn check_service_role<C: GenericClient>(client: &C) -> Result<(), RoleError> {
    let row = client.query_one(ROLE_POWERS, &[]).await?;
    let role: String = row.get(0);
    let power = if row.get::<_, bool>(1) {
        "is a superuser and can switch every trigger off"
    } else if row.get::<_, bool>(4) {
        "owns the schema's tables or functions and can disable or replace their triggers"
    } else if row.get::<_, bool>(3) {
        "owns the database"
    } else if row.get::<_, bool>(2) {
        "bypasses row-level security"
    } else if row.get::<_, bool>(5) {
        "can create roles (and so grant itself the owner's)"
    } else if row.get::<_, bool>(6) {
        "is a replication role"
    } else if row.get::<_, bool>(7) {
        "may set session_replication_role and skip every trigger"
    } else {
        return Ok(());
    };
    Err(RoleError::TooPowerful { role, power })
}
