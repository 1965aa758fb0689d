//! The configuration file (`custodian.toml`, see `custodian.example.toml`). Settings with a flag can be
//! overridden by a flag or a `CUSTODIAN_*` variable; secrets are `SecretString`s, which neither
//! `Debug` nor logs can print.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use secrecy::SecretString;
use serde::Deserialize;

use crate::exit::invalid;

/// The whole file. Unknown keys are refused so a typo is not silently ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// PostgreSQL URL of the service's login (may hold a password).
    pub database_url: Option<SecretString>,
    /// PostgreSQL URL of the schema owner, for `custodian migrate` only (may hold a password).
    pub migrate_database_url: Option<SecretString>,
    /// Ethereum.
    #[serde(default)]
    pub eth: EthConfig,
    /// Bitcoin.
    #[serde(default)]
    pub btc: BtcConfig,
    /// Deposit scanning.
    #[serde(default)]
    pub scanner: ScannerConfig,
    /// The withdrawal worker.
    #[serde(default)]
    pub withdrawals: WithdrawalConfig,
    /// The gRPC API.
    #[serde(default)]
    pub api: ApiConfig,
    /// Prometheus metrics and health.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// Hot-wallet keys per lane.
    #[serde(default)]
    pub hot_keys: BTreeMap<String, HotKey>,
    /// Webhook delivery.
    #[serde(default)]
    pub webhooks: WebhooksConfig,
}

/// `[webhooks]`: how facts are delivered to subscribers (every value in milliseconds).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhooksConfig {
    /// Deliver inside `serve` (default true); `custodian webhook deliver` delivers either way.
    pub enabled: Option<bool>,
    /// How long one request may take (default 10 000).
    pub timeout_ms: Option<u64>,
    /// A subscriber failing for longer than this is paused (default one day).
    pub max_age_ms: Option<u64>,
    /// How often due subscribers are looked for (default 1 000).
    pub poll_ms: Option<u64>,
    /// How long one process holds a subscriber without renewing (default 60 000).
    pub lease_ms: Option<u64>,
    /// The first retry's wait, doubled with jitter for each further one (default 1 000).
    pub min_backoff_ms: Option<u64>,
    /// The longest wait between retries (default 600 000).
    pub max_backoff_ms: Option<u64>,
}

impl WebhooksConfig {
    /// The delivery settings, defaults filled in.
    pub fn delivery(&self) -> custodian_api::webhooks::DeliveryConfig {
        use std::time::Duration;
        let defaults = custodian_api::webhooks::DeliveryConfig::default();
        let ms = |value: Option<u64>, default: Duration| value.map_or(default, |v| Duration::from_millis(v.max(1)));
        custodian_api::webhooks::DeliveryConfig {
            timeout: ms(self.timeout_ms, defaults.timeout),
            max_age: ms(self.max_age_ms, defaults.max_age),
            poll: ms(self.poll_ms, defaults.poll),
            lease: ms(self.lease_ms, defaults.lease),
            min_backoff: ms(self.min_backoff_ms, defaults.min_backoff),
            max_backoff: ms(self.max_backoff_ms, defaults.max_backoff),
        }
    }
}

/// `[eth]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EthConfig {
    /// JSON-RPC endpoint.
    pub rpc_url: Option<String>,
    /// Several endpoints of one chain: reads fail over, broadcasts go to all (instead of rpc_url).
    #[serde(default)]
    pub rpc_urls: Vec<String>,
    /// The EIP-155 chain id withdrawals are signed for (required with hot-wallet keys).
    pub chain_id: Option<u64>,
    /// Account-level xpub (m/44'/60'/0') deposit addresses are derived from.
    pub deposit_xpub: Option<String>,
    /// Read call traces for internal deposits (default true).
    pub traces: Option<bool>,
    /// Timeout of one node call, milliseconds (default 10 000).
    pub rpc_timeout_ms: Option<u64>,
}

