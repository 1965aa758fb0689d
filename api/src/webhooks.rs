//! Webhooks: the fact history pushed to subscribers (DESIGN §8).
//!
//! A subscriber names a URL and the kinds of facts it wants. Each has a cursor over the history
//! ([`custodian_projections::history`], final order), and the [`Deliverer`] sends it every fact of
//! its kinds after the cursor, one `POST` per fact, in order, moving the cursor only after a
//! `2xx`. So delivery is at least once: a crash between the answer and the cursor update sends
//! that fact again. The body is the fact as JSON with its position as `id`; the request carries
//! `Custodian-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
//!
//! A failure (no answer within the timeout, a connection refused, any status but `2xx`) is
//! retried with exponential backoff and jitter; a subscriber failing for longer than the
//! configured age is paused with the reason, until an operator resumes it. Every subscriber is
//! delivered by its own task, so a slow or failing one never delays another, and nothing the
//! scanners, the worker or the ledger do waits for delivery. Several processes may deliver: a
//! subscriber is held by one of them at a time through a lease in its row (no lock is held across
//! a request); see `migrations/V6__api.sql`.

use std::collections::HashMap;
use std::time::Duration;

use bitcoin::hashes::{hmac, sha256, Hash, HashEngine};
use custodian_projections::history::{self, Fact, HistoryError};
use custodian_store::operator::{self, Action};
use custodian_store::Pool;
use deadpool_postgres::GenericClient;
use serde::Serialize;
use serde_json::json;
use tokio::sync::watch;

/// The header carrying the timestamp and the signature.
pub const SIGNATURE_HEADER: &str = "Custodian-Signature";
/// The header carrying the fact's position (also the body's `id`).
pub const ID_HEADER: &str = "Custodian-Event-Id";

/// The kinds of facts a subscriber may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Blocks, orphan marks and reinstatements.
    Block,
    /// Deposits observed, and the ledger transfers that credit them or take them back.
    Deposit,
    /// Every ledger transfer.
    Ledger,
    /// Reversal proposals and decisions.
    Reversal,
    /// Every withdrawal event (requested, approved, signed, broadcast, mined, confirmed, …).
    Withdrawal,
    /// Operator actions.
    Operator,
}

impl Kind {
    /// Every kind, in the order `--help` lists them.
    pub const ALL: [Kind; 6] =
        [Kind::Block, Kind::Deposit, Kind::Ledger, Kind::Reversal, Kind::Withdrawal, Kind::Operator];

    /// The stored and printed name.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Block => "block",
            Kind::Deposit => "deposit",
            Kind::Ledger => "ledger",
            Kind::Reversal => "reversal",
            Kind::Withdrawal => "withdrawal",
            Kind::Operator => "operator",
        }
    }

    /// Whether `fact` is of this kind.
    pub fn covers(self, fact: &Fact) -> bool {
        let kind = fact.kind.as_str();
        let transfer_kind = || fact.payload.get("kind").and_then(serde_json::Value::as_str).unwrap_or("");
        match self {
            Kind::Block => matches!(kind, "block" | "orphan_mark" | "block_reinstated"),
            Kind::Deposit => {
                kind == "deposit_observed"
                    || (kind == "ledger_transfer" && matches!(transfer_kind(), "deposit" | "deposit_loss" | "reversal"))
            }
            Kind::Ledger => kind == "ledger_transfer",
            Kind::Reversal => kind.starts_with("reversal_"),
            Kind::Withdrawal => kind.starts_with("withdrawal_"),
            Kind::Operator => kind.starts_with("operator_"),
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = WebhookError;

    fn from_str(s: &str) -> Result<Kind, WebhookError> {
        Kind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| WebhookError::Invalid(format!("unknown kind {s:?}: expected one of {}", names(&Kind::ALL))))
    }
}

fn names(kinds: &[Kind]) -> String {
    kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(",")
}

