//! Applies the forward-only migrations in `migrations/` (embedded at compile time).
//!
//! Running them twice is a no-op. Concurrent runners serialise on an advisory lock so two
//! processes starting together cannot both apply the same file.

use refinery::embed_migrations;

embed_migrations!("../migrations");

/// Key of the advisory lock held while migrating.
const MIGRATION_LOCK_KEY: i64 = 0x6375_7374_6f64_6961; // "custodia"

/// Why migrating failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Taking or releasing the advisory lock failed.
    #[error("could not take the migration lock: {}", crate::describe(.0))]
    Lock(#[source] tokio_postgres::Error),
    /// A migration failed to apply; nothing of that file is applied.
    #[error("migration failed: {0}")]
    Apply(#[source] refinery::Error),
    /// Reading the schema history failed.
    #[error("could not read the schema version: {}", crate::describe(.0))]
    Read(#[source] tokio_postgres::Error),
}

/// What a migration run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// Names of the migrations applied by this run, in order (empty when already up to date).
    pub applied: Vec<String>,
    /// The schema version after the run.
    pub version: i32,
}

/// The newest migration version this build knows.
pub fn latest_version() -> i32 {
    migrations::runner().get_migrations().iter().map(|m| m.version()).max().expect("BUG: no migrations embedded")
}

/// A fingerprint of every embedded migration (versions and checksums): tests name their
/// template database after it so a schema change gets a fresh template.
pub fn fingerprint() -> u64 {
    migrations::runner().get_migrations().iter().fold(0xcbf2_9ce4_8422_2325_u64, |acc, m| {
        (acc ^ m.checksum() ^ u64::from(m.version().unsigned_abs())).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Applies every pending migration.
///
/// # Cancel safety
/// Each migration runs in its own transaction; a cancelled run leaves the schema at the last
/// fully applied version. The advisory lock is session-scoped and released when the connection
/// closes.
pub async fn run(client: &mut tokio_postgres::Client) -> Result<MigrationReport, MigrateError> {
    client.execute("select pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY]).await.map_err(MigrateError::Lock)?;
    let outcome = migrations::runner().run_async(client).await;
    client.execute("select pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY]).await.map_err(MigrateError::Lock)?;
    let report = outcome.map_err(MigrateError::Apply)?;
    let applied = report.applied_migrations().iter().map(|m| m.to_string()).collect();
    let version = current_version(client).await?.unwrap_or(0);
    Ok(MigrationReport { applied, version })
}

/// Applies the pending migrations up to and including `version` only: for tests that build a
/// database as an older release left it, then migrate it forward.
pub async fn run_to(client: &mut tokio_postgres::Client, version: i32) -> Result<MigrationReport, MigrateError> {
    client.execute("select pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY]).await.map_err(MigrateError::Lock)?;
    let outcome = migrations::runner().set_target(refinery::Target::Version(version)).run_async(client).await;
    client.execute("select pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY]).await.map_err(MigrateError::Lock)?;
    let report = outcome.map_err(MigrateError::Apply)?;
    let applied = report.applied_migrations().iter().map(|m| m.to_string()).collect();
    let version = current_version(client).await?.unwrap_or(0);
    Ok(MigrationReport { applied, version })
}

/// The applied schema version, or `None` for a database never migrated.
pub async fn current_version(client: &tokio_postgres::Client) -> Result<Option<i32>, MigrateError> {
    let exists: bool = client
        .query_one("select to_regclass('refinery_schema_history') is not null", &[])
        .await
        .map_err(MigrateError::Read)?
        .get(0);
    if !exists {
        return Ok(None);
    }
    client
        .query_one("select max(version) from refinery_schema_history", &[])
        .await
        .map(|row| row.get(0))
        .map_err(MigrateError::Read)
}
