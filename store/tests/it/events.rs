//! Appending withdrawal events with an expected sequence.

use std::sync::Arc;

use custodian_store::{append_withdrawal_event, AppendError};
use custodian_testkit::db::column;
use custodian_testkit::TestDb;
use serde_json::json;

use crate::refused;

#[tokio::test]
async fn events_append_in_sequence_and_a_stale_writer_gets_a_conflict() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let first = append_withdrawal_event(&client, 7, 0, "requested", &json!({"amount": "5"})).await.unwrap();
    let second = append_withdrawal_event(&client, 7, 1, "signed", &json!({})).await.unwrap();
    assert!(second > first, "global positions increase");
    for stale in [0, 1, 5] {
        match append_withdrawal_event(&client, 7, stale, "broadcast", &json!({})).await {
            Err(AppendError::Conflict { withdrawal_id: 7, expected_seq }) => assert_eq!(expected_seq, stale),
            other => panic!("expected a conflict at {stale}, got {other:?}"),
        }
    }
    let seqs: Vec<i32> =
        column(&client, "select seq from withdrawal_event where withdrawal_id = 7 order by seq", &[]).await;
    assert_eq!(seqs, [1, 2]);
}

#[tokio::test]
async fn a_duplicate_sequence_number_is_rejected_by_the_primary_key() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into withdrawal_event (withdrawal_id, seq, event_type, payload) values (1, 1, 'requested', '{}')",
        )
        .await
        .unwrap();
    let message = refused(
        &client,
        "insert into withdrawal_event (withdrawal_id, seq, event_type, payload) values (1, 1, 'cancelled', '{}')",
    )
    .await;
    assert!(message.contains("withdrawal_event_pkey"), "{message}");
}

#[tokio::test]
async fn two_concurrent_appends_at_the_same_sequence_one_wins() {
    let db = TestDb::new().await;
    for round in 0..10i64 {
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let writers = (0..2).map(|writer| {
            let (pool, barrier) = (db.pool.clone(), barrier.clone());
            tokio::spawn(async move {
                let mut client = pool.get().await.unwrap();
                let tx = client.transaction().await.unwrap();
                barrier.wait().await;
                let outcome = append_withdrawal_event(&tx, round, 0, "requested", &json!({ "writer": writer })).await;
                match outcome {
                    Ok(_) => tx.commit().await.map(|()| true).map_err(|e| e.to_string()),
                    Err(AppendError::Conflict { .. }) => Ok(false),
                    Err(other) => Err(other.to_string()),
                }
            })
        });
        let mut wins = 0;
        for writer in writers.collect::<Vec<_>>() {
            if writer.await.unwrap().expect("only a typed conflict may stop a writer") {
                wins += 1;
            }
        }
        assert_eq!(wins, 1, "round {round}: exactly one writer appends");
        let client = db.pool.get().await.unwrap();
        let events: i64 = client
            .query_one("select count(*) from withdrawal_event where withdrawal_id = $1", &[&round])
            .await
            .unwrap()
            .get(0);
        assert_eq!(events, 1);
    }
}
