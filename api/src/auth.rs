//! Who is calling and whether they may: the peer's request rate, the bearer token, its scopes and
//! its request rate.
//!
//! Every RPC except `Health.Check` starts with [`Authenticator::authorize`], naming the scope it
//! needs. Order: the peer address must be within its rate (`RESOURCE_EXHAUSTED`, before any
//! database work, so a flood of made-up tokens costs the database nothing); a token must be
//! presented (`UNAUTHENTICATED` otherwise), known and not revoked (`UNAUTHENTICATED`), within its
//! rate (`RESOURCE_EXHAUSTED`), and carry the scope (`PERMISSION_DENIED`).
//!
//! Tokens are checked against a snapshot of the `api_token` table that a task of its own reads
//! every quarter second, never older than [`TOKEN_SNAPSHOT_MAX_AGE`], so a revocation takes effect
//! within that time, for open streams too (they ask [`Authenticator::still_active`] as they go).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use custodian_store::Pool;
use tokio::sync::{watch, Notify};
use tonic::{Request, Status};

use crate::rate::RateLimiter;
use crate::tokens::{Presented, Scope, TokenSet, TOKEN_PREFIX};

/// The metadata key carrying the token.
const AUTHORIZATION: &str = "authorization";

/// How old a snapshot may be and still be used. It is read every quarter second, so a revocation
/// normally takes effect within that; if the reads fail, calls are refused (`UNAVAILABLE`) once
/// the last good snapshot is this old, so a revoked token is never served longer.
pub(crate) const TOKEN_SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(1);

/// How often a token unknown to the snapshot may cause it to be read again: a flood of made-up
/// tokens costs at most one query per interval.
const UNKNOWN_REFRESH_MIN_AGE: Duration = Duration::from_millis(100);

/// The caller of an authorised request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    /// The token's name: the principal recorded for what the call does.
    pub name: String,
    /// The token's row id.
    pub token_id: i64,
}

/// Rates, in requests per second and burst.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rates {
    /// Per token.
    pub token: (u32, u32),
    /// Per peer address.
    pub peer: (u32, u32),
}

/// A read of the token table and when it started.
#[derive(Debug, Clone)]
struct Snapshot {
    read_at: Instant,
    tokens: Arc<TokenSet>,
}

/// Checks tokens against a fresh snapshot of `api_token` and holds the rate limits.
///
/// The snapshot is read by a task of its own, every [`REFRESH_INTERVAL`] and at once when a call
/// presents a token the snapshot does not know (but never more often than
/// [`UNKNOWN_REFRESH_MIN_AGE`]). Calls never wait on each other for a refresh, and a database
/// that stops answering makes calls fail closed (`UNAVAILABLE`) once the snapshot is older than
/// [`TOKEN_SNAPSHOT_MAX_AGE`], never serve a stale one.
#[derive(Debug)]
pub(crate) struct Authenticator {
    tokens: RateLimiter<i64>,
    peers: RateLimiter<IpAddr>,
    snapshot: watch::Receiver<Option<Snapshot>>,
    wake: Arc<Notify>,
}

/// How often the token table is read while nothing asks for it sooner.
const REFRESH_INTERVAL: Duration = Duration::from_millis(250);

impl Authenticator {
    /// An authenticator over `pool` with the given rates; starts the snapshot's reader, which
    /// ends when the authenticator is dropped.
    pub(crate) fn new(pool: Pool, rates: Rates) -> Authenticator {
        let (publish, snapshot) = watch::channel(None);
        let wake = Arc::new(Notify::new());
        tokio::spawn(refresh_tokens(pool, publish, wake.clone()));
        Authenticator {
            tokens: RateLimiter::new(rates.token.0, rates.token.1),
            peers: RateLimiter::new(rates.peer.0, rates.peer.1),
            snapshot,
            wake,
        }
    }

    /// The newest snapshot that `fresh_enough` accepts, waiting (bounded) for the reader.
    async fn snapshot_where(&self, fresh_enough: impl Fn(&Snapshot) -> bool) -> Result<Arc<TokenSet>, Status> {
        let mut snapshot = self.snapshot.clone();
        let found =
            tokio::time::timeout(SNAPSHOT_WAIT, snapshot.wait_for(|s| s.as_ref().is_some_and(&fresh_enough))).await;
        match found {
            Ok(Ok(found)) => Ok(found.as_ref().expect("BUG: wait_for returned an empty snapshot").tokens.clone()),
            _ => Err(Status::unavailable(format!(
                "the API tokens could not be read from the database; retry in {} ms",
                SNAPSHOT_WAIT.as_millis()
            ))),
        }
    }

    /// A snapshot at most [`TOKEN_SNAPSHOT_MAX_AGE`] old.
    async fn tokens(&self) -> Result<Arc<TokenSet>, Status> {
        self.snapshot_where(|s| s.read_at.elapsed() < TOKEN_SNAPSHOT_MAX_AGE).await
    }

