//! Who is calling and whether they may: the bearer token, its scopes and its request rate.
//!
//! Every RPC except `Health.Check` starts with [`Authenticator::authorize`], naming the scope it
//! needs. Order: a token must be presented (`UNAUTHENTICATED` otherwise), known and not revoked
//! (`UNAUTHENTICATED`), within its rate (`RESOURCE_EXHAUSTED`), and carry the scope
//! (`PERMISSION_DENIED`). The token is looked up on every call, so a revocation takes effect at
//! once.

use custodian_store::Pool;
use tonic::{Request, Status};

use crate::rate::RateLimiter;
use crate::status;
use crate::tokens::{self, Presented, Scope};

/// The metadata key carrying the token.
const AUTHORIZATION: &str = "authorization";

/// The caller of an authorised request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Caller {
    /// The token's name, for the records a call leaves (who cancelled).
    pub name: String,
}

/// Checks tokens against the `api_token` table and holds the per-token rate limits.
#[derive(Debug)]
pub(crate) struct Authenticator {
    pool: Pool,
    limiter: RateLimiter,
}

impl Authenticator {
    /// An authenticator over `pool` admitting `burst` requests at once and `requests_per_second`
    /// sustained per token.
    pub(crate) fn new(pool: Pool, requests_per_second: u32, burst: u32) -> Authenticator {
        Authenticator { pool, limiter: RateLimiter::new(requests_per_second, burst) }
    }

    /// Lets `request` through to `call` if its token is valid, within its rate and has `scope`.
    pub(crate) async fn authorize<T>(&self, request: &Request<T>, scope: Scope, call: &str) -> Result<Caller, Status> {
        let token = bearer(request)?;
        let client = self.pool.get().await.map_err(|e| status::pool(&e))?;
        let presented =
            tokens::authenticate(&client, token).await.map_err(|e| status::database("checking the API token", &e))?;
        drop(client);
        let token = match presented {
            None => {
                return Err(Status::unauthenticated(format!(
                    "the bearer token is malformed: expected {:?} followed by 64 lowercase hex digits",
                    tokens::TOKEN_PREFIX
                )))
            }
            Some(Presented::Unknown) => {
                return Err(Status::unauthenticated("the bearer token is not a known API token"))
            }
            Some(Presented::Revoked { name }) => {
                return Err(Status::unauthenticated(format!("the API token {name:?} has been revoked")))
            }
            Some(Presented::Active(token)) => token,
        };
        if let Err(wait) = self.limiter.check(token.id) {
            return Err(Status::resource_exhausted(format!(
                "the API token {:?} exceeded its request rate; retry in {} ms",
                token.name,
                wait.as_millis().max(1)
            )));
        }
        token.check_scope(scope, call).map_err(|refusal| Status::permission_denied(refusal.to_string()))?;
        tracing::debug!(token = %token.name, call, "authorised");
        Ok(Caller { name: token.name })
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
