//! A minimal HTTP/1.1 server that frames, authorises and answers requests the way Bitcoin Core's
//! RPC server (libevent's evhttp under `src/httpserver.cpp` and `src/httprpc.cpp`) does:
//! keep-alive, `Connection: close`, `Expect: 100-continue`, chunked bodies, Basic auth with a 401
//! and `WWW-Authenticate`, 405 for anything but POST, 404 for other paths.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::{rpc, Shared};

/// Longest request line plus headers Bitcoin Core accepts (`MAX_HEADERS_SIZE`).
const MAX_HEADERS_BYTES: usize = 8192;
/// Largest request body Bitcoin Core accepts (`MAX_SIZE`, 32 MiB).
const MAX_BODY_BYTES: usize = 0x0200_0000;
/// How long a connection may sit without completing a request (`-rpcservertimeout`'s default).
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; more are closed on accept. Tests open a handful.
const MAX_CONNECTIONS: usize = 64;
/// Bitcoin Core waits this long before answering wrong credentials, to deter brute force.
const WRONG_CREDENTIALS_DELAY: Duration = Duration::from_millis(250);
/// How long to back off after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(10);
/// Bytes read from a socket at a time.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// libevent's default `Content-Type` for replies that set none.
const DEFAULT_CONTENT_TYPE: &str = "text/html; charset=ISO-8859-1";

/// Accepts connections until the task is aborted. Connection tasks live in a `JoinSet` owned by
/// this task, so aborting it (dropping the simulator) ends them all.
pub(super) async fn serve(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    // While "unavailable", or when full, close the connection unanswered.
                    if !shared.is_unavailable() && connections.len() < MAX_CONNECTIONS {
                        connections.spawn(connection(stream, Arc::clone(&shared)));
                    } else if shared.is_unavailable() {
                        shared.count_refused();
                    }
                }
                Err(_) => tokio::time::sleep(ACCEPT_RETRY_DELAY).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Serves requests on one connection until the client or a reply closes it.
async fn connection(mut stream: TcpStream, shared: Arc<Shared>) {
    let mut buffer = Vec::new();
    loop {
        let read = match tokio::time::timeout(IDLE_TIMEOUT, read_request(&mut stream, &mut buffer)).await {
            Ok(read) => read,
            Err(_elapsed) => return,
        };
        // An outage also drops connections a client keeps alive, answering nothing.
        if shared.is_unavailable() {
            shared.count_refused();
            return;
        }
        let (bytes, keep_alive) = match read {
            Read::Closed => return,
            Read::Refused { status, minor } => (error_page(status, minor), false),
            Read::Request(request) => {
                let response = respond(&shared, &request).await;
                frame(&request, response)
            }
        };
        if stream.write_all(&bytes).await.is_err() || !keep_alive {
            return;
        }
    }
}

/// One request as read off the wire.
struct Request {
    method: String,
    target: String,
    /// The HTTP/1.x minor version; replies carry the request's version, as libevent's do.
    minor: u8,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Request {
    /// The first header named `name`, compared case-insensitively.
    fn header(&self, name: &str) -> Option<&str> {
        header(&self.headers, name)
    }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(key, _)| key.eq_ignore_ascii_case(name)).map(|(_, value)| value.as_str())
}

enum Read {
    Request(Request),
    /// A request libevent refuses before Bitcoin Core sees it: 400, 413, 417, 501.
    Refused {
        status: u16,
        minor: u8,
    },
    Closed,
}

