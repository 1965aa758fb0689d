//! Deposit observations with their block, confirmations and attribution, as operators list them.

use alloy_primitives::U256;
use custodian_domain::{AccountId, Amount, Asset, BlockHash, Chain, ChainAddress, TxHash};
use deadpool_postgres::GenericClient;
use serde::Serialize;

/// Observations listed per call, newest first.
pub const MAX_LISTED: i64 = 10_000;

/// One deposit observation as read from the `deposit_status` view.
#[derive(Debug, Clone, Serialize)]
pub struct DepositView {
    /// Observation id.
    pub id: i64,
    /// Chain.
    pub chain: Chain,
    /// Transaction hash.
    pub tx_hash: TxHash,
    /// Where in the transaction: `native`, `log`, `internal`, `output`.
    pub kind: String,
    /// Stable index within the transaction for that kind.
    pub output_index: i32,
    /// The key every posting of this money is made under.
    pub deposit_key: String,
    /// Block the observation belongs to.
    pub block_hash: BlockHash,
    /// Its height.
    pub height: i64,
    /// Recipient.
    pub address: ChainAddress,
    /// What moved.
    pub asset: Asset,
    /// Asset symbol.
    pub symbol: String,
    /// Smallest units.
    pub amount: Amount,
    /// Whole units, for people.
    pub amount_display: String,
    /// Owner at the block's height (none for an address unassigned at that height).
    pub account_id: Option<AccountId>,
    /// Owner's reference.
    pub account_ref: Option<String>,
    /// The block was retracted by a reorg.
    pub orphaned: bool,
    /// Blocks on top of it, counting its own (0 when orphaned).
    pub confirmations: i64,
    /// What the confirmation policy asks for this amount.
    pub required_confirmations: Option<i32>,
    /// Enough confirmations on a non-orphaned block.
    pub confirmed: bool,
    /// The ledger holds money under the key now (credited and not reversed).
    pub posted: bool,
    /// First credit under the key, smallest units.
    pub credited: Amount,
    /// Taken back under the key (approved reversals and booked losses).
    pub reversed: Amount,
    /// Credited again after a reversal.
    pub recredited: Amount,
}

const LIST: &str = "
select d.id, d.chain, d.tx_hash, d.output_index, d.block_hash, d.height, d.address, d.asset, a.symbol,
       a.decimals, d.amount, d.account_id, acc.external_ref, d.orphaned, d.confirmations,
       d.required_confirmations, d.confirmed, d.posted, d.kind, d.deposit_key,
       d.credited, d.reversed, d.recredited
  from deposit_status d
  join asset a on a.asset = d.asset
  left join account acc on acc.id = d.account_id
 where ($1::bigint is null or d.account_id = $1)
   and ($2::text is null or d.chain = $2)
   and ($4::bigint is null or d.id < $4)
 order by d.id desc
 limit $3";

/// Lists observations, optionally for one account and one chain, newest first, at most `limit`
/// (clamped to 1..=[`MAX_LISTED`]) with ids below `before`: the next page starts before the last
/// id of this one.
pub async fn list<C: GenericClient>(
    client: &C,
    account_id: Option<i64>,
    chain: Option<Chain>,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<DepositView>, tokio_postgres::Error> {
    let chain = chain.map(Chain::as_str);
    let rows = client.query(LIST, &[&account_id, &chain, &limit.clamp(1, MAX_LISTED), &before]).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let decimals = u8::try_from(r.get::<_, i16>(9)).expect("BUG: decimals outside 0..=77");
            let amount = Amount::from_units(r.get::<_, U256>(10));
            let chain: Chain = r.get::<_, &str>(1).parse().expect("BUG: deposit_event.chain is checked by the table");
            let checked = "BUG: deposit_event's columns are checked by the table";
            DepositView {
                id: r.get(0),
                chain,
                tx_hash: TxHash::parse(chain, r.get(2)).expect(checked),
                kind: r.get(18),
                output_index: r.get(3),
                deposit_key: r.get(19),
                block_hash: BlockHash::parse(chain, r.get(4)).expect(checked),
                height: r.get(5),
                address: ChainAddress::parse_stored(r.get(6)).expect(checked),
                asset: Asset::parse_key(r.get(7)).expect(checked),
                symbol: r.get(8),
                amount,
                amount_display: amount.to_decimal_string(decimals),
                account_id: r.get::<_, Option<i64>>(11).map(AccountId::new),
                account_ref: r.get(12),
                orphaned: r.get(13),
                confirmations: r.get::<_, Option<i64>>(14).unwrap_or(0),
                required_confirmations: r.get(15),
                confirmed: r.get(16),
                posted: r.get(17),
                credited: Amount::from_units(r.get::<_, U256>(20)),
                reversed: Amount::from_units(r.get::<_, U256>(21)),
                recredited: Amount::from_units(r.get::<_, U256>(22)),
            }
        })
        .collect())
}
