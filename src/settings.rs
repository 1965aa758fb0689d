//! Settings resolved from arguments and `CUSTODIAN_*` environment variables.

use anyhow::Result;
use custodian_domain::BtcNetwork;
use custodian_ingest::btc::BtcAuth;
use custodian_store::DatabaseUrl;

use crate::cli::GlobalArgs;
use crate::exit::invalid;

/// What every command needs to know about its surroundings.
#[derive(Debug)]
pub struct Settings {
    /// The ledger database.
    pub database_url: DatabaseUrl,
    /// Ethereum JSON-RPC endpoint, if configured.
    pub eth_rpc: Option<String>,
    /// Bitcoin Core JSON-RPC endpoint, if configured.
    pub btc_rpc: Option<String>,
    /// Bitcoin Core credentials.
    pub btc_auth: BtcAuth,
    /// The Bitcoin network.
    pub btc_network: BtcNetwork,
    /// Reorg window and raw-payload retention, in blocks.
    pub retention_blocks: u64,
    /// Print JSON.
    pub json: bool,
}

impl Settings {
    /// Validates the global arguments.
    pub fn from_args(args: &GlobalArgs) -> Result<Settings> {
        let database_url =
            args.database_url.parse().map_err(|e| invalid(format!("--database-url / CUSTODIAN_DATABASE_URL: {e}")))?;
        let btc_network =
            args.btc_network.parse().map_err(|e| invalid(format!("--btc-network / CUSTODIAN_BTC_NETWORK: {e}")))?;
        let btc_auth =
            match (&args.btc_rpc_cookie, &args.btc_rpc_user, &args.btc_rpc_password) {
                (Some(cookie), None, None) => BtcAuth::CookieFile(cookie.clone()),
                (None, Some(user), Some(password)) => {
                    BtcAuth::UserPassword { user: user.clone(), password: password.clone() }
                }
                (None, None, None) => BtcAuth::None,
                _ => return Err(invalid(
                    "give either CUSTODIAN_BTC_RPC_USER and CUSTODIAN_BTC_RPC_PASSWORD, or CUSTODIAN_BTC_RPC_COOKIE",
                )),
            };
        if args.retention_blocks == 0 {
            return Err(invalid("--retention-blocks must be at least 1"));
        }
        Ok(Settings {
            database_url,
            eth_rpc: args.eth_rpc.clone(),
            btc_rpc: args.btc_rpc.clone(),
            btc_auth,
            btc_network,
            retention_blocks: args.retention_blocks,
            json: args.json,
        })
    }
}
