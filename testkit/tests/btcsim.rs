//! The Bitcoin Core simulator over real HTTP, through a hand-written client independent of the
//! simulator's code: chain queries, block contents, verbose JSON, Bitcoin Core's errors and HTTP
//! statuses, authentication, keep-alive, outages and reorgs.

use std::time::Duration;

use bitcoin::block::Header;
use bitcoin::consensus::deserialize;
use bitcoin::hex::FromHex;
use bitcoin::{Address, Amount, Block, BlockHash, CompactTarget, Network, Target, Transaction};
use custodian_testkit::btcsim::AddrKind;
use custodian_testkit::BitcoinSim;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long any one exchange with the simulator may take.
const IO_DEADLINE: Duration = Duration::from_secs(10);
/// The regtest genesis block's hash.
const REGTEST_GENESIS: &str = "0f9188f13cb7b2c71f2a335e3a4fc328bf5beb436012afca590b1a11466e2206";

struct HttpResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl HttpResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| value.as_str())
    }

    fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("a UTF-8 body")
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("a JSON body ({e}): {}", self.text()))
    }
}

/// A minimal HTTP/1.1 client on one kept-alive connection.
struct Client {
    stream: TcpStream,
    buffer: Vec<u8>,
    authorization: String,
}

impl Client {
    async fn connect(sim: &BitcoinSim) -> Client {
        Client::connect_as(sim, sim.user(), sim.password()).await
    }

    async fn connect_as(sim: &BitcoinSim, user: &str, password: &str) -> Client {
        let address = sim.url().strip_prefix("http://").expect("an http URL").to_owned();
        let stream = tokio::time::timeout(IO_DEADLINE, TcpStream::connect(address))
            .await
            .expect("connecting in time")
            .expect("connecting");
        Client { stream, buffer: Vec::new(), authorization: basic_authorization(user, password) }
    }

    /// Writes `raw` and reads one response; `None` if the server closes the connection first.
    async fn exchange(&mut self, raw: &[u8]) -> Option<HttpResponse> {
        tokio::time::timeout(IO_DEADLINE, async {
            self.stream.write_all(raw).await.ok()?;
            self.read_response().await
        })
        .await
        .expect("the simulator answers in time")
    }

    /// Reads one response off the connection; `None` at end of stream.
    async fn read_response(&mut self) -> Option<HttpResponse> {
        let head_end = loop {
            if let Some(position) = self.buffer.windows(4).position(|window| window == b"\r\n\r\n") {
                break position + 4;
            }
            self.fill().await?;
        };
        let head = String::from_utf8(self.buffer.drain(..head_end).collect()).expect("an ASCII head");
        let mut lines = head.split("\r\n");
        let status_line = lines.next().expect("a status line");
        let status = status_line.split(' ').nth(1).expect("a status code").parse().expect("a numeric status");
        let headers: Vec<(String, String)> = lines
            .filter(|line| !line.is_empty())
            .map(|line| {
                let (name, value) = line.split_once(':').expect("a header line");
                (name.to_owned(), value.trim().to_owned())
            })
            .collect();
        let length = headers.iter().find(|(name, _)| name.eq_ignore_ascii_case("Content-Length"));
        let body = match length {
            Some((_, length)) => {
                let length: usize = length.parse().expect("a numeric Content-Length");
                while self.buffer.len() < length {
                    self.fill().await?;
                }
                self.buffer.drain(..length).collect()
            }
            None if status == 204 => Vec::new(),
            // No length: the body runs to the end of the connection.
            None => {
                while self.fill().await.is_some() {}
                std::mem::take(&mut self.buffer)
            }
        };
        Some(HttpResponse { status, headers, body })
    }

    async fn fill(&mut self) -> Option<()> {
        let mut chunk = [0; 4096];
        match self.stream.read(&mut chunk).await {
            Ok(0) | Err(_) => None,
            Ok(read) => {
                self.buffer.extend_from_slice(&chunk[..read]);
                Some(())
            }
        }
    }

    /// POSTs `body` to `/` with this client's credentials.
    async fn post(&mut self, body: &str) -> HttpResponse {
        let request = post_request(&self.authorization, body, "");
        self.exchange(request.as_bytes()).await.expect("a response")
    }

    /// A legacy JSON-RPC call that must succeed; returns its result.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        let response = self.post(&json!({"method": method, "params": params, "id": 1}).to_string()).await;
        assert_eq!(response.status, 200, "{method} {params}: {}", response.text());
        let reply = response.json();
        assert_eq!(reply["error"], Value::Null, "{method} {params}");
        assert_eq!(reply["id"], json!(1));
        reply["result"].clone()
    }

    /// A legacy JSON-RPC call that must fail; returns the HTTP status and the error object.
    async fn call_error(&mut self, method: &str, params: Value) -> (u16, i64, String) {
        let response = self.post(&json!({"method": method, "params": params, "id": 1}).to_string()).await;
        let reply = response.json();
        assert_eq!(reply["result"], Value::Null, "{method} {params}");
        let code = reply["error"]["code"].as_i64().expect("an error code");
        let message = reply["error"]["message"].as_str().expect("an error message").to_owned();
        (response.status, code, message)
    }
}

