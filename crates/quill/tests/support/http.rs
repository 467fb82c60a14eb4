//! HTTP pieces of the harness, for `tests/metrics.rs`: starting quill with a metrics
//! listener on a free port, a minimal HTTP/1.1 client (one request per connection, from a
//! chosen loopback source address), and the Prometheus parser of the reference client
//! library (Python's `prometheus_client`, strict OpenMetrics), run as a subprocess.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

use super::{client_from, free_port, Quill};

/// Starts quill with `{metrics}` (and `{ctl}`, if present) in `args` replaced by free
/// ports; returns the daemon and the metrics address. Retries when a port was taken.
pub fn start_with_metrics(args: &[&str]) -> (Quill, SocketAddr) {
    let mut failures = Vec::new();
    for _ in 0..5 {
        let metrics = free_port();
        let ctl = free_port();
        let real: Vec<String> = args
            .iter()
            .map(|a| {
                a.replace("{metrics}", &metrics.to_string())
                    .replace("{ctl}", &ctl.to_string())
            })
            .collect();
        let refs: Vec<&str> = real.iter().map(String::as_str).collect();
        match Quill::try_start(&refs) {
            Ok(q) => return (q, SocketAddr::from(([127, 0, 0, 1], metrics))),
            Err(e) if e.to_lowercase().contains("in use") => failures.push(e),
            Err(e) => panic!("{e}"),
        }
    }
    panic!(
        "could not start quill with a metrics listener:\n{}",
        failures.join("\n")
    );
}

/// One value of `/metrics` (the Prometheus text format), e.g. `quill_server_pool_idle`.
pub fn metric(addr: SocketAddr, name: &str) -> u64 {
    let text = get(addr, "/metrics").text();
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .and_then(|l| l.split_whitespace().last()?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    /// Header names in lower case.
    pub headers: BTreeMap<String, String>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
}

/// Sends one request (`Connection: close`) from source address `src` and reads the whole
/// response. `headers` are extra `Name: value` lines.
pub fn request_from(
    src: &str,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &[u8],
) -> std::io::Result<Response> {
    let mut s = client_from(src, addr)?;
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    if !body.is_empty() || method == "POST" {
        head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes())?;
    s.write_all(body)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    parse_response(&raw, method == "HEAD")
}

fn parse_response(raw: &[u8], head_only: bool) -> std::io::Result<Response> {
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| bad("head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("no status line"))?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let mut headers = BTreeMap::new();
    for line in lines {
        let (k, v) = line.split_once(':').ok_or_else(|| bad("bad header"))?;
        headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
    }
    let mut body = raw[end + 4..].to_vec();
    if head_only {
        body.clear();
    } else if let Some(n) = headers
        .get("content-length")
        .and_then(|n| n.parse::<usize>().ok())
    {
        if body.len() < n {
            return Err(bad("body shorter than Content-Length"));
        }
        body.truncate(n);
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// `GET path` from 127.0.0.1; panics on an I/O error.
pub fn get(addr: SocketAddr, path: &str) -> Response {
    request_from("127.0.0.1", addr, "GET", path, &[], b"")
        .unwrap_or_else(|e| panic!("GET http://{addr}{path}: {e}"))
}

/// The `Accept` header Prometheus sends: OpenMetrics first, the text format as a fallback.
pub const PROMETHEUS_ACCEPT: &str = "Accept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// `GET /metrics` as Prometheus asks for it (OpenMetrics).
pub fn get_openmetrics(addr: SocketAddr) -> Response {
    request_from(
        "127.0.0.1",
        addr,
        "GET",
        "/metrics",
        &[PROMETHEUS_ACCEPT],
        b"",
    )
    .unwrap_or_else(|e| panic!("GET http://{addr}/metrics: {e}"))
}

/// `POST /control` with `line` from `src`, with the header the dashboard sends.
pub fn post_control(src: &str, addr: SocketAddr, line: &str) -> Response {
    request_from(
        src,
        addr,
        "POST",
        "/control",
        &["X-Quill-Control: 1", "Content-Type: text/plain"],
        line.as_bytes(),
    )
    .unwrap_or_else(|e| panic!("POST /control {line:?}: {e}"))
}

/// One sample of a metrics scrape.
#[derive(Debug, Clone)]
pub struct Sample {
    /// The family (for counters, without `_total`).
    pub family: String,
    /// The family's type as the parser read it (`counter`, `gauge`, ...).
    pub kind: String,
    /// The sample's own name (e.g. `quill_connections_accepted_total`).
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

const PARSER: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append({"family": family.name, "kind": family.type, "name": s.name,
                    "labels": s.labels, "value": s.value})
print(json.dumps(out))
"#;

/// The system Python with the reference Prometheus client library, when installed
/// (Debian's `python3-prometheus-client`, which .ci/run installs).
pub fn prometheus_parser() -> Option<&'static Path> {
    let python = Path::new("/usr/bin/python3");
    let ok = Command::new(python)
        .args(["-c", "import prometheus_client.openmetrics.parser"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then_some(python)
}

/// Parses an exposition with the reference parser (strict OpenMetrics); panics with the
/// parser's complaint when the text is not valid.
pub fn parse_metrics(python: &Path, text: &str) -> Vec<Sample> {
    let mut child = Command::new(python)
        .args(["-c", PARSER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python.display()));
    let mut stdin = child.stdin.take().expect("stdin");
    let input = text.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("parser output");
    let _ = writer.join();
    assert!(
        out.status.success(),
        "the Prometheus parser rejected the metrics:\n{}\n--- metrics ---\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).expect("parser JSON");
    parsed
        .iter()
        .map(|v| Sample {
            family: v["family"].as_str().unwrap_or_default().to_string(),
            kind: v["kind"].as_str().unwrap_or_default().to_string(),
            name: v["name"].as_str().unwrap_or_default().to_string(),
            labels: v["labels"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                        .collect()
                })
                .unwrap_or_default(),
            value: v["value"].as_f64().unwrap_or(f64::NAN),
        })
        .collect()
}

/// An HTTP/2 client connection (prior knowledge) to quill's `port`, ready to send an
/// extended CONNECT (RFC 8441): returned once quill's SETTINGS have enabled it, within
/// `limit`. The task drives the connection.
pub async fn h2_extended_connect_client(
    port: u16,
    limit: std::time::Duration,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    let conn = tokio::spawn(conn);
    let client = client.ready().await.unwrap();
    tokio::time::timeout(limit, async {
        while !client.is_extended_connect_protocol_enabled() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("timed out waiting for ENABLE_CONNECT_PROTOCOL");
    (client, conn)
}
