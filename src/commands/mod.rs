//! One module per command; each builds what it needs from [`Settings`] and returns an [`Exit`].

mod migrate;
mod status;

use anyhow::{Context, Result};

use crate::cli::{Cli, Command};
use crate::exit::Exit;
use crate::settings::Settings;

/// Runs the parsed command line.
pub async fn run(cli: Cli) -> Result<Exit> {
    let settings = Settings::from_args(&cli.global)?;
    match cli.command {
        Command::Migrate => migrate::run(&settings).await,
        Command::Status => status::run(&settings).await,
    }
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &impl serde::Serialize) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(value).context("serialising output")?);
    Ok(())
}

/// A pool for commands that need the database, with a message naming the URL when it fails.
pub async fn pool(settings: &Settings) -> Result<custodian_store::Pool> {
    custodian_store::connect(&settings.database_url, custodian_store::pool::DEFAULT_POOL_SIZE)
        .await
        .context("opening the ledger database")
}
