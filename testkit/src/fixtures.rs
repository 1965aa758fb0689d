//! Shared fixtures for tests that need money or keys without being about how they arrive.

use bitcoin::hashes::{hmac, sha512, Hash, HashEngine};

/// BIP-39 seed of a mnemonic with an empty passphrase: PBKDF2-HMAC-SHA512, 2048 rounds, salt
/// "mnemonic", one 64-byte block.
pub fn bip39_seed(mnemonic: &str) -> [u8; 64] {
    let prf = |parts: &[&[u8]]| {
        let mut engine = hmac::HmacEngine::<sha512::Hash>::new(mnemonic.as_bytes());
        for part in parts {
            engine.input(part);
        }
        hmac::Hmac::<sha512::Hash>::from_engine(engine).to_byte_array()
    };
    let mut block = prf(&[b"mnemonic", &1u32.to_be_bytes()]);
    let mut seed = block;
    for _ in 1..2048 {
        block = prf(&[&block]);
        seed.iter_mut().zip(block).for_each(|(s, b)| *s ^= b);
    }
    seed
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
