//! The connection pool and how Custodian finds its database.

use std::fmt;
use std::str::FromStr;

pub use deadpool_postgres::Pool;

/// Used when neither `--database-url` nor `CUSTODIAN_DATABASE_URL` is given: the service's login
/// on the local server (see [`crate::roles`]).
pub const DEFAULT_DATABASE_URL: &str = "postgres://custodian_app@127.0.0.1:5432/custodian";

/// What `custodian migrate` connects as when neither `--migrate-database-url` nor
/// `CUSTODIAN_MIGRATE_DATABASE_URL` is given: the schema owner on the local server.
pub const DEFAULT_MIGRATE_DATABASE_URL: &str = "postgres://custodian_owner@127.0.0.1:5432/custodian";

/// Connections per process. Each worker holds at most one at a time; the API shares the rest.
pub const DEFAULT_POOL_SIZE: usize = 16;

/// A parsed PostgreSQL URL. Its `Debug` and `Display` hide the password.
#[derive(Clone)]
pub struct DatabaseUrl {
    config: tokio_postgres::Config,
    raw: String,
}

/// Why the pool could not be built or a connection not obtained.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The URL is not a PostgreSQL connection string.
    #[error("invalid database URL {url}: {source}")]
    BadUrl {
        /// The URL with any password masked.
        url: String,
        /// The parser's complaint.
        source: tokio_postgres::Error,
    },
    /// The pool could not be created.
    #[error("could not create the connection pool: {0}")]
    Build(#[from] deadpool_postgres::BuildError),
    /// No connection could be obtained (server down, wrong database, authentication).
    #[error("could not connect to PostgreSQL at {url}: {source}")]
    Connect {
        /// The URL with any password masked.
        url: String,
        /// The underlying error.
        source: deadpool_postgres::PoolError,
    },
}

impl DatabaseUrl {
    /// The database name, if the URL names one.
    pub fn dbname(&self) -> Option<&str> {
        self.config.get_dbname()
    }

    /// The same server and credentials, another database (tests clone databases this way).
    pub fn with_dbname(&self, dbname: &str) -> DatabaseUrl {
        let mut config = self.config.clone();
        config.dbname(dbname);
        let raw = match self.raw.rsplit_once('/') {
            Some((server, rest)) if !server.ends_with('/') => {
                let query = rest.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
                format!("{server}/{dbname}{query}")
            }
            _ => format!("{}/{dbname}", self.raw.trim_end_matches('/')),
        };
        DatabaseUrl { config, raw }
    }

    /// The full URL, password included, for handing to a child process.
    pub fn expose(&self) -> &str {
        &self.raw
    }

    /// The tokio-postgres configuration.
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    fn masked(&self) -> String {
        match self.config.get_password() {
            Some(password) => {
                let password = String::from_utf8_lossy(password);
                self.raw.replace(&format!(":{password}@"), ":***@")
            }
            None => self.raw.clone(),
        }
    }
}

impl FromStr for DatabaseUrl {
    type Err = PoolError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let config = s
            .parse::<tokio_postgres::Config>()
            .map_err(|source| PoolError::BadUrl { url: "(not shown: it did not parse)".to_owned(), source })?;
        Ok(DatabaseUrl { config, raw: s.to_owned() })
    }
}

impl fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.masked())
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DatabaseUrl({})", self.masked())
    }
}

/// Builds a pool of at most `max_size` connections and proves it works by taking one.
pub async fn connect(url: &DatabaseUrl, max_size: usize) -> Result<Pool, PoolError> {
    let manager = deadpool_postgres::Manager::from_config(
        url.config.clone(),
        tokio_postgres::NoTls,
        deadpool_postgres::ManagerConfig { recycling_method: deadpool_postgres::RecyclingMethod::Fast },
    );
    let pool = Pool::builder(manager).max_size(max_size).runtime(deadpool_postgres::Runtime::Tokio1).build()?;
    drop(pool.get().await.map_err(|source| PoolError::Connect { url: url.to_string(), source })?);
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_hide_passwords_and_swap_databases() {
        let url: DatabaseUrl =
            "postgres://app:s3cret@db.internal:5433/custodian?sslmode=disable".parse().expect("valid");
        assert_eq!(url.to_string(), "postgres://app:***@db.internal:5433/custodian?sslmode=disable");
        assert!(!format!("{url:?}").contains("s3cret"));
        let other = url.with_dbname("scratch");
        assert_eq!(other.dbname(), Some("scratch"));
        assert_eq!(other.expose(), "postgres://app:s3cret@db.internal:5433/scratch?sslmode=disable");
        let bare: DatabaseUrl = "postgres://postgres@127.0.0.1:5432".parse().expect("valid");
        assert_eq!(bare.with_dbname("x").expose(), "postgres://postgres@127.0.0.1:5432/x");
    }
}
