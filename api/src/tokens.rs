//! API tokens: created with scopes, stored only as their SHA-256, revoked but never deleted.
//!
//! A token is [`TOKEN_PREFIX`] followed by the lowercase hex of 32 bytes read from the operating
//! system's random source. It is shown once, by [`create`]; the `api_token` table keeps the
//! SHA-256 of the 32 bytes, so a copy of the table cannot call the API. The server hashes the
//! presented token and compares it with every active hash in constant time (see `authenticate`).
//! The table's trigger allows one change, setting `revoked_at` once; [`revoke`] relies on it.

use std::fmt;
use std::io::Read;
use std::str::FromStr;

use bitcoin::hashes::{sha256, Hash};
use deadpool_postgres::GenericClient;

/// What every token starts with, so a leaked one is recognisable (secret scanners, logs).
pub const TOKEN_PREFIX: &str = "cust_";

/// Random bytes in a token.
const TOKEN_BYTES: usize = 32;

/// The longest token name (the table checks the same).
pub const MAX_NAME_LEN: usize = 64;

/// Where the randomness comes from.
const RANDOM_SOURCE: &str = "/dev/urandom";

/// What a token allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    /// Balances, ledger entries, deposit addresses, withdrawal status and the event history.
    Read,
    /// The client's writes: accounts, deposit addresses, withdrawal requests and cancels.
    Withdraw,
    /// Decisions: approving withdrawals and deciding reversals. `admin` alone does not.
    Approve,
    /// Configuration: lanes, limits, confirmation policy, assets and API tokens.
    Admin,
}

impl Scope {
    /// Every scope, in a stable order.
    pub const ALL: [Scope; 4] = [Scope::Read, Scope::Withdraw, Scope::Approve, Scope::Admin];

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Withdraw => "withdraw",
            Scope::Approve => "approve",
            Scope::Admin => "admin",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A scope name that is not `read`, `withdraw`, `approve` or `admin`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown scope {0:?}: expected read, withdraw, approve or admin")]
pub struct UnknownScope(pub String);

impl FromStr for Scope {
    type Err = UnknownScope;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Scope::ALL
            .into_iter()
            .find(|scope| scope.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownScope(s.to_owned()))
    }
}

/// Why a token was not created or revoked. Nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The name is empty, too long, or has characters other than letters, digits and `-_.@:`.
    #[error("token name {0:?} must be 1 to {MAX_NAME_LEN} characters of letters, digits, '-', '_', '.', '@' or ':'")]
    InvalidName(String),
    /// A token needs at least one scope.
    #[error("a token needs at least one scope (read, withdraw, approve, admin)")]
    NoScopes,
    /// Another token, active or revoked, has this name. Names are never reused, so the history
    /// of who held which access stays unambiguous.
    #[error("a token named {0:?} exists already (names are not reused, even after revocation)")]
    NameTaken(String),
    /// No token has this name.
    #[error("no token is named {0:?}")]
    UnknownName(String),
    /// The operating system's random source could not be read.
    #[error("could not read randomness from {RANDOM_SOURCE}: {0}")]
    Random(#[source] std::io::Error),
    /// The database failed.
    #[error("database error: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// A stored token, as the server sees it after a match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredToken {
    /// Row id: the rate limiter's key.
    pub id: i64,
    /// Its name, for messages and logs.
    pub name: String,
    /// What it allows.
    pub scopes: Vec<Scope>,
}

/// The outcome of presenting a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Presented {
    /// An active token.
    Active(StoredToken),
    /// A token that was revoked.
    Revoked {
        /// Its name.
        name: String,
    },
    /// No token has this hash.
    Unknown,
}

/// The token and its `token_created` operator action, in one statement.
const INSERT_TOKEN: &str = "
with created as (
    insert into api_token (name, token_hash, scopes) values ($1, $2, $3)
    on conflict (name) do nothing
    returning id
)
insert into operator_action (action, principal, details)
select 'token_created', $4, jsonb_build_object('name', $1::text, 'token_id', id, 'scopes', to_jsonb($3::text[]))
  from created
returning 1";

/// The revocation and its `token_revoked` operator action, in one statement.
const REVOKE_TOKEN: &str = "
with revoked as (
    update api_token set revoked_at = now() where name = $1 and revoked_at is null returning id
)
insert into operator_action (action, principal, details)
select 'token_revoked', $2, jsonb_build_object('name', $1::text, 'token_id', id)
  from revoked
returning 1";

/// Whether any active token may administer (a first token can be created without one).
const ANY_ADMIN: &str = "select exists (select 1 from api_token where revoked_at is null and 'admin' = any(scopes))";

const TOKEN_EXISTS: &str = "select 1 from api_token where name = $1";

/// Every token with whether it is revoked (see [`TokenSet`]).
const ALL_TOKENS: &str =
    "select id, name, token_hash, scopes, revoked_at is not null as revoked from api_token order by id";

fn valid_name(name: &str) -> bool {
    (1..=MAX_NAME_LEN).contains(&name.len())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '@' | ':'))
}