fn post_request(authorization: &str, body: &str, extra_headers: &str) -> String {
    format!(
        "POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {authorization}\r\nContent-Type: application/json\r\n\
         {extra_headers}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

fn basic_authorization(user: &str, password: &str) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes = format!("{user}:{password}").into_bytes();
    let mut encoded = String::new();
    for chunk in bytes.chunks(3) {
        let padded = [chunk[0], chunk.get(1).copied().unwrap_or(0), chunk.get(2).copied().unwrap_or(0)];
        let group = u32::from(padded[0]) << 16 | u32::from(padded[1]) << 8 | u32::from(padded[2]);
        for index in 0..4 {
            if index <= chunk.len() {
                encoded.push(char::from(ALPHABET[((group >> (18 - 6 * index)) & 0x3f) as usize]));
            } else {
                encoded.push('=');
            }
        }
    }
    format!("Basic {encoded}")
}

fn hash_of(value: &Value) -> BlockHash {
    value.as_str().expect("a hex hash").parse().expect("a block hash")
}

fn decode_block(hex: &Value) -> Block {
    let bytes = Vec::<u8>::from_hex(hex.as_str().expect("hex")).expect("valid hex");
    deserialize::<Block>(&bytes).expect("a consensus-encoded block")
}

/// Chainwork after `height + 1` regtest blocks: each carries exactly 2 units of work.
fn regtest_chainwork(height: u64) -> String {
    format!("{:064x}", 2 * (height + 1))
}

#[tokio::test]
async fn chain_queries_agree_and_blocks_are_real() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    assert_eq!(client.call("getblockcount", json!([])).await, json!(0));
    assert_eq!(client.call("getbestblockhash", json!([])).await, json!(REGTEST_GENESIS));
    assert_eq!(client.call("getblockhash", json!([0])).await, json!(REGTEST_GENESIS));

    let outputs: Vec<(Address, Amount)> = AddrKind::ALL
        .iter()
        .zip(1_u32..)
        .map(|(kind, index)| (sim.address(*kind, index), Amount::from_sat(100_000 * u64::from(index) + 1)))
        .collect();
    let payment = sim.pay(&outputs);
    let other = sim.pay(&outputs[..1]);
    assert_ne!(payment.compute_txid(), other.compute_txid(), "two payments never share a txid");
    let mined = sim.mine(&[payment.clone(), other.clone()]);
    let empty = sim.mine_empty(2);
    assert_eq!(sim.height(), 3);

    assert_eq!(client.call("getblockcount", json!([])).await, json!(3));
    assert_eq!(hash_of(&client.call("getbestblockhash", json!([])).await), empty[1]);
    for height in 0..=3_u64 {
        let hash = hash_of(&client.call("getblockhash", json!([height])).await);
        assert_eq!(Some(hash), sim.block_hash(height), "height {height}");
    }
    assert_eq!(sim.block_hash(1), Some(mined));
    assert_eq!(sim.block_hash(4), None);

    let hex = client.call("getblock", json!([mined.to_string(), 0])).await;
    let block = decode_block(&hex);
    assert_eq!(block.block_hash(), mined);
    assert!(block.check_merkle_root());
    assert!(block.check_witness_commitment());
    assert_eq!(block.header.target(), Target::from_compact(CompactTarget::from_consensus(0x207f_ffff)));
    assert_eq!(block.header.validate_pow(block.header.target()), Ok(mined));
    assert!(block.txdata[0].is_coinbase());
    assert_eq!(block.txdata[1..], [payment.clone(), other]);
    for (vout, (address, amount)) in outputs.iter().enumerate() {
        let output = &block.txdata[1].output[vout];
        assert_eq!(output.value, *amount, "vout {vout}");
        assert_eq!(output.script_pubkey, address.script_pubkey(), "vout {vout}");
        assert_eq!(Address::from_script(&output.script_pubkey, Network::Regtest).as_ref(), Ok(address));
    }
    assert_eq!(block.txdata[1].output.len(), outputs.len(), "nothing but the requested outputs");
    assert_eq!(sim.block(mined), Some(block));

    // Verbosity may be a boolean, as Core accepts.
    assert_eq!(client.call("getblock", json!([mined.to_string(), false])).await, hex);
    let verbose = client.call("getblock", json!([mined.to_string(), true])).await;
    assert_eq!(verbose["hash"], json!(mined.to_string()));

    let info = client.call("getblockchaininfo", json!([])).await;
    assert_eq!(info["chain"], json!("regtest"));
    assert_eq!(info["blocks"], json!(3));
    assert_eq!(info["headers"], json!(3));
    assert_eq!(info["bestblockhash"], json!(empty[1].to_string()));
    assert_eq!(info["chainwork"], json!(regtest_chainwork(3)));
}

