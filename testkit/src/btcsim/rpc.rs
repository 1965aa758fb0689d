//! Bitcoin Core's JSON-RPC layer for the methods the simulator serves: request parsing, named
//! arguments, argument checks, the methods themselves and the reply envelope, each with Core's
//! codes and messages (`src/httprpc.cpp`, `src/rpc/request.cpp`, `src/rpc/server.cpp`,
//! `src/rpc/util.cpp`, `src/rpc/blockchain.cpp`, v28–v29).

use std::str::FromStr;
use std::sync::Arc;

use bitcoin::consensus::encode::serialize_hex;
use bitcoin::hex::DisplayHex;
use bitcoin::{BlockHash, Target};
use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};
use serde_json::{Map, Value};

use super::chain::{difficulty, stripped_size, Chain, Entry};
use super::Shared;

const RPC_INVALID_REQUEST: i32 = -32600;
const RPC_METHOD_NOT_FOUND: i32 = -32601;
const RPC_PARSE_ERROR: i32 = -32700;
const RPC_MISC_ERROR: i32 = -1;
const RPC_TYPE_ERROR: i32 = -3;
const RPC_INVALID_ADDRESS_OR_KEY: i32 = -5;
const RPC_INVALID_PARAMETER: i32 = -8;

/// What the HTTP layer sends back for one request body.
pub(super) struct RpcReply {
    pub(super) status: u16,
    /// `None` for 204 No Content (JSON-RPC 2.0 notifications).
    pub(super) body: Option<String>,
}

/// A JSON-RPC error object, `{"code": …, "message": …}`.
#[derive(Debug, Serialize)]
struct RpcError {
    code: i32,
    message: String,
}

impl RpcError {
    fn new(code: i32, message: impl Into<String>) -> RpcError {
        RpcError { code, message: message.into() }
    }
}

/// Answers one HTTP request body as Bitcoin Core's `HTTPReq_JSONRPC` does once the caller is
/// authorised. Every request that gets as far as method lookup counts in `shared.calls`.
pub(super) fn handle(shared: &Shared, body: &[u8]) -> RpcReply {
    let mut request = Request::fresh();
    let value: Value = match serde_json::from_slice(body) {
        Ok(value) => value,
        Err(_) => return error_reply(&request, RpcError::new(RPC_PARSE_ERROR, "Parse error")),
    };
    match &value {
        Value::Object(_) => {
            if let Err(error) = request.parse(&value) {
                return error_reply(&request, error);
            }
            let outcome = execute(shared, &request);
            if request.is_notification() {
                return RpcReply { status: 204, body: None };
            }
            match outcome {
                Ok(result) => json_reply(200, &request.reply(Ok(result))),
                // JSON-RPC 2.0 answers errors with HTTP 200; the legacy protocol with an HTTP error.
                Err(error) if request.v2 => json_reply(200, &request.reply(Err(error))),
                Err(error) => error_reply(&request, error),
            }
        }
        Value::Array(items) => {
            // Core parses every member into one request object, so a member refused before its
            // own id is read is answered with the previous member's id and version.
            let mut replies = Vec::with_capacity(items.len());
            for item in items {
                let reply = match request.parse(item) {
                    Ok(()) => request.reply(execute(shared, &request)),
                    Err(error) => request.reply(Err(error)),
                };
                if !request.is_notification() {
                    replies.push(reply);
                }
            }
            if replies.is_empty() && !items.is_empty() {
                return RpcReply { status: 204, body: None };
            }
            json_reply(200, &replies)
        }
        _ => error_reply(&request, RpcError::new(RPC_PARSE_ERROR, "Top-level object parse error")),
    }
}

/// Core's `JSONErrorReply`: the HTTP status follows the error code.
fn error_reply(request: &Request, error: RpcError) -> RpcReply {
    let status = match error.code {
        RPC_INVALID_REQUEST => 400,
        RPC_METHOD_NOT_FOUND => 404,
        _ => 500,
    };
    json_reply(status, &request.reply(Err(error)))
}

fn json_reply(status: u16, reply: &impl Serialize) -> RpcReply {
    let mut body = serde_json::to_string(reply).expect("BUG: replies serialise");
    body.push('\n');
    RpcReply { status, body: Some(body) }
}

/// Core's `JSONRPCRequest` as `parse` fills it.
struct Request {
    /// `None` when the request had no `id` member (then the reply has none either).
    id: Option<Value>,
    v2: bool,
    method: String,
    params: Value,
}

