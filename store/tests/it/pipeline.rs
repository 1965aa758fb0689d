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

/// Each produced write goes to the server when it is made, not when the producer is done: the
/// server runs one while the producer makes the next (the BTC worker signs a batch while the one
/// before it is stored). The producer here blocks its thread as signing does, 200 ms per write
/// after the first, on the multi-threaded runtime the service runs; the server stamps each write
/// with its own clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_produced_write_reaches_the_server_while_the_next_is_made() {
    let db = seeded().await;
    let client = db.pool.get().await.expect("pooled");
    let (lock, stamp) = (
        client.prepare_cached(LOCK).await.expect("prepare"),
        client
            .prepare_cached(
                "insert into account (external_ref)
                 values ($1::text || '@' || (extract(epoch from clock_timestamp()) * 1000000)::bigint)",
            )
            .await
            .expect("prepare"),
    );
    // Spawned, as the service runs its workers: a task on a worker thread, where a task it wakes
    // (the connection's) waits for it to yield.
    let (affected, last_made_at) = tokio::spawn(async move {
        let (tx, _) = Pipelined::begin_with(client, &lock, &[&1i64]).await.expect("begin");
        let mut made = 0;
        let mut last_made_at = None;
        let next = || {
            if made == 3 {
                return custodian_store::pipeline::Produced::Done;
            }
            if made > 0 {
                std::thread::sleep(Duration::from_millis(200));
            }
            made += 1;
            last_made_at = Some(std::time::SystemTime::now());
            let params: custodian_store::pipeline::OwnedParams = vec![Box::new(format!("w{made}"))];
            custodian_store::pipeline::Produced::Write(params)
        };
        let affected = tx.commit_produced(&stamp, next, &[]).await.expect("commit");
        (affected, last_made_at)
    })
    .await
    .expect("the task ran");
    assert_eq!(affected, Some(vec![1, 1, 1]));
    let last_made_at = last_made_at.expect("three writes made").duration_since(std::time::UNIX_EPOCH).expect("clock");
    let stamps: Vec<u128> = accounts(&db)
        .await
        .iter()
        .filter_map(|r| r.split_once('@').map(|(_, micros)| micros.parse().expect("stamp")))
        .collect();
    assert_eq!(stamps.len(), 3, "{stamps:?}");
    let ran_before_last = last_made_at.as_micros().saturating_sub(stamps[0]);
    assert!(
        ran_before_last >= 300_000,
        "the first write ran {ran_before_last} µs before the last was made, not while the other two were made (400 ms)"
    );
}