fn random_bytes() -> Result<[u8; TOKEN_BYTES], TokenError> {
    let mut bytes = [0u8; TOKEN_BYTES];
    std::fs::File::open(RANDOM_SOURCE).and_then(|mut f| f.read_exact(&mut bytes)).map_err(TokenError::Random)?;
    Ok(bytes)
}

/// SHA-256 of a token's raw bytes: what the table stores.
fn hash(bytes: &[u8; TOKEN_BYTES]) -> [u8; 32] {
    sha256::Hash::hash(bytes).to_byte_array()
}

/// The raw bytes of a presented token, if it has the shape of one.
fn decode(token: &str) -> Option<[u8; TOKEN_BYTES]> {
    let hex = token.strip_prefix(TOKEN_PREFIX)?.as_bytes();
    if hex.len() != 2 * TOKEN_BYTES {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut bytes = [0u8; TOKEN_BYTES];
    for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(bytes)
}

fn encode(bytes: &[u8; TOKEN_BYTES]) -> String {
    let mut token = String::with_capacity(TOKEN_PREFIX.len() + 2 * TOKEN_BYTES);
    token.push_str(TOKEN_PREFIX);
    for byte in bytes {
        token.push_str(&format!("{byte:02x}"));
    }
    token
}

/// Whether two hashes are equal, in time that does not depend on where they differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut difference = 0u8;
    for (x, y) in a.iter().zip(b) {
        // black_box keeps the optimiser from turning the loop into an early-exit comparison.
        difference = std::hint::black_box(difference | (x ^ y));
    }
    difference == 0
}

/// Creates a token named `name` with `scopes` on `by`'s authority (recorded as an operator
/// action) and returns it. This is the only time the token is known: only its hash is stored.
pub async fn create<C: GenericClient>(
    client: &C,
    name: &str,
    scopes: &[Scope],
    by: &str,
) -> Result<String, TokenError> {
    if !valid_name(name) {
        return Err(TokenError::InvalidName(name.to_owned()));
    }
    let mut scopes = scopes.to_vec();
    scopes.sort();
    scopes.dedup();
    if scopes.is_empty() {
        return Err(TokenError::NoScopes);
    }
    let stored_scopes: Vec<&str> = scopes.iter().map(|s| s.as_str()).collect();
    let bytes = random_bytes()?;
    let token_hash = hash(&bytes).to_vec();
    // The unique name is the guard against two tokens with one name; a second create meets it.
    let inserted = client.query_opt(INSERT_TOKEN, &[&name, &token_hash, &stored_scopes, &by]).await?;
    if inserted.is_none() {
        return Err(TokenError::NameTaken(name.to_owned()));
    }
    Ok(encode(&bytes))
}

/// Revokes the token named `name` on `by`'s authority (recorded as an operator action): true if
/// revoked now, false if it was revoked before.
pub async fn revoke<C: GenericClient>(client: &C, name: &str, by: &str) -> Result<bool, TokenError> {
    if client.query_opt(REVOKE_TOKEN, &[&name, &by]).await?.is_some() {
        return Ok(true);
    }
    match client.query_opt(TOKEN_EXISTS, &[&name]).await? {
        Some(_) => Ok(false),
        None => Err(TokenError::UnknownName(name.to_owned())),
    }
}

/// Whether no active token holds the `admin` scope: then, and only then, the first one may be
/// created without presenting a token (the principal is recorded as [`BOOTSTRAP_PRINCIPAL`]).
pub async fn needs_bootstrap<C: GenericClient>(client: &C) -> Result<bool, tokio_postgres::Error> {
    Ok(!client.query_one(ANY_ADMIN, &[]).await?.get::<_, bool>(0))
}

/// Who created the first admin token: the operator at the database, before any token existed.
pub const BOOTSTRAP_PRINCIPAL: &str = "bootstrap";

/// Why a presented token does not authorise a call.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// Not the shape of a token.
    #[error("the token is malformed: expected {TOKEN_PREFIX:?} followed by 64 lowercase hex digits")]
    Malformed,
    /// No token has this hash.
    #[error("the token is not a known API token")]
    Unknown,
    /// Revoked.
    #[error("the API token {0:?} has been revoked")]
    Revoked(String),
    /// The token lacks the scope.
    #[error("{call} needs the {scope} scope; the API token {name:?} has {held}")]
    MissingScope {
        /// What was attempted.
        call: String,
        /// The scope needed.
        scope: Scope,
        /// The token's name.
        name: String,
        /// Its scopes, comma-separated.
        held: String,
    },
    /// The database failed.
    #[error("database error while checking the token: {}", custodian_store::describe(.0))]
    Database(#[from] tokio_postgres::Error),
}

/// Checks `token` exactly as the API does (known, not revoked, holding `scope`) and returns the
/// principal it stands for: the token's name. The CLI calls this for every decision it records.
pub async fn principal<C: GenericClient>(client: &C, token: &str, scope: Scope, call: &str) -> Result<String, Refusal> {
    let token = match authenticate(client, token).await? {
        None => return Err(Refusal::Malformed),
        Some(Presented::Unknown) => return Err(Refusal::Unknown),
        Some(Presented::Revoked { name }) => return Err(Refusal::Revoked(name)),
        Some(Presented::Active(token)) => token,
    };
    token.check_scope(scope, call)?;
    Ok(token.name)
}

