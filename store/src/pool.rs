//! The connection pool and how Custodian finds its database.

use std::fmt;
use std::str::FromStr;

use crate::tls::{self, SslMode, TlsError};

pub use deadpool_postgres::Pool;

/// Used when neither `--database-url` nor `CUSTODIAN_DATABASE_URL` is given: the service's login
/// on the local server (see [`crate::roles`]).
pub const DEFAULT_DATABASE_URL: &str = "postgres://custodian_app@127.0.0.1:5432/custodian";

/// What `custodian migrate` connects as when neither `--migrate-database-url` nor
/// `CUSTODIAN_MIGRATE_DATABASE_URL` is given: the schema owner on the local server.
pub const DEFAULT_MIGRATE_DATABASE_URL: &str = "postgres://custodian_owner@127.0.0.1:5432/custodian";

/// Connections per process: a worker's pass holds up to two for each lane it runs at once (at
/// most four lanes, `withdrawals::worker::lanes`), the scanners, posting and webhooks share the
/// rest. The gRPC API has its own pool.
pub const DEFAULT_POOL_SIZE: usize = 16;

/// How long a caller waits for a free connection before the checkout fails (the API answers
/// `UNAVAILABLE` with a retry hint; a scanner or the worker retries its step).
pub const DEFAULT_CHECKOUT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long opening or re-checking one connection may take.
const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A parsed PostgreSQL URL. Its `Debug` and `Display` hide the password. `sslmode` and
/// `sslrootcert` are honoured as libpq does (see [`crate::tls`]).
#[derive(Clone)]
pub struct DatabaseUrl {
    config: tokio_postgres::Config,
    raw: String,
    ssl_mode: SslMode,
    root_cert: Option<std::path::PathBuf>,
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
    /// The TLS settings of the URL cannot work.
    #[error("database TLS: {0}")]
    Tls(#[from] TlsError),
    /// One connection could not be opened.
    #[error("could not connect to PostgreSQL at {url}: {}", crate::describe(source))]
    Open {
        /// The URL with any password masked.
        url: String,
        /// The underlying error.
        source: tokio_postgres::Error,
    },
    /// No connection could be obtained (server down, wrong database, authentication).
    #[error("could not connect to PostgreSQL at {url}: {}", describe_checkout(source))]
    Connect {
        /// The URL with any password masked.
        url: String,
        /// The underlying error.
        source: deadpool_postgres::PoolError,
    },
}

/// A failed checkout as the server or the pool put it ([`crate::describe`] for the server's
/// refusals).
fn describe_checkout(error: &deadpool_postgres::PoolError) -> String {
    match error {
        deadpool_postgres::PoolError::Backend(e) => crate::describe(e),
        other => other.to_string(),
    }
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
        let (ssl_mode, root_cert) = (self.ssl_mode, self.root_cert.clone());
        let raw = match self.raw.rsplit_once('/') {
            Some((server, rest)) if !server.ends_with('/') => {
                let query = rest.split_once('?').map(|(_, q)| format!("?{q}")).unwrap_or_default();
                format!("{server}/{dbname}{query}")
            }
            _ => format!("{}/{dbname}", self.raw.trim_end_matches('/')),
        };
        DatabaseUrl { config, raw, ssl_mode, root_cert }
    }

    /// How the connection is protected: the URL's `sslmode`, or `disable` on loopback and
    /// `prefer` elsewhere when it gives none.
    pub fn ssl_mode(&self) -> SslMode {
        self.ssl_mode
    }

    /// Whether every host is this machine.
    pub fn is_loopback(&self) -> bool {
        tls::all_loopback(&self.config)
    }

