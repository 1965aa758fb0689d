//! The one JSON-RPC transport to Bitcoin Core, shared by the scanner (reads) and the withdrawal
//! worker (fee estimates, broadcasts): credentials, the HTTP exchange, and Core's error objects
//! kept apart from transport failures so callers can classify them by code.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};

/// How long one RPC call may take before the node counts as unreachable.
pub const RPC_TIMEOUT: Duration = Duration::from_secs(30);

/// Credentials for Bitcoin Core's RPC.
#[derive(Clone)]
pub enum BtcAuth {
    /// `rpcuser` / `rpcpassword`.
    UserPassword {
        /// The user.
        user: String,
        /// The password (never printed).
        password: String,
    },
    /// The `.cookie` file Bitcoin Core writes into its data directory.
    CookieFile(std::path::PathBuf),
    /// No credentials.
    None,
}

impl std::fmt::Debug for BtcAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BtcAuth::UserPassword { user, .. } => write!(f, "UserPassword({user}, ***)"),
            BtcAuth::CookieFile(path) => write!(f, "CookieFile({})", path.display()),
            BtcAuth::None => f.write_str("None"),
        }
    }
}

/// An error object Bitcoin Core answered with: the node understood and refused.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RpcFault {
    /// Core's `RPCErrorCode` (-25 verify error, -26 rejected, -27 already in chain, …).
    pub code: i64,
    /// Core's message (for `sendrawtransaction`, the mempool's reject reason).
    pub message: String,
}

/// Why a call got no answer from Core: the transport, credentials, or a body that is not JSON-RPC.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// Unreachable, timed out, or the connection broke.
    #[error("{method}: {message}")]
    Unavailable {
        /// The method called.
        method: &'static str,
        /// What failed.
        message: String,
    },
    /// 401/403: the credentials are wrong.
    #[error("{method}: HTTP {status}: check CUSTODIAN_BTC_RPC_USER / _PASSWORD or the cookie file")]
    Unauthorized {
        /// The method called.
        method: &'static str,
        /// The HTTP status.
        status: u16,
    },
    /// The body is not a JSON-RPC reply.
    #[error("{method} answered HTTP {status} with a non-JSON-RPC body ({message}): {body:.200}")]
    Malformed {
        /// The method called.
        method: &'static str,
        /// The HTTP status.
        status: u16,
        /// The parse error.
        message: String,
        /// The start of what came back.
        body: String,
    },
}

/// A client of the configured Bitcoin Core nodes (one or more; see [`crate::nodes`]): calls go
/// to the current node and fail over to the next when it does not answer; `sendrawtransaction`
/// goes to all of them; a node whose genesis block differs from the others' is never used.
#[derive(Clone, Debug)]
pub struct BtcRpc {
    http: reqwest::Client,
    nodes: std::sync::Arc<crate::nodes::NodeSet>,
    auth: BtcAuth,
}

/// The methods sent to every node.
const BTC_BROADCASTS: [&str; 1] = ["sendrawtransaction"];

#[derive(Deserialize)]
struct RpcReply {
    result: Option<Value>,
    error: Option<RpcFault>,
}

impl BtcRpc {
    /// A client of the nodes at `urls` (comma-separated).
    pub fn new(urls: &str, auth: BtcAuth) -> Result<BtcRpc, TransportError> {
        crate::tls::install_crypto_provider();
        let unavailable = |message: String| TransportError::Unavailable { method: "connect", message };
        let urls = crate::nodes::split_urls(urls);
        if urls.is_empty() {
            return Err(unavailable("no Bitcoin RPC URL given".to_owned()));
        }
        let http = reqwest::Client::builder().timeout(RPC_TIMEOUT).build().map_err(|e| unavailable(e.to_string()))?;
        Ok(BtcRpc { http, nodes: std::sync::Arc::new(crate::nodes::NodeSet::new("btc", urls)), auth })
    }

    fn credentials(&self, method: &'static str) -> Result<Option<(String, String)>, TransportError> {
        let unavailable = |message: String| TransportError::Unavailable { method, message };
        match &self.auth {
            BtcAuth::UserPassword { user, password } => Ok(Some((user.clone(), password.clone()))),
            BtcAuth::CookieFile(path) => {
                // Re-read each time: Bitcoin Core writes a new cookie on every start.
                let cookie = std::fs::read_to_string(path)
                    .map_err(|e| unavailable(format!("cannot read cookie file {}: {e}", path.display())))?;
                let (user, password) = cookie
                    .trim()
                    .split_once(':')
                    .ok_or_else(|| unavailable(format!("cookie file {} is not user:password", path.display())))?;
                Ok(Some((user.to_owned(), password.to_owned())))
            }
            BtcAuth::None => Ok(None),
        }
    }

    /// One JSON-RPC call: the result, or the error object Core answered with. Core answers errors
    /// with HTTP 500 and a JSON body, so the body is read whatever the status; 401 has no body.
    ///
    /// # Cancel safety
    /// One HTTP exchange; cancelled, the node may or may not have acted on it.
    pub async fn call(&self, method: &'static str, params: Value) -> Result<Result<Value, RpcFault>, TransportError> {
        let ask = |index| {
            let params = params.clone();
            async move {
                if !self.check(index).await? {
                    return Ok(None);
                }
                self.call_node(index, method, params).await.map(Some)
            }
        };
        let answer = if self.nodes.len() > 1 && BTC_BROADCASTS.contains(&method) {
            self.nodes.broadcast(ask, Result::is_ok).await
        } else {
            self.nodes.read(ask).await
        };
        answer.map_err(|last| match last {
            Some(e) if !self.nodes.any_refused() => e,
            Some(e) => TransportError::Unavailable { method, message: format!("{e}; {}", self.nodes.none_usable()) },
            None => TransportError::Unavailable { method, message: self.nodes.none_usable() },
        })
    }

    /// Reads node `index`'s genesis hash if not yet known; whether the node may be used.
    async fn check(&self, index: usize) -> Result<bool, TransportError> {
        if let Some(usable) = self.nodes.usable(index) {
            return Ok(usable);
        }
        let genesis = match self.call_node(index, "getblockhash", json!([0])).await? {
            Ok(hash) => hash.as_str().unwrap_or("none").to_owned(),
            Err(fault) => format!("none ({})", fault.message),
        };
        Ok(self.nodes.identified(index, &format!("genesis {genesis}")))
    }

    /// One exchange with node `index`.
    async fn call_node(
        &self,
        index: usize,
        method: &'static str,
        params: Value,
    ) -> Result<Result<Value, RpcFault>, TransportError> {
        let body = json!({"jsonrpc": "1.0", "id": "custodian", "method": method, "params": params});
        let mut request = self.http.post(self.nodes.url(index)).json(&body);
        if let Some((user, password)) = self.credentials(method)? {
            request = request.basic_auth(user, Some(password));
        }
        let unavailable = |e: reqwest::Error| TransportError::Unavailable { method, message: e.to_string() };
        let response = request.send().await.map_err(unavailable)?;
        let status = response.status();
        if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
            return Err(TransportError::Unauthorized { method, status: status.as_u16() });
        }
        let text = response.text().await.map_err(unavailable)?;
        let reply: RpcReply = serde_json::from_str(&text).map_err(|e| TransportError::Malformed {
            method,
            status: status.as_u16(),
            message: e.to_string(),
            body: text.chars().take(200).collect(),
        })?;
        match (reply.error, reply.result) {
            (Some(fault), _) => Ok(Err(fault)),
            (None, Some(result)) => Ok(Ok(result)),
            (None, None) => Ok(Ok(Value::Null)),
        }
    }
}
