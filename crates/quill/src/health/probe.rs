//! One active health check of one server: a TCP connect, an HTTP/1.1 `GET` whose status
//! line is read and matched, or a gRPC health check call over HTTP/2.
//!
//! The answer of a server is untrusted bytes: only the status line is parsed (by
//! `httparse`), at most [`MAX_HEAD`] bytes are read (a gRPC answer: [`grpc::MAX_ANSWER`],
//! framed by the h2 crate), and every failure is an error value.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::http;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::grpc::{self, ServingStatus};
use crate::command::{Host, Probe, Word};
use crate::net::connect::{connect, SocketOptions};
use crate::tls::{Offer, UpstreamTls};

/// Most bytes of an answer read to find its status line.
pub const MAX_HEAD: usize = 8192;

/// Why a check failed. Each variant says what an operator needs to look at.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    #[error("connect: {0}")]
    Connect(io::Error),
    #[error("TLS: {0}")]
    Tls(io::Error),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("sending the request: {0}")]
    Send(io::Error),
    #[error("reading the answer: {0}")]
    Receive(io::Error),
    #[error("connection closed before a status line")]
    Closed,
    #[error("not an HTTP answer: {0}")]
    NotHttp(String),
    #[error("status {got}, expected {expected}")]
    Status { got: u16, expected: String },
    #[error("the check's request (the server's name?): {0}")]
    Request(String),
    #[error("HTTP/2: {0}")]
    Http2(h2::Error),
    #[error("the server chose HTTP/1.1 over TLS; a gRPC check needs HTTP/2 (ALPN h2)")]
    NoHttp2,
    #[error("gRPC status {code}{}", if message.is_empty() { String::new() } else { format!(": {message}") })]
    GrpcStatus { code: String, message: String },
    #[error("gRPC answer: {0}")]
    GrpcAnswer(#[from] grpc::AnswerError),
    #[error("serving status {0}")]
    NotServing(ServingStatus),
}

/// Where and how to check one server.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    pub addr: SocketAddr,
    /// The `Host` header: the server's name as configured, with its port.
    pub host: String,
    pub source: Option<IpAddr>,
    pub probe: Probe,
    /// `upstream_tls`: an HTTP check speaks TLS to the server, as clients' traffic does.
    pub tls: Option<ProbeTls>,
}

/// The TLS an HTTP check uses: the upstream configuration and the server's name as written.
/// Compared by identity: a rebuilt configuration (a reload) restarts the checks.
#[derive(Clone)]
pub struct ProbeTls {
    pub conf: Arc<UpstreamTls>,
    pub host: Option<Host>,
}

impl PartialEq for ProbeTls {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.conf, &other.conf) && self.host == other.host
    }
}

impl Eq for ProbeTls {}

impl std::hash::Hash for ProbeTls {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Arc::as_ptr(&self.conf).hash(state);
        self.host.hash(state);
    }
}

impl std::fmt::Debug for ProbeTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProbeTls")
            .field("host", &self.host)
            .finish()
    }
}

/// Runs one check within `timeout` (connect, request and answer together).
pub async fn check(target: &Target, timeout: Duration) -> Result<(), ProbeError> {
    match tokio::time::timeout(timeout, run(target, timeout)).await {
        Ok(r) => r,
        Err(_) => Err(ProbeError::Timeout(timeout)),
    }
}

async fn run(target: &Target, timeout: Duration) -> Result<(), ProbeError> {
    let opts = SocketOptions {
        nodelay: true,
        keepalive: false,
        // Checks come from quill's own address (or `source`), never a client's.
        transparent: false,
    };
    let stream = connect(target.addr, target.source, timeout, opts)
        .await
        .map_err(ProbeError::Connect)?;
    let ip = target.addr.ip();
    match (&target.probe, &target.tls) {
        (Probe::Tcp, _) => Ok(()),
        (Probe::Http { path, status }, None) => http_get(stream, target, path, *status).await,
        (Probe::Http { path, status }, Some(tls)) => {
            let stream = tls
                .conf
                .connect(stream, tls.host.as_ref(), ip, timeout, Offer::Nothing)
                .await
                .map_err(ProbeError::Tls)?;
            http_get(stream, target, path, *status).await
        }
        // h2c with prior knowledge, as gRPC clients speak to plain servers.
        (Probe::Grpc { service }, None) => grpc_check(stream, target, service, "http").await,
        (Probe::Grpc { service }, Some(tls)) => {
            let stream = tls
                .conf
                .connect(stream, tls.host.as_ref(), ip, timeout, Offer::H2First)
                .await
                .map_err(ProbeError::Tls)?;
            if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(ProbeError::NoHttp2);
            }
            grpc_check(stream, target, service, "https").await
        }
    }
}

