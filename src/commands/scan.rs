//! `custodian scan`, `rewind` and `reparse`.

use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use custodian_domain::Chain;
use custodian_ingest::btc::BtcReader;
use custodian_ingest::eth::EthReader;
use custodian_ingest::sql::{self, RewindError};
use custodian_ingest::{ChainReader, Progress, ScanConfig, ScanReport, Scanner};
use serde_json::json;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

/// How often plain progress lines are written when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// A progress bar on a terminal, a line every few seconds otherwise.
enum ScanProgress {
    Bar(indicatif::ProgressBar),
    Lines(Mutex<Instant>),
}

impl ScanProgress {
    fn new() -> Self {
        if std::io::stderr().is_terminal() {
            let bar = indicatif::ProgressBar::new(0);
            bar.set_style(
                indicatif::ProgressStyle::with_template("{prefix} [{bar:40}] {pos}/{len} {msg}")
                    .expect("BUG: progress template")
                    .progress_chars("=> "),
            );
            ScanProgress::Bar(bar)
        } else {
            ScanProgress::Lines(Mutex::new(Instant::now()))
        }
    }

    fn finish(&self) {
        if let ScanProgress::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

impl Progress for ScanProgress {
    fn batch_done(&self, chain: Chain, height: u64, node_tip: u64, report: &ScanReport, elapsed: Duration) {
        let rate = u128::from(report.blocks) * 1000 / elapsed.as_millis().max(1);
        match self {
            ScanProgress::Bar(bar) => {
                bar.set_prefix(format!("scanning {chain}"));
                bar.set_length(node_tip);
                bar.set_position(height);
                bar.set_message(format!("{rate} blocks/s, {} deposits", report.deposits));
            }
            ScanProgress::Lines(last) => {
                let mut last = last.lock().expect("BUG: progress lock poisoned");
                if last.elapsed() >= LOG_EVERY || height >= node_tip {
                    *last = Instant::now();
                    eprintln!(
                        "scanning {chain}: height {height} of {node_tip}, {rate} blocks/s, {} deposits",
                        report.deposits
                    );
                }
            }
        }
    }
}

fn config(settings: &Settings, from_height: Option<u64>) -> ScanConfig {
    ScanConfig {
        retention_blocks: settings.retention_blocks,
        start_height: from_height.unwrap_or(0),
        ..ScanConfig::default()
    }
}

/// The ETH reader as configured, its trace API checked when traces are on: a node without it is a
/// start-up error naming the way out.
pub async fn eth_reader(settings: &Settings) -> Result<EthReader> {
    let url = settings
        .eth_rpc
        .as_deref()
        .ok_or_else(|| invalid("no Ethereum node: set --eth-rpc or CUSTODIAN_ETH_RPC_URL"))?;
    let reader = EthReader::with_timeout(url, settings.eth_rpc_timeout)
        .map_err(|e| invalid(e.to_string()))?
        .with_traces(settings.eth_traces);
    match reader.check_traces().await {
        Ok(()) => Ok(reader),
        Err(e @ custodian_ingest::ReadError::WrongNetwork { .. }) => Err(invalid(e.to_string())),
        Err(e) => Err(anyhow::Error::new(e).context("checking the Ethereum node's trace API")),
    }
}

pub async fn scan(settings: &Settings, chain: Chain, once: bool, from_height: Option<u64>) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    if let Some(from) = from_height {
        let cursor = sql::cursor(&pool.get().await?, chain).await?;
        if cursor.is_some_and(|c| c != from) {
            return Err(invalid(format!(
                "{chain} has been scanned already (cursor at {}); --from-height only applies to a first scan, use `custodian rewind`",
                cursor.unwrap_or_default()
            )));
        }
    }
    let config = config(settings, from_height);
    match chain {
        Chain::Eth => {
            let reader = eth_reader(settings).await?;
            run(settings, posting_scanner(reader, pool, config), once).await
        }
        Chain::Btc => {
            let url = settings
                .btc_rpc
                .as_deref()
                .ok_or_else(|| invalid("no Bitcoin node: set --btc-rpc or CUSTODIAN_BTC_RPC_URL"))?;
            let reader = BtcReader::new(url, settings.btc_auth.clone(), settings.btc_network)
                .map_err(|e| invalid(e.to_string()))?;
            run(settings, posting_scanner(reader, pool, config), once).await
        }
    }
}

/// A scanner of `reader` that posts confirmed deposits after every step that stored blocks or
/// handled a reorg.
fn posting_scanner<R: ChainReader>(reader: R, pool: custodian_store::Pool, config: ScanConfig) -> Scanner<R> {
    Scanner::new(reader, pool.clone(), config)
        .with_after_step(std::sync::Arc::new(custodian_service::posting::PostAfterStep::new(pool)))
}

async fn run<R: ChainReader>(settings: &Settings, scanner: Scanner<R>, once: bool) -> Result<Exit> {
    let progress = ScanProgress::new();
    let chain = scanner.chain();
    let outcome = if once {
        scanner.run_to_tip(&progress).await
    } else {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            super::shutdown_signal().await;
            let _ = stop.send(true);
        });
        scanner.run(&progress, stopped).await
    };
    progress.finish();
    let report = match outcome {
        Err(e @ custodian_ingest::ScanError::LeaseHeld { .. }) => return Err(anyhow::Error::new(e)),
        other => other.with_context(|| format!("scanning {chain}"))?,
    };
    if settings.json {
        super::print_json(&json!({ "chain": chain, "report": report }))?;
    } else {
        println!(
            "{chain}: {} new blocks, {} new deposits, {} reorgs ({} blocks orphaned); our tip {}, node tip {}",
            report.blocks,
            report.deposits,
            report.reorgs,
            report.orphaned,
            report.our_tip.map_or("none".to_owned(), |t| t.to_string()),
            report.node_tip
        );
    }
    Ok(Exit::Success)
}

pub async fn rewind(settings: &Settings, chain: Chain, to_height: u64) -> Result<Exit> {
    if i64::try_from(to_height).is_err() {
        return Err(invalid("--to-height is too large"));
    }
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let previous = match sql::rewind(&mut client, chain, to_height).await {
        Ok(previous) => previous,
        Err(RewindError::Database(e)) => return Err(anyhow::Error::new(e).context("rewinding")),
        Err(refusal) => return Err(invalid(refusal.to_string())),
    };
    if settings.json {
        super::print_json(&json!({ "chain": chain, "previous_next_height": previous, "next_height": to_height }))?;
    } else {
        println!("{chain}: cursor moved from {previous} back to {to_height}; the next scan re-reads from there");
    }
    Ok(Exit::Success)
}

pub async fn reparse(settings: &Settings, chain: Chain, from_height: u64) -> Result<Exit> {
    if i64::try_from(from_height).is_err() {
        return Err(invalid("--from-height is too large"));
    }
    let pool = super::pool(settings).await?;
    let tip = sql::our_tip(&pool.get().await?, chain).await?.map(|(h, _)| h);
    if tip.is_none_or(|tip| from_height > tip) {
        return Err(invalid(format!("{chain} holds no block at or above {from_height} (our tip: {tip:?})")));
    }
    let report = custodian_ingest::reparse::reparse(&pool, chain, settings.btc_network, from_height)
        .await
        .with_context(|| format!("re-parsing {chain} from {from_height}"))?;
    if settings.json {
        super::print_json(&json!({ "chain": chain, "report": report }))?;
    } else {
        println!(
            "{chain}: re-parsed {} retained blocks, added {} deposit observations; {} blocks had their payload pruned",
            report.blocks, report.deposits_added, report.pruned
        );
    }
    Ok(Exit::Success)
}