impl StoredToken {
    /// Refuses a call needing `scope` when the token does not hold it.
    pub(crate) fn check_scope(&self, scope: Scope, call: &str) -> Result<(), Refusal> {
        if self.scopes.contains(&scope) {
            return Ok(());
        }
        let held: Vec<&str> = self.scopes.iter().map(|s| s.as_str()).collect();
        Err(Refusal::MissingScope { call: call.to_owned(), scope, name: self.name.clone(), held: held.join(", ") })
    }
}

/// Every token, active and revoked, as read at one moment: what the server checks presented
/// tokens against. Tokens are issued by operators to the services that call the API, a few dozen
/// at most, so reading them all is cheap, and a presented token costs no query at all while the
/// snapshot is fresh (see `auth`'s cache).
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenSet {
    active: Vec<([u8; 32], StoredToken)>,
    revoked: Vec<([u8; 32], String)>,
}

impl TokenSet {
    /// Reads every token.
    pub(crate) async fn load<C: GenericClient>(client: &C) -> Result<TokenSet, tokio_postgres::Error> {
        let mut set = TokenSet::default();
        for row in client.query(ALL_TOKENS, &[]).await? {
            let stored: &[u8] = row.get(2);
            let hash: [u8; 32] = stored.try_into().expect("BUG: token_hash is 32 bytes, checked by the table");
            let name: String = row.get(1);
            if row.get::<_, bool>(4) {
                set.revoked.push((hash, name));
            } else {
                let scopes: Vec<String> = row.get(3);
                let scopes =
                    scopes.iter().map(|s| s.parse().expect("BUG: api_token.scopes are checked by the table")).collect();
                set.active.push((hash, StoredToken { id: row.get(0), name, scopes }));
            }
        }
        Ok(set)
    }

    /// What `token` is. `None` when it does not have the shape of a token at all.
    pub(crate) fn present(&self, token: &str) -> Option<Presented> {
        let presented = hash(&decode(token)?);
        let mut found = None;
        for (stored, token) in &self.active {
            // No early exit: every active hash is compared whichever matches.
            if constant_time_eq(stored, &presented) {
                found = Some(token.clone());
            }
        }
        if let Some(token) = found {
            return Some(Presented::Active(token));
        }
        Some(match self.revoked.iter().find(|(stored, _)| *stored == presented) {
            Some((_, name)) => Presented::Revoked { name: name.clone() },
            None => Presented::Unknown,
        })
    }

    /// Whether the token with row id `id` is still active.
    pub(crate) fn is_active(&self, id: i64) -> bool {
        self.active.iter().any(|(_, token)| token.id == id)
    }
}

/// Looks up a presented token. `None` when it does not have the shape of a token at all.
pub(crate) async fn authenticate<C: GenericClient>(
    client: &C,
    token: &str,
) -> Result<Option<Presented>, tokio_postgres::Error> {
    if decode(token).is_none() {
        return Ok(None);
    }
    Ok(TokenSet::load(client).await?.present(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_parse_and_print() {
        for scope in Scope::ALL {
            assert_eq!(scope.to_string().parse::<Scope>(), Ok(scope));
        }
        assert_eq!(" Admin ".parse::<Scope>(), Ok(Scope::Admin));
        assert_eq!("write".parse::<Scope>(), Err(UnknownScope("write".into())));
    }

    #[test]
    fn tokens_round_trip_and_malformed_ones_are_refused() {
        let bytes: [u8; 32] = std::array::from_fn(|i| u8::try_from(i * 7).unwrap());
        let token = encode(&bytes);
        assert_eq!(token.len(), TOKEN_PREFIX.len() + 64);
        assert_eq!(decode(&token), Some(bytes));
        let cases = [
            "",
            "cust_",
            &token[TOKEN_PREFIX.len()..],
            &token[..token.len() - 1],
            &format!("{token}0"),
            &token.to_uppercase(),
            &token.replace(TOKEN_PREFIX, "cast_"),
            &format!("{}g", &token[..token.len() - 1]),
        ];
        for case in cases {
            assert_eq!(decode(case), None, "{case:?}");
        }
    }

    #[test]
    fn hashes_compare_equal_only_when_identical() {
        let a = hash(&[1; 32]);
        assert!(constant_time_eq(&a, &a));
        for position in [0, 17, 31] {
            let mut b = a;
            b[position] ^= 0x80;
            assert!(!constant_time_eq(&a, &b), "differs at {position}");
        }
    }

    #[test]
    fn names_are_checked() {
        for good in ["reporting", "alice@ops", "svc:payouts-2", "a", &"x".repeat(MAX_NAME_LEN)] {
            assert!(valid_name(good), "{good:?}");
        }
        for bad in ["", " ", "two words", "tab\t", &"x".repeat(MAX_NAME_LEN + 1), "ünïcode"] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn random_tokens_differ() {
        assert_ne!(random_bytes().unwrap(), random_bytes().unwrap());
    }
}
