//! The pipelined transaction: committed only when every statement and the commit succeed, and
//! never handed back to the pool while still open.

use std::time::{Duration, Instant};

use custodian_store::Pipelined;
use custodian_testkit::TestDb;
use tokio_postgres::Statement;

const LOCK: &str = "select id from account where id = $1 for update";
const ADD: &str = "insert into account (external_ref) values ($1)";

async fn accounts(db: &TestDb) -> Vec<String> {
    let client = db.client().await;
    let rows =
        client.query("select external_ref from account where not treasury order by id", &[]).await.expect("read");
    rows.iter().map(|r| r.get(0)).collect()
}

async fn seeded() -> TestDb {
    let db = TestDb::new().await;
    db.client().await.batch_execute("insert into account (external_ref) values ('locked')").await.expect("seed");
    db
}

/// A pipelined transaction on a pooled connection, holding the seeded row; and the insert.
async fn begin(db: &TestDb) -> (Pipelined, Vec<tokio_postgres::Row>, Statement) {
    let client = db.pool.get().await.expect("pooled");
    let (lock, add) =
        (client.prepare_cached(LOCK).await.expect("prepare"), client.prepare_cached(ADD).await.expect("prepare"));
    let (tx, rows) = Pipelined::begin_with(client, &lock, &[&1i64]).await.expect("begin");
    (tx, rows, add)
}

#[tokio::test]
async fn commits_every_statement_and_returns_the_connection_to_the_pool() {
    let db = seeded().await;
    let (tx, rows, add) = begin(&db).await;
    assert_eq!(rows.len(), 1, "the locked row comes back");
    let affected = tx.commit_with(&[(&add, &[&"a"]), (&add, &[&"b"])]).await.expect("commit");
    assert_eq!(affected, vec![1, 1]);
    assert_eq!(accounts(&db).await, ["locked", "a", "b"]);
    let status = db.pool.status();
    assert_eq!((status.size, status.available), (1, 1), "the connection went back to the pool, idle");
    let other = db.client().await;
    let rows = other.query("select id from account where id = 1 for update nowait", &[]).await.expect("lock released");
    assert_eq!(rows.len(), 1);
}

#[tokio::test]
async fn a_failing_statement_commits_nothing() {
    let db = seeded().await;
    let (tx, _, add) = begin(&db).await;
    // The second insert repeats the first's unique external_ref.
    let error = tx.commit_with(&[(&add, &[&"a"]), (&add, &[&"a"]), (&add, &[&"c"])]).await.expect_err("refused");
    assert!(custodian_store::is_unique_violation(&error, None), "{error}");
    assert_eq!(accounts(&db).await, ["locked"], "the first insert was rolled back with the rest");
}

#[tokio::test]
async fn dropped_midway_it_closes_the_connection_and_releases_the_lock() {
    let db = seeded().await;
    let (tx, _, _) = begin(&db).await;
    let other = db.client().await;
    let held = other.query("select id from account where id = 1 for update nowait", &[]).await;
    assert!(held.is_err(), "the row is locked while the transaction is open");
    drop(tx);
    assert_eq!(db.pool.status().size, 0, "the open connection was not pooled");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match other.query("select id from account where id = 1 for update nowait", &[]).await {
            Ok(rows) => {
                assert_eq!(rows.len(), 1);
                break;
            }
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("the lock was never released: {e}"),
        }
    }
}

#[tokio::test]
async fn reads_run_with_generic_plans_inside_their_own_transaction_only() {
    let db = seeded().await;
    let client = db.pool.get().await.expect("pooled");
    let (mode, lock) = (
        client.prepare_cached("select current_setting('plan_cache_mode')").await.expect("prepare"),
        client.prepare_cached(LOCK).await.expect("prepare"),
    );
    let rows = Pipelined::read_generic(&client, &[(&mode, &[]), (&lock, &[&1i64])]).await.expect("read");
    assert_eq!(rows[0][0].get::<_, String>(0), "force_generic_plan");
    assert_eq!(rows[1].len(), 1, "the second read is answered too");
    let after = client.query_one(&mode, &[]).await.expect("read after");
    assert_eq!(after.get::<_, String>(0), "auto", "the setting ended with the transaction");
    // The transaction committed: the row lock taken inside it is free.
    let other = db.client().await;
    other.query("select id from account where id = 1 for update nowait", &[]).await.expect("lock released");
    // A failing read leaves the connection outside a transaction.
    let pid: i32 = client.query_one("select pg_backend_pid()", &[]).await.expect("pid").get(0);
    let bad = client.prepare_cached("select 1 / (0 * $1::int)").await.expect("prepare");
    Pipelined::read_generic(&client, &[(&bad, &[&1i32])]).await.expect_err("division by zero");
    let state = other.query_one("select state from pg_stat_activity where pid = $1", &[&pid]).await.expect("state");
    assert_eq!(state.get::<_, String>(0), "idle", "no transaction was left open");
}
