//! Integration tests of the schema and the store against a real PostgreSQL: each test gets its
//! own database cloned from the migrated template.

mod append_only;
mod deposit_addresses;
mod events;
mod ledger;
mod pipeline;
mod privileges;
mod schema;
mod tls;

use tokio_postgres::Client;

/// A valid ETH hash whose hex digits are all `c`.
pub fn eth_hash(c: char) -> String {
    format!("0x{}", c.to_string().repeat(64))
}

/// A valid ETH address whose hex digits are all `c`.
pub fn eth_address(c: char) -> String {
    format!("0x{}", c.to_string().repeat(40))
}

/// Runs `sql` (possibly several statements) and returns the database's error message, panicking
/// if it succeeded.
pub async fn refused(client: &Client, sql: &str) -> String {
    match client.batch_execute(sql).await {
        Ok(()) => panic!("statement was accepted but must be refused: {sql}"),
        Err(e) => e.as_db_error().map(|db| db.message().to_owned()).unwrap_or_else(|| e.to_string()),
    }
}

/// One row in every append-only table, linked the way the service links them.
pub async fn seed_one_of_everything(client: &Client) {
    let block = eth_hash('b');
    let parent = eth_hash('a');
    let tx = eth_hash('d');
    let hot = eth_address('1');
    let user = eth_address('2');
    let rival = eth_hash('9');
    client
        .batch_execute(&format!(
            "insert into chain_block (chain, height, block_hash, parent_hash) values ('eth', 10, '{block}', '{parent}');
             insert into raw_block (chain, block_hash, payload) values ('eth', '{block}', '\\x00ff');
             insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
                  values ('eth', '{block}', '{tx}', 'native', 0, '{user}', 'ETH', 1000);
             insert into account (external_ref) values ('alice');
             insert into wallet_address (chain, address, account_id, valid_from_height)
                  values ('eth', '{user}', (select id from account where external_ref = 'alice'), 0);
             begin;
             insert into ledger_transfer (idempotency_key, kind, deposit_key)
                  values ('deposit:eth:{tx}:native:0:credit:1', 'deposit', 'deposit:eth:{tx}:native:0');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 1000),
                  (currval('ledger_transfer_id_seq'), 'user:1', 'ETH', 'credit', 1000);
             commit;
             insert into reversal_proposal (deposit_key, chain, tx_hash, kind, output_index, transfer_id, ledger_account,
                                            asset, amount, reason)
                  values ('deposit:eth:{tx}:native:0', 'eth', '{tx}', 'native', 0, currval('ledger_transfer_id_seq'),
                          'user:1', 'ETH', 1000, 'test');
             insert into chain_block (chain, height, block_hash, parent_hash) values ('eth', 11, '{rival}', '{block}');
             insert into block_verdict (chain, block_hash, seq, verdict, reason) values ('eth', '{rival}', 1, 'orphaned', 'test');
             insert into chain_identity (chain, network, genesis_hash, chain_id) values ('eth', 'ethereum', '{parent}', 31337);
             insert into reversal_decision (proposal_id, decision, decided_by, reason)
                  values (currval('reversal_proposal_id_seq'), 'rejected', 'carol', 'test');
             insert into withdrawal_event (withdrawal_id, seq, event_type, payload) values (1, 1, 'requested', '{{}}');
             insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', '{hot}', 'a', 1);
             insert into nonce_allocation (chain, from_address, nonce, withdrawal_id) values ('eth', '{hot}', 0, 1);
             insert into withdrawal_attempt (tx_hash, withdrawal_id, chain, from_address, nonce, kind, intent, raw_tx, max_fee, priority_fee)
                  values ('{tx}', 1, 'eth', '{hot}', 0, 'original', 'payout', '\\x02', 100, 1);"
        ))
        .await
        .expect("seeding one row per table");
}
