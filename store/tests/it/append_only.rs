//! Every append-only table rejects UPDATE, DELETE and TRUNCATE even for the schema owner (the
//! triggers; the service role meets a missing privilege first, see `privileges`); the permitted
//! one-time updates work exactly once; raw blocks may be pruned.

use custodian_testkit::TestDb;

use crate::{eth_hash, refused, seed_one_of_everything};

/// Table and a harmless-looking change to one of its columns.
const APPEND_ONLY: &[(&str, &str)] = &[
    ("chain_block", "parent_hash = parent_hash"),
    ("deposit_event", "amount = amount + 1"),
    ("wallet_address", "account_id = account_id"),
    ("ledger_transfer", "kind = 'adjustment'"),
    ("ledger_posting", "amount = amount"),
    ("reversal_proposal", "reason = 'changed'"),
    ("reversal_decision", "decided_by = 'mallory'"),
    ("withdrawal_event", "payload = '{\"x\":1}'"),
    ("nonce_allocation", "withdrawal_id = 2"),
    ("withdrawal_attempt", "max_fee = 200"),
    ("block_verdict", "reason = 'changed'"),
    ("chain_identity", "network = 'changed'"),
];

#[tokio::test]
async fn append_only_tables_reject_update_delete_and_truncate() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    seed_one_of_everything(&client).await;
    for (table, change) in APPEND_ONLY {
        let count: i64 = client.query_one(&format!("select count(*) from {table}"), &[]).await.unwrap().get(0);
        assert!(count >= 1, "{table} should hold the seeded rows");
        let message = refused(&client, &format!("update {table} set {change}")).await;
        assert!(message.starts_with(&format!("append-only table {table}: UPDATE rejected")), "{table}: {message}");
        let message = refused(&client, &format!("delete from {table}")).await;
        assert!(message.starts_with(&format!("append-only table {table}: DELETE rejected")), "{table}: {message}");
        let message = refused(&client, &format!("truncate {table} cascade")).await;
        assert!(message.contains("TRUNCATE rejected"), "{table}: {message}");
        let after: i64 = client.query_one(&format!("select count(*) from {table}"), &[]).await.unwrap().get(0);
        assert_eq!(after, count, "{table} lost rows");
    }
}

#[tokio::test]
async fn a_blocks_standing_changes_only_through_its_verdicts_and_can_come_back() {
    let db = TestDb::new().await;
    let owner = db.owner_client().await;
    seed_one_of_everything(&owner).await;
    let block = eth_hash('b');
    async fn standing(client: &tokio_postgres::Client) -> bool {
        client
            .query_one("select orphaned_at is not null from chain_block where block_hash = $1", &[&eth_hash('b')])
            .await
            .unwrap()
            .get(0)
    }
    // Not even the owner sets the projection without a verdict.
    let message =
        refused(&owner, &format!("update chain_block set orphaned_at = now() where block_hash = '{block}'")).await;
    assert!(message.contains("must reflect the latest block_verdict"), "{message}");
    // The rival at the same height (orphaned by the seed) must not be canonical twice over.
    assert!(!standing(&owner).await);

    // The service appends verdicts; the projection follows in the same statement.
    let app = db.pool.get().await.unwrap();
    let verdict = |seq: i32, verdict: &'static str| {
        format!("insert into block_verdict (chain, block_hash, seq, verdict, reason) values ('eth', '{block}', {seq}, '{verdict}', 'test')")
    };
    app.batch_execute(&verdict(1, "orphaned")).await.expect("an orphaned verdict");
    assert!(standing(&owner).await);
    let message =
        refused(&owner, &format!("update chain_block set orphaned_at = null where block_hash = '{block}'")).await;
    assert!(message.contains("must reflect the latest block_verdict"), "un-orphaning without a verdict: {message}");
    app.batch_execute(&verdict(2, "reinstated")).await.expect("the block comes back");
    assert!(!standing(&owner).await);
    app.batch_execute(&verdict(3, "orphaned")).await.expect("and may be orphaned again");
    assert!(standing(&owner).await);
    let message = app.batch_execute(&verdict(3, "reinstated")).await.expect_err("a verdict's seq is unique");
    assert!(message.as_db_error().unwrap().message().contains("duplicate key"), "{message}");

    // The service cannot touch chain_block itself, and nobody changes another column.
    let denied = app
        .batch_execute(&format!("update chain_block set orphaned_at = null where block_hash = '{block}'"))
        .await
        .expect_err("the service has no update privilege on chain_block");
    assert!(denied.as_db_error().unwrap().message().contains("permission denied"), "{denied}");
    let message = refused(
        &owner,
        &format!("update chain_block set orphaned_at = null, height = 11 where block_hash = '{}'", eth_hash('b')),
    )
    .await;
    assert!(message.contains("UPDATE rejected"), "{message}");
    let height: i64 =
        owner.query_one("select height from chain_block where block_hash = $1", &[&block]).await.unwrap().get(0);
    assert_eq!(height, 10);
}

#[tokio::test]
async fn an_orphan_mark_together_with_another_change_is_refused() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    seed_one_of_everything(&client).await;
    let message =
        refused(&client, &format!("update chain_block set orphaned_at = now(), parent_hash = '{}'", eth_hash('e')))
            .await;
    assert!(message.contains("UPDATE rejected"), "{message}");
}

#[tokio::test]
async fn an_ownership_range_can_be_closed_once() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    seed_one_of_everything(&client).await;
    assert_eq!(client.execute("update wallet_address set valid_to_height = 50", &[]).await.unwrap(), 1);
    let message = refused(&client, "update wallet_address set valid_to_height = 60").await;
    assert!(message.contains("UPDATE rejected"), "{message}");
}

#[tokio::test]
async fn raw_blocks_may_be_pruned_but_never_changed() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    seed_one_of_everything(&client).await;
    let message = refused(&client, "update raw_block set payload = '\\x01'").await;
    assert!(message.starts_with("append-only table raw_block: UPDATE rejected"), "{message}");
    let message = refused(&client, "truncate raw_block").await;
    assert!(message.contains("TRUNCATE rejected"), "{message}");
    assert_eq!(client.execute("delete from raw_block", &[]).await.expect("pruning is allowed"), 1);
    let blocks: i64 = client.query_one("select count(*) from chain_block", &[]).await.unwrap().get(0);
    assert_eq!(blocks, 2, "pruning raw bytes keeps the block observations");
}