/// Reads one request, leaving any bytes after it (a pipelined request) in `buffer`.
async fn read_request(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Read {
    let head_end = loop {
        if let Some(end) = find_head_end(buffer) {
            break end;
        }
        if buffer.len() > MAX_HEADERS_BYTES {
            return Read::Refused { status: 413, minor: 1 };
        }
        if !fill(stream, buffer).await {
            return Read::Closed;
        }
    };
    let head: Vec<u8> = buffer.drain(..head_end).collect();
    if head_end > MAX_HEADERS_BYTES {
        return Read::Refused { status: 413, minor: 1 };
    }
    let Some((method, target, minor, headers)) = parse_head(&head) else {
        return Read::Refused { status: 400, minor: 1 };
    };
    if !["GET", "POST", "HEAD", "PUT", "DELETE"].contains(&method.as_str()) {
        return Read::Refused { status: 501, minor };
    }
    let body = if method == "HEAD" {
        Vec::new()
    } else {
        match read_body(stream, buffer, minor, &headers).await {
            Ok(body) => body,
            Err(read) => return read,
        }
    };
    Read::Request(Request { method, target, minor, headers, body })
}

/// Reads a request body framed by `Content-Length` or chunked transfer encoding.
async fn read_body(
    stream: &mut TcpStream,
    buffer: &mut Vec<u8>,
    minor: u8,
    headers: &[(String, String)],
) -> Result<Vec<u8>, Read> {
    let chunked = header(headers, "Transfer-Encoding").is_some_and(|value| value.eq_ignore_ascii_case("chunked"));
    let length = match header(headers, "Content-Length") {
        _ if chunked => 0,
        None => 0,
        Some(value) => value.trim().parse::<usize>().map_err(|_| Read::Refused { status: 400, minor })?,
    };
    if length > MAX_BODY_BYTES {
        return Err(Read::Refused { status: 413, minor });
    }
    if let Some(expect) = header(headers, "Expect").filter(|_| minor >= 1) {
        if !expect.eq_ignore_ascii_case("100-continue") {
            return Err(Read::Refused { status: 417, minor });
        }
        if buffer.is_empty() && (chunked || length > 0) {
            let interim = format!("HTTP/1.{minor} 100 Continue\r\n\r\n");
            stream.write_all(interim.as_bytes()).await.map_err(|_| Read::Closed)?;
        }
    }
    if chunked {
        return read_chunked(stream, buffer, minor).await;
    }
    while buffer.len() < length {
        if !fill(stream, buffer).await {
            return Err(Read::Closed);
        }
    }
    Ok(buffer.drain(..length).collect())
}

/// Decodes a chunked body: hex sizes (extensions ignored), data, then a trailer up to an empty line.
async fn read_chunked(stream: &mut TcpStream, buffer: &mut Vec<u8>, minor: u8) -> Result<Vec<u8>, Read> {
    let too_large = Read::Refused { status: 413, minor };
    let mut body = Vec::new();
    loop {
        let line = read_line(stream, buffer).await?;
        let size_text = line.split(|byte| *byte == b';').next().unwrap_or_default();
        let size_text = std::str::from_utf8(size_text).map(str::trim).unwrap_or("-");
        let size = usize::from_str_radix(size_text, 16).map_err(|_| Read::Refused { status: 413, minor })?;
        if size == 0 {
            break;
        }
        if body.len() + size > MAX_BODY_BYTES {
            return Err(too_large);
        }
        while buffer.len() < size + 2 {
            if !fill(stream, buffer).await {
                return Err(Read::Closed);
            }
        }
        body.extend(buffer.drain(..size));
        buffer.drain(..2);
    }
    // The trailer: header lines up to an empty one, all ignored.
    while !read_line(stream, buffer).await?.is_empty() {}
    Ok(body)
}

/// One line without its line ending, bounded by the header size limit.
async fn read_line(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> Result<Vec<u8>, Read> {
    loop {
        if let Some(end) = buffer.iter().position(|byte| *byte == b'\n') {
            let mut line: Vec<u8> = buffer.drain(..=end).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(line);
        }
        if buffer.len() > MAX_HEADERS_BYTES {
            return Err(Read::Closed);
        }
        if !fill(stream, buffer).await {
            return Err(Read::Closed);
        }
    }
}

/// Reads more bytes into `buffer`; false at end of stream or on error.
async fn fill(stream: &mut TcpStream, buffer: &mut Vec<u8>) -> bool {
    buffer.reserve(READ_CHUNK_BYTES);
    matches!(stream.read_buf(buffer).await, Ok(read) if read > 0)
}

/// The index just past the empty line that ends the head (`\r\n` or bare `\n` line endings).
/// Blank lines before the request line are skipped, as libevent does.
fn find_head_end(buffer: &[u8]) -> Option<usize> {
    let start = buffer.iter().position(|byte| *byte != b'\r' && *byte != b'\n')?;
    let mut line_start = start;
    for (index, byte) in buffer.iter().enumerate().skip(start) {
        if *byte == b'\n' {
            let line = &buffer[line_start..index];
            if line.is_empty() || line == b"\r" {
                return Some(index + 1);
            }
            line_start = index + 1;
        }
    }
    None
}

type Head = (String, String, u8, Vec<(String, String)>);

/// The request line and headers; `None` if libevent would refuse them (400).
fn parse_head(head: &[u8]) -> Option<Head> {
    // Header values are bytes; Latin-1 keeps every byte as one char.
    let text: String = head.iter().map(|byte| char::from(*byte)).collect();
    let mut lines = text.lines().map(|line| line.trim_end_matches('\r')).skip_while(|line| line.is_empty());
    let request_line = lines.next()?.trim_end_matches(' ');
    let (method, rest) = request_line.split_once(' ')?;
    let (target, version) = rest.rsplit_once(' ')?;
    let minor = match version {
        "HTTP/1.0" => 0,
        "HTTP/1.1" => 1,
        _ => return None,
    };
    if method.is_empty() || target.is_empty() {
        return None;
    }
    let mut headers = Vec::new();
    for line in lines.take_while(|line| !line.is_empty()) {
        let (name, value) = line.split_once(':')?;
        headers.push((name.to_owned(), value.trim().to_owned()));
    }
    Some((method.to_owned(), target.to_owned(), minor, headers))
}

/// What to send for a request, before framing.
struct Response {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Response {
    fn empty(status: u16) -> Response {
        Response { status, headers: Vec::new(), body: Vec::new() }
    }
}

/// Bitcoin Core's `http_request_cb` then `HTTPReq_JSONRPC`, in their order: method, path, POST
/// only, credentials, then the JSON-RPC body.
async fn respond(shared: &Shared, request: &Request) -> Response {
    // Core's request-method enum has GET, POST, HEAD and PUT only.
    if request.method == "DELETE" {
        return Response::empty(405);
    }
    // The JSON-RPC handler is registered for "/" exactly and for wallet paths.
    if request.target != "/" && !request.target.starts_with("/wallet/") {
        return Response::empty(404);
    }
    if request.method != "POST" {
        let mut response = Response::empty(405);
        response.body = b"JSONRPC server handles only POST requests".to_vec();
        return response;
    }
    let Some(authorization) = request.header("Authorization") else {
        return unauthorized();
    };
    if !shared.authorized(authorization) {
        tokio::time::sleep(WRONG_CREDENTIALS_DELAY).await;
        return unauthorized();
    }
    let reply = rpc::handle(shared, &request.body);
    match reply.body {
        Some(body) => Response {
            status: reply.status,
            headers: vec![("Content-Type", "application/json".to_owned())],
            body: body.into_bytes(),
        },
        None => Response::empty(reply.status),
    }
}

fn unauthorized() -> Response {
    Response {
        status: 401,
        headers: vec![("WWW-Authenticate", "Basic realm=\"jsonrpc\"".to_owned())],
        body: Vec::new(),
    }
}

/// libevent's framing: the request's HTTP version, `Content-Length` on HTTP/1.1 (and on 1.0 with
/// keep-alive), `Connection: close` echoed. Returns the bytes and whether to keep the connection.
fn frame(request: &Request, response: Response) -> (Vec<u8>, bool) {
    let connection = request.header("Connection").unwrap_or_default().to_ascii_lowercase();
    let asks_close = connection == "close";
    let asks_keep_alive = connection.starts_with("keep-alive");
    let keep_alive = !asks_close && (request.minor >= 1 || asks_keep_alive);
    let mut head = format!("HTTP/1.{} {} {}\r\n", request.minor, response.status, reason(response.status));
    let mut has_content_type = false;
    for (name, value) in &response.headers {
        has_content_type |= name.eq_ignore_ascii_case("Content-Type");
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    let has_body = response.status != 204;
    if has_body && !has_content_type {
        head.push_str(&format!("Content-Type: {DEFAULT_CONTENT_TYPE}\r\n"));
    }
    if request.minor == 0 && asks_keep_alive && !asks_close {
        head.push_str("Connection: keep-alive\r\n");
    }
    if has_body && (request.minor >= 1 || asks_keep_alive) {
        head.push_str(&format!("Content-Length: {}\r\n", response.body.len()));
    }
    if asks_close {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    if request.method != "HEAD" {
        bytes.extend_from_slice(&response.body);
    }
    (bytes, keep_alive)
}

/// libevent's `evhttp_send_error` page, after which it closes the connection.
fn error_page(status: u16, minor: u8) -> Vec<u8> {
    let reason = reason(status);
    let body =
        format!("<HTML><HEAD>\n<TITLE>{status} {reason}</TITLE>\n</HEAD><BODY>\n<H1>{reason}</H1>\n</BODY></HTML>\n");
    format!(
        "HTTP/1.{minor} {status} {reason}\r\nContent-Type: {DEFAULT_CONTENT_TYPE}\r\nConnection: close\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        413 => "Request Entity Too Large",
        417 => "Expectation Failed",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        _ => "Unknown",
    }
}

/// Bitcoin Core's `DecodeBase64`: a multiple of four characters, `=` only as trailing padding.
pub(super) fn base64_decode(text: &str) -> Option<Vec<u8>> {
    fn sextet(byte: u8) -> Option<u32> {
        let value = match byte {
            b'A'..=b'Z' => byte - b'A',
            b'a'..=b'z' => byte - b'a' + 26,
            b'0'..=b'9' => byte - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        Some(u32::from(value))
    }
    let bytes = text.as_bytes();
    if !bytes.len().is_multiple_of(4) {
        return None;
    }
    let padding = bytes.iter().rev().take_while(|byte| **byte == b'=').count();
    if padding > 2 {
        return None;
    }
    let data = &bytes[..bytes.len() - padding];
    let mut out = Vec::with_capacity(data.len() * 3 / 4);
    let mut accumulator = 0_u32;
    let mut bits = 0;
    for byte in data {
        accumulator = (accumulator << 6) | sextet(*byte)?;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from((accumulator >> bits) & 0xff).expect("BUG: masked to a byte"));
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Standard base64 with padding, as in HTTP Basic credentials.
    fn base64_encode(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let triple = chunk.iter().enumerate().fold(0_u32, |acc, (i, byte)| acc | u32::from(*byte) << (16 - 8 * i));
            for position in 0..4 {
                if position <= chunk.len() {
                    let sextet = (triple >> (18 - 6 * position)) & 0x3f;
                    out.push(char::from(ALPHABET[sextet as usize]));
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    #[test]
    fn base64_round_trips_and_refuses_what_core_refuses() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("custodian:simulator", "Y3VzdG9kaWFuOnNpbXVsYXRvcg=="),
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), encoded);
            assert_eq!(base64_decode(encoded).as_deref(), Some(plain.as_bytes()));
        }
        assert_eq!(base64_decode("Zg="), None, "not a multiple of four");
        assert_eq!(base64_decode("Z==="), None, "too much padding");
        assert_eq!(base64_decode("Zm9v!A=="), None, "not base64");
    }

    #[test]
    fn heads_parse_like_libevent() {
        let head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n";
        assert_eq!(find_head_end(head), Some(head.len()));
        let (method, target, minor, headers) = parse_head(head).expect("valid head");
        assert_eq!((method.as_str(), target.as_str(), minor), ("POST", "/", 1));
        assert_eq!(header(&headers, "content-length"), Some("2"));
        assert_eq!(find_head_end(b"POST / HTTP/1.1\r\nHost: x\r\n"), None);
        assert!(parse_head(b"POST / HTTP/2.0\r\n\r\n").is_none());
        assert!(parse_head(b"POST /\r\n\r\n").is_none());
    }
}
