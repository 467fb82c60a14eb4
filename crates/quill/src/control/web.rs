//! The metrics listener (`metrics_listen`): a small HTTP/1.1 server on the control runtime
//! (never on an event loop) serving Prometheus metrics, the JSON status, a live dashboard,
//! and a narrow control endpoint for the dashboard's buttons.
//!
//! Invariants: it only reads the shared state, except through `POST /control`, which runs
//! the control socket's own command path (`dispatch::execute`) for the per-server commands
//! of [`allowed_over_http`], from addresses `control_acl` permits, with a header a
//! cross-site form or script cannot send. Every connection is bounded in time, size and
//! number, so a slow or hostile client costs a fixed, small amount.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::pin::pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};

use super::{dispatch, metrics, report, Context};
use crate::command::{Command, ServerField};
use crate::settings::Settings;

/// HTTP connections served at once; more are closed as soon as they are accepted.
const MAX_CONNECTIONS: usize = 64;
/// A client must send a request's headers within this time.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Longest request head accepted.
const MAX_HEADER_BYTES: usize = 16 * 1024;
/// Longest `POST /control` body (one command line).
const MAX_BODY_BYTES: usize = 4 * 1024;
/// A request body must arrive within this time.
const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// A keep-alive connection is asked to close after this long (an open dashboard simply
/// reconnects); it is cut if it has not finished within [`CLOSE_GRACE`] more.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(120);
const CLOSE_GRACE: Duration = Duration::from_secs(10);
/// One sample of the dashboard's history per this interval ...
const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);
/// ... and this many samples kept (five minutes).
const HISTORY_LEN: usize = 300;
/// Recent clients shown by `/clients.json`: seen within this many seconds, at most this many.
const RECENT_SECONDS: u64 = 300;
const RECENT_LIMIT: usize = 50;
/// The header `POST /control` requires. Browsers send a custom header cross-origin only
/// after a CORS preflight, which this server never grants: that is the CSRF protection.
pub const CONTROL_HEADER: &str = "x-quill-control";

const DASHBOARD_HTML: &str = include_str!("dashboard/index.html");
const DASHBOARD_JS: &str = include_str!("dashboard/dashboard.js");
const DASHBOARD_CSS: &str = include_str!("dashboard/dashboard.css");
const FAVICON_SVG: &str = include_str!("dashboard/favicon.svg");

/// Why the metrics listener could not be opened.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen for metrics on {addr}: {source}")]
pub struct BindError {
    pub addr: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

/// Binds the metrics listener (done by the caller before anything is published, so an
/// address that cannot be bound changes nothing).
pub fn bind(addr: SocketAddr) -> Result<std::net::TcpListener, BindError> {
    let err = |source| BindError { addr, source };
    let l = std::net::TcpListener::bind(addr).map_err(err)?;
    l.set_nonblocking(true).map_err(err)?;
    Ok(l)
}

/// The dashboard's control buttons answer whoever `control_acl` permits; with an empty
/// list (Pen's "permit all") on a non-loopback address, say so (at start-up and whenever
/// the listener moves).
pub fn warn_if_control_open(settings: &Settings, addr: SocketAddr) {
    let acl = &settings.acls[settings.control_acl.index()];
    if !addr.ip().is_loopback() && acl.rules().is_empty() {
        tracing::warn!(
            "metrics_listen {addr}: control_acl {} is empty, so any address that reaches \
             it may blacklist or drain servers from the dashboard; set 'control_acl N' to a list \
             that permits only operators",
            settings.control_acl
        );
    }
}

/// The commands `POST /control` accepts: per-server operations an operator takes from a
/// dashboard and can take back (`server N blacklist SECONDS`, 0 whitelisting; `server N
/// drain`, `drain 0` undoing it). Everything else (files, listeners, `exit`, settings)
/// stays on the control socket, which has its own opt-in (`-C`).
pub fn allowed_over_http(cmd: &Command) -> bool {
    match cmd {
        Command::Server { fields, .. } => fields
            .iter()
            .all(|f| matches!(f, ServerField::Blacklist(_) | ServerField::Drain(_))),
        _ => false,
    }
}

/// The commands of [`allowed_over_http`], as `GET /control` lists them.
const HTTP_COMMANDS: &[&str] = &[
    "server N blacklist SECONDS",
    "server N drain",
    "server N drain 0",
];

/// One point of the dashboard's history.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Unix time, milliseconds.
    at_ms: u64,
    accepted: u64,
    open: u64,
    sent: u64,
    received: u64,
}

/// The last [`HISTORY_LEN`] samples, so the dashboard has a chart as soon as it opens.
#[derive(Debug, Default)]
struct History(Mutex<VecDeque<Sample>>);

