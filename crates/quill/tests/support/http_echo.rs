//! A small HTTP/1.1 backend and client for the `http` (-H) tests.
//!
//! [`EchoServer`] answers every request with a body that reports what it received: the
//! request head exactly as it arrived, and the length and SHA-256 of the de-chunked body.
//! It understands Content-Length and chunked bodies (with trailers), answers
//! `Expect: 100-continue` with `100 Continue` before reading the body, and switches an
//! `Upgrade: websocket` request to a raw echo after `101 Switching Protocols`.
#![allow(dead_code)]

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;

use sha2::{Digest, Sha256};

use super::IO_TIMEOUT;

/// What the echo server saw of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The head as received (request line and fields, CRLF line ends, no empty line).
    pub head: String,
    pub body_len: usize,
    pub body_sha256: String,
}

impl Seen {
    /// The values of every field called `name` (case-insensitive).
    pub fn fields(&self, name: &str) -> Vec<String> {
        self.head
            .split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .filter(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
            .collect()
    }

    pub fn request_line(&self) -> &str {
        self.head.split("\r\n").next().unwrap_or_default()
    }
}

/// The HTTP backend; see the module documentation.
pub struct EchoServer {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
}

impl EchoServer {
    pub fn start() -> EchoServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind echo server");
        let addr = listener.local_addr().expect("local_addr");
        let requests = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let (r, c) = (requests.clone(), connections.clone());
        thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                c.fetch_add(1, Ordering::SeqCst);
                let r = r.clone();
                thread::spawn(move || {
                    let _ = serve(conn, &r);
                });
            }
        });
        EchoServer {
            addr,
            requests,
            connections,
        }
    }

    pub fn spec(&self) -> String {
        format!("127.0.0.1:{}", self.addr.port())
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests answered so far.
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

fn serve(conn: TcpStream, requests: &AtomicUsize) -> io::Result<()> {
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    let mut w = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if r.read_line(&mut line)? == 0 {
                return Ok(());
            }
            if line == "\r\n" {
                break;
            }
            head.push_str(&line);
        }
        let head = head.trim_end_matches("\r\n").to_string();
        let seen_head = Seen {
            head: head.clone(),
            body_len: 0,
            body_sha256: String::new(),
        };
        let field = |n: &str| seen_head.fields(n).into_iter().next();
        if field("expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
            w.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
        }
        let body = if field("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
            read_chunked(&mut r)?
        } else {
            let n: usize = field("content-length").map_or(0, |v| v.parse().unwrap_or(0));
            let mut b = vec![0; n];
            r.read_exact(&mut b)?;
            b
        };
        requests.fetch_add(1, Ordering::SeqCst);
        if field("upgrade").is_some_and(|v| v.eq_ignore_ascii_case("websocket")) {
            w.write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            )?;
            // From here on: a raw echo, as a websocket server echoing frames would.
            let mut buf = [0u8; 4096];
            loop {
                match r.read(&mut buf)? {
                    0 => return Ok(()),
                    n => w.write_all(&buf[..n])?,
                }
            }
        }
        let text = format!(
            "{head}\r\n--\r\nlen {}\r\nsha256 {}\r\n",
            body.len(),
            hex(&Sha256::digest(&body))
        );
        let close = field("connection").is_some_and(|v| v.eq_ignore_ascii_case("close"));
        if head.starts_with("HEAD ") {
            // No body, as HTTP requires; the request line is reported in a field.
            let line = head.split("\r\n").next().unwrap_or_default();
            w.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nX-Request-Line: {line}\r\n{}\r\n",
                    text.len(),
                    if close { "Connection: close\r\n" } else { "" }
                )
                .as_bytes(),
            )?;
            if close {
                return Ok(());
            }
            continue;
        }
        w.write_all(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{}\r\n{text}",
                text.len(),
                if close { "Connection: close\r\n" } else { "" }
            )
            .as_bytes(),
        )?;
        if close {
            return Ok(());
        }
    }
}

fn read_chunked(r: &mut impl BufRead) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let mut line = String::new();
        r.read_line(&mut line)?;
        let size = line.trim_end().split(';').next().unwrap_or_default();
        let size = usize::from_str_radix(size.trim(), 16)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{line:?}: {e}")))?;
        if size == 0 {
            // Trailers, up to the empty line.
            loop {
                let mut t = String::new();
                if r.read_line(&mut t)? == 0 || t == "\r\n" {
                    return Ok(body);
                }
            }
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(&mut body[start..])?;
        let mut crlf = [0u8; 2];
        r.read_exact(&mut crlf)?;
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn sha256_hex(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

/// One response as the client read it.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

impl Response {
    /// What the echo server reported seeing.
    pub fn seen(&self) -> Seen {
        let text = String::from_utf8_lossy(&self.body);
        let (head, rest) = text.split_once("\r\n--\r\n").unwrap_or_else(|| {
            panic!("not an echo server answer: {text:?}");
        });
        let mut len = 0;
        let mut sha = String::new();
        for line in rest.split("\r\n") {
            if let Some(v) = line.strip_prefix("len ") {
                len = v.parse().unwrap_or(0);
            }
            if let Some(v) = line.strip_prefix("sha256 ") {
                sha = v.to_string();
            }
        }
        Seen {
            head: head.to_string(),
            body_len: len,
            body_sha256: sha,
        }
    }

    pub fn field(&self, name: &str) -> Option<String> {
        self.head
            .split("\r\n")
            .skip(1)
            .filter_map(|l| l.split_once(':'))
            .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim().to_string())
    }
}

/// Reads one response (Content-Length bodies, or none) from `r`, byte by byte up to
/// the end of the head so that nothing after it is consumed. `None` at EOF.
pub fn read_response(r: &mut impl Read) -> Option<Response> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match r.read(&mut b) {
            Ok(0) => return None,
            Ok(_) => head.push(b[0]),
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return None,
            Err(e) => panic!(
                "reading a response: {e} (got {:?})",
                String::from_utf8_lossy(&head)
            ),
        }
    }
    let head = String::from_utf8_lossy(&head[..head.len() - 4]).into_owned();
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line: {head:?}"));
    let mut resp = Response {
        status,
        head,
        body: Vec::new(),
    };
    let len: usize = resp
        .field("content-length")
        .map_or(0, |v| v.parse().unwrap_or(0));
    resp.body = vec![0; len];
    r.read_exact(&mut resp.body)
        .unwrap_or_else(|e| panic!("reading a body of {len} bytes: {e}"));
    Some(resp)
}

/// Reads the next final response, skipping interim (1xx) ones.
pub fn read_final_response(r: &mut impl Read) -> Option<Response> {
    loop {
        let resp = read_response(r)?;
        if resp.status >= 200 {
            return Some(resp);
        }
    }
}