impl Request {
    /// A request object before parsing: what errors about the body as a whole are answered with.
    fn fresh() -> Request {
        Request { id: Some(Value::Null), v2: false, method: String::new(), params: Value::Array(vec![]) }
    }

    /// `JSONRPCRequest::parse`, field by field in Core's order.
    fn parse(&mut self, value: &Value) -> Result<(), RpcError> {
        let Value::Object(object) = value else {
            return Err(RpcError::new(RPC_INVALID_REQUEST, "Invalid Request object"));
        };
        self.id = object.get("id").cloned();
        self.v2 = false;
        match object.get("jsonrpc") {
            None | Some(Value::Null) => {}
            Some(Value::String(version)) if version == "2.0" => self.v2 = true,
            // Some old documentation had clients send "1.0"; Core accepts it as the legacy protocol.
            Some(Value::String(version)) if version == "1.0" => {}
            Some(Value::String(_)) => return Err(RpcError::new(RPC_INVALID_REQUEST, "JSON-RPC version not supported")),
            Some(_) => return Err(RpcError::new(RPC_INVALID_REQUEST, "jsonrpc field must be a string")),
        }
        match object.get("method") {
            None | Some(Value::Null) => return Err(RpcError::new(RPC_INVALID_REQUEST, "Missing method")),
            Some(Value::String(method)) => self.method.clone_from(method),
            Some(_) => return Err(RpcError::new(RPC_INVALID_REQUEST, "Method must be a string")),
        }
        self.params = match object.get("params") {
            None | Some(Value::Null) => Value::Array(vec![]),
            Some(params @ (Value::Array(_) | Value::Object(_))) => params.clone(),
            Some(_) => return Err(RpcError::new(RPC_INVALID_REQUEST, "Params must be an array or object")),
        };
        Ok(())
    }

    /// A JSON-RPC 2.0 request without an id: executed, never answered.
    fn is_notification(&self) -> bool {
        self.v2 && self.id.is_none()
    }

    fn reply(&self, outcome: Result<Answer, RpcError>) -> Reply {
        Reply { v2: self.v2, id: self.id.clone(), outcome }
    }
}

/// Core's `JSONRPCReplyObj`. Legacy: `result`, `error` (one of them null) and `id`; 2.0:
/// `jsonrpc`, then `result` or `error`, then `id`. `id` only when the request had one.
struct Reply {
    v2: bool,
    id: Option<Value>,
    outcome: Result<Answer, RpcError>,
}

impl Serialize for Reply {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        if self.v2 {
            map.serialize_entry("jsonrpc", "2.0")?;
        }
        match &self.outcome {
            Ok(result) => {
                map.serialize_entry("result", result)?;
                if !self.v2 {
                    map.serialize_entry("error", &())?;
                }
            }
            Err(error) => {
                if !self.v2 {
                    map.serialize_entry("result", &())?;
                }
                map.serialize_entry("error", error)?;
            }
        }
        if let Some(id) = &self.id {
            map.serialize_entry("id", id)?;
        }
        map.end()
    }
}

/// A method's result. Typed rather than a `serde_json::Value` so objects keep Core's key order.
#[derive(Serialize)]
#[serde(untagged)]
enum Answer {
    Height(u64),
    Hex(String),
    Header(HeaderJson),
    Block(BlockJson),
    ChainInfo(ChainInfoJson),
    Txids(Vec<String>),
    MempoolEntry(MempoolEntryJson),
    Accept(Vec<AcceptJson>),
    FeeEstimate(FeeEstimateJson),
}

/// The JSON type a declared argument must have (`RPCArg::MatchesType`); `None` skips the check.
#[derive(Clone, Copy)]
enum ArgType {
    Number,
    String,
    Bool,
    Array,
    Unchecked,
}

impl ArgType {
    fn expected(self) -> Option<&'static str> {
        match self {
            ArgType::Number => Some("number"),
            ArgType::String => Some("string"),
            ArgType::Bool => Some("bool"),
            ArgType::Array => Some("array"),
            ArgType::Unchecked => None,
        }
    }
}

struct Arg {
    /// Core's `m_names`: `|` separates aliases.
    names: &'static str,
    ty: ArgType,
    required: bool,
}