/// A subscriber as `webhook list` shows it (never its secret).
#[derive(Debug, Clone, Serialize)]
pub struct Subscriber {
    /// Its id.
    pub id: i64,
    /// Where facts are posted.
    pub url: String,
    /// The kinds it receives.
    pub kinds: Vec<String>,
    /// `active` or `paused`.
    pub state: String,
    /// Why it is paused.
    pub paused_reason: Option<String>,
    /// The last fact delivered or passed over (null: none yet).
    pub cursor: Option<i64>,
    /// Facts delivered.
    pub delivered: i64,
    /// Failed attempts at the next fact.
    pub attempts: i32,
    /// The last failure, while failing.
    pub last_error: Option<String>,
    /// Facts of its kinds after the cursor still to deliver (its backlog), at most [`history::MAX_PAGE`].
    pub backlog: Option<i64>,
    /// Who added it.
    pub created_by: String,
    /// When.
    pub created_at: String,
}

/// Why a webhook operation failed.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// Bad input; nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// No subscriber has that id.
    #[error("no webhook subscriber has id {0}")]
    NotFound(i64),
    /// The history could not be read.
    #[error(transparent)]
    History(#[from] HistoryError),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
    /// No connection could be had.
    #[error("database pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// The operating system's random source could not be read.
    #[error("could not read randomness: {0}")]
    Random(#[source] std::io::Error),
    /// The HTTP client could not be built.
    #[error("HTTP client: {0}")]
    Http(#[source] reqwest::Error),
}

impl WebhookError {
    /// Whether the caller asked for something that cannot be done (exit 2, `INVALID_ARGUMENT` or
    /// `NOT_FOUND`), as opposed to a failure.
    pub fn is_refusal(&self) -> bool {
        matches!(self, WebhookError::Invalid(_) | WebhookError::NotFound(_))
    }
}

/// What [`add`] returns: the subscriber and, when the service chose it, its secret (shown once).
#[derive(Debug, Serialize)]
pub struct Added {
    /// The new subscriber.
    #[serde(flatten)]
    pub subscriber: Subscriber,
    /// The generated secret, when none was given; it is not shown again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
}

const SELECT: &str = "
select id, url, kinds, state, paused_reason, cursor_position, delivered, attempts, last_error, created_by,
       to_char(created_at at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
  from webhook_subscriber";

fn subscriber(row: &tokio_postgres::Row) -> Subscriber {
    Subscriber {
        id: row.get(0),
        url: row.get(1),
        kinds: row.get(2),
        state: row.get(3),
        paused_reason: row.get(4),
        cursor: row.get(5),
        delivered: row.get(6),
        attempts: row.get(7),
        last_error: row.get(8),
        backlog: None,
        created_by: row.get(9),
        created_at: row.get(10),
    }
}

/// The kinds named in `list` (comma-separated), deduplicated, in their canonical order.
pub fn parse_kinds(list: &str) -> Result<Vec<Kind>, WebhookError> {
    let mut kinds = Vec::new();
    for name in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let kind: Kind = name.parse()?;
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    if kinds.is_empty() {
        return Err(WebhookError::Invalid(format!("give at least one kind: {}", names(&Kind::ALL))));
    }
    kinds.sort_by_key(|k| Kind::ALL.iter().position(|a| a == k));
    Ok(kinds)
}

fn check_url(url: &str) -> Result<(), WebhookError> {
    let parsed = reqwest::Url::parse(url).map_err(|e| WebhookError::Invalid(format!("--url {url:?}: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(WebhookError::Invalid(format!("--url {url:?}: expected an http:// or https:// URL with a host")));
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(WebhookError::Invalid(format!(
            "--url {url:?}: credentials in the URL would be stored in plain sight; receivers check the signature"
        )));
    }
    if url.len() > 2048 || url.chars().any(char::is_whitespace) {
        return Err(WebhookError::Invalid("--url: at most 2,048 characters and no spaces".to_owned()));
    }
    Ok(())
}

/// A secret given by the operator: 16 to 512 printable ASCII characters once trimmed.
pub fn check_secret(secret: &str) -> Result<&str, WebhookError> {
    let secret = secret.trim();
    if !(16..=512).contains(&secret.len()) || !secret.chars().all(|c| c.is_ascii_graphic()) {
        return Err(WebhookError::Invalid(
            "the webhook secret must be 16 to 512 printable ASCII characters (no spaces)".to_owned(),
        ));
    }
    Ok(secret)
}

fn random_secret() -> Result<String, WebhookError> {
    use std::io::Read;
    let mut bytes = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes)).map_err(WebhookError::Random)?;
    Ok(format!("whsec_{}", bytes.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// The position of the last final fact, where a subscriber that does not want the past starts.
async fn history_end<C: GenericClient>(client: &C) -> Result<Option<i64>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "select position from audit_event
              where xid < pg_snapshot_xmin(pg_current_snapshot())
              order by xid desc, position desc limit 1",
            &[],
        )
        .await?
        .map(|row| row.get(0)))
}

/// Adds a subscriber for `kinds` at `url`, signed with `secret` (generated when `None`), starting
/// after the last final fact, or with the whole history when `from_start`. Recorded as an
/// operator action by `by`.
pub async fn add(
    client: &mut deadpool_postgres::Object,
    url: &str,
    kinds: &[Kind],
    secret: Option<&str>,
    from_start: bool,
    by: &str,
) -> Result<Added, WebhookError> {
    check_url(url)?;
    if kinds.is_empty() {
        return Err(WebhookError::Invalid(format!("give at least one kind: {}", names(&Kind::ALL))));
    }
    let (secret, generated) = match secret {
        Some(given) => (check_secret(given)?.to_owned(), false),
        None => (random_secret()?, true),
    };
    let kind_names: Vec<&str> = kinds.iter().map(|k| k.as_str()).collect();
    let tx = client.transaction().await?;
    let cursor = if from_start { None } else { history_end(&tx).await? };
    let id: i64 = tx
        .query_one(
            "insert into webhook_subscriber (url, kinds, secret, cursor_position, created_by)
             values ($1, $2, $3, $4, $5) returning id",
            &[&url, &kind_names, &secret, &cursor, &by],
        )
        .await?
        .get(0);
    operator::record(
        &tx,
        Action::WebhookAdded,
        by,
        &json!({ "subscriber": id, "url": url, "kinds": kind_names, "from_start": from_start }),
    )
    .await?;
    tx.commit().await?;
    let subscriber = get(&*client, id).await?;
    Ok(Added { subscriber, secret: generated.then_some(secret) })
}

/// One subscriber.
pub async fn get<C: GenericClient>(client: &C, id: i64) -> Result<Subscriber, WebhookError> {
    let row = client.query_opt(&format!("{SELECT} where id = $1"), &[&id]).await?.ok_or(WebhookError::NotFound(id))?;
    let mut found = subscriber(&row);
    found.backlog = Some(backlog(client, &found).await?);
    Ok(found)
}

/// Every subscriber, with its backlog.
pub async fn list<C: GenericClient>(client: &C) -> Result<Vec<Subscriber>, WebhookError> {
    let mut all: Vec<Subscriber> =
        client.query(&format!("{SELECT} order by id"), &[]).await?.iter().map(subscriber).collect();
    for s in &mut all {
        s.backlog = Some(backlog(client, s).await?);
    }
    Ok(all)
}

/// How many final facts of the subscriber's kinds follow its cursor (counted up to one page).
async fn backlog<C: GenericClient>(client: &C, s: &Subscriber) -> Result<i64, WebhookError> {
    let kinds: Vec<Kind> = s.kinds.iter().filter_map(|k| k.parse().ok()).collect();
    let facts = history::page(client, s.cursor, history::MAX_PAGE).await?;
    let wanted = facts.iter().filter(|f| kinds.iter().any(|k| k.covers(f))).count();
    Ok(i64::try_from(wanted).unwrap_or(i64::MAX))
}

/// Every subscriber's backlog and state as gauges (`custodian_webhook_backlog{subscriber}`,
/// `custodian_webhook_paused{subscriber}`).
pub async fn record_gauges<C: GenericClient>(client: &C) -> Result<(), WebhookError> {
    for s in list(client).await? {
        let id = s.id.to_string();
        metrics::gauge!("custodian_webhook_backlog", "subscriber" => id.clone()).set(s.backlog.unwrap_or(0) as f64);
        metrics::gauge!("custodian_webhook_paused", "subscriber" => id).set(if s.state == "paused" {
            1.0
        } else {
            0.0
        });
    }
    Ok(())
}

/// Pauses (`Some(reason)`) or resumes (`None`) a subscriber. Resuming clears its failures and
/// makes it due at once; its cursor stays where it was, so nothing is skipped.
pub async fn set_paused(
    client: &mut deadpool_postgres::Object,
    id: i64,
    reason: Option<&str>,
    by: &str,
) -> Result<Subscriber, WebhookError> {
    if let Some(reason) = reason.filter(|r| r.trim().is_empty()) {
        return Err(WebhookError::Invalid(format!("a pause needs a reason for the next operator (got {reason:?})")));
    }
    let tx = client.transaction().await?;
    let changed = match reason {
        Some(reason) => {
            tx.execute(
                "update webhook_subscriber set state = 'paused', paused_reason = $2 where id = $1",
                &[&id, &reason.trim()],
            )
            .await?
        }
        None => {
            tx.execute(
                "update webhook_subscriber
                    set state = 'active', paused_reason = null, attempts = 0, failing_since = null,
                        last_error = null, next_attempt_at = now()
                  where id = $1",
                &[&id],
            )
            .await?
        }
    };
    if changed == 0 {
        return Err(WebhookError::NotFound(id));
    }
    let (action, details) = match reason {
        Some(reason) => (Action::WebhookPaused, json!({ "subscriber": id, "reason": reason.trim() })),
        None => (Action::WebhookResumed, json!({ "subscriber": id })),
    };
    operator::record(&tx, action, by, &details).await?;
    tx.commit().await?;
    get(&*client, id).await
}

/// Removes a subscriber: nothing more is delivered to it.
pub async fn remove(client: &mut deadpool_postgres::Object, id: i64, by: &str) -> Result<(), WebhookError> {
    let tx = client.transaction().await?;
    let url: String = tx
        .query_opt("delete from webhook_subscriber where id = $1 returning url", &[&id])
        .await?
        .ok_or(WebhookError::NotFound(id))?
        .get(0);
    operator::record(&tx, Action::WebhookRemoved, by, &json!({ "subscriber": id, "url": url })).await?;
    tx.commit().await?;
    Ok(())
}

/// The signature of `body` sent at `timestamp` (unix seconds): lowercase hex of
/// HMAC-SHA256(`secret`, `"{timestamp}.{body}"`). Receivers compute the same and compare in
/// constant time, and refuse timestamps far from their clock (replays).
pub fn signature(secret: &str, timestamp: u64, body: &[u8]) -> String {
    let mut engine = hmac::HmacEngine::<sha256::Hash>::new(secret.as_bytes());
    engine.input(timestamp.to_string().as_bytes());
    engine.input(b".");
    engine.input(body);
    let mac = hmac::Hmac::<sha256::Hash>::from_engine(engine);
    mac.to_byte_array().iter().map(|b| format!("{b:02x}")).collect()
}

/// The request body of `fact`: its position as `id`, its kind, when it was recorded, what it says.
pub fn body(fact: &Fact) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "id": fact.position,
        "kind": fact.kind,
        "recorded_at": fact.recorded_at,
        "payload": fact.payload,
    }))
    .unwrap_or_default()
}