    /// The TLS connector this URL's `sslmode` asks for.
    pub fn tls_connector(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect, PoolError> {
        Ok(tls::connector(self.ssl_mode, self.root_cert.as_deref())?)
    }

    /// One connection outside any pool, its connection task spawned.
    pub async fn connect_one(&self) -> Result<tokio_postgres::Client, PoolError> {
        let (client, connection) = self
            .config
            .connect(self.tls_connector()?)
            .await
            .map_err(|source| PoolError::Open { url: self.to_string(), source })?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!("database connection ended: {e}");
            }
        });
        Ok(client)
    }

    /// The full URL, password included, for handing to a child process.
    pub fn expose(&self) -> &str {
        &self.raw
    }

    /// The tokio-postgres configuration.
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The URL with every place a password can sit masked, found from the string's structure
    /// rather than by searching for the parsed password (which a percent-encoded URL spells
    /// differently): the userinfo of a URL, its `password` query parameters, and the `password`
    /// key of a key=value string. If the parsed configuration holds a password that none of
    /// these covered, nothing of the string is shown.
    fn masked(&self) -> String {
        let masked = match self.raw.split_once("://") {
            Some((scheme, rest)) => format!("{scheme}://{}", mask_url_rest(rest)),
            None => mask_key_values(&self.raw),
        };
        // Checked against the decoded text too: the parser reads percent-escapes the masker
        // does not (a password spelled with %2F, a key spelled pass%77ord).
        let decoded = tls::percent_decode(&masked);
        match self.config.get_password() {
            Some(password)
                if !password.is_empty()
                    && [&masked, &decoded].iter().any(|shown| shown.contains(&*String::from_utf8_lossy(password))) =>
            {
                "(connection string not shown: it holds a password)".to_owned()
            }
            _ => masked,
        }
    }
}

