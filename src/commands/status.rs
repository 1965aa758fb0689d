//! `custodian status`: is the database reachable, which schema version, which chains configured.

use anyhow::Result;
use custodian_domain::Chain;
use custodian_store::migrate;
use serde::Serialize;

use crate::exit::Exit;
use crate::settings::Settings;

#[derive(Serialize)]
struct Status {
    database: DatabaseStatus,
    chains: Vec<ChainStatus>,
}

#[derive(Serialize)]
struct DatabaseStatus {
    url: String,
    reachable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    schema_version: Option<i32>,
    latest_schema_version: i32,
    up_to_date: bool,
}

#[derive(Serialize)]
struct ChainStatus {
    chain: Chain,
    configured: bool,
    rpc_url: Option<String>,
}

pub async fn run(settings: &Settings) -> Result<Exit> {
    let latest = migrate::latest_version();
    let (reachable, error, version) = match super::pool(settings).await {
        Ok(pool) => match pool.get().await {
            Ok(client) => match migrate::current_version(&client).await {
                Ok(version) => (true, None, version),
                Err(e) => (true, Some(crate::exit::message(&e.into())), None),
            },
            Err(e) => (false, Some(crate::exit::message(&e.into())), None),
        },
        // A role that may not run the service is a refusal, not an unreachable database.
        Err(e) if crate::exit::classify(&e) == Exit::Usage => return Err(e),
        Err(e) => (false, Some(crate::exit::message(&e)), None),
    };
    let status = Status {
        database: DatabaseStatus {
            url: settings.database_url.to_string(),
            reachable,
            error,
            schema_version: version,
            latest_schema_version: latest,
            up_to_date: version == Some(latest),
        },
        chains: vec![
            ChainStatus {
                chain: Chain::Eth,
                configured: settings.eth_rpc.is_some(),
                rpc_url: settings.eth_rpc.as_deref().map(mask_userinfo),
            },
            ChainStatus {
                chain: Chain::Btc,
                configured: settings.btc_rpc.is_some(),
                rpc_url: settings.btc_rpc.as_deref().map(mask_userinfo),
            },
        ],
    };
    if settings.json {
        super::print_json(&status)?;
    } else {
        let db = &status.database;
        println!("database      {} ({})", db.url, if db.reachable { "reachable" } else { "NOT reachable" });
        if let Some(error) = &db.error {
            println!("  error       {error}");
        }
        match db.schema_version {
            Some(v) if v == latest => println!("schema        version {v} (up to date)"),
            Some(v) => println!("schema        version {v} of {latest}: run `custodian migrate`"),
            None => println!("schema        not migrated: run `custodian migrate`"),
        }
        for chain in &status.chains {
            match &chain.rpc_url {
                Some(url) => println!("chain {:<7} rpc {url}", chain.chain.as_str()),
                None => println!("chain {:<7} not configured", chain.chain.as_str()),
            }
        }
    }
    Ok(if status.database.reachable { Exit::Success } else { Exit::Operational })
}

/// Hides credentials in `scheme://user:password@host/…` so status output can be shared.
fn mask_userinfo(url: &str) -> String {
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, host))) => format!("{scheme}://***@{host}"),
        _ => url.to_owned(),
    }
}
