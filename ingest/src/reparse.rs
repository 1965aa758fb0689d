//! Re-deriving deposit observations from retained raw blocks, without asking the node: the
//! recovery after a parser fix. Existing observations are left untouched; missing ones are added.

use custodian_domain::{BtcNetwork, Chain};
use custodian_store::Pool;
use serde::Serialize;

use crate::block::FetchedBlock;
use crate::reader::ReadError;
use crate::scanner::{deposits_in, ScanError};
use crate::sql;

/// Blocks re-parsed per database round trip.
pub const REPARSE_PAGE_BLOCKS: u64 = 200;

/// What a reparse did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ReparseReport {
    /// Canonical blocks whose payload was re-parsed.
    pub blocks: u64,
    /// Canonical blocks at or above the start whose payload was already pruned.
    pub pruned: u64,
    /// Deposit observations added.
    pub deposits_added: u64,
    /// Spends of outputs we hold added.
    pub spends_added: u64,
}

/// Decodes a stored payload of `chain` at `height`.
pub fn parse_payload(
    chain: Chain,
    network: BtcNetwork,
    height: u64,
    payload: &[u8],
) -> Result<FetchedBlock, ReadError> {
    match chain {
        Chain::Eth => crate::eth::parse_payload(payload),
        Chain::Btc => crate::btc::parse_block(payload, height, network),
    }
}

/// Re-parses every retained canonical block of `chain` from `from_height` up.
pub async fn reparse(
    pool: &Pool,
    chain: Chain,
    network: BtcNetwork,
    from_height: u64,
) -> Result<ReparseReport, ScanError> {
    let client = pool.get().await?;
    let watched = sql::watched_addresses(&client, chain).await?;
    let tokens = sql::registered_tokens(&client).await?;
    let canonical: i64 = client
        .query_one(
            "select count(*) from chain_block where chain = $1 and orphaned_at is null and height >= $2",
            &[&chain.as_str(), &i64::try_from(from_height).expect("BUG: height beyond i64")],
        )
        .await?
        .get(0);
    let mut report = ReparseReport::default();
    let mut next = from_height;
    loop {
        let page = sql::retained_blocks(&client, chain, next, REPARSE_PAGE_BLOCKS).await?;
        let Some((last, _, _)) = page.last() else { break };
        next = last + 1;
        let mut blocks = Vec::with_capacity(page.len());
        for (height, hash, payload) in &page {
            let block = parse_payload(chain, network, *height, payload).map_err(ScanError::Read)?;
            assert_eq!(
                &block.hash.to_string(),
                hash,
                "BUG: retained payload of {chain} block {hash} decodes to another block"
            );
            blocks.push(block);
        }
        let deposits = deposits_in(chain, &blocks, &watched, &tokens);
        report.deposits_added += sql::insert_deposits(&client, chain, &deposits).await?;
        report.spends_added += sql::insert_spends(&client, chain, &blocks).await?;
        report.blocks += blocks.len() as u64;
    }
    report.pruned = u64::try_from(canonical).expect("BUG: negative count") - report.blocks;
    Ok(report)
}

/// What re-parsing every retained payload found against the stored observations.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ObservationCheck {
    /// Retained payloads re-parsed (every standing: canonical and orphaned).
    pub blocks: u64,
    /// Stored observations compared with their block's payload.
    pub observations: u64,
    /// Observations the payloads hold that are not stored (addresses watched after the scan;
    /// `reparse` adds them). Not a difference.
    pub not_stored: u64,
    /// Stored observations their block's payload does not hold, or holds differently.
    pub differences: Vec<String>,
}