impl FromStr for DatabaseUrl {
    type Err = PoolError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (rest, tls) = tls::split_tls_params(s)?;
        let mut config = rest
            .parse::<tokio_postgres::Config>()
            .map_err(|source| PoolError::BadUrl { url: "(not shown: it did not parse)".to_owned(), source })?;
        let ssl_mode = tls.mode.unwrap_or(if tls::all_loopback(&config) { SslMode::Disable } else { SslMode::Prefer });
        config.ssl_mode(ssl_mode.negotiation());
        // A URL whose TLS cannot work is refused when parsed, not at the first connection.
        tls::connector(ssl_mode, tls.root_cert.as_deref())?;
        Ok(DatabaseUrl { config, raw: s.to_owned(), ssl_mode, root_cert: tls.root_cert })
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

/// `user:password@hosts/db?params` with the password and any `password=` parameter masked. The
/// userinfo ends at the first `@`, as tokio-postgres reads it (a password may hold `/` or `?`).
fn mask_url_rest(rest: &str) -> String {
    let userinfo_end = rest.find('@').map_or(0, |at| at + 1);
    let (authority, tail) = match rest[userinfo_end..].find(['/', '?']) {
        Some(end) => rest.split_at(userinfo_end + end),
        None => (rest, ""),
    };
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{hosts}"),
            None => format!("{userinfo}@{hosts}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|param| match param.split_once('=') {
                    Some((key, _)) if tls::percent_decode(key).eq_ignore_ascii_case("password") => format!("{key}=***"),
                    _ => param.to_owned(),
                })
                .collect();
            format!("{path}?{}", params.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{authority}{tail}")
}

/// `host=… password=… dbname=…` with the password's value (quoted or not) masked, read with the
/// same tokenizer that takes the TLS parameters out ([`tls::key_values`]).
fn mask_key_values(raw: &str) -> String {
    tls::key_values(raw)
        .into_iter()
        .map(|(key, _, text)| if key.eq_ignore_ascii_case("password") { format!("{key}=***") } else { text })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Builds a pool of at most `max_size` connections and proves it works by taking one. A checkout
/// waits at most [`DEFAULT_CHECKOUT_TIMEOUT`].
pub async fn connect(url: &DatabaseUrl, max_size: usize) -> Result<Pool, PoolError> {
    connect_with(url, max_size, DEFAULT_CHECKOUT_TIMEOUT).await
}

/// What every pooled connection sets at startup, after any `options` the URL gives.
///
/// `jit=off`: the service runs short statements, and a few of them (the posting pass's view over
/// every deposit key) are estimated far above `jit_above_cost` although they touch a few rows.
/// PostgreSQL then compiled and optimised them with LLVM on every call: under the request path
/// bench the discrepancy check of each posting pass took 0.4–1.8 s of CPU, almost all of it JIT
/// (130 functions inlined and optimised for a statement that read 64 rows), twice a block, on a
/// machine with two cores.
///
/// `max_parallel_workers_per_gather=0`: for the same short statements, starting parallel workers
/// cost more than they saved. The BTC worker's coin read (10,000 coins, under the lane lock) was
/// planned with two workers and a Gather Merge that took 56 of its 72 ms while each worker sorted
/// for 18 (`explain analyze` in the BTC allocation bench, on two cores); serially it took 25–39 ms.
const SESSION_OPTIONS: &str = "-c jit=off -c max_parallel_workers_per_gather=0";

/// `config` with [`SESSION_OPTIONS`] added to its startup options.
fn with_session_options(config: &tokio_postgres::Config) -> tokio_postgres::Config {
    let mut config = config.clone();
    let options = match config.get_options() {
        Some(given) if !given.trim().is_empty() => format!("{given} {SESSION_OPTIONS}"),
        _ => SESSION_OPTIONS.to_owned(),
    };
    config.options(&options);
    config
}

/// [`connect`] with checkouts that wait at most `checkout_timeout` for a free connection.
pub async fn connect_with(
    url: &DatabaseUrl,
    max_size: usize,
    checkout_timeout: std::time::Duration,
) -> Result<Pool, PoolError> {
    let manager = deadpool_postgres::Manager::from_config(
        with_session_options(&url.config),
        url.tls_connector()?,
        deadpool_postgres::ManagerConfig { recycling_method: deadpool_postgres::RecyclingMethod::Fast },
    );
    let pool = Pool::builder(manager)
        .max_size(max_size)
        // The connection used last is handed out first: a connection's first statements pay for
        // its plans (the generic plans of pipelined writes, PL/pgSQL functions and triggers,
        // foreign-key checks), so taking them in turns paid that on every connection of the pool.
        .queue_mode(deadpool_postgres::QueueMode::Lifo)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .wait_timeout(Some(checkout_timeout))
        .create_timeout(Some(CONNECT_TIMEOUT))
        .recycle_timeout(Some(CONNECT_TIMEOUT))
        .build()?;
    drop(pool.get().await.map_err(|source| PoolError::Connect { url: url.to_string(), source })?);
    Ok(pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooled_sessions_switch_jit_and_parallel_workers_off_after_the_urls_own_options() {
        let plain: DatabaseUrl = "postgres://app@db/custodian".parse().expect("valid");
        assert_eq!(
            with_session_options(plain.config()).get_options(),
            Some("-c jit=off -c max_parallel_workers_per_gather=0")
        );
        let given: DatabaseUrl =
            "postgres://app@db/custodian?options=-c%20statement_timeout%3D5000".parse().expect("valid");
        assert_eq!(
            with_session_options(given.config()).get_options(),
            Some("-c statement_timeout=5000 -c jit=off -c max_parallel_workers_per_gather=0")
        );
    }

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

    #[test]
    fn every_form_of_password_is_masked() {
        let cases = [
            // percent-encoded: the parsed password is "p@ss:w/rd", spelled differently in the URL
            ("postgres://app:p%40ss%3Aw%2Frd@db:5432/custodian", "postgres://app:***@db:5432/custodian", "p%40ss"),
            (
                "postgresql://app:s3cret@a:5432,b:5433/custodian?target_session_attrs=read-write",
                "postgresql://app:***@a:5432,b:5433/custodian?target_session_attrs=read-write",
                "s3cret",
            ),
            (
                "postgres://app@db/custodian?sslmode=require&password=s3cret",
                "postgres://app@db/custodian?sslmode=require&password=***",
                "s3cret",
            ),
            ("postgres://app@db?password=s3cret", "postgres://app@db?password=***", "s3cret"),
            // a password holding '/' (base64), and a key spelled with an escape
            ("postgres://app:ab/c%2Bd@db/custodian", "postgres://app:***@db/custodian", "ab/c"),
            (
                "postgres://app@db/custodian?pass%77ord=s%33cret",
                "postgres://app@db/custodian?pass%77ord=***",
                "s%33cret",
            ),
            (
                "host=db user=app password=s3cret dbname=custodian",
                "host=db user=app password=*** dbname=custodian",
                "s3cret",
            ),
            ("host=db password = 's3 cr\\'et' dbname=custodian", "host=db password=*** dbname=custodian", "cr"),
            ("host=db user=app dbname=custodian", "host=db user=app dbname=custodian", "-"),
        ];
        for (raw, shown, secret) in cases {
            let url: DatabaseUrl = raw.parse().unwrap_or_else(|e| panic!("{raw}: {e}"));
            assert_eq!(url.to_string(), shown, "{raw}");
            assert!(!format!("{url:?}").contains(secret), "{raw}");
            assert_eq!(url.expose(), raw, "the real URL is still there for the child process");
        }
    }
}
