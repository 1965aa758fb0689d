//! Double-entry at commit, ownership ranges, nonce allocation and numeric(78,0).

use alloy_primitives::U256;
use custodian_testkit::db::column;
use custodian_testkit::TestDb;

use crate::{eth_address, refused, seed_one_of_everything};

#[tokio::test]
async fn an_unbalanced_transfer_is_rejected_at_commit_and_a_balanced_one_accepted() {
    let db = TestDb::new().await;
    let mut client = db.client().await;

    // The postings are accepted one by one; the deferred trigger refuses the whole at commit.
    let tx = client.transaction().await.unwrap();
    tx.batch_execute(
        "insert into ledger_transfer (idempotency_key, kind) values ('adj:1', 'adjustment');
         insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
             (currval('ledger_transfer_id_seq'), 'treasury', 'ETH', 'debit', 100),
             (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'credit', 99);",
    )
    .await
    .expect("statements inside the transaction are accepted until commit");
    let error = tx.commit().await.expect_err("commit must refuse an unbalanced transfer");
    let db_error = error.as_db_error().expect("a database error");
    assert_eq!(db_error.code().code(), "23514");
    assert!(db_error.message().contains("does not balance for asset ETH"), "{}", db_error.message());

    // Balanced per asset, but unbalanced in another asset, is refused too.
    let message = refused(
        &client,
        "begin;
         insert into ledger_transfer (idempotency_key, kind) values ('adj:2', 'adjustment');
         insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
             (currval('ledger_transfer_id_seq'), 'treasury', 'ETH', 'debit', 100),
             (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'credit', 100),
             (currval('ledger_transfer_id_seq'), 'treasury', 'BTC', 'debit', 5);
         commit;",
    )
    .await;
    assert!(message.contains("does not balance for asset BTC"), "{message}");
    client.batch_execute("rollback").await.ok();

    // A transfer without postings is refused.
    let message =
        refused(&client, "insert into ledger_transfer (idempotency_key, kind) values ('adj:3', 'adjustment')").await;
    assert!(message.contains("has no postings"), "{message}");

    let tx = client.transaction().await.unwrap();
    tx.batch_execute(
        "insert into ledger_transfer (idempotency_key, kind) values ('adj:4', 'adjustment');
         insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
             (currval('ledger_transfer_id_seq'), 'treasury', 'ETH', 'debit', 100),
             (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'credit', 60),
             (currval('ledger_transfer_id_seq'), 'network_fees', 'ETH', 'credit', 40);",
    )
    .await
    .unwrap();
    tx.commit().await.expect("a balanced transfer commits");
    let transfers: Vec<String> = column(&client, "select idempotency_key from ledger_transfer", &[]).await;
    assert_eq!(transfers, ["adj:4"], "only the balanced transfer exists");
}

#[tokio::test]
async fn overlapping_ownership_is_rejected_and_adjacent_ranges_accepted() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let address = eth_address('7');
    client
        .batch_execute(&format!(
            "insert into account (external_ref) values ('old'), ('new');
             insert into wallet_address (chain, address, account_id, valid_from_height, valid_to_height)
                 values ('eth', '{address}', 1, 0, 100);"
        ))
        .await
        .unwrap();
    for (from, to) in [("50", "150"), ("99", "null"), ("1", "2"), ("10", "20")] {
        let message = refused(
            &client,
            &format!(
                "insert into wallet_address (chain, address, account_id, valid_from_height, valid_to_height)
                 values ('eth', '{address}', 2, {from}, {to})"
            ),
        )
        .await;
        assert!(message.contains("wallet_address_no_overlap"), "[{from}, {to}): {message}");
    }
    client
        .batch_execute(&format!(
            "insert into wallet_address (chain, address, account_id, valid_from_height) values ('eth', '{address}', 2, 100)"
        ))
        .await
        .expect("a range starting where the previous one ends is accepted");
    let owners: i64 =
        client.query_one("select count(*) from wallet_address where address = $1", &[&address]).await.unwrap().get(0);
    assert_eq!(owners, 2);
}