/// Calls `grpc.health.v1.Health/Check` for `service` (the whole server when `None`) and
/// passes only on gRPC status 0 with `SERVING`.
async fn grpc_check<S>(
    stream: S,
    target: &Target,
    service: &Option<Word>,
    scheme: &str,
) -> Result<(), ProbeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut sender, conn) = h2::client::handshake(stream)
        .await
        .map_err(ProbeError::Http2)?;
    let call = async {
        let req = http::Request::post(format!("{scheme}://{}{}", target.host, grpc::PATH))
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .header(http::header::USER_AGENT, "quill-health-check")
            .body(())
            .map_err(|e| ProbeError::Request(e.to_string()))?;
        let (answer, mut body) = sender.send_request(req, false).map_err(ProbeError::Http2)?;
        let service = service.as_ref().map_or("", Word::as_str);
        body.send_data(Bytes::from(grpc::request(service)), true)
            .map_err(ProbeError::Http2)?;
        let (head, mut body) = answer.await.map_err(ProbeError::Http2)?.into_parts();
        if head.status != http::StatusCode::OK {
            return Err(ProbeError::Status {
                got: head.status.as_u16(),
                expected: "200 (gRPC)".to_string(),
            });
        }
        // A trailers-only answer (an error) carries its status in the head.
        if head.headers.contains_key("grpc-status") {
            grpc_status(&head.headers)?;
            return Err(grpc::AnswerError::Empty.into());
        }
        let mut message = Vec::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(ProbeError::Http2)?;
            let _ = body.flow_control().release_capacity(chunk.len());
            if message.len() + chunk.len() > grpc::MAX_ANSWER {
                return Err(grpc::AnswerError::TooLong.into());
            }
            message.extend_from_slice(&chunk);
        }
        let trailers = body.trailers().await.map_err(ProbeError::Http2)?;
        grpc_status(&trailers.unwrap_or_default())?;
        match grpc::serving_status(&message)? {
            ServingStatus::Serving => Ok(()),
            other => Err(ProbeError::NotServing(other)),
        }
    };
    // The connection is driven beside the call; it ends only when the server closes.
    tokio::select! {
        result = call => result,
        end = conn => Err(match end {
            Ok(()) => ProbeError::Closed,
            Err(e) => ProbeError::Http2(e),
        }),
    }
}

/// `Ok` for `grpc-status: 0`; the status and its message otherwise (none is an error too).
fn grpc_status(fields: &http::HeaderMap) -> Result<(), ProbeError> {
    let text = |name: &str| {
        fields
            .get(name)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    match text("grpc-status").as_deref() {
        Some("0") => Ok(()),
        code => Err(ProbeError::GrpcStatus {
            code: code.unwrap_or("missing").to_string(),
            message: text("grpc-message").unwrap_or_default(),
        }),
    }
}

/// Sends the check's request and matches the status line of the answer.
async fn http_get<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    target: &Target,
    path: &crate::command::Word,
    expected: Option<u16>,
) -> Result<(), ProbeError> {
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {}\r\nUser-Agent: quill-health-check\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        target.host
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(ProbeError::Send)?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    let got = loop {
        if let Some(code) = status_code(&buf)? {
            break code;
        }
        if buf.len() >= MAX_HEAD {
            return Err(ProbeError::NotHttp(format!(
                "no status line in the first {MAX_HEAD} bytes"
            )));
        }
        let n = stream.read(&mut chunk).await.map_err(ProbeError::Receive)?;
        if n == 0 {
            return Err(ProbeError::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if status_matches(got, expected) {
        Ok(())
    } else {
        Err(ProbeError::Status {
            got,
            expected: expected.map_or_else(|| "2xx or 3xx".to_string(), |s| s.to_string()),
        })
    }
}

/// Whether a status passes: the configured one exactly, or any 2xx/3xx.
pub fn status_matches(got: u16, expected: Option<u16>) -> bool {
    match expected {
        Some(s) => got == s,
        None => (200..400).contains(&got),
    }
}

/// The status code of an answer once its status line is complete; `None` while more
/// bytes are needed.
pub fn status_code(head: &[u8]) -> Result<Option<u16>, ProbeError> {
    // The status line ends at the first LF; headers after it are not needed.
    let Some(end) = head.iter().position(|&b| b == b'\n') else {
        return Ok(None);
    };
    let mut headers = [httparse::EMPTY_HEADER; 0];
    let mut response = httparse::Response::new(&mut headers);
    // Parse the status line alone, as if the head ended there.
    let mut line = head[..=end].to_vec();
    line.extend_from_slice(b"\r\n");
    match response.parse(&line) {
        Ok(_) => response
            .code
            .map(Some)
            .ok_or_else(|| ProbeError::NotHttp("no status code".to_string())),
        Err(e) => Err(ProbeError::NotHttp(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_line_forms() {
        assert!(matches!(status_code(b"HTTP/1.1 200 OK\r\n"), Ok(Some(200))));
        assert!(matches!(
            status_code(b"HTTP/1.0 503 Service Unavailable\r\nServer: x\r\n"),
            Ok(Some(503))
        ));
        assert!(matches!(status_code(b"HTTP/1.1 204\n"), Ok(Some(204))));
        assert!(matches!(status_code(b"HTTP/1.1 20"), Ok(None)));
        assert!(status_code(b"SSH-2.0-OpenSSH\r\n").is_err());
        assert!(status_code(b"HTTP/1.1 abc OK\r\n").is_err());
    }

    #[test]
    fn default_status_is_2xx_or_3xx() {
        assert!(status_matches(200, None));
        assert!(status_matches(302, None));
        assert!(!status_matches(404, None));
        assert!(!status_matches(500, None));
        assert!(status_matches(404, Some(404)));
        assert!(!status_matches(200, Some(204)));
    }
}
