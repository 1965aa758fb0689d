//! Finance's exports through its own read-only login (`custodian_reader`): the ledger between two
//! moments as CSV or JSON, and balances as of a past moment, agreeing with the live balances.

use custodian_testkit::btcsim::AddrKind;
use serde_json::Value;

use crate::btc_withdrawals::Payouts;
use crate::lifecycle::run;

/// The database's clock, as an RFC 3339 moment.
async fn moment(p: &Payouts) -> String {
    let now: String =
        p.db.client()
            .await
            .query_one("select to_char(clock_timestamp() at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')", &[])
            .await
            .unwrap()
            .get(0);
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    now
}

fn alice_at(balances: &Value, alice: i64) -> (String, String) {
    let found = balances["balances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["account_id"] == alice && b["asset"] == "BTC")
        .cloned()
        .unwrap_or_else(|| panic!("alice holds BTC: {balances}"));
    (found["available"].as_str().unwrap().to_owned(), found["held"].as_str().unwrap().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finance_exports_the_ledger_and_balances_as_of_a_moment_with_its_read_only_login() {
    let p = Payouts::new(1, 2, 1_000_000, 50_000_000).await;
    let reader = vec![(
        "CUSTODIAN_DATABASE_URL".to_owned(),
        p.db.url.expose().replacen("custodian_app@", "custodian_reader@", 1),
    )];
    let before = moment(&p).await;
    let w = p.request("w", &p.sim.address(AddrKind::P2wpkh, 5), 200_000).await.unwrap().withdrawal;
    let requested = moment(&p).await;
    let worker = p.worker(custodian_withdrawals::btc::BtcConfig {
        confirmations: 1,
        ..custodian_withdrawals::btc::BtcConfig::default()
    });
    p.settle(&[&worker], &[w.id().get()], 4).await;
    let after = moment(&p).await;

    // Balances as of each moment, from the postings.
    let as_of = |at: String| {
        let reader = reader.clone();
        async move {
            let out = run(reader, &["balances", "--as-of", &at, "--json"]).await;
            assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
            out.json()
        }
    };
    assert_eq!(alice_at(&as_of(before.clone()).await, p.alice), ("50000000".into(), "0".into()));
    assert_eq!(alice_at(&as_of(requested.clone()).await, p.alice), ("49800000".into(), "200000".into()));
    let now = as_of(after.clone()).await;
    assert_eq!(alice_at(&now, p.alice), ("49800000".into(), "0".into()), "settled: the hold left custody");
    assert_eq!(crate::ledger_support::available(&p.db, p.alice).await, "49800000", "as the live balance says");

    // The postings between two moments, as CSV and as JSON.
    let expected: i64 =
        p.db.client()
            .await
            .query_one(
                "select count(*) from ledger_posting p join ledger_transfer t on t.id = p.transfer_id
              where t.created_at >= $1::text::timestamptz and t.created_at < $2::text::timestamptz",
                &[&before, &after],
            )
            .await
            .unwrap()
            .get(0);
    assert!(expected >= 6, "hold, settlement and fee: {expected}");
    let csv = run(reader.clone(), &["export", "ledger", "--from", &before, "--to", &after]).await;
    assert_eq!(csv.code, 0, "{}", csv.stderr);
    let lines: Vec<&str> = csv.stdout.lines().collect();
    assert_eq!(
        lines[0],
        "posting_id,transfer_id,created_at,idempotency_key,kind,ledger_account,asset,direction,amount"
    );
    assert_eq!(lines.len() as i64 - 1, expected, "{}", csv.stdout);
    assert!(lines.iter().all(|l| l.split(',').count() == 9), "{}", csv.stdout);
    assert!(csv.stdout.contains(&format!(
        "withdrawal:{}:hold,withdrawal_hold,user:{},BTC,debit,200000",
        w.id(),
        p.alice
    )));
    let json = run(reader.clone(), &["export", "ledger", "--from", &before, "--to", &after, "--format", "json"]).await;
    assert_eq!(json.code, 0, "{}", json.stderr);
    let rows = json.json();
    assert_eq!(rows.as_array().unwrap().len() as i64, expected);
    let fee: Vec<&Value> = rows.as_array().unwrap().iter().filter(|r| r["kind"] == "network_fee").collect();
    assert_eq!(fee.len(), 2, "the fee's two postings: {rows}");
    let only = run(
        reader.clone(),
        &["export", "ledger", "--from", &before, "--to", &after, "--ledger-account", "network_fees"],
    )
    .await;
    assert_eq!(only.stdout.lines().count(), 2, "{}", only.stdout);

    // Refusals, with nothing written: not a moment, an empty range; and the login cannot write.
    let bad = run(reader.clone(), &["export", "ledger", "--from", "last tuesday", "--to", &after]).await;
    assert_eq!(bad.code, 2, "{}", bad.stderr);
    assert!(bad.stderr.contains("not a date or a timestamp"), "{}", bad.stderr);
    let empty = run(reader.clone(), &["export", "ledger", "--from", &after, "--to", &before]).await;
    assert_eq!(empty.code, 2, "{}", empty.stderr);
    let write = run(reader, &["account", "create", "--ref", "mallory"]).await;
    assert_ne!(write.code, 0, "finance's login writes nothing: {}", write.stdout);
    let accounts: i64 =
        p.db.client()
            .await
            .query_one("select count(*) from account where external_ref = 'mallory'", &[])
            .await
            .unwrap()
            .get(0);
    assert_eq!(accounts, 0);
}
