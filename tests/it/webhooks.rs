//! Webhooks against a real HTTP receiver in the test process: order, signatures, a receiver that
//! fails twice, one that does not answer in time, one that is down for good, and two `serve`
//! processes delivering one subscriber while one of them is killed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use bitcoin::hashes::{hmac, sha256, Hash, HashEngine};
use custodian_api::tokens::{self, Scope, BOOTSTRAP_PRINCIPAL};
use custodian_api::webhooks::{self, Deliverer, DeliveryConfig, Kind};
use custodian_projections::history;
use custodian_testkit::db::column;
use custodian_testkit::{eventually, TestDb};

use crate::harness::{custodian, custodian_as};

const SECRET: &str = "whsec_test_secret_0123456789";

/// One request as the receiver saw it, and what it answered.
#[derive(Debug, Clone)]
struct Received {
    id: i64,
    header_id: String,
    signature: String,
    content_type: String,
    body: Vec<u8>,
    answered: u16,
}

#[derive(Debug, Default)]
struct Inner {
    requests: Mutex<Vec<Received>>,
    /// Answer 500 to this many requests first.
    fail_first: AtomicUsize,
    /// Take `delay` to answer this many requests first.
    slow_first: AtomicUsize,
    delay: Duration,
}

/// A webhook receiver on a port of its own.
#[derive(Debug, Clone)]
struct Receiver {
    inner: Arc<Inner>,
    url: String,
}

async fn hook(State(inner): State<Arc<Inner>>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let id = serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v["id"].as_i64()).unwrap_or(-1);
    let take =
        |counter: &AtomicUsize| counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok();
    let slow = take(&inner.slow_first);
    let status = if take(&inner.fail_first) { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::OK };
    inner.requests.lock().unwrap().push(Received {
        id,
        header_id: header("custodian-event-id"),
        signature: header("custodian-signature"),
        content_type: header("content-type"),
        body: body.to_vec(),
        answered: if slow { 0 } else { status.as_u16() },
    });
    if slow {
        tokio::time::sleep(inner.delay).await;
    }
    status
}

