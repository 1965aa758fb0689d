//! Ledger and projections: confirmation tiers, posting, reversals, ownership changes, replay.

use bitcoin::Amount as Sats;
use custodian_api::tokens::Scope;
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::TestDb;
use serde_json::json;

use crate::harness::{custodian, custodian_as};
use crate::ledger_support::{available, new_account, scan_and_post};

#[tokio::test]
async fn a_deep_reorg_after_posting_is_proposed_and_reversed_only_on_approval() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 8);
    let alice = new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(2);
    let small = sim.pay(&[(address.clone(), Sats::from_sat(5_000_000))]); // 0.05 BTC: 1 confirmation
    sim.mine(&[small]);
    sim.mine_empty(1);
    assert_eq!(scan_and_post(&db, &sim).await.posted, 1);
    assert_eq!(available(&db, alice).await, "5000000");

    sim.reorg(3, &[vec![], vec![], vec![], vec![]]);
    let report = scan_and_post(&db, &sim).await;
    assert_eq!(report.reversals_proposed, 1);
    assert_eq!(available(&db, alice).await, "5000000", "nothing is debited automatically");
    assert_eq!(scan_and_post(&db, &sim).await.reversals_proposed, 0, "proposed once");

    let url = db.url.expose();
    let carol = crate::harness::token(&db, "carol", &[Scope::Approve]).await;
    let dave = crate::harness::token(&db, "dave", &[Scope::Approve, Scope::Admin]).await;
    let erin = crate::harness::token(&db, "erin", &[Scope::Approve]).await;
    let reader = crate::harness::token(&db, "reporting", &[Scope::Read, Scope::Admin]).await;
    let listed = custodian(url, &["reversals", "list", "--json"]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let id = listed.json()[0]["id"].as_i64().unwrap();
    assert_eq!(listed.json()[0]["decision"], serde_json::Value::Null);
    let anonymous = custodian(url, &["reversals", "approve", "--id", &id.to_string()]);
    assert_eq!(anonymous.code, 2, "{}", anonymous.stderr);
    assert!(anonymous.stderr.contains("CUSTODIAN_TOKEN"), "{}", anonymous.stderr);
    let unscoped = custodian_as(url, &reader, &["reversals", "approve", "--id", &id.to_string()]);
    assert_eq!(unscoped.code, 2, "admin alone does not decide: {}", unscoped.stderr);
    assert!(unscoped.stderr.contains("needs the approve scope"), "{}", unscoped.stderr);
    let forged =
        custodian_as(url, &format!("cust_{}", "0".repeat(64)), &["reversals", "approve", "--id", &id.to_string()]);
    assert_eq!(forged.code, 2, "{}", forged.stderr);
    assert!(forged.stderr.contains("not a known API token"), "{}", forged.stderr);

    let approved = custodian_as(url, &carol, &["reversals", "approve", "--id", &id.to_string(), "--json"]);
    assert_eq!(approved.code, 0, "{}", approved.stderr);
    assert_eq!(approved.json()["recorded_now"], true);
    assert_eq!(approved.json()["proposal"]["decided_by"], "carol");
    assert_eq!(available(&db, alice).await, "0");
    let again = custodian_as(url, &dave, &["reversals", "approve", "--id", &id.to_string(), "--json"]);
    assert_eq!((again.code, again.json()["recorded_now"].clone()), (0, json!(false)));
    assert_eq!(again.json()["proposal"]["decided_by"], "carol", "the first decision stands");
    let rejected = custodian_as(url, &erin, &["reversals", "reject", "--id", &id.to_string(), "--reason", "late"]);
    assert_eq!(rejected.code, 2, "{}", rejected.stderr);
    let client = db.pool.get().await.unwrap();
    let reversals: i64 =
        client.query_one("select count(*) from ledger_transfer where kind = 'reversal'", &[]).await.unwrap().get(0);
    assert_eq!(reversals, 1, "exactly one compensating transfer");
    let verified = custodian(url, &["replay", "--verify", "--json"]);
    assert_eq!(verified.code, 0, "{}", verified.stdout);
}

