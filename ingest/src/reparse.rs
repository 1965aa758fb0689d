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
            assert_eq!(&block.hash, hash, "BUG: retained payload of {chain} block {hash} decodes to another block");
            blocks.push(block);
        }
        let deposits = deposits_in(chain, &blocks, &watched, &tokens);
        report.deposits_added += sql::insert_deposits(&client, chain, &deposits).await?;
        report.blocks += blocks.len() as u64;
    }
    report.pruned = u64::try_from(canonical).expect("BUG: negative count") - report.blocks;
    Ok(report)
}
