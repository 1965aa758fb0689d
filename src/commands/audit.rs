//! `custodian replay --verify` and `custodian events`.

use std::time::Instant;

use anyhow::{Context, Result};
use custodian_projections::history::{self, HistoryError};
use custodian_projections::replay;
use serde_json::json;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

pub async fn replay(settings: &Settings, verify: bool) -> Result<Exit> {
    if !verify {
        return Err(invalid("replay only runs as `custodian replay --verify`"));
    }
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let started = Instant::now();
    let mut report = replay::verify(&mut client).await.context("replaying the facts")?;
    // Every retained payload re-parsed: an observation its own block's bytes do not hold is found
    // even when its transfer and everything after were made to match.
    for chain in custodian_domain::Chain::ALL {
        let check = custodian_ingest::reparse::verify_observations(&pool, chain, settings.btc_network)
            .await
            .with_context(|| format!("re-parsing the retained {chain} blocks"))?;
        report.facts_read += check.blocks;
        report
            .differences
            .extend(check.differences.into_iter().map(|detail| replay::Difference { check: "raw blocks", detail }));
    }
    let elapsed_ms = started.elapsed().as_millis();
    if settings.json {
        super::print_json(&json!({ "verified": report.verified(), "facts_read": report.facts_read,
                                    "elapsed_ms": elapsed_ms, "differences": report.differences }))?;
    } else {
        for d in &report.differences {
            println!("DIFFERENCE [{}] {}", d.check, d.detail);
        }
        if report.verified() {
            println!(
                "verified: {} facts replayed in {elapsed_ms} ms, every projection and invariant matches",
                report.facts_read
            );
        } else {
            println!("NOT verified: {} differences", report.differences.len());
        }
    }
    Ok(if report.verified() { Exit::Success } else { Exit::Verification })
}

pub async fn events(settings: &Settings, from: Option<i64>, limit: i64) -> Result<Exit> {
    if !(1..=history::MAX_PAGE).contains(&limit) {
        return Err(invalid(format!("--limit must be between 1 and {}", history::MAX_PAGE)));
    }
    let pool = super::pool(settings).await?;
    let facts = match history::page(&pool.get().await?, from, limit).await {
        Ok(facts) => facts,
        Err(HistoryError::UnknownPosition(p)) => {
            return Err(invalid(format!("--from {p}: no such position in the history")))
        }
        Err(HistoryError::Database(e)) => return Err(anyhow::Error::new(e).context("reading the history")),
    };
    let full = i64::try_from(facts.len()).is_ok_and(|n| n == limit);
    if let Some(last) = facts.last().filter(|_| full) {
        eprintln!("{limit} facts shown; the next page: --from {}", last.position);
    }
    if settings.json {
        return super::print_json(&facts).map(|()| Exit::Success);
    }
    for f in &facts {
        println!("{:>10} {} {:<22} {}", f.position, f.recorded_at, f.kind, f.payload);
    }
    Ok(Exit::Success)
}
