//! [`FaultyRpc`]: a JSON-RPC proxy in front of one node that, by a seeded schedule per method,
//! drops a request, forwards it but loses the answer, delays it past the client's timeout,
//! answers a scripted error ("already known", "nonce too low", "replacement transaction
//! underpriced", "insufficient funds", HTTP 429 or 502) or answers from a stale block. The same
//! seed gives the same sequence of decisions (per method, in the order requests arrive), so a
//! failing run prints its seed and the seed replays the schedule.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// One thing that can go wrong with a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// The connection closes before the request reaches the node.
    Drop,
    /// The node gets the request and acts on it; the answer never comes back.
    LoseAnswer,
    /// The request waits this long before it reaches the node (past the client's timeout, the
    /// client has given up by then; the node still acts on it).
    Delay(Duration),
    /// A JSON-RPC error with this message (code -32000), the node never asked.
    Error(&'static str),
    /// This HTTP status with an empty JSON body, the node never asked.
    Http(u16),
    /// Answered as a node this many blocks behind would: `eth_blockNumber`, `latest` and
    /// `pending` reads at that block, and receipts of later blocks `null`.
    Stale(u64),
}

/// Faults per method, each with its chance in a thousand per call.
#[derive(Debug, Clone, Default)]
pub struct Schedule {
    faults: HashMap<String, Vec<(Fault, u32)>>,
}

impl Schedule {
    /// No faults.
    pub fn new() -> Schedule {
        Schedule::default()
    }

    /// Adds `fault` to `method` with a chance of `per_mille` in a thousand calls.
    pub fn with(mut self, method: &str, fault: Fault, per_mille: u32) -> Schedule {
        self.faults.entry(method.to_owned()).or_default().push((fault, per_mille));
        self
    }

    /// Adds `fault` to each of `methods`.
    pub fn with_all(mut self, methods: &[&str], fault: Fault, per_mille: u32) -> Schedule {
        for method in methods {
            self = self.with(method, fault.clone(), per_mille);
        }
        self
    }
}

/// SplitMix64: small, fast, and the same on every machine. Tests draw their own seeded decisions
/// from it too.
pub fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct State {
    upstream: SocketAddr,
    schedule: Schedule,
    seed: u64,
    /// One random stream per method, so the decisions for a method do not depend on how calls of
    /// other methods interleave with it.
    streams: Mutex<HashMap<String, u64>>,
    enabled: AtomicBool,
    injected: Mutex<HashMap<String, u64>>,
    calls: AtomicU64,
}

/// A JSON-RPC proxy that injects faults by a seeded schedule.
pub struct FaultyRpc {
    state: Arc<State>,
    /// `http://127.0.0.1:<port>`.
    pub url: String,
    server: tokio::task::JoinHandle<()>,
}

impl FaultyRpc {
    /// A proxy in front of `upstream` (`http://127.0.0.1:<port>`), injecting `schedule` from the
    /// start with the decisions drawn from `seed`.
    pub async fn start(upstream: &str, schedule: Schedule, seed: u64) -> Result<FaultyRpc> {
        let upstream = upstream.trim_start_matches("http://").trim_end_matches('/').parse().context("the upstream")?;
        let state = Arc::new(State {
            upstream,
            schedule,
            seed,
            streams: Mutex::default(),
            enabled: AtomicBool::new(true),
            injected: Mutex::default(),
            calls: AtomicU64::new(0),
        });
        let (url, server) = crate::proxy::listen(state.clone(), serve).await?;
        Ok(FaultyRpc { state, url, server })
    }

    /// Stops injecting (`false`) or starts again (`true`).
    pub fn set_enabled(&self, enabled: bool) {
        self.state.enabled.store(enabled, Ordering::SeqCst);
    }

    /// How many faults of each kind were injected, keyed `method: fault`.
    pub fn injected(&self) -> HashMap<String, u64> {
        self.state.injected.lock().expect("BUG: proxy lock poisoned").clone()
    }

    /// Every call seen.
    pub fn calls(&self) -> u64 {
        self.state.calls.load(Ordering::SeqCst)
    }
}

impl Drop for FaultyRpc {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl State {
    /// The fault for this call of `method`, if the schedule draws one.
    fn draw(&self, method: &str) -> Option<Fault> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if !self.enabled.load(Ordering::SeqCst) {
            return None;
        }
        let faults = self.schedule.faults.get(method)?;
        let roll = {
            let mut streams = self.streams.lock().expect("BUG: proxy lock poisoned");
            let stream = streams.entry(method.to_owned()).or_insert_with(|| {
                let mut s = self.seed;
                method.bytes().for_each(|b| s = s.rotate_left(8) ^ u64::from(b));
                s
            });
            splitmix(stream) % 1000
        } as u32;
        let mut threshold = 0;
        for (fault, per_mille) in faults {
            threshold += per_mille;
            if roll < threshold {
                let key = format!("{method}: {fault:?}");
                *self.injected.lock().expect("BUG: proxy lock poisoned").entry(key).or_default() += 1;
                return Some(fault.clone());
            }
        }
        None
    }
}

