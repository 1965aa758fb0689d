//! Settings resolved from flags, `CUSTODIAN_*` environment variables and the configuration
//! file, in that order of precedence.

use anyhow::Result;
use custodian_domain::BtcNetwork;
use custodian_ingest::btc::BtcAuth;
use custodian_store::DatabaseUrl;
use secrecy::ExposeSecret;

use crate::cli::GlobalArgs;
use crate::config::FileConfig;
use crate::exit::invalid;

/// What every command needs to know about its surroundings.
#[derive(Debug)]
pub struct Settings {
    /// The ledger database, as the service's login (`custodian_app`).
    pub database_url: DatabaseUrl,
    /// The ledger database as its owner: `custodian migrate` only.
    pub migrate_database_url: DatabaseUrl,
    /// Ethereum JSON-RPC endpoint, if configured.
    pub eth_rpc: Option<String>,
    /// The chain id withdrawals are signed for.
    pub eth_chain_id: Option<u64>,
    /// Whether ETH call traces are read.
    pub eth_traces: bool,
    /// Timeout of one Ethereum node call.
    pub eth_rpc_timeout: std::time::Duration,
    /// Bitcoin Core JSON-RPC endpoint, if configured.
    pub btc_rpc: Option<String>,
    /// Bitcoin Core credentials.
    pub btc_auth: BtcAuth,
    /// The Bitcoin network.
    pub btc_network: BtcNetwork,
    /// Reorg window and raw-payload retention, in blocks.
    pub retention_blocks: u64,
    /// The operator's API token, if given.
    pub token: Option<secrecy::SecretString>,
    /// Print JSON.
    pub json: bool,
    /// The configuration file's other sections (worker, API, metrics, keys).
    pub file: FileConfig,
}

impl Settings {
    /// Validates the global arguments over the configuration file.
    pub fn from_args(args: &GlobalArgs) -> Result<Settings> {
        let file = match &args.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let database_url = args
            .database_url
            .clone()
            .or_else(|| file.database_url.as_ref().map(|s| s.expose_secret().to_owned()))
            .unwrap_or_else(|| custodian_store::DEFAULT_DATABASE_URL.to_owned())
            .parse()
            .map_err(|e| invalid(format!("--database-url / CUSTODIAN_DATABASE_URL: {e}")))?;
        let migrate_database_url = args
            .migrate_database_url
            .clone()
            .or_else(|| file.migrate_database_url.as_ref().map(|s| s.expose_secret().to_owned()))
            .unwrap_or_else(|| custodian_store::DEFAULT_MIGRATE_DATABASE_URL.to_owned())
            .parse()
            .map_err(|e| invalid(format!("--migrate-database-url / CUSTODIAN_MIGRATE_DATABASE_URL: {e}")))?;
        let btc_network = args
            .btc_network
            .clone()
            .or_else(|| file.btc.network.clone())
            .unwrap_or_else(|| "mainnet".to_owned())
            .parse()
            .map_err(|e| invalid(format!("--btc-network / CUSTODIAN_BTC_NETWORK: {e}")))?;
        let cookie = args.btc_rpc_cookie.clone().or_else(|| file.btc.rpc_cookie.clone());
        let user = args.btc_rpc_user.clone().or_else(|| file.btc.rpc_user.clone());
        let password = args
            .btc_rpc_password
            .clone()
            .or_else(|| file.btc.rpc_password.as_ref().map(|s| s.expose_secret().to_owned()));
        let btc_auth =
            match (cookie, user, password) {
                (Some(cookie), None, None) => BtcAuth::CookieFile(cookie),
                (None, Some(user), Some(password)) => BtcAuth::UserPassword { user, password },
                (None, None, None) => BtcAuth::None,
                _ => return Err(invalid(
                    "give either CUSTODIAN_BTC_RPC_USER and CUSTODIAN_BTC_RPC_PASSWORD, or CUSTODIAN_BTC_RPC_COOKIE",
                )),
            };
        let retention_blocks = args.retention_blocks.or(file.scanner.retention_blocks).unwrap_or(1024);
        if retention_blocks == 0 {
            return Err(invalid("--retention-blocks must be at least 1"));
        }
        let eth_rpc = node_urls("eth", args.eth_rpc.as_deref(), file.eth.rpc_url.as_deref(), &file.eth.rpc_urls)?;
        let btc_rpc = node_urls("btc", args.btc_rpc.as_deref(), file.btc.rpc_url.as_deref(), &file.btc.rpc_urls)?;
        Ok(Settings {
            database_url,
            migrate_database_url,
            eth_rpc,
            eth_chain_id: args.eth_chain_id.or(file.eth.chain_id),
            eth_traces: args.eth_traces.or(file.eth.traces).unwrap_or(true),
            eth_rpc_timeout: std::time::Duration::from_millis(
                args.eth_rpc_timeout_ms.or(file.eth.rpc_timeout_ms).unwrap_or(10_000).max(1),
            ),
            btc_rpc,
            btc_auth,
            btc_network,
            retention_blocks,
            token: args.token.clone().map(secrecy::SecretString::from),
            json: args.json,
            file,
        })
    }
}

/// A chain's node URLs as one comma-separated list (what the clients take): the flag or variable
/// (itself a list), else the file's `rpc_url` or `rpc_urls` (not both).
fn node_urls(chain: &str, flag: Option<&str>, url: Option<&str>, urls: &[String]) -> Result<Option<String>> {
    if url.is_some() && !urls.is_empty() {
        return Err(invalid(format!("[{chain}] takes rpc_url or rpc_urls, not both")));
    }
    let list = match (flag, url) {
        (Some(flag), _) => flag.to_owned(),
        (None, Some(url)) => url.to_owned(),
        (None, None) if urls.is_empty() => return Ok(None),
        (None, None) => urls.join(","),
    };
    let split = custodian_store::nodes::split_urls(&list);
    if split.is_empty() {
        return Err(invalid(format!("no {chain} node URL in {list:?}")));
    }
    if let Some(bad) = split.iter().find(|u| !(u.starts_with("http://") || u.starts_with("https://"))) {
        return Err(invalid(format!("{chain} node URL {bad:?}: expected http:// or https://")));
    }
    Ok(Some(split.join(",")))
}