impl History {
    fn record(&self, ctx: &Context) {
        let state = &ctx.state;
        let settings = state.settings();
        let (mut sent, mut received) = (0u64, 0u64);
        for (_, _, _, rt) in state.servers_in_use(&settings) {
            sent = sent.wrapping_add(rt.bytes_to.load(Relaxed));
            received = received.wrapping_add(rt.bytes_from.load(Relaxed));
        }
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let sample = Sample {
            at_ms,
            accepted: state.counters.accepted.load(Relaxed),
            open: state.active.load(Relaxed) as u64,
            sent,
            received,
        };
        let mut ring = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == HISTORY_LEN {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    fn json(&self) -> String {
        let ring = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let samples: Vec<_> = ring
            .iter()
            .map(|s| [s.at_ms, s.accepted, s.open, s.sent, s.received])
            .collect();
        json!({
            "interval_ms": SAMPLE_INTERVAL.as_millis() as u64,
            "fields": ["at_ms", "accepted", "open", "sent_bytes", "received_bytes"],
            "samples": samples,
        })
        .to_string()
    }
}

/// What every request handler shares.
struct Site {
    ctx: Arc<Context>,
    registry: prometheus_client::registry::Registry,
    history: History,
}

/// Serves the metrics listener for the life of the process: takes each new listener from
/// `listeners` (`None` closes the current one; its open connections finish on their own),
/// and samples the dashboard's history while a listener is open.
pub async fn run(
    ctx: Arc<Context>,
    mut listeners: mpsc::UnboundedReceiver<Option<std::net::TcpListener>>,
) {
    let site = Arc::new(Site {
        registry: metrics::registry(Arc::clone(&ctx.state)),
        ctx,
        history: History::default(),
    });
    // Dropped (also when this task is aborted at shutdown or after an upgrade), the guard
    // aborts the accept loop, which closes the listening socket.
    let mut current: Option<AbortOnDrop> = None;
    let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            next = listeners.recv() => {
                let Some(next) = next else { break };
                current = None;
                let Some(l) = next else {
                    tracing::info!("metrics listener closed");
                    continue;
                };
                match TcpListener::from_std(l) {
                    Ok(l) => {
                        if let Ok(a) = l.local_addr() {
                            tracing::info!("metrics and dashboard on http://{a}/");
                        }
                        current = Some(AbortOnDrop(tokio::spawn(accept_loop(Arc::clone(&site), l))));
                    }
                    Err(e) => tracing::error!("metrics listener: {e}"),
                }
            }
            _ = tick.tick(), if current.is_some() => site.history.record(&site.ctx),
        }
    }
}

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn accept_loop(site: Arc<Site>, listener: TcpListener) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, typically: wait a little rather than spin.
                tracing::warn!("metrics accept: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(%peer, "metrics listener busy; connection closed");
            continue;
        };
        let site = Arc::clone(&site);
        tokio::spawn(async move {
            serve_connection(site, stream, peer.ip()).await;
            drop(permit);
        });
    }
}

async fn serve_connection(site: Arc<Site>, stream: tokio::net::TcpStream, peer: IpAddr) {
    let service = hyper::service::service_fn(move |req| {
        let site = Arc::clone(&site);
        async move { Ok::<_, Infallible>(handle(&site, peer, req).await) }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_header_size(MAX_HEADER_BYTES)
        .keep_alive(true);
    let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                tracing::debug!(%peer, "metrics connection: {e}");
            }
            return;
        }
        () = tokio::time::sleep(CONNECTION_LIFETIME) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
}

type Reply = Response<Full<Bytes>>;

fn reply(status: StatusCode, content_type: &'static str, body: impl Into<Bytes>) -> Reply {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    // The dashboard has buttons: no other site may frame it (clickjacking).
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
        ),
    );
    r
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Reply {
    reply(status, "text/plain; charset=utf-8", body)
}

fn json_reply(body: String) -> Reply {
    reply(StatusCode::OK, "application/json", body)
}

fn permitted(ctx: &Context, peer: IpAddr) -> bool {
    let settings = ctx.state.settings();
    settings.acls[settings.control_acl.index()].permits(peer)
}