impl Arg {
    /// An argument the call must give.
    const fn required(names: &'static str, ty: ArgType) -> Arg {
        Arg { names, ty, required: true }
    }

    /// An argument the call may leave out.
    const fn optional(names: &'static str, ty: ArgType) -> Arg {
        Arg { names, ty, required: false }
    }
}

type Handler = fn(&Shared, &[Value]) -> Result<Answer, RpcError>;

struct Method {
    name: &'static str,
    args: &'static [Arg],
    /// Sent as the error message when the argument count is wrong. Core sends the whole help
    /// text; the simulator sends its first paragraphs only.
    usage: &'static str,
    handler: Handler,
}

const BLOCKHASH: Arg = Arg::required("blockhash", ArgType::String);

static METHODS: &[Method] = &[
    Method {
        name: "getbestblockhash",
        args: &[],
        usage: "getbestblockhash\n\nReturns the hash of the best (tip) block in the most-work fully-validated chain.\n",
        handler: getbestblockhash,
    },
    Method {
        name: "getblock",
        // Verbosity skips the type check: Core also accepts a boolean there.
        args: &[BLOCKHASH, Arg::optional("verbosity|verbose", ArgType::Unchecked)],
        usage: "getblock \"blockhash\" ( verbosity )\n\nIf verbosity is 0, returns a string that is serialized, \
                hex-encoded data for block 'hash'.\nIf verbosity is 1, returns an Object with information about \
                block <hash>.\n",
        handler: getblock,
    },
    Method {
        name: "getblockchaininfo",
        args: &[],
        usage:
            "getblockchaininfo\n\nReturns an object containing various state info regarding blockchain processing.\n",
        handler: getblockchaininfo,
    },
    Method {
        name: "getblockcount",
        args: &[],
        usage: "getblockcount\n\nReturns the height of the most-work fully-validated chain.\nThe genesis block has \
                height 0.\n",
        handler: getblockcount,
    },
    Method {
        name: "getblockhash",
        args: &[Arg::required("height", ArgType::Number)],
        usage: "getblockhash height\n\nReturns hash of block in best-block-chain at height provided.\n",
        handler: getblockhash,
    },
    Method {
        name: "getblockheader",
        args: &[BLOCKHASH, Arg::optional("verbose", ArgType::Bool)],
        usage: "getblockheader \"blockhash\" ( verbose )\n\nIf verbose is false, returns a string that is serialized, \
                hex-encoded data for blockheader 'hash'.\nIf verbose is true, returns an Object with information \
                about blockheader <hash>.\n",
        handler: getblockheader,
    },
    Method {
        name: "estimatesmartfee",
        args: &[Arg::required("conf_target", ArgType::Number), Arg::optional("estimate_mode", ArgType::String)],
        usage:
            "estimatesmartfee conf_target ( \"estimate_mode\" )\n\nEstimates the approximate fee per kilobyte needed \
                for a transaction to begin\nconfirmation within conf_target blocks if possible and return the number \
                of blocks\nfor which the estimate is valid.\n",
        handler: estimatesmartfee,
    },
    Method {
        name: "getmempoolentry",
        args: &[Arg::required("txid", ArgType::String)],
        usage: "getmempoolentry \"txid\"\n\nReturns mempool data for given transaction\n",
        handler: getmempoolentry,
    },
    Method {
        name: "getrawmempool",
        args: &[Arg::optional("verbose", ArgType::Bool), Arg::optional("mempool_sequence", ArgType::Bool)],
        usage: "getrawmempool ( verbose mempool_sequence )\n\nReturns all transaction ids in memory pool as a json \
                array of string transaction ids.\n",
        handler: getrawmempool,
    },
    Method {
        name: "sendrawtransaction",
        args: &[
            Arg::required("hexstring", ArgType::String),
            Arg::optional("maxfeerate", ArgType::Unchecked),
            Arg::optional("maxburnamount", ArgType::Unchecked),
        ],
        usage:
            "sendrawtransaction \"hexstring\" ( maxfeerate maxburnamount )\n\nSubmit a raw transaction (serialized, \
                hex-encoded) to local node and network.\n",
        handler: sendrawtransaction,
    },
    Method {
        name: "testmempoolaccept",
        args: &[Arg::required("rawtxs", ArgType::Array), Arg::optional("maxfeerate", ArgType::Unchecked)],
        usage: "testmempoolaccept [\"rawtx\",...] ( maxfeerate )\n\nReturns result of mempool acceptance tests \
                indicating if raw transaction(s) (serialized, hex-encoded) would be accepted by mempool.\n",
        handler: testmempoolaccept,
    },
];

