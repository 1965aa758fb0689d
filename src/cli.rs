//! Command-line arguments. Every command that prints data takes `--json`.

use clap::{Args, Parser, Subcommand};

/// Custodian: a custodial-wallet ledger for Bitcoin and Ethereum on PostgreSQL.
#[derive(Debug, Parser)]
#[command(name = "custodian", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command understands.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// PostgreSQL URL of the ledger database.
    #[arg(long, global = true, env = "CUSTODIAN_DATABASE_URL", default_value = custodian_store::DEFAULT_DATABASE_URL, hide_env_values = true)]
    pub database_url: String,
    /// Ethereum JSON-RPC endpoint.
    #[arg(long = "eth-rpc", global = true, env = "CUSTODIAN_ETH_RPC_URL", hide_env_values = true)]
    pub eth_rpc: Option<String>,
    /// Bitcoin Core JSON-RPC endpoint.
    #[arg(long = "btc-rpc", global = true, env = "CUSTODIAN_BTC_RPC_URL", hide_env_values = true)]
    pub btc_rpc: Option<String>,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply pending database migrations (a no-op when up to date).
    Migrate,
    /// Show whether the database answers, its schema version and the configured chains.
    Status,
}
