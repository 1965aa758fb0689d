//! Deposits through the command line: set-up commands, scanning, listing, and bad input.

use custodian_testkit::{Anvil, TestDb};
use serde_json::json;

use crate::harness::custodian;

const ALICE_ADDRESS: &str = "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed";

async fn table_counts(db: &TestDb) -> Vec<i64> {
    let client = db.client().await;
    let mut counts = Vec::new();
    for table in ["account", "wallet_address", "asset", "scan_cursor", "chain_block", "deposit_event"] {
        counts.push(client.query_one(&format!("select count(*) from {table}"), &[]).await.unwrap().get(0));
    }
    counts
}

#[tokio::test]
async fn an_operator_assigns_an_address_scans_and_lists_the_deposit() {
    let db = TestDb::new().await;
    let anvil = Anvil::spawn().await.unwrap();
    let url = db.url.expose();

    let created = custodian(url, &["account", "create", "--ref", "alice", "--json"]);
    assert_eq!(created.code, 0, "{}", created.stderr);
    assert_eq!(created.json()["created"], true);
    let again = custodian(url, &["account", "create", "--ref", "alice", "--json"]);
    assert_eq!(
        (again.code, again.json()["created"].clone(), again.json()["id"].clone()),
        (0, json!(false), created.json()["id"].clone())
    );

    let assigned = custodian(
        url,
        &["address", "assign", "--account", "alice", "--chain", "eth", "--address", ALICE_ADDRESS, "--json"],
    );
    assert_eq!(assigned.code, 0, "{}", assigned.stderr);
    assert_eq!(assigned.json()["address"], ALICE_ADDRESS.to_lowercase());

    anvil
        .rpc("eth_sendTransaction", json!([{"from": "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266", "to": ALICE_ADDRESS, "value": "0x1bc16d674ec80000"}]))
        .await
        .unwrap();
    anvil.rpc("anvil_mine", json!(["0x4"])).await.unwrap();

    let scanned = custodian(url, &["scan", "--chain", "eth", "--once", "--eth-rpc", &anvil.url, "--json"]);
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
    assert_eq!(scanned.json()["report"]["deposits"], 1);
    assert_eq!(scanned.json()["report"]["our_tip"], 5);

    let listed = custodian(url, &["deposits", "--account", "alice", "--json"]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let deposits = listed.json();
    assert_eq!(deposits.as_array().map(Vec::len), Some(1), "{deposits}");
    let deposit = &deposits[0];
    assert_eq!(deposit["amount"], "2000000000000000000");
    assert_eq!(deposit["amount_display"], "2");
    assert_eq!(deposit["height"], 1);
    assert_eq!(deposit["confirmations"], 5);
    assert_eq!(deposit["required_confirmations"], 32, "2 ETH falls in the 1 to 100 ETH tier");
    assert_eq!(deposit["orphaned"], false);
    assert_eq!(deposit["account_ref"], "alice");
    let text = custodian(url, &["deposits"]);
    assert!(text.stdout.contains("pending 5/32"), "{}", text.stdout);
}

#[tokio::test]
async fn bad_input_is_refused_with_exit_2_and_writes_nothing() {
    let db = TestDb::new().await;
    let url = db.url.expose();
    let operator = crate::harness::operator(&db).await;
    assert_eq!(custodian(url, &["account", "create", "--ref", "bob"]).code, 0);
    assert_eq!(
        crate::harness::custodian_as(
            url,
            &operator,
            &["asset", "add", "--chain", "eth", "--contract", ALICE_ADDRESS, "--symbol", "TT", "--decimals", "6"]
        )
        .code,
        0
    );
    let before = table_counts(&db).await;

    let cases: &[(&[&str], &str)] = &[
        (&["scan", "--chain", "sol", "--once"], "possible values: eth, btc"),
        (&["rewind", "--chain", "eth", "--to-height", "-1"], "unexpected argument"),
        (&["rewind", "--chain", "eth", "--to-height", "5"], "never been scanned"),
        (
            &[
                "address",
                "assign",
                "--account",
                "bob",
                "--chain",
                "eth",
                "--address",
                "0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAeD",
            ],
            "checksum",
        ),
        (&["address", "assign", "--account", "bob", "--chain", "eth", "--address", "0x1234"], "40 hexadecimal digits"),
        (
            &[
                "address",
                "assign",
                "--account",
                "bob",
                "--chain",
                "btc",
                "--address",
                "bc1qar0srrr7xfkvy5l643lydnw9re59gtzzwf5mdq",
                "--btc-network",
                "regtest",
            ],
            "not a regtest address",
        ),
        (
            &["address", "assign", "--account", "nobody", "--chain", "eth", "--address", ALICE_ADDRESS],
            "unknown account",
        ),
        (&["deposits", "--account", "nobody"], "unknown account"),
        (
            &["asset", "add", "--chain", "btc", "--contract", ALICE_ADDRESS, "--symbol", "X", "--decimals", "6"],
            "only on eth",
        ),
        (
            &["asset", "add", "--chain", "eth", "--contract", ALICE_ADDRESS, "--symbol", "TT", "--decimals", "8"],
            "already registered",
        ),
        (&["reparse", "--chain", "eth", "--from-height", "0"], "holds no block"),
        (&["scan", "--chain", "eth", "--once"], "no Ethereum node"),
    ];
    for (args, message) in cases {
        let run = crate::harness::custodian_as(url, &operator, args);
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(message), "{args:?}: expected {message:?} in {}", run.stderr);
        assert_eq!(table_counts(&db).await, before, "{args:?} wrote something");
    }
}