/// `CRPCTable::execute` through `RPCHelpMan::HandleRequest`: find the method, map named
/// arguments, check the count (help text as `RPC_MISC_ERROR`) and the types, run it.
fn execute(shared: &Shared, request: &Request) -> Result<Answer, RpcError> {
    shared.count_call();
    let Some(method) = METHODS.iter().find(|method| method.name == request.method) else {
        return Err(RpcError::new(RPC_METHOD_NOT_FOUND, "Method not found"));
    };
    let params = match &request.params {
        Value::Object(named) => transform_named_arguments(named, method.args)?,
        Value::Array(positional) => positional.clone(),
        _ => unreachable!("BUG: parse admits only arrays and objects"),
    };
    let required = method.args.iter().rposition(|arg| arg.required).map_or(0, |last| last + 1);
    if params.len() < required || params.len() > method.args.len() {
        return Err(RpcError::new(RPC_MISC_ERROR, method.usage));
    }
    check_types(method.args, &params)?;
    (method.handler)(shared, &params)
}

/// Core's `transformNamedArguments`: named parameters to positions, JSON nulls in the holes
/// before the last one given, `args` as leading positional arguments.
fn transform_named_arguments(named: &Map<String, Value>, args: &[Arg]) -> Result<Vec<Value>, RpcError> {
    let mut remaining: Vec<(&str, &Value)> = named.iter().map(|(key, value)| (key.as_str(), value)).collect();
    let mut out = Vec::new();
    let mut hole = 0;
    let mut initial_hole_size = 0;
    let mut initial_param = None;
    for arg in args {
        let found = arg.names.split('|').find_map(|name| remaining.iter().position(|(key, _)| *key == name));
        match found {
            Some(index) => {
                out.extend(std::iter::repeat_n(Value::Null, hole));
                hole = 0;
                initial_param.get_or_insert(arg.names);
                out.push(remaining.remove(index).1.clone());
            }
            None => {
                hole += 1;
                if out.is_empty() {
                    initial_hole_size = hole;
                }
            }
        }
    }
    if let Some(index) = remaining.iter().position(|(key, _)| *key == "args") {
        if let Value::Array(positional) = remaining.remove(index).1 {
            if let Some(param) = initial_param.filter(|_| initial_hole_size < positional.len()) {
                return Err(RpcError::new(
                    RPC_INVALID_PARAMETER,
                    format!("Parameter {param} specified twice both as positional and named argument"),
                ));
            }
            let named_after = out.into_iter().skip(positional.len());
            out = positional.iter().cloned().chain(named_after).collect();
        }
    }
    if let Some((key, _)) = remaining.first() {
        return Err(RpcError::new(RPC_INVALID_PARAMETER, format!("Unknown named parameter {key}")));
    }
    Ok(out)
}

/// `RPCHelpMan::HandleRequest`'s type check: every mismatch in one pretty-printed object.
fn check_types(args: &[Arg], params: &[Value]) -> Result<(), RpcError> {
    let mut mismatches = Vec::new();
    for (index, arg) in args.iter().enumerate() {
        let value = params.get(index).unwrap_or(&Value::Null);
        let Some(expected) = arg.ty.expected() else { continue };
        if (!arg.required && value.is_null()) || type_name(value) == expected {
            continue;
        }
        mismatches.push(format!(
            "    \"Position {} ({})\": \"JSON value of type {} is not of expected type {expected}\"",
            index + 1,
            arg.names,
            type_name(value)
        ));
    }
    if mismatches.is_empty() {
        return Ok(());
    }
    Err(RpcError::new(RPC_TYPE_ERROR, format!("Wrong type passed:\n{{\n{}\n}}", mismatches.join(",\n"))))
}

/// UniValue's `uvTypeName`.
fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// UniValue's `getInt<int>()`: a type error for a non-number (`RPC_TYPE_ERROR` once
/// `ExecuteCommand` catches it), `RPC_MISC_ERROR` for a fraction or a number outside `int`.
fn get_int(value: &Value) -> Result<i32, RpcError> {
    let Value::Number(number) = value else {
        return Err(RpcError::new(
            RPC_TYPE_ERROR,
            format!("JSON value of type {} is not of expected type number", type_name(value)),
        ));
    };
    number
        .as_i64()
        .and_then(|n| i32::try_from(n).ok())
        .ok_or_else(|| RpcError::new(RPC_MISC_ERROR, "JSON integer out of range"))
}

