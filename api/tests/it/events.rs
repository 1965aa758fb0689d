//! The auditors' event stream: resuming from a position without gaps or repeats, following new
//! facts, and ending cleanly when the server shuts down.

use std::collections::HashSet;
use std::time::Duration;

use custodian_api::pb;
use tonic::{Code, Streaming};

use crate::support::{assert_status, authed, withdrawal_request, Api, ETHER, FUNDER};

/// Bulk facts written by one transaction: more than one page of the stream (500).
const BULK_BLOCKS: i64 = 620;

async fn open(api: &Api, token: &str, after_position: Option<i64>, until_caught_up: bool) -> Streaming<pb::Event> {
    let request = authed(token, pb::StreamEventsRequest { after_position, until_caught_up });
    api.audit().stream_events(request).await.expect("open the event stream").into_inner()
}

/// Every event after `after` up to the settled end.
async fn read_to_end(api: &Api, token: &str, after: Option<i64>) -> Vec<pb::Event> {
    let mut stream = open(api, token, after, true).await;
    let mut events = Vec::new();
    while let Some(event) = stream.message().await.expect("a stream that ends cleanly") {
        events.push(event);
    }
    events
}

/// The whole history once `expected` facts have settled. A fact settles when every transaction
/// older than its own has ended, in any database of the server, so parallel tests can hold it
/// back for a moment.
async fn settled_history(api: &Api, token: &str, expected: usize) -> Vec<pb::Event> {
    custodian_testkit::eventually("every fact to settle", Duration::from_secs(30), || async {
        let events = read_to_end(api, token, None).await;
        assert!(events.len() <= expected, "more facts than written: {}", events.len());
        (events.len() == expected).then_some(events)
    })
    .await
}

/// The next event of a following stream, within a deadline.
async fn next(stream: &mut Streaming<pb::Event>) -> pb::Event {
    tokio::time::timeout(Duration::from_secs(10), stream.message())
        .await
        .expect("an event within 10 s")
        .expect("no stream error")
        .expect("the stream goes on")
}

/// Facts of several kinds and transactions: deposits with their postings, a bulk of blocks from
/// one transaction, withdrawal requests with their holds. Returns the account and the number of
/// facts written.
async fn write_history(api: &Api, token: &str) -> (i64, usize) {
    let account = api.account(token, "ivan").await;
    api.hot_wallet().await;
    for n in 0..4 {
        api.credit(account, n, ETHER).await;
    }
    api.db
        .pool
        .get()
        .await
        .unwrap()
        .execute(
            "insert into chain_block (chain, height, block_hash, parent_hash)
             select 'eth', 5000000 + g, '0x' || lpad(to_hex(g), 64, '0'), '0x' || lpad(to_hex(g), 64, '0')
               from generate_series(1, $1::bigint) g",
            &[&BULK_BLOCKS],
        )
        .await
        .unwrap();
    for n in 0..3 {
        let request = withdrawal_request(account, &format!("w-{n}"), FUNDER, ETHER / 10);
        api.withdrawals().request_withdrawal(authed(token, request)).await.unwrap();
    }
    // Each credit: a block, a deposit observation, a ledger transfer. Each request: its event
    // and the hold's transfer. And the operator actions (the tokens' creation).
    let client = api.db.pool.get().await.unwrap();
    let actions: i64 = client.query_one("select count(*) from operator_action", &[]).await.unwrap().get(0);
    assert!(actions >= 1, "creating the caller's token is an operator action");
    (account, 4 * 3 + usize::try_from(BULK_BLOCKS).unwrap() + 3 * 2 + usize::try_from(actions).unwrap())
}