/// How delivery behaves (`[webhooks]` in the configuration).
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    /// How long one request may take.
    pub timeout: Duration,
    /// A subscriber failing for longer than this is paused.
    pub max_age: Duration,
    /// How often due subscribers are looked for.
    pub poll: Duration,
    /// How long a process holds a subscriber without renewing.
    pub lease: Duration,
    /// The first retry's wait; each further one doubles it (with jitter), up to `max_backoff`.
    pub min_backoff: Duration,
    /// The longest wait between retries.
    pub max_backoff: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            timeout: Duration::from_secs(10),
            max_age: Duration::from_secs(24 * 3600),
            poll: Duration::from_secs(1),
            lease: Duration::from_secs(60),
            min_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(600),
        }
    }
}

/// What one subscriber's turn did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Turn {
    /// Facts delivered (`2xx`).
    pub delivered: u64,
    /// Facts of other kinds passed over.
    pub skipped: u64,
    /// The failure that ended the turn, if one did.
    pub failed: Option<String>,
    /// Whether that failure paused the subscriber.
    pub paused: bool,
}

/// What a pass over every due subscriber did, per subscriber id.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PassReport {
    /// Each subscriber's turn.
    pub subscribers: std::collections::BTreeMap<i64, Turn>,
}

struct Claimed {
    url: String,
    kinds: Vec<Kind>,
    secret: String,
    cursor: Option<i64>,
    attempts: i32,
}

