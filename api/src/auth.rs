//! Who is calling and whether they may: the peer's request rate, the bearer token, its scopes and
//! its request rate.
//!
//! Every RPC except `Health.Check` starts with [`Authenticator::authorize`], naming the scope it
//! needs. Order: the peer address must be within its rate (`RESOURCE_EXHAUSTED`, before any
//! database work, so a flood of made-up tokens costs the database nothing); a token must be
//! presented (`UNAUTHENTICATED` otherwise), known and not revoked (`UNAUTHENTICATED`), within its
//! rate (`RESOURCE_EXHAUSTED`), and carry the scope (`PERMISSION_DENIED`).
//!
//! Tokens are checked against a snapshot of the `api_token` table read at most every
//! [`TOKEN_SNAPSHOT_MAX_AGE`], so a revocation takes effect within that time, for open streams
//! too (they ask [`Authenticator::still_active`] as they go).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use custodian_store::Pool;
use tonic::{Request, Status};

use crate::rate::RateLimiter;
use crate::status;
use crate::tokens::{Presented, Scope, TokenSet, TOKEN_PREFIX};

/// The metadata key carrying the token.
const AUTHORIZATION: &str = "authorization";

/// How old the token snapshot may be: a revoked token is refused at most this long after its
/// revocation commits.
pub(crate) const TOKEN_SNAPSHOT_MAX_AGE: Duration = Duration::from_millis(500);

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

/// Checks tokens against a fresh snapshot of `api_token` and holds the rate limits.
#[derive(Debug)]
pub(crate) struct Authenticator {
    pool: Pool,
    tokens: RateLimiter<i64>,
    peers: RateLimiter<IpAddr>,
    snapshot: tokio::sync::Mutex<Option<(Instant, Arc<TokenSet>)>>,
}

impl Authenticator {
    /// An authenticator over `pool` with the given rates.
    pub(crate) fn new(pool: Pool, rates: Rates) -> Authenticator {
        Authenticator {
            pool,
            tokens: RateLimiter::new(rates.token.0, rates.token.1),
            peers: RateLimiter::new(rates.peer.0, rates.peer.1),
            snapshot: tokio::sync::Mutex::new(None),
        }
    }

    /// The token snapshot, read again when older than [`TOKEN_SNAPSHOT_MAX_AGE`]. One reader
    /// refreshes while the others wait for it, so a burst of calls costs one query.
    async fn tokens(&self) -> Result<Arc<TokenSet>, Status> {
        let mut snapshot = self.snapshot.lock().await;
        match snapshot.as_ref() {
            Some((read_at, tokens)) if read_at.elapsed() < TOKEN_SNAPSHOT_MAX_AGE => Ok(tokens.clone()),
            _ => self.refresh(&mut snapshot).await,
        }
    }

    /// A snapshot read after `arrived`, so it holds every token committed before the call came
    /// in (one created a moment ago works at once). Snapshots are read at most every
    /// [`UNKNOWN_REFRESH_MIN_AGE`] this way: a flood of made-up tokens waits instead of turning
    /// into a query each.
    async fn tokens_read_after(&self, arrived: Instant) -> Result<Arc<TokenSet>, Status> {
        loop {
            let mut snapshot = self.snapshot.lock().await;
            let wait = match snapshot.as_ref() {
                Some((read_at, tokens)) if *read_at >= arrived => return Ok(tokens.clone()),
                Some((read_at, _)) => UNKNOWN_REFRESH_MIN_AGE.saturating_sub(read_at.elapsed()),
                None => Duration::ZERO,
            };
            if wait.is_zero() {
                return self.refresh(&mut snapshot).await;
            }
            drop(snapshot);
            tokio::time::sleep(wait).await;
        }
    }

    async fn refresh(&self, snapshot: &mut Option<(Instant, Arc<TokenSet>)>) -> Result<Arc<TokenSet>, Status> {
        // Stamped before the query: every token committed before this instant is in the answer.
        let read_at = Instant::now();
        let client = self.pool.get().await.map_err(|e| status::pool(&e))?;
        let tokens =
            Arc::new(TokenSet::load(&client).await.map_err(|e| status::database("checking the API token", &e))?);
        *snapshot = Some((read_at, tokens.clone()));
        Ok(tokens)
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