#[tokio::test]
async fn a_row_without_its_source_fact_makes_replay_verify_exit_3_and_name_it() {
    let db = TestDb::new().await;
    let url = db.url.expose();
    let clean = custodian(url, &["replay", "--verify"]);
    assert_eq!(clean.code, 0, "{}{}", clean.stdout, clean.stderr);

    let client = db.superuser_client().await;
    client
        .batch_execute(
            "insert into withdrawal (id, external_id, chain, asset, destination, amount, state, last_seq)
             values (4242, 'slipped', 'eth', 'ETH', '0x5aaeb6053f3e94c9b9a09f33669435e7ef1beaed', 5, 'requested', 1)",
        )
        .await
        .unwrap();
    let run = custodian(url, &["replay", "--verify"]);
    assert_eq!(run.code, 3, "{}", run.stdout);
    assert!(
        run.stdout.contains("live withdrawal row not rebuilt from its events") && run.stdout.contains("id=4242"),
        "{}",
        run.stdout
    );

    client
        .batch_execute(
            "set session_replication_role = replica; delete from withdrawal; set session_replication_role = origin",
        )
        .await
        .unwrap();
    client
        .batch_execute(&format!(
            "insert into account (external_ref) values ('mallory');
             begin;
             insert into ledger_transfer (idempotency_key, kind, reference)
                  values ('deposit:eth:0x{tx}:native:0:credit:1', 'deposit', '{{\"chain\":\"eth\",\"tx_hash\":\"0x{tx}\",\"kind\":\"native\",\"output_index\":0,\"block_hash\":\"0x{tx}\"}}');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 77),
                  (currval('ledger_transfer_id_seq'), 'user:1', 'ETH', 'credit', 77);
             commit;",
            tx = "ab".repeat(32)
        ))
        .await
        .unwrap();
    let run = custodian(url, &["replay", "--verify", "--json"]);
    assert_eq!(run.code, 3, "{}", run.stdout);
    let report = run.json();
    assert_eq!(report["verified"], false);
    let details: Vec<String> =
        report["differences"].as_array().unwrap().iter().map(|d| d["detail"].to_string()).collect();
    let key = format!("deposit:eth:0x{}:native:0:credit:1", "ab".repeat(32));
    assert!(
        details.iter().any(|d| d.contains("credit names no observation of its key") && d.contains(&key)),
        "{details:?}"
    );
    assert!(report["differences"].as_array().unwrap().iter().any(|d| d["check"] == "custody"), "{details:?}");
}

#[tokio::test]
async fn events_print_the_history_in_order_and_resume_after_a_position() {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 10);
    new_account(&db, "alice", &address, 0).await;
    let tx = sim.pay(&[(address.clone(), Sats::from_sat(1_000))]);
    sim.mine(&[tx]);
    sim.mine_empty(1);
    scan_and_post(&db, &sim).await;
    let url = db.url.expose();
    // The history shows only facts older than every transaction still running on the server
    // (other tests' included), so wait until ours have settled.
    let all = custodian_testkit::eventually(
        "our facts to settle into the history",
        std::time::Duration::from_secs(30),
        || async {
            let all = custodian(url, &["events", "--json"]).json();
            let settled = all.as_array().unwrap().iter().any(|f| f["kind"] == "ledger_transfer");
            settled.then_some(all)
        },
    )
    .await;
    let kinds: Vec<&str> = all.as_array().unwrap().iter().map(|f| f["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds.iter().filter(|k| **k == "block").count(), 3);
    assert!(kinds.contains(&"deposit_observed") && kinds.contains(&"ledger_transfer"), "{kinds:?}");
    let first_three: Vec<i64> =
        all.as_array().unwrap().iter().take(3).map(|f| f["position"].as_i64().unwrap()).collect();
    let resumed = custodian(url, &["events", "--json", "--from", &first_three[2].to_string()]).json();
    assert_eq!(
        resumed.as_array().unwrap().as_slice(),
        &all.as_array().unwrap()[3..],
        "resumes exactly after the position"
    );
    let bad = custodian(url, &["events", "--from", "999999"]);
    assert_eq!(bad.code, 2, "{}", bad.stderr);
}