/// Facts read per page while delivering.
const DELIVERY_PAGE: i64 = 500;

/// Delivers the history to subscribers. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Deliverer {
    pool: Pool,
    http: reqwest::Client,
    config: DeliveryConfig,
    owner: String,
}

impl Deliverer {
    /// A deliverer on `pool`; `owner` names this process in leases (host and pid, say).
    /// The lease is at least three request timeouts, so no lease runs out while its holder is
    /// still waiting for an answer.
    pub fn new(pool: Pool, mut config: DeliveryConfig, owner: String) -> Result<Deliverer, WebhookError> {
        config.lease = config.lease.max(config.timeout.saturating_mul(3));
        custodian_store::tls::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            // A receiver answers; it does not send the signed fact somewhere else.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("custodian-webhooks/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(WebhookError::Http)?;
        Ok(Deliverer { pool, http, config, owner })
    }

    /// Subscribers due now that no other process holds.
    async fn due(&self) -> Result<Vec<i64>, WebhookError> {
        let client = self.pool.get().await?;
        let rows = client
            .query(
                "select id from webhook_subscriber
                  where state = 'active' and next_attempt_at <= now()
                    and (lease_until is null or lease_until < now() or lease_owner = $1)
                  order by id",
                &[&self.owner],
            )
            .await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    fn lease_ms(&self) -> i64 {
        i64::try_from(self.config.lease.as_millis()).unwrap_or(i64::MAX)
    }

    /// Takes (or renews) the lease of subscriber `id` if it is due and free.
    async fn claim(&self, id: i64) -> Result<Option<Claimed>, WebhookError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "update webhook_subscriber
                    set lease_owner = $2, lease_until = now() + $3::bigint * interval '1 millisecond'
                  where id = $1 and state = 'active' and next_attempt_at <= now()
                    and (lease_until is null or lease_until < now() or lease_owner = $2)
                  returning url, kinds, secret, cursor_position, attempts",
                &[&id, &self.owner, &self.lease_ms()],
            )
            .await?;
        Ok(row.map(|row| Claimed {
            url: row.get(0),
            kinds: row.get::<_, Vec<String>>(1).iter().filter_map(|k| k.parse().ok()).collect(),
            secret: row.get(2),
            cursor: row.get(3),
            attempts: row.get(4),
        }))
    }

    /// Moves the cursor to `position` (and counts `delivered`), renewing the lease; false when the
    /// lease was lost (another process holds the subscriber now, or it was paused or removed).
    async fn advance(&self, id: i64, position: i64, delivered: bool) -> Result<bool, WebhookError> {
        let client = self.pool.get().await?;
        let changed = client
            .execute(
                "update webhook_subscriber
                    set cursor_position = $3,
                        delivered = delivered + case when $4 then 1 else 0 end,
                        last_delivered_at = case when $4 then now() else last_delivered_at end,
                        attempts = 0, failing_since = null, last_error = null,
                        lease_until = now() + $5::bigint * interval '1 millisecond'
                  where id = $1 and lease_owner = $2 and state = 'active'",
                &[&id, &self.owner, &position, &delivered, &self.lease_ms()],
            )
            .await?;
        Ok(changed == 1)
    }

    /// Records a failed attempt: the next waits longer, and a subscriber failing for longer than
    /// the maximum age is paused. The lease is let go. Returns whether it was paused.
    async fn failed(&self, id: i64, attempts: i32, error: &str) -> Result<bool, WebhookError> {
        let shift = u32::try_from(attempts.clamp(0, 20)).unwrap_or(20);
        let base = self.config.min_backoff.saturating_mul(1u32 << shift).min(self.config.max_backoff);
        let wait = custodian_store::jittered(base).min(self.config.max_backoff.max(self.config.min_backoff));
        let wait_ms = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
        let max_age_ms = i64::try_from(self.config.max_age.as_millis()).unwrap_or(i64::MAX);
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "update webhook_subscriber
                    set attempts = attempts + 1,
                        failing_since = coalesce(failing_since, now()),
                        last_error = $3,
                        next_attempt_at = now() + $4::bigint * interval '1 millisecond',
                        state = case when now() - coalesce(failing_since, now()) >= $5::bigint * interval '1 millisecond'
                                     then 'paused' else 'active' end,
                        paused_reason = case when now() - coalesce(failing_since, now()) >= $5::bigint * interval '1 millisecond'
                                             then 'failing since ' || to_char(coalesce(failing_since, now()) at time zone 'UTC',
                                                                             'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')
                                                  || ' (' || (attempts + 1) || ' attempts): ' || $3
                                        end,
                        lease_owner = null, lease_until = null
                  where id = $1 and lease_owner = $2
                  returning state = 'paused'",
                &[&id, &self.owner, &error, &wait_ms, &max_age_ms],
            )
            .await?;
        Ok(row.is_some_and(|r| r.get(0)))
    }

    /// Lets go of subscriber `id` (caught up, or stopping).
    async fn release(&self, id: i64) -> Result<(), WebhookError> {
        let client = self.pool.get().await?;
        client
            .execute(
                "update webhook_subscriber set lease_owner = null, lease_until = null where id = $1 and lease_owner = $2",
                &[&id, &self.owner],
            )
            .await?;
        Ok(())
    }

    /// Sends one fact; `Err` describes the failure.
    async fn send(&self, claimed: &Claimed, fact: &Fact) -> Result<(), String> {
        let body = body(fact);
        let timestamp =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let signed = format!("t={timestamp},v1={}", signature(&claimed.secret, timestamp, &body));
        let started = std::time::Instant::now();
        let answer = self
            .http
            .post(&claimed.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(SIGNATURE_HEADER, signed)
            .header(ID_HEADER, fact.position.to_string())
            .body(body)
            .send()
            .await;
        metrics::histogram!("custodian_webhook_request_seconds").record(started.elapsed().as_secs_f64());
        match answer {
            Ok(response) if response.status().is_success() => Ok(()),
            Ok(response) => Err(format!("HTTP {}", response.status())),
            Err(e) if e.is_timeout() => Err(format!("no answer within {} ms", self.config.timeout.as_millis())),
            Err(e) if e.is_connect() => Err(format!("cannot connect: {}", root_cause(&e))),
            Err(e) => Err(root_cause(&e)),
        }
    }

    /// One subscriber's turn: claims it, then delivers its facts in order until it is caught up, a
    /// request fails, the lease is lost or `stopped` says so.
    pub async fn turn(&self, id: i64, stopped: &watch::Receiver<bool>) -> Result<Option<Turn>, WebhookError> {
        let Some(claimed) = self.claim(id).await? else { return Ok(None) };
        let mut turn = Turn::default();
        let mut cursor = claimed.cursor;
        'pages: loop {
            let facts = history::page(&self.pool.get().await?, cursor, DELIVERY_PAGE).await?;
            if facts.is_empty() {
                break;
            }
            let mut passed_over = None;
            for fact in &facts {
                if *stopped.borrow() {
                    break 'pages;
                }
                if !claimed.kinds.iter().any(|k| k.covers(fact)) {
                    passed_over = Some(fact.position);
                    turn.skipped += 1;
                    continue;
                }
                match self.send(&claimed, fact).await {
                    Ok(()) => {
                        metrics::counter!("custodian_webhook_deliveries_total", "outcome" => "delivered").increment(1);
                        if !self.advance(id, fact.position, true).await? {
                            return Ok(Some(turn));
                        }
                        turn.delivered += 1;
                        passed_over = None;
                        cursor = Some(fact.position);
                    }
                    Err(error) => {
                        metrics::counter!("custodian_webhook_deliveries_total", "outcome" => "failed").increment(1);
                        if let Some(position) = passed_over {
                            self.advance(id, position, false).await?;
                        }
                        // Delivering in this turn reset the count; otherwise the row's count stands.
                        let attempts = if turn.delivered > 0 { 0 } else { claimed.attempts };
                        turn.paused = self.failed(id, attempts, &error).await?;
                        if turn.paused {
                            tracing::error!(subscriber = id, %error, "ALERT: webhook subscriber paused: failing for too long");
                        } else {
                            tracing::warn!(subscriber = id, position = fact.position, %error, "webhook delivery failed; retrying later");
                        }
                        turn.failed = Some(error);
                        return Ok(Some(turn));
                    }
                }
            }
            if let Some(position) = passed_over {
                if !self.advance(id, position, false).await? {
                    return Ok(Some(turn));
                }
                cursor = Some(position);
            }
        }
        self.release(id).await?;
        Ok(Some(turn))
    }

    /// Every due subscriber, each in its own task, until each is caught up or has failed once.
    pub async fn pass(&self) -> Result<PassReport, WebhookError> {
        let (_keep, stopped) = watch::channel(false);
        let mut tasks = tokio::task::JoinSet::new();
        for id in self.due().await? {
            let (me, stopped) = (self.clone(), stopped.clone());
            tasks.spawn(async move { (id, me.turn(id, &stopped).await) });
        }
        let mut report = PassReport::default();
        while let Some(joined) = tasks.join_next().await {
            let Ok((id, turn)) = joined else { continue };
            if let Some(turn) = turn? {
                report.subscribers.insert(id, turn);
            }
        }
        Ok(report)
    }

    /// Delivers until `stopped`: every [`DeliveryConfig::poll`], each due subscriber not already
    /// being delivered here gets a task of its own. Database failures are logged and retried.
    pub async fn run(&self, mut stopped: watch::Receiver<bool>) -> Result<(), WebhookError> {
        let mut running: HashMap<i64, tokio::task::JoinHandle<()>> = HashMap::new();
        loop {
            running.retain(|_, task| !task.is_finished());
            match self.due().await {
                Ok(due) => {
                    for id in due {
                        if running.contains_key(&id) {
                            continue;
                        }
                        let (me, stopped) = (self.clone(), stopped.clone());
                        running.insert(
                            id,
                            tokio::spawn(async move {
                                if let Err(e) = me.turn(id, &stopped).await {
                                    tracing::warn!(subscriber = id, error = %e, "webhook delivery interrupted; retrying");
                                }
                            }),
                        );
                    }
                }
                Err(e) => tracing::warn!(error = %e, "looking for due webhook subscribers failed; retrying"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.config.poll) => {}
                _ = stopped.wait_for(|stop| *stop) => break,
            }
        }
        for (id, task) in running {
            let _ = task.await;
            let _ = self.release(id).await;
        }
        Ok(())
    }
}

fn root_cause(error: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = error;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}
