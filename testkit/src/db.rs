//! One database per test, cloned from a migrated template (the `spawn_app` pattern).
//!
//! The template is named after the migrations' fingerprint, so a schema change builds a new one.
//! Creating it is serialised across test processes by an advisory lock, and it is marked
//! `is_template` only once fully migrated: a half-built template from a crashed run is rebuilt.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, Result};
use custodian_store::roles::OWNER_ROLE;
use custodian_store::{migrate, DatabaseUrl, Pool};
use tokio_postgres::types::{FromSql, ToSql};

/// Prefix of every per-test database; `make clean-test-dbs` drops them by it.
pub const TEST_DB_PREFIX: &str = "custodian_t_";

const TEMPLATE_LOCK_KEY: i64 = 0x7465_6d70_6c61_7465; // "template"
static COUNTER: AtomicU32 = AtomicU32::new(0);

/// The first column of every row `sql` returns, for a test to compare with what it expects.
pub async fn column<T>(client: &tokio_postgres::Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Vec<T>
where
    T: for<'a> FromSql<'a>,
{
    let rows = client.query(sql, params).await.expect("the query of a column");
    rows.iter().map(|r| r.get(0)).collect()
}

/// The plan PostgreSQL chooses for `sql` (`explain`, without running it), one line per plan line.
pub async fn plan(client: &tokio_postgres::Client, sql: &str, params: &[&(dyn ToSql + Sync)]) -> String {
    column::<String>(client, &format!("explain {sql}"), params).await.join("\n")
}

/// The generic plan of `statement` with the parameters `args` (SQL literals, as `execute` takes
/// them): the plan the service runs, since `Pipelined` forces generic plans. The session's
/// `plan_cache_mode` stays forced generic afterwards.
pub async fn generic_plan(client: &tokio_postgres::Client, statement: &str, args: &str) -> String {
    client
        .batch_execute(&format!("set plan_cache_mode = force_generic_plan; prepare generic_plan_probe as {statement}"))
        .await
        .expect("preparing the statement to explain");
    let plan = plan(client, &format!("execute generic_plan_probe({args})"), &[]).await;
    client.batch_execute("deallocate generic_plan_probe").await.expect("deallocating the explained statement");
    plan
}

/// A migrated database of its own, dropped when the value is dropped.
///
/// It is owned by `custodian_owner`, which migrated it; [`TestDb::url`] and [`TestDb::pool`]
/// connect as `custodian_app`, the service's least-privileged login, so every test of service
/// code runs with the privileges the service has. [`TestDb::owner_client`] is for what only the
/// owner may do (a tampering test writing behind the service's back).
pub struct TestDb {
    /// The database's name.
    pub name: String,
    /// A URL for it as `custodian_app` (handed to the binary under test).
    pub url: DatabaseUrl,
    /// A URL for it as the schema owner (for `custodian migrate` and owner-only fixtures).
    pub owner_url: DatabaseUrl,
    /// A pool connected to it as `custodian_app`.
    pub pool: Pool,
    admin: DatabaseUrl,
}

/// The roles' SQL, run as a superuser before the first template is built (as `scripts/setup.sh`
/// runs it on a fresh machine).
const ROLES_SQL: &str = include_str!("../../scripts/roles.sql");

/// The server tests run against, as the service's login: `CUSTODIAN_DATABASE_URL` or the
/// project default.
pub fn server_url() -> DatabaseUrl {
    from_env("CUSTODIAN_DATABASE_URL", custodian_store::DEFAULT_DATABASE_URL)
}

/// The same server as the schema owner: `CUSTODIAN_MIGRATE_DATABASE_URL` or the project default.
pub fn owner_server_url() -> DatabaseUrl {
    from_env("CUSTODIAN_MIGRATE_DATABASE_URL", custodian_store::DEFAULT_MIGRATE_DATABASE_URL)
}

/// A superuser on the same server (`CUSTODIAN_TEST_SUPERUSER_URL`, default `postgres` on the
/// local server): test infrastructure only — it creates the roles and the per-test databases,
/// and proves that the service refuses to run as it.
pub fn superuser_url() -> DatabaseUrl {
    from_env("CUSTODIAN_TEST_SUPERUSER_URL", "postgres://postgres@127.0.0.1:5432/postgres")
}

fn from_env(variable: &str, default: &str) -> DatabaseUrl {
    let raw = std::env::var(variable).unwrap_or_else(|_| default.to_owned());
    raw.parse().unwrap_or_else(|e| panic!("{variable} is not a valid PostgreSQL URL: {e}"))
}

async fn admin_client(admin: &DatabaseUrl) -> Result<tokio_postgres::Client> {
    let (client, connection) = admin
        .config()
        .connect(tokio_postgres::NoTls)
        .await
        .with_context(|| format!("connecting to {admin} (is PostgreSQL running? `make test` starts it)"))?;
    tokio::spawn(connection);
    Ok(client)
}

async fn ensure_template(admin: &tokio_postgres::Client) -> Result<String> {
    let template = format!("custodian_tpl_{:016x}", migrate::fingerprint());
    admin.execute("select pg_advisory_lock($1)", &[&TEMPLATE_LOCK_KEY]).await?;
    let ready: Option<bool> = admin
        .query_opt("select datistemplate from pg_database where datname = $1", &[&template])
        .await?
        .map(|row| row.get(0));
    if ready != Some(true) {
        admin.batch_execute(ROLES_SQL).await.context("creating the custodian roles")?;
        if ready == Some(false) {
            admin.batch_execute(&format!("drop database \"{template}\" with (force)")).await?;
        }
        admin.batch_execute(&format!("create database \"{template}\" owner {OWNER_ROLE}")).await?;
        // Migrated as the owner, exactly as `custodian migrate` does it.
        let (mut client, connection) =
            owner_server_url().with_dbname(&template).config().connect(tokio_postgres::NoTls).await?;
        let handle = tokio::spawn(connection);
        migrate::run(&mut client).await.context("migrating the template database")?;
        drop(client);
        let _ = handle.await;
        admin.batch_execute(&format!("alter database \"{template}\" is_template true")).await?;
    }
    admin.execute("select pg_advisory_unlock($1)", &[&TEMPLATE_LOCK_KEY]).await?;
    Ok(template)
}

impl TestDb {
    /// A fresh, migrated database.
    pub async fn new() -> TestDb {
        TestDb::try_new().await.expect("could not create a test database")
    }

    async fn try_new() -> Result<TestDb> {
        let admin = superuser_url();
        let client = admin_client(&admin).await?;
        let template = ensure_template(&client).await?;
        let name = format!(
            "{TEST_DB_PREFIX}{}_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos()
        );
        // Two clones of one template at the same instant can collide on PostgreSQL's check that
        // nobody else is using the source; retry a bounded number of times.
        let mut attempts = 0;
        loop {
            match client
                .batch_execute(&format!("create database \"{name}\" template \"{template}\" owner {OWNER_ROLE}"))
                .await
            {
                Ok(()) => break,
                Err(e) if attempts < 20 && e.to_string().contains("being accessed by other users") => {
                    attempts += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(50 * attempts)).await;
                }
                Err(e) => return Err(e).context("cloning the template database"),
            }
        }
        let url = server_url().with_dbname(&name);
        let owner_url = owner_server_url().with_dbname(&name);
        let pool = custodian_store::connect(&url, 8).await?;
        Ok(TestDb { name, url, owner_url, pool, admin })
    }

    /// A single connection as `custodian_app`, outside the pool (for tests that need their own
    /// session).
    pub async fn client(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// A single connection as the schema owner: for what the service may not do (a fixture the
    /// service has no privilege to write, or a tampering test).
    pub async fn owner_client(&self) -> tokio_postgres::Client {
        connect(&self.owner_url).await
    }

    /// A single connection as a superuser: only for forgeries that must get past the triggers
    /// themselves (`session_replication_role = replica`), to prove what a check finds.
    pub async fn superuser_client(&self) -> tokio_postgres::Client {
        connect(&superuser_url().with_dbname(&self.name)).await
    }
}

async fn connect(url: &DatabaseUrl) -> tokio_postgres::Client {
    let (client, connection) =
        url.config().connect(tokio_postgres::NoTls).await.unwrap_or_else(|e| panic!("connecting to {url}: {e}"));
    tokio::spawn(connection);
    client
}

impl Drop for TestDb {
    fn drop(&mut self) {
        self.pool.close();
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs inside the test's runtime, which must not block on itself: use a thread with
        // its own small runtime.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let client = admin_client(&admin).await?;
                client.batch_execute(&format!("drop database if exists \"{name}\" with (force)")).await?;
                anyhow::Ok(())
            })
        })
        .join();
        if let Ok(Err(e)) = dropped {
            eprintln!("warning: could not drop test database {}: {e:#}", self.name);
        }
    }
}
