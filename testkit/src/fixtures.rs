//! Shared fixtures for tests that need money or keys without being about how they arrive.

pub use crate::bip39::bip39_seed;

/// The side of its postings a ledger account's balance grows on: credit for what we owe (customers,
/// the treasury), debit for what we hold (custody).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Normal {
    /// Credits less debits.
    Credit,
    /// Debits less credits.
    Debit,
}

/// The balance of `ledger_account` in `asset` summed from its postings, on its `normal` side, as
/// text (`0` when it has none).
pub async fn posted_balance(
    client: &tokio_postgres::Client,
    ledger_account: &str,
    asset: &str,
    normal: Normal,
) -> String {
    let side = match normal {
        Normal::Credit => "credit",
        Normal::Debit => "debit",
    };
    client
        .query_one(
            "select coalesce(sum(case direction when $3 then amount else -amount end), 0)::text
               from ledger_posting where ledger_account = $1 and asset = $2",
            &[&ledger_account, &asset, &side],
        )
        .await
        .expect("reading a ledger account's postings")
        .get(0)
}

/// A lane's queue behind a long history, with statistics that still call it long: 2,200
/// withdrawals of `lane` (`chain`, `asset`, paying `amount` to `destination`) written by one
/// request transaction (one `requested_at`, so the queue is in id order), analysed while 2,000 of
/// them were requested, then all but the last 50 (ids 2,151–2,200) signed. Written as the owner.
pub async fn stale_requested_queue(
    owner: &tokio_postgres::Client,
    (chain, asset): (&str, &str),
    lane: &str,
    destination: &str,
    amount: u64,
) {
    owner
        .batch_execute(&format!(
            "insert into withdrawal (id, external_id, chain, asset, destination, amount, state, lane, last_seq)
             select n, 'q' || n, '{chain}', '{asset}', '{destination}', {amount},
                    case when n <= 200 then 'signed' else 'requested' end, '{lane}', 1
               from generate_series(1, 2200) n;
             analyze withdrawal;
             update withdrawal set state = 'signed' where id <= 2150;"
        ))
        .await
        .expect("writing a stale requested queue");
}

/// Credits `account` with `wei` of ETH by a deposit fact (block, observation, owned address) and
/// its posted transfer, exactly as the posting pass would, so `replay --verify` traces it. `n`
/// keeps several credits of one account apart.
pub async fn credit_eth(client: &tokio_postgres::Client, account: i64, n: u32, wei: u128) {
    credit_asset(client, account, n, "ETH", wei).await;
}

/// [`credit_eth`] for any ETH-chain asset: ether (`ETH`, a native observation) or a registered
/// token (`eth:0x…`, a log observation).
pub async fn credit_asset(client: &tokio_postgres::Client, account: i64, n: u32, asset: &str, units: u128) {
    let seed = u64::try_from(account).expect("account ids are positive") * 1000 + u64::from(n);
    let address = format!("0x{:040x}", 0xdead_0000_0000u64 + seed);
    let block = format!("0x{:064x}", 0xb10c_0000_0000u64 + seed);
    let tx = format!("0x{:064x}", 0x7e57_0000_0000u64 + seed);
    let kind = if asset == "ETH" { "native" } else { "log" };
    client
        .batch_execute(&format!(
            "insert into wallet_address (chain, address, account_id) values ('eth', '{address}', {account});
             insert into chain_block (chain, height, block_hash, parent_hash)
                  values ('eth', {seed} + 1000000, '{block}', '{block}');
             insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
                  values ('eth', '{block}', '{tx}', '{kind}', 0, '{address}', '{asset}', {units});
             begin;
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  values ('deposit:eth:{tx}:{kind}:0:credit:1', 'deposit', 'deposit:eth:{tx}:{kind}:0',
                  jsonb_build_object('chain', 'eth', 'tx_hash', '{tx}', 'kind', '{kind}', 'output_index', 0,
                                     'block_hash', '{block}'));
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', '{asset}', 'debit', {units}),
                  (currval('ledger_transfer_id_seq'), 'user:{account}', '{asset}', 'credit', {units});
             commit;"
        ))
        .await
        .expect("credit the account");
}