/// Re-parses every retained payload of `chain` and compares what it holds for the watched
/// addresses with the stored observations of that block: an observation its own block's bytes do
/// not contain (or contain with another amount, recipient, asset or coinbase flag), or a recorded
/// spend that is not one of its block's inputs, is a difference. Reads only; never writes.
pub async fn verify_observations(
    pool: &Pool,
    chain: Chain,
    network: BtcNetwork,
) -> Result<ObservationCheck, ScanError> {
    let client = pool.get().await?;
    // The network the chain was scanned on, as recorded, decodes its blocks' addresses.
    let network = match sql::chain_identity(&client, chain).await? {
        Some(identity) if chain == Chain::Btc => identity.network.parse().unwrap_or(network),
        _ => network,
    };
    let watched = sql::watched_addresses(&client, chain).await?;
    let tokens = sql::registered_tokens(&client).await?;
    let mut check = ObservationCheck::default();
    let mut after: (i64, String) = (-1, String::new());
    loop {
        let page = client
            .query(
                "select b.height, b.block_hash, r.payload from chain_block b
                   join raw_block r on r.chain = b.chain and r.block_hash = b.block_hash
                  where b.chain = $1 and (b.height, b.block_hash) > ($2, $3)
                  order by b.height, b.block_hash limit $4",
                &[&chain.as_str(), &after.0, &after.1, &i64::try_from(REPARSE_PAGE_BLOCKS).expect("BUG: page size")],
            )
            .await?;
        let Some(last) = page.last() else { break };
        after = (last.get(0), last.get(1));
        let mut blocks = Vec::with_capacity(page.len());
        for row in &page {
            let (height, hash, payload): (i64, String, Vec<u8>) = (row.get(0), row.get(1), row.get(2));
            let height = u64::try_from(height).expect("BUG: a check keeps heights non-negative");
            match parse_payload(chain, network, height, &payload) {
                Ok(block) if block.hash.to_string() == hash => blocks.push(block),
                Ok(block) => check.differences.push(format!(
                    "{chain} block {hash}: its retained payload is block {} at height {height}",
                    block.hash
                )),
                Err(e) => {
                    check.differences.push(format!("{chain} block {hash}: its retained payload does not decode: {e}"))
                }
            }
        }
        check.blocks += blocks.len() as u64;
        let hashes: Vec<String> = blocks.iter().map(|b| b.hash.to_string()).collect();
        let mut derived: std::collections::HashMap<(String, String, String, u32), sql::DepositRow> =
            deposits_in(chain, &blocks, &watched, &tokens)
                .into_iter()
                .map(|d| {
                    ((d.block_hash.to_string(), d.tx_hash.to_string(), d.kind.as_str().to_owned(), d.output_index), d)
                })
                .collect();
        let stored = client
            .query(
                "select block_hash, tx_hash, kind, output_index, address, asset, amount::text, coinbase
                   from deposit_event where chain = $1 and block_hash = any($2)",
                &[&chain.as_str(), &hashes],
            )
            .await?;
        for row in &stored {
            check.observations += 1;
            let (block, tx, kind, index): (String, String, String, i32) =
                (row.get(0), row.get(1), row.get(2), row.get(3));
            let (address, asset, amount, coinbase): (String, String, String, bool) =
                (row.get(4), row.get(5), row.get(6), row.get(7));
            let key = (block.clone(), tx.clone(), kind.clone(), u32::try_from(index).unwrap_or(u32::MAX));
            match derived.remove(&key) {
                None => check.differences.push(format!(
                    "{chain} observation {tx}:{kind}:{index} in block {block} is not in that block's retained payload"
                )),
                Some(d)
                    if (d.address.stored(), d.asset.key(), d.amount.as_str(), d.coinbase)
                        != (address.clone(), asset.clone(), amount.as_str(), coinbase) =>
                {
                    check.differences.push(format!(
                        "{chain} observation {tx}:{kind}:{index} in block {block} says {amount} {asset} to {address}; \
                         the block's payload says {} {} to {}",
                        d.amount,
                        d.asset,
                        d.address.stored()
                    ))
                }
                Some(_) => {}
            }
        }
        check.not_stored += derived.len() as u64;
        // Every stored spend must be an input of its own block's transactions.
        let inputs: std::collections::HashSet<(String, String, u32, String, u32)> = blocks
            .iter()
            .flat_map(|b| {
                b.spends.iter().map(move |s| {
                    (b.hash.to_string(), s.prev_tx.to_string(), s.prev_vout, s.tx_hash.to_string(), s.input_index)
                })
            })
            .collect();
        let spends = client
            .query(
                "select block_hash, tx_hash, output_index, spending_tx, input_index
                   from output_spend where chain = $1 and block_hash = any($2)",
                &[&chain.as_str(), &hashes],
            )
            .await?;
        for row in &spends {
            check.observations += 1;
            let (block, tx, vout, spending, input): (String, String, i32, String, i32) =
                (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
            let key = (
                block.clone(),
                tx.clone(),
                u32::try_from(vout).unwrap_or(u32::MAX),
                spending.clone(),
                u32::try_from(input).unwrap_or(u32::MAX),
            );
            if !inputs.contains(&key) {
                check.differences.push(format!(
                    "{chain} spend of {tx}:{vout} by {spending} input {input} in block {block} is not in that block's \
                     retained payload"
                ));
            }
        }
    }
    Ok(check)
}