#[tokio::test]
async fn rewind_refuses_a_height_above_the_cursor() {
    let db = TestDb::new().await;
    let anvil = Anvil::spawn().await.unwrap();
    anvil.rpc("anvil_mine", json!(["0x3"])).await.unwrap();
    let url = db.url.expose();
    assert_eq!(custodian(url, &["scan", "--chain", "eth", "--once", "--eth-rpc", &anvil.url]).code, 0);
    let above = custodian(url, &["rewind", "--chain", "eth", "--to-height", "10"]);
    assert_eq!(above.code, 2, "{}", above.stderr);
    assert!(above.stderr.contains("the cursor is at 4 (our tip is 3)"), "{}", above.stderr);
    let back = custodian(url, &["rewind", "--chain", "eth", "--to-height", "1", "--json"]);
    assert_eq!(back.code, 0, "{}", back.stderr);
    assert_eq!(back.json(), json!({"chain": "eth", "previous_next_height": 4, "next_height": 1}));
}

#[tokio::test]
async fn deposits_and_events_list_a_page_at_a_time_and_say_where_the_next_starts() {
    let db = TestDb::new().await;
    let url = db.url.expose();
    let client = db.client().await;
    let account: i64 =
        client.query_one("insert into account (external_ref) values ('pager') returning id", &[]).await.unwrap().get(0);
    for n in 0..5 {
        custodian_testkit::fixtures::credit_eth(&client, account, n, 1_000 + u128::from(n)).await;
    }
    let mut seen = Vec::new();
    let mut before: Option<String> = None;
    for expected in [2, 2, 1] {
        let mut args = vec!["deposits", "--limit", "2", "--json"];
        if let Some(b) = &before {
            args.extend(["--before", b.as_str()]);
        }
        let page = custodian(url, &args);
        assert_eq!(page.code, 0, "{}", page.stderr);
        let ids: Vec<i64> = page.json().as_array().unwrap().iter().map(|d| d["id"].as_i64().unwrap()).collect();
        assert_eq!(ids.len(), expected, "{}", page.stdout);
        if expected == 2 {
            let hint = format!("the next page: --before {}", ids[1]);
            assert!(page.stderr.contains(&hint), "a full page says where the next starts: {}", page.stderr);
        } else {
            assert!(!page.stderr.contains("next page"), "a short page is the last: {}", page.stderr);
        }
        before = ids.last().map(i64::to_string);
        seen.extend(ids);
    }
    let mut sorted = seen.clone();
    sorted.sort_unstable_by(|a, b| b.cmp(a));
    sorted.dedup();
    assert_eq!(seen, sorted, "newest first, none twice");
    assert_eq!(seen.len(), 5, "every deposit on some page");
    assert_eq!(custodian(url, &["deposits", "--limit", "0"]).code, 2);

    // The history shows facts once final (no older transaction still running anywhere).
    let events = custodian_testkit::eventually("the facts are final", std::time::Duration::from_secs(30), || async {
        let events = custodian(url, &["events", "--limit", "3", "--json"]);
        assert_eq!(events.code, 0, "{}", events.stderr);
        (events.json().as_array().unwrap().len() == 3).then_some(events)
    })
    .await;
    let last = events.json().as_array().unwrap().last().unwrap()["position"].as_i64().unwrap();
    assert!(events.stderr.contains(&format!("the next page: --from {last}")), "{}", events.stderr);
    let next = custodian(url, &["events", "--from", &last.to_string(), "--limit", "3", "--json"]);
    assert_eq!(next.code, 0, "{}", next.stderr);
    assert!(next.json().as_array().unwrap().iter().all(|f| f["position"].as_i64() != Some(last)));
}