/// Core's `ParseHashV` (v28+: the length is checked before the digits).
fn parse_hash(value: &Value, name: &str) -> Result<BlockHash, RpcError> {
    let text = value.as_str().expect("BUG: the type check admits only strings here");
    if text.len() != 64 {
        return Err(RpcError::new(
            RPC_INVALID_PARAMETER,
            format!("{name} must be of length 64 (not {}, for '{text}')", text.len()),
        ));
    }
    if !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return Err(RpcError::new(RPC_INVALID_PARAMETER, format!("{name} must be hexadecimal string (not '{text}')")));
    }
    Ok(BlockHash::from_str(&text.to_ascii_lowercase()).expect("BUG: 64 hex digits are a block hash"))
}

fn block_not_found() -> RpcError {
    RpcError::new(RPC_INVALID_ADDRESS_OR_KEY, "Block not found")
}

fn getblockcount(shared: &Shared, _: &[Value]) -> Result<Answer, RpcError> {
    Ok(Answer::Height(shared.chain().tip_height()))
}

fn getbestblockhash(shared: &Shared, _: &[Value]) -> Result<Answer, RpcError> {
    Ok(Answer::Hex(shared.chain().tip().hash.to_string()))
}

fn getblockhash(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let height = get_int(&params[0])?;
    let chain = shared.chain();
    u64::try_from(height)
        .ok()
        .and_then(|height| chain.active_hash(height))
        .map(|hash| Answer::Hex(hash.to_string()))
        .ok_or_else(|| RpcError::new(RPC_INVALID_PARAMETER, "Block height out of range"))
}

fn getblock(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let hash = parse_hash(&params[0], "blockhash")?;
    let verbosity = match params.get(1) {
        None | Some(Value::Null) => 1,
        Some(Value::Bool(verbose)) => i32::from(*verbose),
        Some(other) => get_int(other)?,
    };
    // The lock is held only to look the block up; serialising happens after it is released.
    let (header, block, txids) = {
        let chain = shared.chain();
        let entry = chain.entry(&hash).ok_or_else(block_not_found)?;
        (HeaderJson::new(&chain, entry), Arc::clone(&entry.block), entry.txids.clone())
    };
    if verbosity <= 0 {
        return Ok(Answer::Hex(serialize_hex(&*block)));
    }
    if verbosity >= 2 {
        return Err(RpcError::new(
            RPC_INVALID_PARAMETER,
            "getblock verbosity 2 and 3 are not implemented by the Bitcoin Core simulator",
        ));
    }
    Ok(Answer::Block(BlockJson {
        header,
        strippedsize: stripped_size(&block),
        size: block.total_size(),
        weight: block.weight().to_wu(),
        tx: txids.iter().map(ToString::to_string).collect(),
    }))
}

fn getblockheader(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let hash = parse_hash(&params[0], "hash")?;
    // The type check admits only a boolean or null here.
    let verbose = params.get(1).and_then(Value::as_bool).unwrap_or(true);
    let chain = shared.chain();
    let entry = chain.entry(&hash).ok_or_else(block_not_found)?;
    Ok(if verbose {
        Answer::Header(HeaderJson::new(&chain, entry))
    } else {
        Answer::Hex(serialize_hex(&entry.block.header))
    })
}

fn getblockchaininfo(shared: &Shared, _: &[Value]) -> Result<Answer, RpcError> {
    let chain = shared.chain();
    let tip = chain.tip();
    let header = &tip.block.header;
    // Core reports its block and undo files; the simulator counts each block's bytes as stored
    // in a block file (4-byte magic and 4-byte length before each).
    let size_on_disk = chain.entries().map(|entry| entry.block.total_size() as u64 + 8).sum();
    Ok(Answer::ChainInfo(ChainInfoJson {
        chain: "regtest",
        blocks: tip.height,
        headers: tip.height,
        bestblockhash: tip.hash.to_string(),
        bits: format!("{:08x}", header.bits.to_consensus()),
        target: Target::from_compact(header.bits).to_be_bytes().to_lower_hex_string(),
        difficulty: difficulty(header.bits.to_consensus()),
        time: header.time,
        mediantime: tip.median_time,
        // Regtest has no transaction-rate data, so Core's estimate at the tip is exactly 1.
        verificationprogress: 1,
        initialblockdownload: false,
        chainwork: tip.chainwork.to_be_bytes().to_lower_hex_string(),
        size_on_disk,
        pruned: false,
        warnings: Vec::new(),
    }))
}

