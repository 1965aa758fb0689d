//! Launches the project-local anvil (installed by `scripts/setup.sh`) on a free port and kills it
//! when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long anvil may take to answer its first request.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);

/// A running anvil node.
pub struct Anvil {
    child: Child,
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    /// Its JSON-RPC URL.
    pub url: String,
}

/// The anvil binary: `CUSTODIAN_ANVIL`, or `.tools/bin/anvil` in the workspace.
pub fn anvil_path() -> PathBuf {
    std::env::var_os("CUSTODIAN_ANVIL").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(".tools").join("bin").join("anvil")
    })
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// The genesis timestamp of [`Anvil::spawn_shared_genesis`] nodes (2026-01-01T00:00:00Z).
pub const SHARED_GENESIS_TIMESTAMP: &str = "1767225600";

impl Anvil {
    /// Starts anvil with its defaults (chain id 31337, ten funded dev accounts, automine).
    pub async fn spawn() -> Result<Anvil> {
        Anvil::spawn_with(&[]).await
    }

    /// Starts anvil on the genesis block every other `spawn_shared_genesis` anvil has (the same
    /// `--timestamp`): two such nodes are one chain that can fork, as a node that resynced or a
    /// minority fork would be.
    pub async fn spawn_shared_genesis(args: &[&str]) -> Result<Anvil> {
        let mut all = vec!["--timestamp", SHARED_GENESIS_TIMESTAMP];
        all.extend_from_slice(args);
        Anvil::spawn_with(&all).await
    }

    /// Starts anvil with extra arguments (`--no-mining`, `--block-time 1`, …).
    pub async fn spawn_with(args: &[&str]) -> Result<Anvil> {
        let path = anvil_path();
        if !path.exists() {
            bail!("anvil not found at {}: run `make setup` (or set CUSTODIAN_ANVIL)", path.display());
        }
        // Another process may take the port between our probe and anvil's bind; retry then.
        for _ in 0..5 {
            let port = free_port()?;
            let child = Command::new(&path)
                .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--silent"])
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {}", path.display()))?;
            let mut anvil = Anvil { child, port, url: format!("http://127.0.0.1:{port}") };
            let start = std::time::Instant::now();
            while start.elapsed() < STARTUP_DEADLINE {
                if anvil.child.try_wait()?.is_some() {
                    break;
                }
                if anvil.rpc("eth_chainId", json!([])).await.is_ok() {
                    return Ok(anvil);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        bail!("anvil did not start answering on 127.0.0.1")
    }

    /// Sends one JSON-RPC request and returns its `result`, or the node's error as an `Err`.
    pub async fn rpc(&self, method: &str, params: Value) -> Result<Value> {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).to_string();
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await?;
        let request = format!(
            "POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        let response = String::from_utf8(response)?;
        let (_, json_body) = response.split_once("\r\n\r\n").context("malformed HTTP response from anvil")?;
        let mut reply: Value = serde_json::from_str(json_body.trim())
            .with_context(|| format!("anvil answered {method} with something that is not JSON: {json_body}"))?;
        if let Some(error) = reply.get("error") {
            bail!("anvil refused {method}: {error}");
        }
        Ok(reply["result"].take())
    }
}

impl Drop for Anvil {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