async fn handle(site: &Site, peer: IpAddr, req: Request<Incoming>) -> Reply {
    let read_only = matches!(*req.method(), Method::GET | Method::HEAD);
    match req.uri().path() {
        "/" | "/index.html" if read_only => {
            reply(StatusCode::OK, "text/html; charset=utf-8", DASHBOARD_HTML)
        }
        "/dashboard.js" if read_only => reply(
            StatusCode::OK,
            "text/javascript; charset=utf-8",
            DASHBOARD_JS,
        ),
        "/dashboard.css" if read_only => {
            reply(StatusCode::OK, "text/css; charset=utf-8", DASHBOARD_CSS)
        }
        "/favicon.svg" if read_only => reply(StatusCode::OK, "image/svg+xml", FAVICON_SVG),
        "/metrics" if read_only => {
            let openmetrics = req
                .headers()
                .get(header::ACCEPT)
                .and_then(|a| a.to_str().ok())
                .is_some_and(metrics::wants_openmetrics);
            match metrics::encode(&site.registry) {
                Ok(body) if openmetrics => reply(StatusCode::OK, metrics::CONTENT_TYPE, body),
                Ok(body) => reply(
                    StatusCode::OK,
                    metrics::TEXT_CONTENT_TYPE,
                    metrics::to_text_format(&body),
                ),
                Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n"),
            }
        }
        "/status.json" if read_only => json_reply(report::json(&site.ctx)),
        "/history.json" if read_only => json_reply(site.history.json()),
        "/clients.json" if read_only => json_reply(
            report::recent_json(&site.ctx.state, RECENT_SECONDS, RECENT_LIMIT).to_string(),
        ),
        "/control" if read_only => json_reply(
            json!({
                "permitted": permitted(&site.ctx, peer),
                "commands": HTTP_COMMANDS,
            })
            .to_string(),
        ),
        "/control" if req.method() == Method::POST => control(site, peer, req).await,
        "/" | "/index.html" | "/dashboard.js" | "/dashboard.css" | "/favicon.svg" | "/metrics"
        | "/status.json" | "/history.json" | "/clients.json" | "/control" => {
            let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
            let allow = if req.uri().path() == "/control" {
                "GET, HEAD, POST"
            } else {
                "GET, HEAD"
            };
            r.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
            r
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// `POST /control`: one command line in the body, its reply in the answer.
async fn control(site: &Site, peer: IpAddr, req: Request<Incoming>) -> Reply {
    let ctx = &site.ctx;
    if !permitted(ctx, peer) {
        tracing::warn!(%peer, "HTTP control request refused by control_acl");
        return text(
            StatusCode::FORBIDDEN,
            "error: access denied by control_acl\n",
        );
    }
    if !req.headers().contains_key(CONTROL_HEADER) {
        return text(
            StatusCode::FORBIDDEN,
            format!("error: control requests need the {CONTROL_HEADER} header\n"),
        );
    }
    if !same_origin(&req) {
        return text(
            StatusCode::FORBIDDEN,
            "error: cross-origin control request\n",
        );
    }
    let body = Limited::new(req.into_body(), MAX_BODY_BYTES);
    let bytes = match tokio::time::timeout(BODY_TIMEOUT, body.collect()).await {
        Err(_) => return text(StatusCode::REQUEST_TIMEOUT, "error: body too slow\n"),
        Ok(Err(_)) => {
            return text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("error: a command is at most {MAX_BODY_BYTES} bytes\n"),
            )
        }
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    let Ok(line) = std::str::from_utf8(&bytes) else {
        return text(StatusCode::BAD_REQUEST, "error: command is not UTF-8\n");
    };
    let line = line.trim();
    let cmd = match line.parse::<Command>() {
        Ok(cmd) => cmd,
        Err(e) => return text(StatusCode::BAD_REQUEST, format!("error: {e}\n")),
    };
    if !allowed_over_http(&cmd) {
        return text(
            StatusCode::FORBIDDEN,
            "error: over HTTP only 'server N blacklist SECONDS' and 'server N drain [0]' are \
             accepted; use the control socket for other commands\n",
        );
    }
    if let Command::Server { index, .. } = &cmd {
        let settings = ctx.state.settings();
        if settings.servers.get(*index).and_then(|s| s.ip).is_none() {
            return text(StatusCode::NOT_FOUND, format!("error: no server {index}\n"));
        }
    }
    tracing::info!(%peer, "HTTP control: {cmd}");
    match dispatch::execute(ctx, &cmd) {
        Ok(out) => text(StatusCode::OK, out),
        Err(reason) => text(StatusCode::BAD_REQUEST, format!("error: {reason}\n")),
    }
}

/// A browser names the page's origin in `Origin`; it must be this server's (`Host`).
/// Clients that send no `Origin` (curl, scripts) are not browsers acting for a third site.
fn same_origin(req: &Request<Incoming>) -> bool {
    let Some(origin) = req.headers().get(header::ORIGIN) else {
        return true;
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok());
    let origin_host = origin.to_str().ok().and_then(|o| o.strip_prefix("http://"));
    matches!((origin_host, host), (Some(o), Some(h)) if o.eq_ignore_ascii_case(h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_server_blacklisting_is_allowed_over_http() {
        let ok = |l: &str| allowed_over_http(&l.parse::<Command>().unwrap());
        assert!(ok("server 1 blacklist 60"));
        assert!(ok("server 1 blacklist 0"));
        assert!(ok("server 1 drain"));
        assert!(ok("server 1 drain 0"));
        assert!(!ok("server 1 address 10.0.0.1"));
        assert!(!ok("server 1 blacklist 5 port 80"));
        assert!(!ok("exit"));
        assert!(!ok("write /tmp/x"));
        assert!(!ok("include /tmp/x"));
        assert!(!ok("metrics_listen 9100"));
    }
}