#[tokio::test]
async fn a_stream_resumed_after_any_position_continues_without_gaps_or_repeats() {
    let api = Api::start().await;
    let token = api.root_token().await;
    let (_, written) = write_history(&api, &token).await;

    let full = settled_history(&api, &token, written).await;
    let positions: HashSet<i64> = full.iter().map(|e| e.position).collect();
    assert_eq!(positions.len(), full.len(), "no position twice");
    let kinds: HashSet<&str> = full.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        HashSet::from([
            "block",
            "deposit_observed",
            "ledger_transfer",
            "withdrawal_requested",
            "operator_token_created"
        ])
    );
    let created = full.iter().find(|e| e.kind == "operator_token_created").unwrap();
    let payload: serde_json::Value = serde_json::from_str(&created.payload_json).unwrap();
    assert_eq!((payload["name"].as_str(), payload["principal"].as_str()), (Some("root"), Some("bootstrap")));
    let requested = full.iter().find(|e| e.kind == "withdrawal_requested").unwrap();
    let payload: serde_json::Value = serde_json::from_str(&requested.payload_json).unwrap();
    assert_eq!(payload["amount"], (ETHER / 10).to_string(), "amounts are integer strings of smallest units");
    assert!(requested.recorded_at.ends_with('Z') && requested.recorded_at.contains('T'), "{}", requested.recorded_at);

    // Read part of a following stream, drop it, resume after the last position seen: together
    // they are the full read, at any split, including inside the bulk and across its pages.
    for split in [1, 7, 500, 501, 630, full.len() - 1] {
        let mut stream = open(&api, &token, None, false).await;
        let mut seen = Vec::new();
        for _ in 0..split {
            seen.push(next(&mut stream).await);
        }
        drop(stream);
        let rest = read_to_end(&api, &token, seen.last().map(|e| e.position)).await;
        seen.extend(rest);
        assert_eq!(seen, full, "split after {split} events");
    }
    assert_eq!(read_to_end(&api, &token, full.last().map(|e| e.position)).await, [], "nothing after the end");

    let unknown = api
        .audit()
        .stream_events(authed(&token, pb::StreamEventsRequest { after_position: Some(1 << 40), until_caught_up: true }))
        .await;
    assert_status(unknown, Code::NotFound, &["after_position 1099511627776"]);
}

#[tokio::test]
async fn a_following_stream_delivers_new_facts_as_they_settle() {
    let api = Api::start().await;
    let token = api.root_token().await;
    let (account, written) = write_history(&api, &token).await;
    let before = settled_history(&api, &token, written).await;

    let mut stream = open(&api, &token, before.last().map(|e| e.position), false).await;
    api.credit(account, 9, ETHER).await;
    let mut new = Vec::new();
    for _ in 0..3 {
        new.push(next(&mut stream).await);
    }
    let kinds: Vec<&str> = new.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(kinds, ["block", "deposit_observed", "ledger_transfer"]);
    let mut everything = before;
    everything.extend(new);
    assert_eq!(read_to_end(&api, &token, None).await, everything);
}

#[tokio::test]
async fn shutdown_ends_an_open_stream_with_where_to_resume() {
    let mut api = Api::start().await;
    let token = api.root_token().await;
    let account = api.account(&token, "judy").await;
    api.credit(account, 0, ETHER).await;
    let mut stream = open(&api, &token, None, false).await;
    let first = next(&mut stream).await;

    // The server stops although a stream is open, and the stream says where to pick up.
    api.stop().await.expect("serve returns cleanly");
    let mut last = first.position;
    let ended = loop {
        match stream.message().await {
            Ok(Some(event)) => last = event.position,
            Ok(None) => panic!("the stream ended without saying why"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    assert!(ended.message().contains("shutting down"), "{ended:?}");
    assert!(ended.message().contains(&format!("after_position {last}")), "{ended:?}");
}

#[tokio::test]
async fn a_revoked_tokens_open_stream_ends_within_a_second() {
    let api = Api::start().await;
    let root = api.root_token().await;
    let auditor = api.token("auditor", &[custodian_api::tokens::Scope::Read]).await;
    let mut stream = open(&api, &auditor, None, false).await;
    // the stream is open and following (the root token's creation is its first fact)
    assert_eq!(next(&mut stream).await.kind, "operator_token_created");
    assert_eq!(next(&mut stream).await.kind, "operator_token_created");
    custodian_api::tokens::revoke(&api.db.pool.get().await.unwrap(), "auditor", "root").await.unwrap();
    let revoked_at = std::time::Instant::now();
    let ended = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the stream ended without saying why"),
                Err(status) => return status,
            }
        }
    })
    .await
    .expect("the stream ends");
    let took = revoked_at.elapsed();
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert!(ended.message().contains("revoked") && ended.message().contains("resume"), "{}", ended.message());
    assert!(took < Duration::from_secs(1), "ended {took:?} after the revocation");
    // and the token opens nothing any more, while others still do
    let refused = api.audit().stream_events(authed(&auditor, pb::StreamEventsRequest::default())).await;
    assert_status(refused, Code::Unauthenticated, &["revoked"]);
    assert!(api
        .audit()
        .stream_events(authed(&root, pb::StreamEventsRequest { after_position: None, until_caught_up: true }))
        .await
        .is_ok());
}