/// Core's `blockheaderToJSON` (v29: with `target`).
#[derive(Serialize)]
struct HeaderJson {
    hash: String,
    confirmations: i64,
    height: u64,
    version: i32,
    #[serde(rename = "versionHex")]
    version_hex: String,
    merkleroot: String,
    time: u32,
    mediantime: u32,
    nonce: u32,
    bits: String,
    target: String,
    difficulty: f64,
    chainwork: String,
    #[serde(rename = "nTx")]
    n_tx: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    previousblockhash: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    nextblockhash: Option<String>,
}

impl HeaderJson {
    fn new(chain: &Chain, entry: &Entry) -> HeaderJson {
        let header = &entry.block.header;
        let (confirmations, next) = chain.confirmations_and_next(entry);
        let version = header.version.to_consensus();
        HeaderJson {
            hash: entry.hash.to_string(),
            confirmations,
            height: entry.height,
            version,
            // C's %08x prints the two's-complement bits of a negative version.
            version_hex: format!("{:08x}", u32::from_ne_bytes(version.to_ne_bytes())),
            merkleroot: header.merkle_root.to_string(),
            time: header.time,
            mediantime: entry.median_time,
            nonce: header.nonce,
            bits: format!("{:08x}", header.bits.to_consensus()),
            target: Target::from_compact(header.bits).to_be_bytes().to_lower_hex_string(),
            difficulty: difficulty(header.bits.to_consensus()),
            chainwork: entry.chainwork.to_be_bytes().to_lower_hex_string(),
            n_tx: entry.block.txdata.len(),
            previousblockhash: (entry.height > 0).then(|| header.prev_blockhash.to_string()),
            nextblockhash: next.map(|hash| hash.to_string()),
        }
    }
}

/// Core's `blockToJSON` at verbosity 1.
#[derive(Serialize)]
struct BlockJson {
    #[serde(flatten)]
    header: HeaderJson,
    strippedsize: usize,
    size: usize,
    weight: u64,
    tx: Vec<String>,
}

/// Core's `getblockchaininfo` (v29 fields, not pruned, not signet).
#[derive(Serialize)]
struct ChainInfoJson {
    chain: &'static str,
    blocks: u64,
    headers: u64,
    bestblockhash: String,
    bits: String,
    target: String,
    difficulty: f64,
    time: u32,
    mediantime: u32,
    verificationprogress: u8,
    initialblockdownload: bool,
    chainwork: String,
    size_on_disk: u64,
    pruned: bool,
    warnings: Vec<String>,
}

const RPC_DESERIALIZATION_ERROR: i32 = -22;

/// An amount in BTC written as Core's `ValueFromAmount` does: a JSON number with eight decimals.
struct Btc(u64);

impl Serialize for Btc {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let text = format!("{}.{:08}", self.0 / 100_000_000, self.0 % 100_000_000);
        serde_json::value::RawValue::from_string(text).map_err(serde::ser::Error::custom)?.serialize(serializer)
    }
}

/// A BTC amount argument (a number or a numeric string, as `AmountFromValue`) in satoshis.
fn satoshis(value: &Value) -> Result<u64, RpcError> {
    let text = match value {
        Value::Number(n) => n.to_string(),
        Value::String(s) => s.clone(),
        other => {
            return Err(RpcError::new(
                RPC_TYPE_ERROR,
                format!("JSON value of type {} is not of expected type number", type_name(other)),
            ))
        }
    };
    let invalid = || RpcError::new(RPC_TYPE_ERROR, "Invalid amount");
    let (whole, fraction) = text.split_once('.').unwrap_or((&text, ""));
    if fraction.len() > 8 || whole.starts_with('-') {
        return Err(invalid());
    }
    let whole: u64 = whole.parse().map_err(|_| invalid())?;
    let fraction: u64 = format!("{fraction:0<8}").parse().map_err(|_| invalid())?;
    whole.checked_mul(100_000_000).and_then(|w| w.checked_add(fraction)).ok_or_else(invalid)
}

