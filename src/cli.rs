//! Command-line arguments. Every command that prints data takes `--json`.

use clap::builder::TypedValueParser as _;
use clap::{Args, Parser, Subcommand};
use custodian_domain::Chain;

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
    /// Configuration file (TOML); flags and CUSTODIAN_* variables override it.
    #[arg(long, global = true, env = "CUSTODIAN_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// PostgreSQL URL of the ledger database, as the service's login
    /// [default: postgres://custodian_app@127.0.0.1:5432/custodian].
    #[arg(long, global = true, env = "CUSTODIAN_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// PostgreSQL URL of the schema owner, used by `custodian migrate` only
    /// [default: postgres://custodian_owner@127.0.0.1:5432/custodian].
    #[arg(long, global = true, env = "CUSTODIAN_MIGRATE_DATABASE_URL", hide_env_values = true)]
    pub migrate_database_url: Option<String>,
    /// Ethereum JSON-RPC endpoint; several, comma-separated, are one chain's nodes (reads fail
    /// over, broadcasts go to all).
    #[arg(long = "eth-rpc", global = true, env = "CUSTODIAN_ETH_RPC_URL", hide_env_values = true)]
    pub eth_rpc: Option<String>,
    /// The Ethereum chain id withdrawals are signed for; a node answering another is refused
    /// (required whenever hot-wallet keys are configured).
    #[arg(long = "eth-chain-id", global = true, env = "CUSTODIAN_ETH_CHAIN_ID")]
    pub eth_chain_id: Option<u64>,
    /// How long one Ethereum node call may take before it counts as failed (retried; a worker lane
    /// backs off) [default: 10000].
    #[arg(long = "eth-rpc-timeout-ms", global = true, env = "CUSTODIAN_ETH_RPC_TIMEOUT_MS")]
    pub eth_rpc_timeout_ms: Option<u64>,
    /// Read ETH call traces (internal deposits: contract wallets, batch payouts); `false` scans
    /// without them, knowingly, on a node without `debug_traceBlockByNumber` [default: true].
    #[arg(long = "eth-traces", global = true, env = "CUSTODIAN_ETH_TRACES")]
    pub eth_traces: Option<bool>,
    /// Bitcoin Core JSON-RPC endpoint; several, comma-separated, fail over like --eth-rpc.
    #[arg(long = "btc-rpc", global = true, env = "CUSTODIAN_BTC_RPC_URL", hide_env_values = true)]
    pub btc_rpc: Option<String>,
    /// Bitcoin Core RPC user (or use a cookie file).
    #[arg(long = "btc-rpc-user", global = true, env = "CUSTODIAN_BTC_RPC_USER", hide_env_values = true)]
    pub btc_rpc_user: Option<String>,
    /// Bitcoin Core RPC password.
    #[arg(long = "btc-rpc-password", global = true, env = "CUSTODIAN_BTC_RPC_PASSWORD", hide_env_values = true)]
    pub btc_rpc_password: Option<String>,
    /// Bitcoin Core's `.cookie` file, instead of a user and password.
    #[arg(long = "btc-rpc-cookie", global = true, env = "CUSTODIAN_BTC_RPC_COOKIE")]
    pub btc_rpc_cookie: Option<std::path::PathBuf>,
    /// Bitcoin network addresses are checked against: mainnet, testnet, signet or regtest.
    #[arg(long = "btc-network", global = true, env = "CUSTODIAN_BTC_NETWORK",
          value_parser = btc_network_arg())]
    pub btc_network: Option<String>,
    /// Blocks of history a reorg may reach and raw payloads are kept for.
    #[arg(long = "retention-blocks", global = true, env = "CUSTODIAN_RETENTION_BLOCKS")]
    pub retention_blocks: Option<u64>,
    /// The operator's API token: every command that records a decision or a change (withdraw,
    /// cancel, approve, limits, policy, lanes, tokens, reversals) is made on its authority and
    /// checked exactly as the gRPC API checks it.
    #[arg(long, global = true, env = "CUSTODIAN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
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
    /// Manage customer accounts.
    #[command(subcommand)]
    Account(AccountCommand),
    /// Manage deposit addresses.
    #[command(subcommand)]
    Address(AddressCommand),
    /// Assets the ledger counts: register an ERC-20 token.
    #[command(subcommand)]
    Asset(AssetCommand),
    /// API bearer tokens: create and revoke.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Scan a chain for deposits (to the node's tip with --once, else until stopped).
    Scan {
        /// eth or btc.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// Scan to the node's current tip, then exit.
        #[arg(long)]
        once: bool,
        /// Where a never-scanned chain starts.
        #[arg(long)]
        from_height: Option<u64>,
    },
    /// Move the scan cursor back so the next scan re-reads from a height (nothing is deleted).
    Rewind {
        /// eth or btc.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// The height the next scan starts at.
        #[arg(long)]
        to_height: u64,
    },
    /// Re-derive deposit observations from retained raw blocks, without the node.
    Reparse {
        /// eth or btc.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// First height to re-parse.
        #[arg(long)]
        from_height: u64,
    },
    /// Value-dependent confirmation policy.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Post every confirmed deposit not yet posted (also runs after every scan step).
    Post,
    /// Reversal proposals for posted deposits that a deep reorg took away.
    #[command(subcommand)]
    Reversals(ReversalsCommand),
    /// Balances per account and asset: confirmed, pending, held, available. With `--as-of`, the
    /// balances the postings made at a past moment (available and held), from the finance views.
    Balances {
        /// Only this account (reference or id).
        #[arg(long)]
        account: Option<String>,
        /// A past moment (`2026-11-30`, `2026-11-30T18:00:00Z`): balances from the postings up to it.
        #[arg(long)]
        as_of: Option<String>,
    },
    /// Finance exports, read through the views the read-only role `custodian_reader` sees.
    #[command(subcommand)]
    Export(ExportCommand),
    /// The ledger against the chain, per asset: custody against what our addresses hold at our
    /// tip (less what is observed and not yet credited), and what customers are owed against
    /// custody. Exit 3 with each difference named.
    Reconcile,
    /// Rebuild every projection from the appended facts and compare (exit 3 on any difference).
    Replay {
        /// Compare the rebuilt projections with the live ones and check the invariants.
        #[arg(long)]
        verify: bool,
    },
    /// Print the history of appended facts in order, as an auditor reads it.
    Events {
        /// Continue after this position (from the beginning when absent).
        #[arg(long = "from")]
        from: Option<i64>,
        /// At most this many facts (1 to 10,000); a full page says where the next one starts.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
    /// Hot wallets (withdrawal lanes).
    #[command(subcommand, name = "hot-wallet")]
    HotWallet(HotWalletCommand),
    /// Webhook subscribers: the fact history pushed to a URL, signed, in order, at least once.
    #[command(subcommand, alias = "webhooks")]
    Webhook(WebhookCommand),
    /// Request a withdrawal (idempotent per account and --external-id).
    Withdraw {
        /// Account reference or id.
        #[arg(long)]
        account: String,
        /// Asset symbol or key (ETH, a token symbol, eth:0x…).
        #[arg(long)]
        asset: String,
        /// Destination address (EIP-55 checksummed or all lowercase).
        #[arg(long)]
        to: String,
        /// Amount in whole units ("1.5").
        #[arg(long)]
        amount: String,
        /// The client's idempotency key.
        #[arg(long)]
        external_id: String,
    },
    /// List withdrawals with every attempt, or approve one.
    Withdrawals {
        #[command(subcommand)]
        action: Option<WithdrawalsCommand>,
        /// Only this withdrawal.
        #[arg(long)]
        id: Option<i64>,
        /// Only this state.
        #[arg(long, value_parser = STATES)]
        state: Option<String>,
        /// Only withdrawals with a larger id (the next page: the last id of the one before).
        #[arg(long)]
        after: Option<i64>,
        /// At most this many (1 to 10,000).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
    /// Cancel a withdrawal (a replacement transaction once signed).
    Cancel {
        /// Withdrawal id.
        #[arg(long)]
        id: i64,
    },
    /// Run the withdrawal worker: approve-check, allocate, broadcast, bump, settle.
    Work {
        /// One pass, then exit.
        #[arg(long)]
        once: bool,
        #[command(flatten)]
        worker: WorkerArgs,
    },
    /// Run everything: the gRPC API, a scanner per configured chain with posting, the withdrawal
    /// worker, and /metrics and /healthz. Stops cleanly on SIGTERM.
    Serve {
        /// Address of the gRPC API [default: 127.0.0.1:50051, or [api] listen].
        #[arg(long, env = "CUSTODIAN_GRPC_LISTEN")]
        grpc_listen: Option<String>,
        /// Address of /metrics and /healthz [default: 127.0.0.1:9100, or [metrics] listen].
        #[arg(long, env = "CUSTODIAN_METRICS_LISTEN")]
        metrics_listen: Option<String>,
        #[command(flatten)]
        worker: WorkerArgs,
    },
    /// Tell the whole story on a laptop: deposits, reorgs, withdrawals, replay --verify.
    Demo,
    /// List deposit observations with their block, confirmations and whether orphaned.
    Deposits {
        /// Only this account (reference or id).
        #[arg(long)]
        account: Option<String>,
        /// Only this chain.
        #[arg(long)]
        chain: Option<Chain>,
        /// Only observations with a smaller id (the next page: the last id of the one before).
        #[arg(long)]
        before: Option<i64>,
        /// At most this many (1 to 10,000), newest first.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Set the confirmations required from an amount up (replaces the tier at that amount).
    Set {
        /// eth or btc.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// Asset symbol or key (ETH, BTC, a token symbol, eth:0x…).
        #[arg(long)]
        asset: String,
        /// The smallest amount of the tier, in whole units ("0.1").
        #[arg(long)]
        min_amount: String,
        /// Confirmations required.
        #[arg(long)]
        confirmations: u32,
    },
    /// Show every tier.
    Show,
}

/// How the withdrawal worker runs (flags override `[withdrawals]` in the configuration file).
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// LANE=PATH of a hot-wallet key file (also CUSTODIAN_HOT_KEY_<LANE> / CUSTODIAN_HOT_KEY_FILE_<LANE>).
    #[arg(long = "key-file")]
    pub key_files: Vec<String>,
    /// Blocks a withdrawal must be buried under before it is confirmed [default: 12].
    #[arg(long, env = "CUSTODIAN_WITHDRAWAL_CONFIRMATIONS")]
    pub confirmations: Option<u64>,
    /// Blocks an attempt may stay unmined before a fee bump [default: 3].
    #[arg(long, env = "CUSTODIAN_BUMP_AFTER_BLOCKS")]
    pub bump_after_blocks: Option<u64>,
    /// The most any attempt pays per gas, in gwei [default: 500].
    #[arg(long, env = "CUSTODIAN_MAX_FEE_GWEI")]
    pub max_fee_gwei: Option<u64>,
    /// Milliseconds between passes when running continuously.
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
}

#[derive(Debug, Subcommand)]
pub enum WebhookCommand {
    /// Subscribe a URL to kinds of facts. Prints the subscriber, and its secret once when none
    /// was given.
    Add {
        /// Where facts are posted (http:// or https://).
        #[arg(long)]
        url: String,
        /// Comma-separated: block, deposit, ledger, reversal, withdrawal, operator.
        #[arg(long)]
        kinds: String,
        /// A file (readable by its owner only) holding the HMAC secret; generated when absent.
        #[arg(long)]
        secret_file: Option<std::path::PathBuf>,
        /// Deliver the whole history, not only facts from now on.
        #[arg(long)]
        from_start: bool,
    },
    /// Every subscriber with its cursor, backlog and state.
    List,
    /// Stop delivering to a subscriber (its cursor stays).
    Pause {
        /// Subscriber id.
        #[arg(long)]
        id: i64,
        /// Why.
        #[arg(long, default_value = "paused by an operator")]
        reason: String,
    },
    /// Deliver again, from where the cursor stands, with its failures cleared.
    Resume {
        /// Subscriber id.
        #[arg(long)]
        id: i64,
    },
    /// Remove a subscriber.
    Remove {
        /// Subscriber id.
        #[arg(long)]
        id: i64,
    },
    /// Deliver to every due subscriber (until stopped, or with --once until each is caught up
    /// or has failed once).
    Deliver {
        /// One pass, then exit with a report.
        #[arg(long)]
        once: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum HotWalletCommand {
    /// Register a hot wallet from its key file (readable by its owner only).
    Add {
        /// Only eth.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// File holding the hex private key.
        #[arg(long)]
        key_file: std::path::PathBuf,
        /// Lane name (default: lane<N>).
        #[arg(long)]
        lane: Option<String>,
    },
    /// Stop automation on a lane.
    Pause {
        /// Lane.
        #[arg(long)]
        lane: String,
        /// Why.
        #[arg(long, default_value = "paused by an operator")]
        reason: String,
    },
    /// Resume a paused lane (one paused because its key was used outside the service needs a
    /// resync first).
    Resume {
        /// Lane.
        #[arg(long)]
        lane: String,
    },
    /// Re-sync a lane's nonce cursor with the chain (the larger of the chain's pending nonce and
    /// one above our highest allocated nonce), recorded with both figures; the lane stays paused.
    Resync {
        /// Lane.
        #[arg(long)]
        lane: String,
    },
    /// Move money between two hot wallets: an internal withdrawal of treasury through the same
    /// allocator (the fee to network_fees; the arrival is credited back to treasury).
    Rebalance {
        /// Only eth.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// The lane paying.
        #[arg(long)]
        from: String,
        /// The lane receiving.
        #[arg(long)]
        to: String,
        /// Whole units ("2.5").
        #[arg(long)]
        amount: String,
        /// Asset symbol or key.
        #[arg(long, default_value = "ETH")]
        asset: String,
        /// Idempotency key (default: one per invocation).
        #[arg(long)]
        external_id: Option<String>,
    },
    /// Retire a lane: new withdrawals no longer hash to it, its in-flight ones finish.
    Retire {
        /// Lane.
        #[arg(long)]
        lane: String,
    },
    /// List lanes: address, nonce cursor, pause, shortage, retirement.
    List,
}

#[derive(Debug, Subcommand)]
pub enum WithdrawalsCommand {
    /// Approve a withdrawal waiting for approval, as the token's principal (never its requester).
    Approve {
        /// Withdrawal id.
        #[arg(long)]
        id: i64,
    },
    /// Set an asset's limits: above --amount a withdrawal needs --approvals distinct approvers;
    /// past --daily (a rolling 24-hour total per account) it waits for approval too.
    Limit {
        /// Asset symbol or key.
        #[arg(long)]
        asset: String,
        /// Approval limit in whole units, or "none".
        #[arg(long)]
        amount: Option<String>,
        /// Distinct approvers a withdrawal above the limit needs (1 to 16).
        #[arg(long)]
        approvals: Option<u32>,
        /// Rolling 24-hour total per account in whole units, or "none".
        #[arg(long)]
        daily: Option<String>,
    },
    /// Send the stored bytes of a withdrawal in review again (a payment reorged out deeper than
    /// the confirmation depth), so it can mine again and be resolved --paid-by. Signs nothing.
    Rebroadcast {
        /// Withdrawal id.
        #[arg(long)]
        id: i64,
    },
    /// Resolve a withdrawal that needs review, with evidence checked on chain: --paid-by the
    /// transaction that paid it (sent by its hot wallet at its nonce, paying its destination), or
    /// --not-paid when its nonce was consumed by something else (releases the hold).
    Resolve {
        /// Withdrawal id.
        #[arg(long)]
        id: i64,
        /// The transaction that paid it.
        #[arg(long, conflicts_with = "not_paid", required_unless_present = "not_paid")]
        paid_by: Option<String>,
        /// Nothing paid it.
        #[arg(long)]
        not_paid: bool,
        /// Blocks the evidence must be buried under [default: the withdrawal depth, 12].
        #[arg(long, env = "CUSTODIAN_WITHDRAWAL_CONFIRMATIONS")]
        confirmations: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ReversalsCommand {
    /// List proposals and decisions.
    List,
    /// Approve a proposal: posts the compensating transfer.
    Approve {
        /// Proposal id.
        #[arg(long)]
        id: i64,
    },
    /// Reject a proposal: nothing is debited.
    Reject {
        /// Proposal id.
        #[arg(long)]
        id: i64,
        /// Why.
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum AccountCommand {
    /// Create an account (returns the existing one if the reference is taken).
    Create {
        /// The operator's reference for the customer.
        #[arg(long = "ref")]
        external_ref: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum AddressCommand {
    /// Assign an address to an account from a height (reassignment closes the previous range).
    Assign {
        /// Account reference or id.
        #[arg(long)]
        account: String,
        /// eth or btc.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// The address (EIP-55 or lowercase for ETH; on the configured network for BTC).
        #[arg(long)]
        address: String,
        /// First height the account owns it (default: 0 when new; when reassigned, the node's tip + 1,
        /// so payments in blocks not scanned yet stay with the old owner). A height at or below
        /// a deposit already observed to the address is refused.
        #[arg(long)]
        from_height: Option<u64>,
    },
}

/// Every withdrawal state, as `--state` takes it.
const STATES: [&str; 11] = [
    "requested",
    "awaiting_approval",
    "rejected",
    "signed",
    "broadcast",
    "mined",
    "confirmed",
    "failed_onchain",
    "cancel_requested",
    "cancelled",
    "needs_review",
];

/// `--btc-network`: the four networks, listed by `--help` (with the aliases the domain accepts).
fn btc_network_arg() -> clap::builder::PossibleValuesParser {
    use clap::builder::PossibleValue;
    clap::builder::PossibleValuesParser::new([
        PossibleValue::new("mainnet").aliases(["bitcoin", "main"]),
        PossibleValue::new("testnet").alias("test"),
        PossibleValue::new("signet"),
        PossibleValue::new("regtest"),
    ])
}

/// `--chain`: the chains' names, listed by `--help`, parsed into the domain's [`Chain`].
fn chain_arg() -> impl clap::builder::TypedValueParser<Value = Chain> {
    clap::builder::PossibleValuesParser::new(["eth", "btc"])
        .map(|name| name.parse::<Chain>().expect("BUG: the possible values are chains"))
}

#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Every posting between two moments (`--from` inclusive, `--to` exclusive), oldest first.
    Ledger {
        /// From this moment (`2026-11-01` or an RFC 3339 timestamp).
        #[arg(long)]
        from: String,
        /// Until this moment, exclusive.
        #[arg(long)]
        to: String,
        /// csv (a header, then one line per posting) or json (an array).
        #[arg(long, value_enum, default_value = "csv")]
        format: ExportFormat,
        /// Only this ledger account (`user:42`, `treasury`, `custody`, …).
        #[arg(long)]
        ledger_account: Option<String>,
    },
}

/// How an export is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ExportFormat {
    /// Comma-separated values with a header line.
    Csv,
    /// One JSON array.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum AssetCommand {
    /// Register an ERC-20 contract so its transfers to watched addresses count as deposits.
    Add {
        /// Only eth has tokens.
        #[arg(long, value_parser = chain_arg())]
        chain: Chain,
        /// The token contract.
        #[arg(long)]
        contract: String,
        /// Its symbol, unique per chain.
        #[arg(long)]
        symbol: String,
        /// Its decimals.
        #[arg(long)]
        decimals: u8,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Create an API bearer token; it is printed once and stored only hashed.
    Create {
        /// A name for the token (who uses it).
        #[arg(long)]
        name: String,
        /// Comma-separated scopes: read, withdraw, approve, admin.
        #[arg(long)]
        scope: String,
    },
    /// Revoke an API token by name.
    Revoke {
        /// The token's name.
        #[arg(long)]
        name: String,
    },
}