#[tokio::test]
async fn a_nonce_cannot_be_allocated_twice() {
    let db = TestDb::new().await;
    let client = db.client().await;
    seed_one_of_everything(&client).await;
    let hot = eth_address('1');
    let message = refused(
        &client,
        &format!(
            "insert into nonce_allocation (chain, from_address, nonce, withdrawal_id) values ('eth', '{hot}', 0, 2)"
        ),
    )
    .await;
    assert!(message.contains("nonce_allocation_pkey"), "{message}");
    client
        .batch_execute(&format!(
            "insert into nonce_allocation (chain, from_address, nonce, withdrawal_id) values ('eth', '{hot}', 1, 2)"
        ))
        .await
        .expect("the next nonce is free");
}

#[tokio::test]
async fn u256_max_round_trips_through_numeric_78_0() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for value in [U256::ZERO, U256::from(1u8), U256::from(u64::MAX), U256::from(u128::MAX), U256::MAX] {
        let back: U256 = client.query_one("select $1::numeric(78,0)", &[&value]).await.unwrap().get(0);
        assert_eq!(back, value);
    }
    client
        .batch_execute(&format!(
            "insert into account (external_ref) values ('whale');
             begin;
             insert into ledger_transfer (idempotency_key, kind) values ('adj:max', 'adjustment');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                 (currval('ledger_transfer_id_seq'), 'treasury', 'ETH', 'debit', {max}),
                 (currval('ledger_transfer_id_seq'), 'user:1', 'ETH', 'credit', {max});
             commit;",
            max = U256::MAX
        ))
        .await
        .expect("U256::MAX fits a posting");
    let stored: U256 =
        client.query_one("select amount from ledger_posting where direction = 'credit'", &[]).await.unwrap().get(0);
    assert_eq!(stored, U256::MAX);
    let too_big = client.query_one("select (2::numeric ^ 256)::numeric(80,0)", &[]).await.unwrap();
    assert!(too_big.try_get::<_, U256>(0).is_err(), "2^256 must not silently wrap into a U256");
}

#[tokio::test]
async fn the_ledger_writer_writes_a_key_once_and_available_follows_the_postings() {
    use custodian_domain::{Amount, LedgerAccount};
    use custodian_store::ledger::{self, Direction, Posting, Transfer};
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let account: i64 =
        client.query_one("insert into account (external_ref) values ('w') returning id", &[]).await.unwrap().get(0);
    assert_eq!(ledger::available(&client, account, "ETH").await.unwrap().to_string(), "0", "no row is zero");
    let leg = |account, direction, units| Posting {
        account,
        asset: "ETH".into(),
        direction,
        amount: Amount::from_u64(units),
    };
    let credit = |key: &str, units| {
        Transfer::new(
            key,
            "adjustment",
            serde_json::json!({ "why": key }),
            vec![
                leg(LedgerAccount::Treasury, Direction::Debit, units),
                leg(LedgerAccount::User(account), Direction::Credit, units),
            ],
        )
        .unwrap()
    };
    let written = ledger::write(&client, &[credit("adj:a", 70), credit("adj:b", 5)]).await.unwrap();
    assert_eq!(written.len(), 2);
    assert_eq!(ledger::available(&client, account, "ETH").await.unwrap().to_string(), "75");
    // The same keys again (a retried pass): nothing is written, postings included.
    assert!(ledger::write(&client, &[credit("adj:a", 70)]).await.unwrap().is_empty());
    let postings: i64 = client.query_one("select count(*) from ledger_posting", &[]).await.unwrap().get(0);
    assert_eq!(postings, 4);
    let back = Transfer::moving(
        "adj:c",
        "adjustment",
        serde_json::Value::Null,
        (LedgerAccount::User(account), LedgerAccount::Treasury),
        "ETH",
        Amount::from_u64(80),
    )
    .unwrap();
    ledger::write(&client, &[back]).await.unwrap();
    assert_eq!(ledger::available(&client, account, "ETH").await.unwrap().to_string(), "-5");
    let reference: serde_json::Value = client
        .query_one("select reference from ledger_transfer where idempotency_key = 'adj:b'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(reference, serde_json::json!({ "why": "adj:b" }));
}