/// `DecodeHexTx` as `sendrawtransaction` calls it (witness first, then without).
fn decode_tx(value: &Value) -> Result<bitcoin::Transaction, RpcError> {
    let text = value.as_str().unwrap_or_default();
    let bytes: Vec<u8> = bitcoin::hex::FromHex::from_hex(text).map_err(|_| {
        RpcError::new(RPC_DESERIALIZATION_ERROR, "TX decode failed. Make sure the tx has at least one input.")
    })?;
    bitcoin::consensus::deserialize(&bytes).map_err(|_| {
        RpcError::new(RPC_DESERIALIZATION_ERROR, "TX decode failed. Make sure the tx has at least one input.")
    })
}

fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn max_fee_rate(value: Option<&Value>) -> Result<u64, RpcError> {
    match value {
        None | Some(Value::Null) => Ok(super::mempool::Mempool::default_max_fee_rate()),
        Some(value) => satoshis(value),
    }
}

fn sendrawtransaction(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let tx = decode_tx(&params[0])?;
    let max = max_fee_rate(params.get(1))?;
    let txid = tx.compute_txid();
    let mut chain = shared.chain();
    // Already waiting with the same witness: Core relays it again and answers its txid.
    if chain.mempool.entries.get(&txid).is_some_and(|e| e.wtxid == tx.compute_wtxid()) {
        return Ok(Answer::Hex(txid.to_string()));
    }
    let utxos = chain.utxos();
    let height = chain.tip_height();
    match chain.mempool.check(&tx, &utxos, height, Some(max), now()) {
        Ok(accepted) => {
            chain.mempool.insert(accepted);
            Ok(Answer::Hex(txid.to_string()))
        }
        Err(refusal) => {
            let (code, message) = refusal.rpc();
            Err(RpcError::new(code, message))
        }
    }
}

/// Core's `testmempoolaccept` result for one transaction.
#[derive(Serialize)]
struct AcceptJson {
    txid: String,
    wtxid: String,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    vsize: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fees: Option<AcceptFeesJson>,
    #[serde(rename = "reject-reason", skip_serializing_if = "Option::is_none")]
    reject_reason: Option<String>,
}

#[derive(Serialize)]
struct AcceptFeesJson {
    base: Btc,
    #[serde(rename = "effective-feerate")]
    effective_feerate: Btc,
    #[serde(rename = "effective-includes")]
    effective_includes: Vec<String>,
}

fn testmempoolaccept(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let raws = params[0].as_array().expect("BUG: the type check admits only arrays here");
    if raws.is_empty() || raws.len() > 25 {
        return Err(RpcError::new(RPC_INVALID_PARAMETER, "Array must contain between 1 and 25 transactions."));
    }
    if raws.len() > 1 {
        return Err(RpcError::new(RPC_INVALID_PARAMETER, "the Bitcoin Core simulator tests one transaction at a time"));
    }
    let tx = decode_tx(&raws[0])?;
    let max = max_fee_rate(params.get(1))?;
    let chain = shared.chain();
    let (txid, wtxid) = (tx.compute_txid().to_string(), tx.compute_wtxid().to_string());
    if chain.mempool.contains(&tx.compute_txid()) {
        let reason = Some("txn-already-in-mempool".to_owned());
        return Ok(Answer::Accept(vec![AcceptJson {
            txid,
            wtxid,
            allowed: false,
            vsize: None,
            fees: None,
            reject_reason: reason,
        }]));
    }
    let answer = match chain.mempool.check(&tx, &chain.utxos(), chain.tip_height(), Some(max), now()) {
        Ok(accepted) => AcceptJson {
            txid,
            wtxid: wtxid.clone(),
            allowed: true,
            vsize: Some(accepted.entry.vsize),
            fees: Some(AcceptFeesJson {
                base: Btc(accepted.entry.fee.to_sat()),
                effective_feerate: Btc(accepted.entry.fee.to_sat() * 1000 / accepted.entry.vsize.max(1)),
                effective_includes: vec![wtxid],
            }),
            reject_reason: None,
        },
        Err(refusal) => AcceptJson {
            txid,
            wtxid,
            allowed: false,
            vsize: None,
            fees: None,
            reject_reason: Some(refusal.reject_reason()),
        },
    };
    Ok(Answer::Accept(vec![answer]))
}

