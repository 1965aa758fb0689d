//! Settings resolved from arguments and `CUSTODIAN_*` environment variables.

use anyhow::Result;
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
    /// Print JSON.
    pub json: bool,
}

impl Settings {
    /// Validates the global arguments.
    pub fn from_args(args: &GlobalArgs) -> Result<Settings> {
        let database_url =
            args.database_url.parse().map_err(|e| invalid(format!("--database-url / CUSTODIAN_DATABASE_URL: {e}")))?;
        Ok(Settings { database_url, eth_rpc: args.eth_rpc.clone(), btc_rpc: args.btc_rpc.clone(), json: args.json })
    }
}
