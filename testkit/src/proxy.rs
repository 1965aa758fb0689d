//! Fault injection between the service and what it talks to.
//!
//! [`RpcProxy`] sits in front of one or more JSON-RPC nodes: it forwards each request to one of
//! them (a fixed one, or alternating per request, as a load balancer in front of two nodes does)
//! and can answer `null` for `eth_getBlockReceipts`, as a node still indexing does. [`TcpProxy`]
//! forwards bytes to a server (PostgreSQL) and can go down: open connections are cut and new ones
//! refused until it comes back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct RpcState {
    upstreams: Vec<SocketAddr>,
    /// Index of the upstream served when not alternating.
    fixed: AtomicUsize,
    alternate: AtomicBool,
    /// Requests forwarded so far (drives alternation).
    requests: AtomicUsize,
    /// `eth_getBlockReceipts` calls still to be answered `null`.
    null_receipts: AtomicU32,
    /// A method answered "method not found" (-32601), as a node without that API does, or an
    /// error for calls of a method whose parameters contain a string.
    refused: std::sync::Mutex<Option<(String, Option<String>)>>,
    /// Calls of a method mentioning a string that are never answered.
    silent: std::sync::Mutex<Option<(String, String)>>,
}

/// A JSON-RPC proxy in front of nodes on loopback.
pub struct RpcProxy {
    state: Arc<RpcState>,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    server: tokio::task::JoinHandle<()>,
}

impl RpcProxy {
    /// A proxy serving `upstreams` (`http://127.0.0.1:<port>` URLs), the first one by default.
    pub async fn start(upstreams: &[&str]) -> Result<RpcProxy> {
        let upstreams = upstreams
            .iter()
            .map(|url| url.trim_start_matches("http://").trim_end_matches('/').parse().context("an upstream address"))
            .collect::<Result<Vec<SocketAddr>>>()?;
        let state = Arc::new(RpcState { upstreams, ..RpcState::default() });
        let (url, server) = listen(state.clone(), serve_rpc).await?;
        Ok(RpcProxy { state, url, server })
    }

    /// Serves every request from upstream `index` from now on.
    pub fn serve_only(&self, index: usize) {
        self.state.alternate.store(false, Ordering::SeqCst);
        self.state.fixed.store(index, Ordering::SeqCst);
    }

    /// Alternates between the first two upstreams, request by request.
    pub fn alternate(&self) {
        self.state.alternate.store(true, Ordering::SeqCst);
    }

    /// Answers the next `n` `eth_getBlockReceipts` calls with `null`.
    pub fn null_receipts(&self, n: u32) {
        self.state.null_receipts.store(n, Ordering::SeqCst);
    }

    /// Answers `method` with JSON-RPC's "method not found" from now on, as a node without that
    /// API (no `debug` namespace, say) does.
    pub fn refuse(&self, method: &str) {
        *self.state.refused.lock().expect("BUG: proxy lock poisoned") = Some((method.to_owned(), None));
    }

    /// Answers calls of `method` whose parameters mention `needle` (an address, say) with an
    /// internal error, as a node failing for one account does; other calls are served.
    pub fn fail_mentioning(&self, method: &str, needle: &str) {
        *self.state.refused.lock().expect("BUG: proxy lock poisoned") =
            Some((method.to_owned(), Some(needle.to_ascii_lowercase())));
    }

    /// Never answers calls of `method` whose parameters mention `needle`, as a node that went
    /// silent for them does; other calls are served.
    pub fn hang_mentioning(&self, method: &str, needle: &str) {
        *self.state.silent.lock().expect("BUG: proxy lock poisoned") =
            Some((method.to_owned(), needle.to_ascii_lowercase()));
    }

    /// Serves every call again (undoes [`refuse`](Self::refuse) and
    /// [`fail_mentioning`](Self::fail_mentioning)).
    pub fn heal(&self) {
        *self.state.refused.lock().expect("BUG: proxy lock poisoned") = None;
        *self.state.silent.lock().expect("BUG: proxy lock poisoned") = None;
    }

    /// Requests forwarded so far.
    pub fn requests(&self) -> usize {
        self.state.requests.load(Ordering::SeqCst)
    }

    /// `eth_getBlockReceipts` calls still to be answered `null`.
    pub fn null_receipts_left(&self) -> u32 {
        self.state.null_receipts.load(Ordering::SeqCst)
    }
}