fn getrawmempool(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    if params.first().and_then(Value::as_bool).unwrap_or(false) {
        return Err(RpcError::new(
            RPC_INVALID_PARAMETER,
            "getrawmempool verbose is not implemented by the Bitcoin Core simulator",
        ));
    }
    let chain = shared.chain();
    Ok(Answer::Txids(chain.mempool.in_order().iter().map(|tx| tx.compute_txid().to_string()).collect()))
}

/// Core's `entryToJSON` (v28).
#[derive(Serialize)]
struct MempoolEntryJson {
    vsize: u64,
    weight: u64,
    time: u64,
    height: u64,
    descendantcount: usize,
    descendantsize: u64,
    ancestorcount: usize,
    ancestorsize: u64,
    wtxid: String,
    fees: MempoolFeesJson,
    depends: Vec<String>,
    spentby: Vec<String>,
    #[serde(rename = "bip125-replaceable")]
    bip125_replaceable: bool,
    unbroadcast: bool,
}

#[derive(Serialize)]
struct MempoolFeesJson {
    base: Btc,
    modified: Btc,
    ancestor: Btc,
    descendant: Btc,
}

fn getmempoolentry(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let text = params[0].as_str().unwrap_or_default();
    let txid = bitcoin::Txid::from_str(text).map_err(|_| {
        RpcError::new(RPC_INVALID_PARAMETER, format!("txid must be of length 64 (not {}, for '{text}')", text.len()))
    })?;
    let chain = shared.chain();
    let entry = chain
        .mempool
        .entries
        .get(&txid)
        .ok_or_else(|| RpcError::new(RPC_INVALID_ADDRESS_OR_KEY, "Transaction not in mempool"))?;
    let depends: Vec<String> = entry
        .tx
        .input
        .iter()
        .filter(|i| chain.mempool.contains(&i.previous_output.txid))
        .map(|i| i.previous_output.txid.to_string())
        .collect();
    let spentby: Vec<String> = chain
        .mempool
        .entries
        .values()
        .filter(|other| other.tx.input.iter().any(|i| i.previous_output.txid == txid))
        .map(|other| other.tx.compute_txid().to_string())
        .collect();
    let fee = entry.fee.to_sat();
    Ok(Answer::MempoolEntry(MempoolEntryJson {
        vsize: entry.vsize,
        weight: entry.tx.weight().to_wu(),
        time: entry.time,
        height: entry.height,
        descendantcount: 1 + spentby.len(),
        descendantsize: entry.vsize,
        ancestorcount: 1 + depends.len(),
        ancestorsize: entry.vsize,
        wtxid: entry.wtxid.to_string(),
        fees: MempoolFeesJson { base: Btc(fee), modified: Btc(fee), ancestor: Btc(fee), descendant: Btc(fee) },
        depends,
        spentby,
        // Full replace-by-fee (Core 28's default): every transaction is replaceable, and Core
        // reports signalling only.
        bip125_replaceable: entry.tx.input.iter().any(|i| i.sequence.is_rbf()),
        unbroadcast: false,
    }))
}

/// Core's `estimatesmartfee` answer.
#[derive(Serialize)]
struct FeeEstimateJson {
    #[serde(skip_serializing_if = "Option::is_none")]
    feerate: Option<Btc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    errors: Option<Vec<String>>,
    blocks: i32,
}

fn estimatesmartfee(shared: &Shared, params: &[Value]) -> Result<Answer, RpcError> {
    let target = get_int(&params[0])?;
    if !(1..=1008).contains(&target) {
        return Err(RpcError::new(RPC_INVALID_PARAMETER, "Invalid conf_target, must be between 1 and 1008"));
    }
    if let Some(mode) = params.get(1).and_then(Value::as_str) {
        if !["unset", "economical", "conservative"].contains(&mode.to_ascii_lowercase().as_str()) {
            return Err(RpcError::new(
                RPC_INVALID_PARAMETER,
                "Invalid estimate_mode parameter, must be one of: \"unset\", \"economical\", \"conservative\"",
            ));
        }
    }
    Ok(Answer::FeeEstimate(match shared.fee_rate() {
        Some(sat_per_kvb) => FeeEstimateJson { feerate: Some(Btc(sat_per_kvb)), errors: None, blocks: target.max(2) },
        None => FeeEstimateJson {
            feerate: None,
            errors: Some(vec!["Insufficient data or no feerate found".to_owned()]),
            blocks: 0,
        },
    }))
}