#[tokio::test]
async fn verbose_block_and_header_describe_the_block() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    let payment = sim.pay(&[(sim.address(AddrKind::P2wpkh, 0), Amount::from_sat(5_000))]);
    let first = sim.mine(&[]);
    let second = sim.mine(&[payment]);
    let third = sim.mine(&[]);
    let block = sim.block(second).expect("mined block");
    let times: Vec<u32> = (0..=2).map(|h| sim.block(sim.block_hash(h).unwrap()).unwrap().header.time).collect();

    let response =
        client.post(&json!({"method": "getblock", "params": [second.to_string()], "id": 1}).to_string()).await;
    assert!(response.text().starts_with(r#"{"result":{"hash":""#), "Core's key order: {}", response.text());
    // serde_json's default float parser is not correctly rounded, so difficulty is checked as text.
    assert!(response.text().contains(r#""difficulty":4.656542373906925e-10,"#), "Core's 16 digits");
    let mut verbose = response.json()["result"].clone();
    verbose.as_object_mut().unwrap().remove("difficulty");
    let txids: Vec<String> = block.txdata.iter().map(|tx| tx.compute_txid().to_string()).collect();
    let expected = json!({
        "hash": second.to_string(),
        "confirmations": 2,
        "height": 2,
        "version": 0x2000_0000,
        "versionHex": "20000000",
        "merkleroot": block.header.merkle_root.to_string(),
        "time": block.header.time,
        "mediantime": times[1],
        "nonce": block.header.nonce,
        "bits": "207fffff",
        "target": "7fffff0000000000000000000000000000000000000000000000000000000000",
        "chainwork": regtest_chainwork(2),
        "nTx": 2,
        "previousblockhash": first.to_string(),
        "nextblockhash": third.to_string(),
        "strippedsize": block.txdata.iter().map(Transaction::base_size).sum::<usize>() + 81,
        "size": bitcoin::consensus::serialize(&block).len(),
        "weight": block.weight().to_wu(),
        "tx": txids,
    });
    assert_eq!(verbose, expected);

    // The header is the block's object without its size and transactions.
    let mut header = client.call("getblockheader", json!([second.to_string()])).await;
    assert!(header.as_object_mut().unwrap().remove("difficulty").is_some());
    let mut header_expected = expected.clone();
    for key in ["strippedsize", "size", "weight", "tx"] {
        header_expected.as_object_mut().unwrap().remove(key);
    }
    assert_eq!(header, header_expected);
    let raw_header = client.call("getblockheader", json!({"blockhash": second.to_string(), "verbose": false})).await;
    let raw_header = Vec::<u8>::from_hex(raw_header.as_str().unwrap()).unwrap();
    assert_eq!(raw_header.len(), 80);
    assert_eq!(deserialize::<Header>(&raw_header).unwrap(), block.header);

    // The genesis block has no previous block; the tip has no next one and one confirmation.
    let genesis = client.call("getblock", json!([REGTEST_GENESIS])).await;
    assert_eq!(genesis["confirmations"], json!(4));
    assert_eq!(genesis["nextblockhash"], json!(first.to_string()));
    assert!(genesis.get("previousblockhash").is_none());
    let tip = client.call("getblockheader", json!([third.to_string(), true])).await;
    assert_eq!(tip["confirmations"], json!(1));
    assert!(tip.get("nextblockhash").is_none());
    assert_eq!(tip["previousblockhash"], json!(second.to_string()));
    assert_eq!(tip["nTx"], json!(1));
}

#[tokio::test]
async fn errors_carry_bitcoin_core_codes_messages_and_http_statuses() {
    let sim = BitcoinSim::start().await;
    sim.mine_empty(1);
    let mut client = Client::connect(&sim).await;

    let response = client.post(r#"{"method":"getblockhash","params":[2],"id":1}"#).await;
    assert_eq!(response.status, 500);
    assert_eq!(response.header("Content-Type"), Some("application/json"));
    assert_eq!(
        response.text(),
        "{\"result\":null,\"error\":{\"code\":-8,\"message\":\"Block height out of range\"},\"id\":1}\n"
    );
    assert_eq!(client.call_error("getblockhash", json!([-1])).await, (500, -8, "Block height out of range".into()));
    assert_eq!(
        client.call_error("getblockhash", json!(["1"])).await,
        (
            500,
            -3,
            "Wrong type passed:\n{\n    \"Position 1 (height)\": \"JSON value of type string is not of expected type \
             number\"\n}"
                .into()
        )
    );
    assert_eq!(client.call_error("getblockhash", json!([1.5])).await, (500, -1, "JSON integer out of range".into()));
    let usage = client.call_error("getblockhash", json!([])).await;
    assert_eq!((usage.0, usage.1), (500, -1));
    assert!(usage.2.starts_with("getblockhash height\n"), "{}", usage.2);

    let unknown = "11".repeat(32);
    assert_eq!(client.call_error("getblock", json!([unknown])).await, (500, -5, "Block not found".into()));
    assert_eq!(client.call_error("getblockheader", json!([unknown])).await, (500, -5, "Block not found".into()));
    assert_eq!(
        client.call_error("getblock", json!(["abcd"])).await,
        (500, -8, "blockhash must be of length 64 (not 4, for 'abcd')".into())
    );
    assert_eq!(
        client.call_error("getblockheader", json!(["abcd"])).await,
        (500, -8, "hash must be of length 64 (not 4, for 'abcd')".into())
    );
    let not_hex = "zz".repeat(32);
    assert_eq!(
        client.call_error("getblock", json!([not_hex])).await,
        (500, -8, format!("blockhash must be hexadecimal string (not '{not_hex}')"))
    );
    assert_eq!(
        client.call_error("getblock", json!([REGTEST_GENESIS, "1"])).await,
        (500, -3, "JSON value of type string is not of expected type number".into())
    );
    assert_eq!(
        client.call_error("getblock", json!({"blockhash": REGTEST_GENESIS, "verbosty": 1})).await,
        (500, -8, "Unknown named parameter verbosty".into())
    );

    let response = client.post(r#"{"method":"sendtoaddress","params":[],"id":"a"}"#).await;
    assert_eq!(response.status, 404);
    assert_eq!(
        response.text(),
        "{\"result\":null,\"error\":{\"code\":-32601,\"message\":\"Method not found\"},\"id\":\"a\"}\n"
    );
    let response = client.post("{not json").await;
    assert_eq!(response.status, 500);
    assert_eq!(
        response.text(),
        "{\"result\":null,\"error\":{\"code\":-32700,\"message\":\"Parse error\"},\"id\":null}\n"
    );
    let response = client.post(r#"{"params":[],"id":3}"#).await;
    assert_eq!(response.status, 400);
    assert_eq!(response.json()["error"], json!({"code": -32600, "message": "Missing method"}));

    // JSON-RPC 2.0: HTTP 200 for errors, only one of result and error, notifications unanswered.
    let response = client.post(r#"{"jsonrpc":"2.0","method":"getblockhash","params":[9],"id":"x"}"#).await;
    assert_eq!(response.status, 200);
    assert_eq!(
        response.text(),
        "{\"jsonrpc\":\"2.0\",\"error\":{\"code\":-8,\"message\":\"Block height out of range\"},\"id\":\"x\"}\n"
    );
    let response = client.post(r#"{"jsonrpc":"2.0","method":"nosuchmethod","id":2}"#).await;
    assert_eq!(response.status, 200);
    assert_eq!(response.json()["error"]["code"], json!(-32601));
    let response = client.post(r#"{"jsonrpc":"2.0","method":"getblockcount","id":7}"#).await;
    assert_eq!((response.status, response.text()), (200, "{\"jsonrpc\":\"2.0\",\"result\":1,\"id\":7}\n"));
    let response = client.post(r#"{"jsonrpc":"2.0","method":"getblockcount"}"#).await;
    assert_eq!((response.status, response.body.len()), (204, 0));

    // A batch is answered with an array and HTTP 200 whatever its members' outcomes.
    let response = client
        .post(r#"[{"method":"getblockcount","id":1},{"method":"nosuchmethod","id":2},{"method":"getblockhash","params":[0],"id":3}]"#)
        .await;
    assert_eq!(response.status, 200);
    assert_eq!(
        response.json(),
        json!([
            {"result": 1, "error": null, "id": 1},
            {"result": null, "error": {"code": -32601, "message": "Method not found"}, "id": 2},
            {"result": REGTEST_GENESIS, "error": null, "id": 3},
        ])
    );
}

#[tokio::test]
async fn http_refusals_match_bitcoin_core() {
    let sim = BitcoinSim::start().await;
    let body = r#"{"method":"getblockcount","params":[],"id":1}"#;

    let mut wrong = Client::connect_as(&sim, sim.user(), "wrong").await;
    let response = wrong.post(body).await;
    assert_eq!(response.status, 401);
    assert!(response.body.is_empty());
    assert_eq!(response.header("WWW-Authenticate"), Some("Basic realm=\"jsonrpc\""));

    let mut client = Client::connect(&sim).await;
    let no_credentials = format!("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    let response = client.exchange(no_credentials.as_bytes()).await.expect("a response");
    assert_eq!((response.status, response.body.len()), (401, 0));
    assert_eq!(response.header("WWW-Authenticate"), Some("Basic realm=\"jsonrpc\""));

    let get = format!("GET / HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\n\r\n", client.authorization);
    let response = client.exchange(get.as_bytes()).await.expect("a response");
    assert_eq!((response.status, response.text()), (405, "JSONRPC server handles only POST requests"));

    let elsewhere = post_request(&client.authorization, body, "").replacen("POST / ", "POST /rest ", 1);
    let response = client.exchange(elsewhere.as_bytes()).await.expect("a response");
    assert_eq!((response.status, response.body.len()), (404, 0));

    // None of the refused requests reached JSON-RPC; the connection still serves.
    assert_eq!(sim.call_count(), 0);
    assert_eq!(client.call("getblockcount", json!([])).await, json!(0));
    assert_eq!(sim.call_count(), 1);
}

#[tokio::test]
async fn cookie_file_credentials_are_accepted() {
    let sim = BitcoinSim::start().await;
    let cookie = std::fs::read_to_string(sim.cookie_file()).expect("the cookie file");
    let (user, password) = cookie.split_once(':').expect("user:password");
    assert_eq!(user, "__cookie__");
    assert_eq!(password.len(), 64);
    assert!(password.bytes().all(|byte| byte.is_ascii_hexdigit()));
    let mut client = Client::connect_as(&sim, user, password).await;
    assert_eq!(client.call("getblockcount", json!([])).await, json!(0));

    let path = sim.cookie_file().to_owned();
    drop(sim);
    assert!(!path.exists(), "dropping the simulator removes its cookie file");
}

#[tokio::test]
async fn connections_are_kept_alive_pipelined_and_closed_on_request() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    for expected in 0..3 {
        assert_eq!(client.call("getblockcount", json!([])).await, json!(expected));
        sim.mine_empty(1);
    }

    // Two requests in one write are answered in order.
    let first = post_request(&client.authorization, r#"{"method":"getblockhash","params":[0],"id":1}"#, "");
    let second = post_request(&client.authorization, r#"{"method":"getblockcount","id":2}"#, "");
    client.stream.write_all(format!("{first}{second}").as_bytes()).await.unwrap();
    let replies = [client.read_response().await.unwrap().json(), client.read_response().await.unwrap().json()];
    assert_eq!(replies[0]["result"], json!(REGTEST_GENESIS));
    assert_eq!(replies[1]["result"], json!(3));

    let closing = post_request(&client.authorization, r#"{"method":"getblockcount","id":3}"#, "Connection: close\r\n");
    let response = client.exchange(closing.as_bytes()).await.expect("a response");
    assert_eq!(response.status, 200);
    assert_eq!(response.header("Connection"), Some("close"));
    assert!(client.read_response().await.is_none(), "the server closes after Connection: close");
    assert_eq!(sim.call_count(), 6);
}

#[tokio::test]
async fn an_outage_closes_connections_until_the_node_is_back() {
    let sim = BitcoinSim::start().await;
    let body = r#"{"method":"getblockcount","id":1}"#;
    let mut kept_alive = Client::connect(&sim).await;
    assert_eq!(kept_alive.call("getblockcount", json!([])).await, json!(0));

    sim.set_unavailable(true);
    let request = post_request(&kept_alive.authorization, body, "");
    assert!(kept_alive.exchange(request.as_bytes()).await.is_none(), "a kept-alive connection is dropped");
    let mut fresh = Client::connect(&sim).await;
    assert!(fresh.exchange(request.as_bytes()).await.is_none(), "a new connection is dropped");
    assert_eq!(sim.call_count(), 1);

    sim.set_unavailable(false);
    let mut after = Client::connect(&sim).await;
    assert_eq!(after.call("getblockcount", json!([])).await, json!(0));
    assert_eq!(sim.call_count(), 2);
}

#[tokio::test]
async fn reorg_switches_to_the_longer_branch_and_keeps_the_old_blocks_as_stale() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    let in_both = sim.pay(&[(sim.address(AddrKind::P2wsh, 3), Amount::from_sat(70_000))]);
    let old_only = sim.pay(&[(sim.address(AddrKind::P2pkh, 3), Amount::from_sat(80_000))]);
    sim.mine_empty(2);
    let fork = sim.block_hash(2).unwrap();
    let old3 = sim.mine(std::slice::from_ref(&in_both));
    let old4 = sim.mine(&[old_only]);

    // The first replacement block holds the same transactions as the block it replaces.
    let new = sim.reorg(2, &[vec![in_both.clone()], vec![], vec![]]);
    assert_eq!(new.len(), 3);
    assert_ne!(new[0], old3, "a replacement block differs from the block it replaces");
    assert_ne!(new[1], old4);

    assert_eq!(client.call("getblockcount", json!([])).await, json!(5));
    assert_eq!(hash_of(&client.call("getbestblockhash", json!([])).await), new[2]);
    for (height, hash) in (3_u64..).zip(&new) {
        assert_eq!(hash_of(&client.call("getblockhash", json!([height])).await), *hash);
    }

    // The abandoned blocks are still served, with -1 confirmations and no next block.
    let stale3 = client.call("getblock", json!([old3.to_string()])).await;
    assert_eq!(stale3["confirmations"], json!(-1));
    assert_eq!(stale3["height"], json!(3));
    assert_eq!(stale3["previousblockhash"], json!(fork.to_string()));
    assert!(stale3.get("nextblockhash").is_none());
    let stale4 = client.call("getblockheader", json!([old4.to_string()])).await;
    assert_eq!(stale4["confirmations"], json!(-1));
    assert_eq!(stale4["previousblockhash"], json!(old3.to_string()));
    assert!(stale4.get("nextblockhash").is_none());
    assert_eq!(decode_block(&client.call("getblock", json!([old4.to_string(), 0])).await).block_hash(), old4);

    // The fork point now leads into the new branch.
    let fork_json = client.call("getblockheader", json!([fork.to_string()])).await;
    assert_eq!(fork_json["nextblockhash"], json!(new[0].to_string()));
    assert_eq!(fork_json["confirmations"], json!(4));
    let new3 = client.call("getblock", json!([new[0].to_string()])).await;
    assert_eq!(new3["confirmations"], json!(3));
    assert_eq!(new3["previousblockhash"], json!(fork.to_string()));
    assert_eq!(new3["nextblockhash"], json!(new[1].to_string()));

    // A transaction in both branches keeps its txid.
    let txid = json!(in_both.compute_txid().to_string());
    assert_eq!(stale3["tx"][1], txid);
    assert_eq!(new3["tx"][1], txid);
    assert_eq!(client.call("getblockchaininfo", json!([])).await["chainwork"], json!(regtest_chainwork(5)));
}

#[tokio::test]
#[should_panic(expected = "needs more than 2 replacement blocks")]
async fn reorg_without_more_work_is_refused() {
    let sim = BitcoinSim::start().await;
    sim.mine_empty(3);
    sim.reorg(2, &[vec![], vec![]]);
}

/// A P2WPKH key the test holds, and the transactions it signs (BIP143), as a wallet would.
struct TestWallet {
    secp: bitcoin::secp256k1::Secp256k1<bitcoin::secp256k1::All>,
    key: bitcoin::secp256k1::SecretKey,
    pubkey: bitcoin::CompressedPublicKey,
}

impl TestWallet {
    fn new(seed: u8) -> TestWallet {
        let secp = bitcoin::secp256k1::Secp256k1::new();
        let key = bitcoin::secp256k1::SecretKey::from_slice(&[seed; 32]).unwrap();
        let pubkey = bitcoin::CompressedPublicKey(key.public_key(&secp));
        TestWallet { secp, key, pubkey }
    }

    fn address(&self) -> Address {
        Address::p2wpkh(&self.pubkey, Network::Regtest)
    }

    /// Spends `coins` (outpoint, value) to `outputs`, signing each input with `signer`'s key but
    /// presenting `self`'s public key (the same wallet for an honest spend).
    fn spend_signed_by(
        &self,
        signer: &TestWallet,
        coins: &[(bitcoin::OutPoint, Amount)],
        outputs: &[(Address, Amount)],
    ) -> Transaction {
        use bitcoin::sighash::SighashCache;
        let mut tx = Transaction {
            version: bitcoin::transaction::Version::TWO,
            lock_time: bitcoin::absolute::LockTime::ZERO,
            input: coins
                .iter()
                .map(|(outpoint, _)| bitcoin::TxIn {
                    previous_output: *outpoint,
                    script_sig: bitcoin::ScriptBuf::new(),
                    sequence: bitcoin::Sequence::ENABLE_RBF_NO_LOCKTIME,
                    witness: bitcoin::Witness::new(),
                })
                .collect(),
            output: outputs
                .iter()
                .map(|(a, v)| bitcoin::TxOut { value: *v, script_pubkey: a.script_pubkey() })
                .collect(),
        };
        let script = self.address().script_pubkey();
        for (i, (_, value)) in coins.iter().enumerate() {
            let sighash = SighashCache::new(&tx)
                .p2wpkh_signature_hash(i, &script, *value, bitcoin::EcdsaSighashType::All)
                .unwrap();
            let signature = signer.secp.sign_ecdsa(&bitcoin::secp256k1::Message::from(sighash), &signer.key);
            let signature = bitcoin::ecdsa::Signature { signature, sighash_type: bitcoin::EcdsaSighashType::All };
            let pubkey = if std::ptr::eq(self, signer) { self.pubkey.0 } else { signer.pubkey.0 };
            tx.input[i].witness = bitcoin::Witness::p2wpkh(&signature, &pubkey);
        }
        tx
    }

    fn spend(&self, coins: &[(bitcoin::OutPoint, Amount)], outputs: &[(Address, Amount)]) -> Transaction {
        self.spend_signed_by(self, coins, outputs)
    }
}

/// A mined, spendable coin of `wallet` worth `value`.
fn fund(sim: &BitcoinSim, wallet: &TestWallet, value: Amount) -> (bitcoin::OutPoint, Amount) {
    let payment = sim.pay(&[(wallet.address(), value)]);
    sim.mine(std::slice::from_ref(&payment));
    (bitcoin::OutPoint { txid: payment.compute_txid(), vout: 0 }, value)
}

fn hex_of(tx: &Transaction) -> String {
    bitcoin::consensus::encode::serialize_hex(tx)
}

#[tokio::test]
async fn a_signed_spend_waits_in_the_mempool_is_mined_and_is_then_in_the_utxo_set() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    let alice = TestWallet::new(7);
    let coin = fund(&sim, &alice, Amount::from_sat(100_000));
    let to = sim.address(AddrKind::P2wpkh, 1);
    let tx = alice.spend(&[coin], &[(to.clone(), Amount::from_sat(90_000))]);
    let txid = client.call("sendrawtransaction", json!([hex_of(&tx)])).await;
    assert_eq!(txid, json!(tx.compute_txid().to_string()));
    assert_eq!(client.call("sendrawtransaction", json!([hex_of(&tx)])).await, txid, "sent again: the same answer");
    assert_eq!(client.call("getrawmempool", json!([])).await, json!([txid]));
    let entry = client.call("getmempoolentry", json!([txid])).await;
    assert_eq!(entry["vsize"], json!(tx.vsize()));
    let raw = client
        .post(&json!({"method": "getmempoolentry", "params": [txid], "id": 1}).to_string())
        .await
        .text()
        .to_owned();
    assert!(raw.contains("\"base\":0.00010000,"), "eight decimals, as Core writes amounts: {raw}");
    assert_eq!(entry["bip125-replaceable"], json!(true));
    sim.mine_mempool();
    assert!(sim.mempool().is_empty());
    assert!(sim.utxo(bitcoin::OutPoint { txid: tx.compute_txid(), vout: 0 }).is_some());
    assert_eq!(
        client.call_error("sendrawtransaction", json!([hex_of(&tx)])).await,
        (500, -27, "Transaction outputs already in utxo set".to_owned())
    );
    assert_eq!(
        client.call_error("getmempoolentry", json!([txid])).await,
        (500, -5, "Transaction not in mempool".to_owned())
    );
    // Its input is spent now: spending it again is missing inputs.
    let again = alice.spend(&[coin], &[(to, Amount::from_sat(80_000))]);
    assert_eq!(
        client.call_error("sendrawtransaction", json!([hex_of(&again)])).await,
        (500, -25, "Inputs missing or spent".to_owned())
    );
}

#[tokio::test]
async fn a_wrongly_signed_spend_is_refused_with_bitcoin_cores_script_error() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    let (alice, mallory) = (TestWallet::new(7), TestWallet::new(8));
    let coin = fund(&sim, &alice, Amount::from_sat(100_000));
    let to = sim.address(AddrKind::P2wpkh, 1);
    // Mallory's key and Mallory's public key: the public key does not hash to alice's program.
    let foreign = alice.spend_signed_by(&mallory, &[coin], &[(to.clone(), Amount::from_sat(90_000))]);
    assert_eq!(
        client.call_error("sendrawtransaction", json!([hex_of(&foreign)])).await,
        (500, -26, "mandatory-script-verify-flag-failed (Script failed an OP_EQUALVERIFY operation)".to_owned())
    );
    // Alice's public key with a signature by another key: the signature check fails.
    let mut forged = alice.spend(&[coin], &[(to.clone(), Amount::from_sat(90_000))]);
    let other = alice.spend(&[coin], &[(to, Amount::from_sat(89_000))]);
    let mut witness = forged.input[0].witness.to_vec();
    witness[0] = other.input[0].witness.to_vec()[0].clone();
    forged.input[0].witness = bitcoin::Witness::from_slice(&witness);
    assert_eq!(
        client.call_error("sendrawtransaction", json!([hex_of(&forged)])).await,
        (
            500,
            -26,
            "mandatory-script-verify-flag-failed (Signature must be zero for failed CHECK(MULTI)SIG operation)"
                .to_owned()
        )
    );
    let tested = client.call("testmempoolaccept", json!([[hex_of(&forged)]])).await;
    assert_eq!(tested[0]["allowed"], json!(false));
    assert!(sim.mempool().is_empty(), "nothing accepted");
}

#[tokio::test]
async fn policy_refusals_and_replacements_follow_bitcoin_core() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    let alice = TestWallet::new(7);
    let coin = fund(&sim, &alice, Amount::from_sat(100_000));
    let to = sim.address(AddrKind::P2wpkh, 1);
    let pay = |value: u64| alice.spend(&[coin], &[(to.clone(), Amount::from_sat(value))]);
    let (status, code, message) = client.call_error("sendrawtransaction", json!([hex_of(&pay(100_001))])).await;
    assert_eq!((status, code), (500, -26));
    assert_eq!(message, "bad-txns-in-belowout, value in (0.001) < value out (0.00100001)", "Core's FormatMoney");
    let (_, code, message) = client.call_error("sendrawtransaction", json!([hex_of(&pay(99_990))])).await;
    assert_eq!(code, -26);
    assert!(message.starts_with("min relay fee not met, 10 < "), "{message}");
    let big = fund(&sim, &alice, Amount::from_sat(5_000_000));
    let overpaying = alice.spend(&[big], &[(to.clone(), Amount::from_sat(1_000))]);
    let (_, code, message) = client.call_error("sendrawtransaction", json!([hex_of(&overpaying)])).await;
    assert_eq!((code, message.as_str()), (-25, "Fee exceeds maximum configured by user (e.g. -maxtxfee, maxfeerate)"));
    let dust = alice.spend(&[coin], &[(to.clone(), Amount::from_sat(90_000)), (to.clone(), Amount::from_sat(100))]);
    assert_eq!(client.call_error("sendrawtransaction", json!([hex_of(&dust)])).await.2, "dust");
    let tested = client.call("testmempoolaccept", json!([[hex_of(&pay(99_000))]])).await;
    assert_eq!((tested[0]["allowed"].clone(), tested[0]["vsize"].clone()), (json!(true), json!(pay(99_000).vsize())));

    // Replacement: a lower fee rate is refused; a higher one evicts the original.
    let original = pay(99_000);
    client.call("sendrawtransaction", json!([hex_of(&original)])).await;
    let (_, code, message) = client.call_error("sendrawtransaction", json!([hex_of(&pay(99_500))])).await;
    assert_eq!(code, -26);
    assert!(message.starts_with("insufficient fee, rejecting replacement "), "{message}");
    assert!(message.contains("BTC/kvB <= old feerate"), "{message}");
    let (_, _, message) = client.call_error("sendrawtransaction", json!([hex_of(&pay(98_950))])).await;
    assert!(message.contains("not enough additional fees to relay"), "{message}");
    let replacement = pay(98_000);
    client.call("sendrawtransaction", json!([hex_of(&replacement)])).await;
    assert_eq!(sim.mempool(), vec![replacement.compute_txid()], "the original was replaced");
    sim.mine_mempool();
    assert_eq!(
        sim.utxo(bitcoin::OutPoint { txid: replacement.compute_txid(), vout: 0 }).unwrap().value.to_sat(),
        98_000
    );
}

#[tokio::test]
async fn a_reorg_returns_mined_transactions_to_the_mempool_and_estimates_are_what_the_test_set() {
    let sim = BitcoinSim::start().await;
    let mut client = Client::connect(&sim).await;
    assert_eq!(
        client.call("estimatesmartfee", json!([6])).await,
        json!({"errors": ["Insufficient data or no feerate found"], "blocks": 0})
    );
    sim.set_fee_rate(Some(12));
    let raw =
        client.post(&json!({"method": "estimatesmartfee", "params": [6], "id": 1}).to_string()).await.text().to_owned();
    assert!(raw.contains("\"feerate\":0.00012000,\"blocks\":6"), "{raw}");
    let alice = TestWallet::new(7);
    let coin = fund(&sim, &alice, Amount::from_sat(100_000));
    let tx = alice.spend(&[coin], &[(sim.address(AddrKind::P2wpkh, 1), Amount::from_sat(90_000))]);
    client.call("sendrawtransaction", json!([hex_of(&tx)])).await;
    sim.mine_mempool();
    assert!(sim.mempool().is_empty());
    sim.reorg(1, &[vec![], vec![]]);
    assert_eq!(sim.mempool(), vec![tx.compute_txid()], "back in the mempool, as Core does after a reorg");
    assert!(sim.evict(tx.compute_txid()));
    assert!(sim.mempool().is_empty());
}