impl Drop for RpcProxy {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// Reads one HTTP request (headers, then a `Content-Length` body); returns its body.
pub(crate) async fn read_http(stream: &mut TcpStream) -> Result<Vec<u8>> {
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buffer[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length:"))
                .map(|v| v.trim().parse())
                .transpose()?
                .unwrap_or(0);
            while buffer.len() < end + 4 + length {
                let n = stream.read(&mut chunk).await?;
                anyhow::ensure!(n > 0, "connection closed mid-body");
                buffer.extend_from_slice(&chunk[..n]);
            }
            return Ok(buffer[end + 4..end + 4 + length].to_vec());
        }
        let n = stream.read(&mut chunk).await?;
        anyhow::ensure!(n > 0, "connection closed");
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// Listens on a fresh port of 127.0.0.1 and serves each connection with `serve` on a task of its
/// own (an error ends only that connection). Returns the `http://127.0.0.1:<port>` URL and the
/// accepting task.
pub(crate) async fn listen<S, F, Fut>(state: Arc<S>, serve: F) -> Result<(String, tokio::task::JoinHandle<()>)>
where
    S: Send + Sync + 'static,
    F: Fn(TcpStream, Arc<S>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream, state.clone()));
        }
    });
    Ok((url, server))
}

async fn serve_rpc(mut stream: TcpStream, state: Arc<RpcState>) -> Result<()> {
    loop {
        let body = read_http(&mut stream).await?;
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let is_receipts = request["method"] == "eth_getBlockReceipts";
        let silent = state.silent.lock().expect("BUG: proxy lock poisoned").clone();
        if silent.is_some_and(|(method, needle)| {
            request["method"] == method.as_str() && request["params"].to_string().to_ascii_lowercase().contains(&needle)
        }) {
            // Silent: hold the connection open without a word until the client gives up.
            std::future::pending::<()>().await;
        }
        let refused = state.refused.lock().expect("BUG: proxy lock poisoned").clone();
        let refusal = refused.filter(|(method, needle)| {
            request["method"] == method.as_str()
                && needle
                    .as_ref()
                    .is_none_or(|n| request["params"].to_string().to_ascii_lowercase().contains(n.as_str()))
        });
        let answer = if let Some((method, needle)) = refusal {
            let (code, message) = match needle {
                None => (-32601, format!("the method {method} does not exist/is not available")),
                Some(_) => (-32603, "internal error".to_owned()),
            };
            serde_json::json!({"jsonrpc": "2.0", "id": request["id"], "error": {"code": code, "message": message}})
                .to_string()
                .into_bytes()
        } else if is_receipts
            && state.null_receipts.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
        {
            serde_json::json!({"jsonrpc": "2.0", "id": request["id"], "result": null}).to_string().into_bytes()
        } else {
            let n = state.requests.fetch_add(1, Ordering::SeqCst);
            let index = if state.alternate.load(Ordering::SeqCst) { n % 2 } else { state.fixed.load(Ordering::SeqCst) };
            forward(state.upstreams[index.min(state.upstreams.len() - 1)], &body).await?
        };
        let head =
            format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", answer.len());
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(&answer).await?;
    }
}

/// POSTs `body` to `upstream` and returns the response body.
pub(crate) async fn forward(upstream: SocketAddr, body: &[u8]) -> Result<Vec<u8>> {
    let mut stream = TcpStream::connect(upstream).await?;
    let head = format!(
        "POST / HTTP/1.1\r\nHost: {upstream}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let end = response.windows(4).position(|w| w == b"\r\n\r\n").context("an HTTP response")?;
    Ok(response[end + 4..].to_vec())
}

/// A byte-for-byte TCP proxy that can go down.
pub struct TcpProxy {
    down: Arc<AtomicBool>,
    /// Bumped on every outage: connections opened before it are cut.
    generation: Arc<AtomicU32>,
    /// The proxy's port on 127.0.0.1.
    pub port: u16,
    server: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// A proxy to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Result<TcpProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let down = Arc::new(AtomicBool::new(false));
        let generation = Arc::new(AtomicU32::new(0));
        let (down_flag, generations) = (down.clone(), generation.clone());
        let server = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if down_flag.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let (generations, born) = (generations.clone(), generations.load(Ordering::SeqCst));
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else { return };
                    let (mut client, mut server) = (client, server);
                    let cut = async {
                        while generations.load(Ordering::SeqCst) == born {
                            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                        }
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        () = cut => {}
                    }
                });
            }
        });
        Ok(TcpProxy { down, generation, port, server })
    }

    /// Cuts every open connection and refuses new ones (`true`), or serves again (`false`).
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
        if down {
            self.generation.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.server.abort();
    }
}