    /// A snapshot read after `arrived`, so it holds every token committed before the call came
    /// in (one created a moment ago works at once).
    async fn tokens_read_after(&self, arrived: Instant) -> Result<Arc<TokenSet>, Status> {
        self.wake.notify_one();
        self.snapshot_where(|s| s.read_at >= arrived).await
    }

    /// Lets `request` through to `call` if its peer is within its rate, and its token is valid,
    /// within its rate and has `scope`.
    pub(crate) async fn authorize<T>(&self, request: &Request<T>, scope: Scope, call: &str) -> Result<Caller, Status> {
        if let Some(peer) = request.remote_addr() {
            if let Err(wait) = self.peers.check(peer.ip()) {
                metrics::counter!("custodian_api_refused_total", "reason" => "peer_rate").increment(1);
                return Err(Status::resource_exhausted(format!(
                    "too many requests from {}; retry in {} ms",
                    peer.ip(),
                    wait.as_millis().max(1)
                )));
            }
        }
        let arrived = Instant::now();
        let token = bearer(request)?;
        let mut presented = self.tokens().await?.present(token);
        if matches!(presented, Some(Presented::Unknown)) {
            // Perhaps created since the snapshot was read.
            presented = self.tokens_read_after(arrived).await?.present(token);
        }
        let token = match presented {
            None => {
                return Err(Status::unauthenticated(format!(
                    "the bearer token is malformed: expected {TOKEN_PREFIX:?} followed by 64 lowercase hex digits"
                )))
            }
            Some(Presented::Unknown) => {
                metrics::counter!("custodian_api_refused_total", "reason" => "unknown_token").increment(1);
                return Err(Status::unauthenticated("the bearer token is not a known API token"));
            }
            Some(Presented::Revoked { name }) => {
                return Err(Status::unauthenticated(format!("the API token {name:?} has been revoked")))
            }
            Some(Presented::Active(token)) => token,
        };
        if let Err(wait) = self.tokens.check(token.id) {
            return Err(Status::resource_exhausted(format!(
                "the API token {:?} exceeded its request rate; retry in {} ms",
                token.name,
                wait.as_millis().max(1)
            )));
        }
        token.check_scope(scope, call).map_err(|refusal| Status::permission_denied(refusal.to_string()))?;
        tracing::debug!(token = %token.name, call, "authorised");
        Ok(Caller { name: token.name, token_id: token.id })
    }

    /// `UNAUTHENTICATED` once `caller`'s token has been revoked: open streams ask as they go.
    pub(crate) async fn still_active(&self, caller: &Caller) -> Result<(), Status> {
        if self.tokens().await?.is_active(caller.token_id) {
            Ok(())
        } else {
            Err(Status::unauthenticated(format!("the API token {:?} has been revoked", caller.name)))
        }
    }
}

/// How long a call waits for a usable snapshot before `UNAVAILABLE`.
const SNAPSHOT_WAIT: Duration = Duration::from_secs(2);

/// Reads the token table into `publish` until nobody listens: every [`REFRESH_INTERVAL`], or
/// sooner when woken, but never twice within [`UNKNOWN_REFRESH_MIN_AGE`]. A failed read keeps
/// the previous snapshot (which ages out) and is retried.
async fn refresh_tokens(pool: Pool, publish: watch::Sender<Option<Snapshot>>, wake: Arc<Notify>) {
    while !publish.is_closed() {
        // Stamped before the query: every token committed before this instant is in the answer.
        let read_at = Instant::now();
        let read = match pool.get().await {
            Ok(client) => TokenSet::load(&client).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match read {
            Ok(tokens) => {
                publish.send_replace(Some(Snapshot { read_at, tokens: Arc::new(tokens) }));
            }
            Err(error) => tracing::warn!(%error, "could not read the API tokens; retrying"),
        }
        tokio::time::sleep(UNKNOWN_REFRESH_MIN_AGE.saturating_sub(read_at.elapsed())).await;
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep(REFRESH_INTERVAL.saturating_sub(read_at.elapsed())) => {}
            () = publish.closed() => return,
        }
    }
}

/// The token in `authorization: Bearer <token>`.
fn bearer<T>(request: &Request<T>) -> Result<&str, Status> {
    let value = request
        .metadata()
        .get(AUTHORIZATION)
        .ok_or_else(|| Status::unauthenticated("no API token: send the metadata `authorization: Bearer <token>`"))?;
    let value =
        value.to_str().map_err(|_| Status::unauthenticated("the authorization metadata is not printable ASCII"))?;
    let (scheme, token) = value.trim().split_once(' ').unwrap_or((value.trim(), ""));
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(Status::unauthenticated("the authorization metadata must be `Bearer <token>`"));
    }
    Ok(token.trim())
}