async fn respond(stream: &mut TcpStream, status: u16, body: &[u8]) -> Result<()> {
    let reason = match status {
        200 => "OK",
        429 => "Too Many Requests",
        502 => "Bad Gateway",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body).await?;
    Ok(())
}

async fn call(upstream: SocketAddr, method: &str, params: Value) -> Result<Value> {
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
    let answer: Value = serde_json::from_slice(&crate::proxy::forward(upstream, body.as_bytes()).await?)?;
    Ok(answer["result"].clone())
}

fn quantity(value: &Value) -> Option<u64> {
    u64::from_str_radix(value.as_str()?.trim_start_matches("0x"), 16).ok()
}

/// The answer of a node `behind` blocks behind the upstream.
async fn stale(upstream: SocketAddr, request: &Value, body: &[u8], behind: u64) -> Result<Vec<u8>> {
    let head = quantity(&call(upstream, "eth_blockNumber", json!([])).await?).unwrap_or(0);
    let old = format!("0x{:x}", head.saturating_sub(behind));
    let reply =
        |result: Value| json!({"jsonrpc": "2.0", "id": request["id"], "result": result}).to_string().into_bytes();
    let method = request["method"].as_str().unwrap_or_default();
    let mut params = request["params"].clone();
    match method {
        "eth_blockNumber" => Ok(reply(json!(old))),
        "eth_getTransactionCount" | "eth_getBalance" | "eth_call" | "eth_getCode" => {
            if let Some(tag) = params.as_array_mut().and_then(|p| p.last_mut()) {
                if tag == "latest" || tag == "pending" {
                    *tag = json!(old);
                }
            }
            Ok(reply(call(upstream, method, params).await?))
        }
        "eth_getBlockByNumber" => {
            if let Some(tag) = params.as_array_mut().and_then(|p| p.first_mut()) {
                if tag == "latest" || quantity(tag).is_some_and(|n| n > head.saturating_sub(behind)) {
                    *tag = json!(old);
                }
            }
            Ok(reply(call(upstream, method, params).await?))
        }
        "eth_getTransactionReceipt" => {
            let receipt = call(upstream, method, params).await?;
            let too_new = quantity(&receipt["blockNumber"]).is_some_and(|n| n > head.saturating_sub(behind));
            Ok(reply(if too_new { Value::Null } else { receipt }))
        }
        _ => crate::proxy::forward(upstream, body).await,
    }
}

async fn serve(mut stream: TcpStream, state: Arc<State>) -> Result<()> {
    loop {
        let body = crate::proxy::read_http(&mut stream).await?;
        let request: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let method = request["method"].as_str().unwrap_or_default().to_owned();
        match state.draw(&method) {
            None => respond(&mut stream, 200, &crate::proxy::forward(state.upstream, &body).await?).await?,
            Some(Fault::Drop) => return Ok(()),
            Some(Fault::LoseAnswer) => {
                crate::proxy::forward(state.upstream, &body).await?;
                return Ok(());
            }
            Some(Fault::Delay(wait)) => {
                tokio::time::sleep(wait).await;
                let answer = crate::proxy::forward(state.upstream, &body).await?;
                respond(&mut stream, 200, &answer).await?;
            }
            Some(Fault::Error(message)) => {
                let error =
                    json!({"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32000, "message": message}});
                respond(&mut stream, 200, error.to_string().as_bytes()).await?;
            }
            Some(Fault::Http(status)) => {
                respond(&mut stream, status, b"{}").await?;
                return Ok(());
            }
            Some(Fault::Stale(behind)) => {
                let answer = stale(state.upstream, &request, &body, behind).await?;
                respond(&mut stream, 200, &answer).await?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_faults_per_method_whatever_the_interleaving() {
        let schedule = || Schedule::new().with("a", Fault::Drop, 300).with("b", Fault::Error("x"), 500);
        let state = |seed| State {
            upstream: "127.0.0.1:1".parse().unwrap(),
            schedule: schedule(),
            seed,
            streams: Mutex::default(),
            enabled: AtomicBool::new(true),
            injected: Mutex::default(),
            calls: AtomicU64::new(0),
        };
        let (one, two) = (state(7), state(7));
        let a1: Vec<_> = (0..50).map(|_| one.draw("a")).collect();
        let _b: Vec<_> = (0..20).map(|_| two.draw("b")).collect();
        let a2: Vec<_> = (0..50).map(|_| two.draw("a")).collect();
        assert_eq!(a1, a2, "a's decisions do not depend on b's calls");
        let drops = a1.iter().filter(|f| f.is_some()).count();
        assert!((5..=30).contains(&drops), "about 30% of 50: {drops}");
        let three = state(8);
        assert_ne!(a1, (0..50).map(|_| three.draw("a")).collect::<Vec<_>>(), "another seed, other faults");
        assert_eq!(state(7).draw("c"), None, "unscheduled methods are never faulted");
    }
}
