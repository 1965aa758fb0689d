//! One module per command; each builds what it needs from [`Settings`] and returns an [`Exit`].

mod account;
mod audit;
mod demo;
mod deposits;
mod export;
mod ledger;
mod migrate;
mod reconcile;
mod scan;
mod serve;
mod status;
mod webhook;
mod withdraw;

use anyhow::{Context, Result};

use crate::cli::{
    AccountCommand, AddressCommand, AssetCommand, Cli, Command, ExportCommand, HotWalletCommand, PolicyCommand,
    ReversalsCommand, TokenCommand, WithdrawalsCommand,
};
use crate::exit::Exit;
use crate::settings::Settings;

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> Result<Exit> {
    let settings = Settings::from_args(&cli.global)?;
    match cli.command {
        Command::Migrate => migrate::run(&settings).await,
        Command::Status => status::run(&settings).await,
        Command::Account(AccountCommand::Create { external_ref }) => account::create(&settings, &external_ref).await,
        Command::Address(AddressCommand::Assign { account, chain, address, from_height }) => {
            account::assign(&settings, &account, chain, &address, from_height).await
        }
        Command::Asset(AssetCommand::Add { chain, contract, symbol, decimals }) => {
            account::add_token(&settings, chain, &contract, &symbol, decimals).await
        }
        Command::Scan { chain, once, from_height } => scan::scan(&settings, chain, once, from_height).await,
        Command::Rewind { chain, to_height } => scan::rewind(&settings, chain, to_height).await,
        Command::Reparse { chain, from_height } => scan::reparse(&settings, chain, from_height).await,
        Command::Deposits { account, chain, before, limit } => {
            deposits::list(&settings, account.as_deref(), chain, before, limit).await
        }
        Command::Policy(PolicyCommand::Set { chain, asset, min_amount, confirmations }) => {
            ledger::policy_set(&settings, chain, &asset, &min_amount, confirmations).await
        }
        Command::Policy(PolicyCommand::Show) => ledger::policy_show(&settings).await,
        Command::Post => ledger::post(&settings).await,
        Command::Reversals(ReversalsCommand::List) => ledger::reversals_list(&settings).await,
        Command::Reversals(ReversalsCommand::Approve { id }) => ledger::decide(&settings, id, true, None).await,
        Command::Reversals(ReversalsCommand::Reject { id, reason }) => {
            ledger::decide(&settings, id, false, Some(&reason)).await
        }
        Command::Balances { account, as_of: None } => ledger::balances(&settings, account.as_deref()).await,
        Command::Balances { account, as_of: Some(as_of) } => {
            export::balances_as_of(&settings, account.as_deref(), &as_of).await
        }
        Command::Export(ExportCommand::Ledger { from, to, format, ledger_account }) => {
            export::ledger(&settings, &from, &to, format, ledger_account.as_deref()).await
        }
        Command::Replay { verify } => audit::replay(&settings, verify).await,
        Command::Reconcile => reconcile::reconcile(&settings).await,
        Command::Events { from, limit } => audit::events(&settings, from, limit).await,
        Command::HotWallet(HotWalletCommand::Add { chain, key_file, lane }) => {
            withdraw::hot_wallet_add(&settings, chain, &key_file, lane.as_deref()).await
        }
        Command::HotWallet(HotWalletCommand::Pause { lane, reason }) => {
            withdraw::pause(&settings, &lane, Some(&reason)).await
        }
        Command::HotWallet(HotWalletCommand::Resume { lane }) => withdraw::pause(&settings, &lane, None).await,
        Command::HotWallet(HotWalletCommand::Resync { lane }) => withdraw::resync(&settings, &lane).await,
        Command::HotWallet(HotWalletCommand::Rebalance { chain, from, to, amount, asset, external_id }) => {
            withdraw::rebalance(&settings, chain, &from, &to, &amount, &asset, external_id.as_deref()).await
        }
        Command::HotWallet(HotWalletCommand::Retire { lane }) => withdraw::retire(&settings, &lane).await,
        Command::HotWallet(HotWalletCommand::List) => withdraw::lanes(&settings).await,
        Command::Webhook(command) => webhook::run(&settings, command).await,
        Command::Withdraw { account, asset, to, amount, external_id } => {
            withdraw::request(&settings, &account, &asset, &to, &amount, &external_id).await
        }
        Command::Withdrawals { action: Some(WithdrawalsCommand::Approve { id }), .. } => {
            withdraw::approve(&settings, id).await
        }
        Command::Withdrawals {
            action: Some(WithdrawalsCommand::Limit { asset, amount, approvals, daily }), ..
        } => withdraw::limit(&settings, &asset, amount.as_deref(), approvals, daily.as_deref()).await,
        Command::Withdrawals { action: Some(WithdrawalsCommand::Rebroadcast { id }), .. } => {
            withdraw::rebroadcast(&settings, id).await
        }
        Command::Withdrawals {
            action: Some(WithdrawalsCommand::Resolve { id, paid_by, not_paid: _, confirmations }),
            ..
        } => withdraw::resolve(&settings, id, paid_by.as_deref(), confirmations).await,
        Command::Withdrawals { action: None, id, state, after, limit } => {
            withdraw::list(&settings, id, state.as_deref(), after, limit).await
        }
        Command::Cancel { id } => withdraw::cancel(&settings, id).await,
        Command::Work { once, worker } => {
            let interval = std::time::Duration::from_millis(worker.interval_ms);
            withdraw::work(&settings, once, &worker.key_files, withdraw::worker_config(&settings, &worker), interval)
                .await
        }
        Command::Serve { grpc_listen, metrics_listen, worker } => {
            serve::run(&settings, grpc_listen.as_deref(), metrics_listen.as_deref(), &worker).await
        }
        Command::Demo => demo::run(&settings).await,
        Command::Token(TokenCommand::Create { name, scope }) => account::token_create(&settings, &name, &scope).await,
        Command::Token(TokenCommand::Revoke { name }) => account::token_revoke(&settings, &name).await,
    }
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value).context("serialising output")?);
    Ok(())
}

