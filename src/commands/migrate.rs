//! `custodian migrate`: apply pending migrations.

use anyhow::{Context, Result};
use custodian_store::migrate;
use serde::Serialize;

use crate::exit::Exit;
use crate::settings::Settings;

#[derive(Serialize)]
struct Report {
    applied: Vec<String>,
    schema_version: i32,
}

pub async fn run(settings: &Settings) -> Result<Exit> {
    // The schema owner, never the service's login: only the owner may create and alter tables.
    let url = &settings.migrate_database_url;
    let pool = custodian_store::connect(url, 1).await.context("opening the ledger database as its owner")?;
    let mut client = pool.get().await.context("taking a database connection")?;
    let report = migrate::run(&mut client).await.context("migrating the database")?;
    let report = Report { applied: report.applied, schema_version: report.version };
    if settings.json {
        super::print_json(&report)?;
    } else if report.applied.is_empty() {
        println!("schema is up to date at version {}", report.schema_version);
    } else {
        for name in &report.applied {
            println!("applied {name}");
        }
        println!("schema is now at version {}", report.schema_version);
    }
    Ok(Exit::Success)
}