impl Receiver {
    async fn start(fail_first: usize, slow_first: usize, delay: Duration) -> Receiver {
        let inner = Arc::new(Inner {
            fail_first: AtomicUsize::new(fail_first),
            slow_first: AtomicUsize::new(slow_first),
            delay,
            ..Inner::default()
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}/hook", listener.local_addr().expect("address"));
        let app = axum::Router::new().route("/hook", axum::routing::post(hook)).with_state(inner.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver { inner, url }
    }

    async fn ok() -> Receiver {
        Receiver::start(0, 0, Duration::ZERO).await
    }

    fn requests(&self) -> Vec<Received> {
        self.inner.requests.lock().unwrap().clone()
    }

    /// Ids answered 2xx, in the order they were received.
    fn delivered(&self) -> Vec<i64> {
        self.requests().iter().filter(|r| r.answered == 200).map(|r| r.id).collect()
    }
}

/// A URL nothing listens on.
async fn closed_url() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    drop(listener);
    format!("http://{address}/hook")
}

/// Checks the signature header of `r` with HMAC-SHA256 computed here, as a receiver would.
fn assert_signed(r: &Received, secret: &str) {
    let (t, v1) = r
        .signature
        .strip_prefix("t=")
        .and_then(|rest| rest.split_once(",v1="))
        .unwrap_or_else(|| panic!("malformed signature header {:?}", r.signature));
    let timestamp: u64 = t.parse().expect("a unix timestamp");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    assert!(now.abs_diff(timestamp) < 300, "timestamp {timestamp} is far from now {now}");
    let mut engine = hmac::HmacEngine::<sha256::Hash>::new(secret.as_bytes());
    engine.input(format!("{t}.").as_bytes());
    engine.input(&r.body);
    let expected: String =
        hmac::Hmac::<sha256::Hash>::from_engine(engine).to_byte_array().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(v1, expected, "the signature of fact {} does not verify", r.id);
    assert_eq!(r.header_id, r.id.to_string(), "the id header names the body's id");
    assert_eq!(r.content_type, "application/json");
}

fn fast(timeout_ms: u64, max_age_ms: u64) -> DeliveryConfig {
    DeliveryConfig {
        timeout: Duration::from_millis(timeout_ms),
        max_age: Duration::from_millis(max_age_ms),
        poll: Duration::from_millis(50),
        lease: Duration::from_millis(2_000),
        min_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
    }
}

/// `n` operator facts (API tokens created).
async fn operator_facts(db: &TestDb, prefix: &str, n: usize) {
    let client = db.pool.get().await.expect("connection");
    for i in 0..n {
        tokens::create(&client, &format!("{prefix}-{i}"), &[Scope::Read], BOOTSTRAP_PRINCIPAL).await.expect("token");
    }
}

/// The final facts of `kind` after `cursor`, in history order.
async fn expected(db: &TestDb, kind: Kind, cursor: Option<i64>) -> Vec<i64> {
    let client = db.pool.get().await.expect("connection");
    let facts = history::page(&client, cursor, history::MAX_PAGE).await.expect("history");
    facts.iter().filter(|f| kind.covers(f)).map(|f| f.position).collect()
}

/// Delivers passes until `receiver` has `count` deliveries.
async fn deliver_until(deliverer: &Deliverer, receiver: &Receiver, count: usize) -> Vec<i64> {
    eventually("the facts are delivered", Duration::from_secs(60), || async {
        deliverer.pass().await.expect("a delivery pass");
        let got = receiver.delivered();
        (got.len() >= count).then_some(got)
    })
    .await
}

#[test]
fn the_signature_is_hmac_sha256_over_the_timestamp_and_the_body() {
    // The same value as Python's hmac.new(key, b"1700000000." + body, hashlib.sha256).hexdigest(),
    // the snippet in the README.
    assert_eq!(
        webhooks::signature("whsec_known_answer_key", 1_700_000_000, br#"{"id":42}"#),
        "7f66bf8259b4f0b602ad08690611246318f7d88ea3c2da0265cf32cae60f7279"
    );
}

#[tokio::test]
async fn each_subscriber_gets_the_facts_of_its_kinds_in_history_order_signed() {
    let db = TestDb::new().await;
    operator_facts(&db, "before", 4).await;
    let everything = Receiver::ok().await;
    let withdrawals_only = Receiver::ok().await;
    let from_now = Receiver::ok().await;
    let mut client = db.pool.get().await.expect("connection");
    webhooks::add(&mut client, &everything.url, &[Kind::Operator], Some(SECRET), true, "test").await.expect("add");
    webhooks::add(&mut client, &withdrawals_only.url, &[Kind::Withdrawal], Some(SECRET), true, "test")
        .await
        .expect("add");
    // A subscriber without --from-start begins after the last final fact: wait until the facts
    // above are final so that where it begins is known.
    let before = eventually("the first facts are final", Duration::from_secs(30), || async {
        let facts = expected(&db, Kind::Operator, None).await;
        (facts.len() >= 6).then_some(facts)
    })
    .await;
    let later =
        webhooks::add(&mut client, &from_now.url, &[Kind::Operator], Some(SECRET), false, "test").await.expect("add");
    assert!(later.secret.is_none(), "a given secret is not echoed back");
    let start = later.subscriber.cursor.expect("a subscriber from now has a cursor");
    operator_facts(&db, "after", 3).await;

    let deliverer = Deliverer::new(db.pool.clone(), fast(2_000, 60_000), "test:1".to_owned()).expect("deliverer");
    let all = eventually("every operator fact is final", Duration::from_secs(30), || async {
        let facts = expected(&db, Kind::Operator, None).await;
        (facts.len() >= 10).then_some(facts)
    })
    .await;
    let got = deliver_until(&deliverer, &everything, all.len()).await;
    assert_eq!(got, all, "every operator fact, once, in the history's order");
    for r in everything.requests() {
        assert_signed(&r, SECRET);
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("JSON");
        assert!(body["kind"].as_str().is_some_and(|k| k.starts_with("operator_")), "{body}");
        assert!(body["payload"].is_object() && body["recorded_at"].is_string(), "{body}");
    }
    let tail = expected(&db, Kind::Operator, Some(start)).await;
    let got_later = deliver_until(&deliverer, &from_now, tail.len()).await;
    assert_eq!(got_later, tail, "a subscriber from now gets what follows its cursor, nothing before");
    assert!(tail.len() >= 3 && !got_later.contains(&before[0]));
    deliverer.pass().await.expect("pass");
    assert!(withdrawals_only.requests().is_empty(), "no fact of another kind is sent");

    let listed = webhooks::list(&client).await.expect("list");
    assert_eq!(listed[0].delivered, i64::try_from(all.len()).unwrap());
    assert_eq!(listed[0].backlog, Some(0));
    assert_eq!(listed[1].delivered, 0);
    let last = history::page(&client, None, history::MAX_PAGE).await.expect("history").last().map(|f| f.position);
    assert_eq!(listed[1].cursor, last, "facts of other kinds are passed over: the cursor is at the end");
}

#[tokio::test]
async fn a_receiver_that_fails_twice_then_succeeds_gets_every_fact_in_order() {
    let db = TestDb::new().await;
    operator_facts(&db, "t", 3).await;
    let flaky = Receiver::start(2, 0, Duration::ZERO).await;
    let mut client = db.pool.get().await.expect("connection");
    webhooks::add(&mut client, &flaky.url, &[Kind::Operator], Some(SECRET), true, "test").await.expect("add");
    let all = eventually("the facts are final", Duration::from_secs(30), || async {
        let facts = expected(&db, Kind::Operator, None).await;
        (facts.len() >= 4).then_some(facts)
    })
    .await;
    let deliverer = Deliverer::new(db.pool.clone(), fast(2_000, 60_000), "test:1".to_owned()).expect("deliverer");
    let first = deliverer.pass().await.expect("pass");
    let turn = first.subscribers.values().next().expect("the subscriber was due");
    assert_eq!(turn.delivered, 0);
    assert!(turn.failed.as_deref().is_some_and(|e| e.contains("500")), "{turn:?}");
    assert!(!turn.paused);
    let got = deliver_until(&deliverer, &flaky, all.len()).await;
    assert_eq!(got, all, "each fact delivered once, in order");
    let requests: Vec<(i64, u16)> = flaky.requests().iter().map(|r| (r.id, r.answered)).collect();
    assert_eq!(
        &requests[..3],
        &[(all[0], 500), (all[0], 500), (all[0], 200)],
        "the first fact retried until it succeeded"
    );
    assert_eq!(requests.len(), all.len() + 2, "nothing else was sent twice");
    let s = webhooks::get(&client, webhooks::list(&client).await.unwrap()[0].id).await.expect("get");
    assert_eq!((s.attempts, s.last_error, s.state.as_str()), (0, None, "active"));
}

#[tokio::test]
async fn a_receiver_that_does_not_answer_in_time_is_retried() {
    let db = TestDb::new().await;
    operator_facts(&db, "t", 2).await;
    let slow = Receiver::start(0, 1, Duration::from_secs(5)).await;
    let mut client = db.pool.get().await.expect("connection");
    webhooks::add(&mut client, &slow.url, &[Kind::Operator], Some(SECRET), true, "test").await.expect("add");
    let all = eventually("the facts are final", Duration::from_secs(30), || async {
        let facts = expected(&db, Kind::Operator, None).await;
        (facts.len() >= 3).then_some(facts)
    })
    .await;
    let deliverer = Deliverer::new(db.pool.clone(), fast(500, 60_000), "test:1".to_owned()).expect("deliverer");
    let started = std::time::Instant::now();
    let first = deliverer.pass().await.expect("pass");
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the request was given up after its timeout (500 ms), not its 5 s answer"
    );
    let turn = first.subscribers.values().next().expect("due");
    assert!(turn.failed.as_deref().is_some_and(|e| e.contains("no answer within 500 ms")), "{turn:?}");
    let got = deliver_until(&deliverer, &slow, all.len()).await;
    assert_eq!(got, all);
    let first_fact_requests = slow.requests().iter().filter(|r| r.id == all[0]).count();
    assert_eq!(first_fact_requests, 2, "the unanswered fact was sent again (at least once)");
}

#[tokio::test]
async fn a_receiver_down_for_good_is_paused_and_no_subscriber_waits_for_another() {
    let db = TestDb::new().await;
    operator_facts(&db, "t", 3).await;
    let (good, hanging) = (Receiver::ok().await, Receiver::start(0, 1_000, Duration::from_secs(30)).await);
    let down = closed_url().await;
    let mut client = db.pool.get().await.expect("connection");
    let down_id =
        webhooks::add(&mut client, &down, &[Kind::Operator], Some(SECRET), true, "test").await.unwrap().subscriber.id;
    let hanging_id = webhooks::add(&mut client, &hanging.url, &[Kind::Operator], Some(SECRET), true, "test")
        .await
        .unwrap()
        .subscriber
        .id;
    webhooks::add(&mut client, &good.url, &[Kind::Operator], Some(SECRET), true, "test").await.expect("add");
    let all = eventually("the facts are final", Duration::from_secs(30), || async {
        let facts = expected(&db, Kind::Operator, None).await;
        (facts.len() >= 6).then_some(facts)
    })
    .await;

    let deliverer = Deliverer::new(db.pool.clone(), fast(3_000, 1_000), "test:1".to_owned()).expect("deliverer");
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let running = tokio::spawn({
        let deliverer = deliverer.clone();
        async move { deliverer.run(stopped).await }
    });
    let started = std::time::Instant::now();
    let got = eventually("the good receiver has everything", Duration::from_secs(30), || async {
        let got = good.delivered();
        (got.len() >= all.len()).then_some(got)
    })
    .await;
    assert_eq!(got, all);
    assert!(
        started.elapsed() < Duration::from_millis(2_900),
        "the good subscriber was served while the hanging one still waited ({:?})",
        started.elapsed()
    );
    for (id, why) in [(down_id, "cannot connect"), (hanging_id, "no answer within 3000 ms")] {
        let paused = eventually("the failing subscriber is paused", Duration::from_secs(30), || async {
            let s = webhooks::get(&client, id).await.expect("get");
            (s.state == "paused").then_some(s)
        })
        .await;
        let reason = paused.paused_reason.clone().expect("a reason");
        assert!(reason.starts_with("failing since ") && reason.contains(why), "{reason}");
        assert!(paused.attempts >= 2, "retried before pausing: {paused:?}");
        assert_eq!(paused.delivered, 0);
    }
    stop.send(true).expect("stop");
    running.await.expect("joined").expect("delivery stopped cleanly");

    // The operator sees why through the CLI and resumes it; it fails again, from the same fact.
    let operator = crate::harness::operator(&db).await;
    let listed = custodian_as(db.url.expose(), &operator, &["webhook", "list", "--json"]);
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let listed = listed.json();
    let shown = listed.as_array().unwrap().iter().find(|s| s["id"] == down_id).expect("listed").clone();
    assert_eq!(shown["state"], "paused");
    assert!(shown.get("secret").is_none(), "the secret is never listed");
    let resumed =
        custodian_as(db.url.expose(), &operator, &["webhook", "resume", "--id", &down_id.to_string(), "--json"]);
    assert_eq!(resumed.code, 0, "{}", resumed.stderr);
    assert_eq!(resumed.json()["state"], "active");
    let run = custodian_as(db.url.expose(), &operator, &["webhook", "deliver", "--once", "--json"]);
    assert_eq!(run.code, 1, "a failed delivery is an operational failure: {}", run.stdout);
    let report = run.json();
    assert!(report["subscribers"][down_id.to_string()]["failed"]
        .as_str()
        .is_some_and(|e| e.contains("cannot connect")));
}

#[tokio::test]
async fn webhook_commands_refuse_bad_input_with_nothing_written() {
    let db = TestDb::new().await;
    let operator = crate::harness::operator(&db).await;
    let url = db.url.expose();
    let loose = std::env::temp_dir().join(format!("custodian-{}-loose-secret", std::process::id()));
    std::fs::write(&loose, SECRET).unwrap();
    std::fs::set_permissions(&loose, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let loose = loose.to_str().unwrap().to_owned();
    for (args, message) in [
        (vec!["--url", "ftp://example.com/x", "--kinds", "deposit"], "http:// or https://"),
        (vec!["--url", "not a url", "--kinds", "deposit"], "--url"),
        (vec!["--url", "https://user:pw@example.com/x", "--kinds", "deposit"], "credentials"),
        (vec!["--url", "https://example.com/x", "--kinds", "deposits"], "unknown kind"),
        (vec!["--url", "https://example.com/x", "--kinds", ","], "at least one kind"),
        (vec!["--url", "https://example.com/x", "--kinds", "deposit", "--secret-file", &loose], "chmod 600"),
    ] {
        let run = custodian_as(url, &operator, &[&["webhook", "add"][..], &args].concat());
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains(message), "{args:?}: {}", run.stderr);
    }
    let no_token = custodian(url, &["webhook", "add", "--url", "https://example.com/x", "--kinds", "deposit"]);
    assert_eq!(no_token.code, 2, "{}", no_token.stderr);
    let reader = crate::harness::token(&db, "reader", &[Scope::Read]).await;
    let wrong_scope = custodian_as(url, &reader, &["webhook", "list"]);
    assert_eq!(wrong_scope.code, 2, "{}", wrong_scope.stderr);
    let client = db.pool.get().await.unwrap();
    let rows: i64 = client.query_one("select count(*) from webhook_subscriber", &[]).await.unwrap().get(0);
    assert_eq!(rows, 0, "nothing was written");

    let added = custodian_as(
        url,
        &operator,
        &["webhook", "add", "--url", "https://example.com/x", "--kinds", "deposit,withdrawal", "--json"],
    );
    assert_eq!(added.code, 0, "{}", added.stderr);
    let added = added.json();
    assert!(added["secret"].as_str().is_some_and(|s| s.starts_with("whsec_") && s.len() == 70), "{added}");
    assert_eq!(added["kinds"], serde_json::json!(["deposit", "withdrawal"]));
    let id = added["id"].as_i64().unwrap().to_string();
    let missing = custodian_as(url, &operator, &["webhook", "pause", "--id", "999"]);
    assert_eq!(missing.code, 2, "{}", missing.stderr);
    assert!(missing.stderr.contains("no webhook subscriber has id 999"));
    let removed = custodian_as(url, &operator, &["webhook", "remove", "--id", &id]);
    assert_eq!(removed.code, 0, "{}", removed.stderr);
    let actions: Vec<String> =
        column(&client, "select action from operator_action where action like 'webhook_%' order by id", &[]).await;
    assert_eq!(actions, ["webhook_added", "webhook_removed"], "each change is an operator action");
}

/// `custodian serve` with webhook delivery and no chain.
struct Served {
    child: std::process::Child,
    grpc: String,
}

/// The process goes with the value, also when a test panics.
impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(db: &TestDb, config: &std::path::Path) -> Served {
    let mut command = Command::new(env!("CARGO_BIN_EXE_custodian"));
    for (key, _) in std::env::vars() {
        if key.starts_with("CUSTODIAN_") {
            command.env_remove(key);
        }
    }
    let mut child = command
        .env("CUSTODIAN_DATABASE_URL", db.url.expose())
        .args(["serve", "--config"])
        .arg(config)
        .args(["--grpc-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting custodian serve");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut grpc = String::new();
    for _ in 0..2 {
        let line = lines.next().expect("serve prints its addresses").expect("utf-8");
        if let Some(address) = line.strip_prefix("grpc listening on ") {
            grpc = address.to_owned();
        }
    }
    Served { child, grpc }
}

#[tokio::test]
async fn two_serve_processes_deliver_one_subscriber_without_duplicates_and_survive_a_kill() {
    let db = TestDb::new().await;
    let config = std::env::temp_dir().join(format!("custodian-{}-webhooks.toml", std::process::id()));
    std::fs::write(&config, "[webhooks]\npoll_ms = 50\ntimeout_ms = 500\nlease_ms = 1500\nmin_backoff_ms = 50\n")
        .unwrap();
    let mut a = serve(&db, &config);
    let mut b = serve(&db, &config);
    let receiver = Receiver::ok().await;

    // Added through the gRPC Admin service of one of them.
    let operator = crate::harness::operator(&db).await;
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", a.grpc)).unwrap().connect().await.unwrap();
    let mut admin = custodian_api::pb::admin_client::AdminClient::new(channel);
    let mut request = tonic::Request::new(custodian_api::pb::AddWebhookRequest {
        url: receiver.url.clone(),
        kinds: vec!["operator".to_owned()],
        secret: Some(SECRET.to_owned()),
        from_start: true,
    });
    request.metadata_mut().insert("authorization", format!("Bearer {operator}").parse().unwrap());
    let added = admin.add_webhook(request).await.expect("AddWebhook").into_inner();
    let id = added.webhook.expect("the subscriber").id;
    assert!(added.secret.is_none());
    let mut bad = tonic::Request::new(custodian_api::pb::AddWebhookRequest {
        url: "gopher://x".to_owned(),
        kinds: vec!["operator".to_owned()],
        secret: None,
        from_start: false,
    });
    bad.metadata_mut().insert("authorization", format!("Bearer {operator}").parse().unwrap());
    assert_eq!(admin.add_webhook(bad).await.unwrap_err().code(), tonic::Code::InvalidArgument);

    // Facts keep coming while the process holding the subscriber is killed.
    let client = db.pool.get().await.unwrap();
    let mut killed = None;
    for i in 0..40 {
        tokens::create(&client, &format!("t-{i}"), &[Scope::Read], BOOTSTRAP_PRINCIPAL).await.expect("token");
        tokio::time::sleep(Duration::from_millis(25)).await;
        if i == 20 {
            let owner = eventually("a process holds the subscriber", Duration::from_secs(30), || async {
                client
                    .query_one("select lease_owner from webhook_subscriber where id = $1", &[&id])
                    .await
                    .unwrap()
                    .get::<_, Option<String>>(0)
            })
            .await;
            let pid: u32 = owner.rsplit(':').next().unwrap().parse().expect("host:pid");
            let (victim, survivor) = if pid == a.child.id() { (&mut a, &mut b) } else { (&mut b, &mut a) };
            assert_eq!(victim.child.id(), pid, "the lease names one of the two processes");
            victim.child.kill().expect("SIGKILL");
            victim.child.wait().expect("reaped");
            killed = Some(survivor.child.id());
        }
    }
    let survivor = killed.expect("one was killed");
    let all = eventually("all facts are final", Duration::from_secs(30), || async {
        let facts = expected(&db, Kind::Operator, None).await;
        (facts.len() >= 42).then_some(facts)
    })
    .await;
    let got = eventually("the survivor delivers the rest", Duration::from_secs(60), || async {
        let got = receiver.delivered();
        let mut unique = got.clone();
        unique.dedup();
        (unique.len() >= all.len()).then_some(got)
    })
    .await;
    let mut in_order = got.clone();
    in_order.dedup();
    assert_eq!(in_order, all, "every fact, in order; a repeat only right after itself");
    assert!(got.len() - all.len() <= 1, "at most the fact in flight at the kill was sent twice: {got:?}");
    for r in receiver.requests() {
        assert_signed(&r, SECRET);
    }
    let owner: Option<String> =
        client.query_one("select lease_owner from webhook_subscriber where id = $1", &[&id]).await.unwrap().get(0);
    assert!(
        owner.as_ref().is_none_or(|o| o.ends_with(&format!(":{survivor}"))),
        "only the survivor holds it now: {owner:?}"
    );
    drop((a, b));
    let _ = std::fs::remove_file(&config);
}