/// A pool for commands that need the database, with a message naming the URL when it fails.
/// A role that could undo what the database enforces (a superuser, the schema owner) is refused
/// with exit 2 before anything runs: only `custodian migrate` uses the owner.
pub async fn pool(settings: &Settings) -> Result<custodian_store::Pool> {
    pool_of(settings, custodian_store::pool::DEFAULT_POOL_SIZE).await
}

/// [`pool`] with `size` connections at most.
pub async fn pool_of(settings: &Settings, size: usize) -> Result<custodian_store::Pool> {
    let pool = custodian_store::connect(&settings.database_url, size).await.context("opening the ledger database")?;
    let client = pool.get().await.context("taking a database connection")?;
    custodian_store::check_service_role(&client).await.map_err(|e| match e {
        refused @ custodian_store::RoleError::TooPowerful { .. } => crate::exit::invalid(refused.to_string()),
        other => anyhow::Error::new(other),
    })?;
    Ok(pool)
}

/// The principal a command acts as: the operator's token (`--token` / `CUSTODIAN_TOKEN`),
/// checked exactly as the gRPC API checks it, holding `scope` for `call`.
pub async fn principal<C: deadpool_postgres::GenericClient>(
    settings: &Settings,
    client: &C,
    scope: custodian_api::tokens::Scope,
    call: &str,
) -> Result<String> {
    use custodian_api::tokens::{self, Refusal};
    let Some(token) = &settings.token else {
        return Err(crate::exit::invalid(format!(
            "{call} is recorded with its author: give the operator's API token with --token or CUSTODIAN_TOKEN \
             (one with the {scope} scope; `custodian token create --name NAME --scope {scope}`)"
        )));
    };
    match tokens::principal(client, secrecy::ExposeSecret::expose_secret(token), scope, call).await {
        Ok(name) => Ok(name),
        Err(Refusal::Database(e)) => Err(anyhow::Error::new(e).context("checking the operator's token")),
        Err(refusal) => Err(crate::exit::invalid(refusal.to_string())),
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