/// `[btc]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BtcConfig {
    /// Bitcoin Core JSON-RPC endpoint.
    pub rpc_url: Option<String>,
    /// Several Bitcoin Core nodes: reads fail over, broadcasts go to all (instead of rpc_url).
    #[serde(default)]
    pub rpc_urls: Vec<String>,
    /// RPC user.
    pub rpc_user: Option<String>,
    /// RPC password.
    pub rpc_password: Option<SecretString>,
    /// Bitcoin Core's `.cookie` file, instead of a user and password.
    pub rpc_cookie: Option<PathBuf>,
    /// mainnet, testnet, signet or regtest.
    pub network: Option<String>,
    /// Account-level xpub/zpub (m/84'/0'/0') deposit addresses are derived from.
    pub deposit_xpub: Option<String>,
    /// Per BTC lane, the file holding its account-level extended private key (owner-only).
    #[serde(default)]
    pub hot_key_files: std::collections::BTreeMap<String, PathBuf>,
    /// Withdrawals one BTC transaction pays at most (default 50).
    pub batch_max: Option<i64>,
    /// BTC transactions one allocation signs and commits at once when a backlog waits (default 8).
    pub batches_per_commit: Option<i64>,
    /// How long the oldest waiting withdrawal waits for a batch to fill, ms (default 2000).
    pub batch_wait_ms: Option<u64>,
    /// `estimatesmartfee`'s target, blocks (default 6).
    pub fee_target_blocks: Option<u16>,
    /// Fee rate floor, sat/vB (default 1).
    pub min_fee_rate_sat_vb: Option<u64>,
    /// Fee rate cap, sat/vB (default 500).
    pub max_fee_rate_sat_vb: Option<u64>,
    /// Blocks before a BTC withdrawal is confirmed (default 3).
    pub confirmations: Option<u64>,
    /// Blocks an accepted BTC transaction may stay unmined before it is replaced (default 3).
    pub bump_after_blocks: Option<u64>,
}

/// `[scanner]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScannerConfig {
    /// Reorg window and raw-payload retention.
    pub retention_blocks: Option<u64>,
}

/// `[withdrawals]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WithdrawalConfig {
    /// Blocks before a withdrawal counts as confirmed.
    pub confirmations: Option<u64>,
    /// Blocks before a fee bump.
    pub bump_after_blocks: Option<u64>,
    /// Most any attempt pays per gas, gwei.
    pub max_fee_gwei: Option<u64>,
}

/// `[api]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApiConfig {
    /// Address the gRPC API listens on.
    pub listen: Option<String>,
    /// Requests per second allowed per token.
    pub requests_per_second: Option<u32>,
    /// Burst allowed per token.
    pub burst: Option<u32>,
    /// Requests per second allowed per peer address, checked before any database work.
    pub peer_requests_per_second: Option<u32>,
    /// Burst allowed per peer address.
    pub peer_burst: Option<u32>,
    /// Calls handled at once across all connections.
    pub max_concurrent_requests: Option<usize>,
    /// How long one call may take, milliseconds.
    pub request_timeout_ms: Option<u64>,
    /// The API's own connections (never shared with the scanners or the worker).
    pub pool_size: Option<usize>,
    /// How long a call waits for a free connection before `UNAVAILABLE`, milliseconds.
    pub pool_timeout_ms: Option<u64>,
    /// PEM certificate chain of the gRPC listener (with `tls_key`: TLS).
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of the gRPC listener, readable by its owner only.
    pub tls_key: Option<PathBuf>,
    /// PEM CA that client certificates must chain to (clients must then present one).
    pub client_ca: Option<PathBuf>,
}

/// `[metrics]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Address `/metrics` and `/healthz` listen on.
    pub listen: Option<String>,
    /// Per lane, the balance of its native coin (in ETH or BTC, as a decimal) below which
    /// `custodian_hot_wallet_low{lane}` reads 1 and an alert is logged.
    #[serde(default)]
    pub low_balance: std::collections::BTreeMap<String, String>,
}

/// The file's permission bits when group or others may read or write it; `None` when only its
/// owner may. Files holding secrets (configuration with a password, TLS keys) must be the latter.
pub fn readable_by_others(path: &Path) -> std::io::Result<Option<u32>> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)?.permissions().mode() & 0o777;
    Ok((mode & 0o077 != 0).then_some(mode))
}

/// A lane's key: a file readable by its owner only, or the hex key itself.
pub type HotKey = custodian_service::keys::ConfiguredKey;

impl FileConfig {
    /// Reads and parses `path`; a missing or malformed file is a usage error.
    pub fn load(path: &Path) -> Result<FileConfig> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading {}", path.display()))
            .map_err(|e| invalid(format!("{e:#}")))?;
        // The error's own Display quotes the offending line, which may hold a secret: report only
        // the line number and the message.
        let config: FileConfig = toml::from_str(&text).map_err(|e| {
            let line = e.span().map_or(0, |span| text[..span.start].matches('\n').count() + 1);
            invalid(format!("{} line {line}: {}", path.display(), e.message()))
        })?;
        if let Some(secret) = config.secret_held() {
            if let Some(mode) = readable_by_others(path).with_context(|| format!("reading {}", path.display()))? {
                return Err(invalid(format!(
                    "{} holds a secret ({secret}) but is readable by other users (mode {mode:o}); chmod 600 it, \
                     as key files are",
                    path.display()
                )));
            }
        }
        Ok(config)
    }

    /// The first secret the file holds, named (never shown): a database password, the Bitcoin
    /// Core RPC password, or a hot key.
    fn secret_held(&self) -> Option<String> {
        use secrecy::ExposeSecret;
        let has_password = |url: &Option<SecretString>| {
            url.as_ref().is_some_and(|url| {
                url.expose_secret()
                    .parse::<tokio_postgres::Config>()
                    .map_or(true, |config| config.get_password().is_some_and(|p| !p.is_empty()))
            })
        };
        if has_password(&self.database_url) {
            return Some("database_url has a password".into());
        }
        if has_password(&self.migrate_database_url) {
            return Some("migrate_database_url has a password".into());
        }
        if self.btc.rpc_password.is_some() {
            return Some("[btc] rpc_password".into());
        }
        self.hot_keys.iter().find(|(_, key)| key.key.is_some()).map(|(lane, _)| format!("[hot_keys.{lane}] key"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_parses_and_debug_output_hides_secrets() {
        let example: FileConfig =
            toml::from_str(include_str!("../custodian.example.toml")).expect("the example parses");
        assert!(example.eth.rpc_url.is_some());
        let secret = "ac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
        let with_secrets: FileConfig = toml::from_str(&format!(
            "database_url = \"postgres://app:db-pass-123@db/custodian\"\n[btc]\nrpc_password = \"btc-pass-456\"\n[hot_keys.lane1]\nkey = \"0x{secret}\"\n"
        ))
        .expect("parses");
        let debug = format!("{with_secrets:?}");
        for leaked in [secret, "db-pass-123", "btc-pass-456"] {
            assert!(!debug.contains(leaked), "{leaked} appears in {debug}");
        }
        assert!(toml::from_str::<FileConfig>("[eth]\nrpc_urll = \"x\"\n").is_err(), "typos are refused");
    }

    #[test]
    fn a_file_holding_a_secret_must_be_readable_by_its_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("custodian-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            ("database_url = \"postgres://app:pw@db/custodian\"\n", true),
            ("database_url = \"host=db user=app password=pw\"\n", true),
            ("[btc]\nrpc_password = \"pw\"\n", true),
            ("[hot_keys.a]\nkey = \"0x01\"\n", true),
            ("database_url = \"postgres://app@db/custodian\"\n[hot_keys.a]\nkey_file = \"/k\"\n", false),
        ];
        for (n, (text, secret)) in cases.iter().enumerate() {
            let path = dir.join(format!("{n}.toml"));
            std::fs::write(&path, text).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
            let loaded = FileConfig::load(&path);
            assert_eq!(loaded.is_err(), *secret, "{text}");
            if let Err(e) = loaded {
                let message = format!("{e:#}");
                assert!(message.contains("chmod 600") && !message.contains("pw"), "{message}");
            }
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
            assert!(FileConfig::load(&path).is_ok(), "{text} at 0600");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
