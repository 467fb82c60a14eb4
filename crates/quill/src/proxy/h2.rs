//! HTTP/2 from clients (`http` with ALPN `h2` on TLS listeners, or `h2c` prior knowledge on
//! plain ones): hyper serves the connection; every stream is one request, sent to a server
//! chosen for it by Pen's rules over a pooled HTTP/1.1 connection (`proxy::pool`).
//!
//! Invariants: a request goes to a server with its hop-by-hop fields removed,
//! `X-Forwarded-For` merged (the client appended) and `X-Forwarded-Proto` replaced, exactly
//! as the HTTP/1.x path does; a request is sent again only when none of it reached the
//! server (a pooled connection the server had just closed); a server's `conns` counts the
//! requests in flight to it (a lease held until the response body ends), which is what
//! least-connections and `server N max` compare.

use std::cell::Cell;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::pool::{self, Conn, Limits, Target};
use super::tcp::{open_upstream, Preamble, Server};
use crate::balance::select::{Choice, Selector};
use crate::balance::{clock, ServerState};
use crate::net::connect::is_local_failure;
use crate::net::connect::SocketOptions;
use crate::settings::Settings;
use crate::state::State;

/// Default `h2_max_streams`: concurrent streams per client connection (what NGINX and
/// most servers advertise).
pub const DEFAULT_MAX_STREAMS: u32 = 100;

/// How long a connection with no stream left may stay open after quill's GOAWAY.
const GOAWAY_GRACE: Duration = Duration::from_secs(1);

/// The first bytes of every HTTP/2 connection (RFC 9113 3.4).
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A request body on its way to a server, counted into the server's `bytes_to`.
pub struct RequestBody {
    inner: Incoming,
    server: Option<&'static ServerState>,
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let (Poll::Ready(Some(Ok(frame))), Some(server)) = (&polled, self.server) {
            if let Some(data) = frame.data_ref() {
                server.bytes_to.fetch_add(data.len() as u64, Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A server's response body on its way to the client: counted into the server's
/// `bytes_from`; holds the request's lease on the server and its place among the
/// connection's streams in flight until the body ends (or the client resets the stream).
pub struct ResponseBody {
    inner: Incoming,
    server: &'static ServerState,
    _lease: Lease,
    _stream: InFlight,
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let Some(data) = frame.data_ref() {
                self.server.bytes_from.fetch_add(data.len() as u64, Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

type Reply = Response<Either<ResponseBody, Full<Bytes>>>;

/// One request in flight on a server: counts in its `conns` until dropped.
struct Lease(&'static ServerState);

impl Lease {
    fn take(server: &'static ServerState) -> Lease {
        server.conns.fetch_add(1, Relaxed);
        Lease(server)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.conns.fetch_sub(1, Relaxed);
    }
}

/// The streams of one client connection in flight, and when the last one ended: the
/// connection's idle watchdog reads both.
#[derive(Default)]
struct Activity {
    in_flight: Cell<usize>,
    last: Cell<Option<Instant>>,
}

/// One stream in flight (dropped when its response has ended).
struct InFlight(Rc<Activity>);

impl InFlight {
    fn start(activity: &Rc<Activity>) -> InFlight {
        activity.in_flight.set(activity.in_flight.get() + 1);
        InFlight(Rc::clone(activity))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .in_flight
            .set(self.0.in_flight.get().saturating_sub(1));
        self.0.last.set(Some(Instant::now()));
    }
}

/// What is known of the client for all its streams.
#[derive(Debug, Clone, Copy)]
pub(super) struct Peer {
    pub addr: SocketAddr,
    /// Over TLS (`X-Forwarded-Proto: https`, HSTS).
    pub tls: bool,
    /// The client ACL lets it in; else its requests go to the abuse server.
    pub permitted: bool,
    /// For a PROXY protocol header to servers (such connections are not pooled).
    pub preamble: Preamble,
    pub opts: SocketOptions,
}

/// Spawns hyper's per-stream tasks on the connection's event loop.
#[derive(Clone, Copy)]
struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
    F::Output: 'static,
{
    fn execute(&self, fut: F) {
        tokio::task::spawn_local(fut);
    }
}

/// Serves one HTTP/2 client connection until it ends. A connection with no stream in flight
/// for `idle_timeout` (before its first request: `http_request_timeout`) is sent GOAWAY.
pub(super) async fn serve<IO>(state: &'static State, io: IO, peer: Peer)
where
    IO: AsyncRead + AsyncWrite + Unpin + 'static,
{
    let settings = state.settings();
    let mut builder = hyper::server::conn::http2::Builder::new(LocalExec);
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(settings.h2_max_streams)
        .max_header_list_size(u32::try_from(settings.http_header_max).unwrap_or(u32::MAX))
        // Keep-alive PINGs find clients that vanished without a FIN.
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));
    let activity = Rc::new(Activity::default());
    let service = {
        let activity = Rc::clone(&activity);
        hyper::service::service_fn(move |req| {
            let stream = InFlight::start(&activity);
            async move { Ok::<_, Infallible>(forward(state, peer, req, stream).await) }
        })
    };
    let conn = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    let first = secs(settings.http_request_timeout);
    let idle = secs(settings.idle_timeout);
    let started = Instant::now();
    let mut stopping = state.stopping.subscribe();
    // When GOAWAY went out: the client then has `GOAWAY_GRACE` after its last stream to
    // acknowledge and close; one that does not (a silent client never answers hyper's
    // PING) is closed by quill.
    let mut shut: Option<Instant> = None;
    if *stopping.borrow_and_update() {
        conn.as_mut().graceful_shutdown();
        shut = Some(Instant::now());
    }
    loop {
        // The watchdog looks again at most every second; a connection busy with streams
        // is never idle.
        let tick = tokio::time::sleep(Duration::from_secs(1));
        tokio::select! {
            ended = conn.as_mut() => {
                if let Err(e) = ended {
                    tracing::debug!(peer = %peer.addr, "HTTP/2 connection ended: {e}");
                }
                return;
            }
            _ = stopping.changed(), if shut.is_none() => {
                conn.as_mut().graceful_shutdown();
                shut = Some(Instant::now());
            }
            () = tick => {
                if activity.in_flight.get() > 0 {
                    continue;
                }
                let last = activity.last.get();
                if let Some(at) = shut {
                    let quiet_since = last.map_or(at, |l| l.max(at));
                    if quiet_since.elapsed() >= GOAWAY_GRACE {
                        tracing::debug!(peer = %peer.addr, "HTTP/2 connection closed after GOAWAY");
                        return;
                    }
                    continue;
                }
                let (since, limit) = match last {
                    None => (started, first),
                    Some(last) => (last, idle),
                };
                if limit.is_some_and(|l| since.elapsed() >= l) {
                    if last.is_none() {
                        state.counters.http_request_timeouts.fetch_add(1, Relaxed);
                    }
                    tracing::debug!(peer = %peer.addr, "HTTP/2 connection idle: GOAWAY");
                    conn.as_mut().graceful_shutdown();
                    shut = Some(Instant::now());
                }
            }
        }
    }
}

fn secs(n: u64) -> Option<Duration> {
    (n > 0).then(|| Duration::from_secs(n))
}

/// Sends one request to a server chosen for it and returns the server's response, or
/// quill's own answer when no server could take it (502, 503).
async fn forward(
    state: &'static State,
    peer: Peer,
    req: Request<Incoming>,
    stream: InFlight,
) -> Reply {
    let settings = state.settings();
    state.counters.h2_requests.fetch_add(1, Relaxed);
    if req.method() == Method::CONNECT {
        return answer(
            StatusCode::NOT_IMPLEMENTED,
            "CONNECT is not proxied over HTTP/2\n",
        );
    }
    let Some(mut req) = upstream_request(req, peer) else {
        return answer(StatusCode::BAD_REQUEST, "Bad request\n");
    };
    let limits = Limits {
        keepalive: settings.upstream_keepalive,
        idle_timeout: Duration::from_secs(settings.upstream_idle_timeout.max(1)),
        max_requests: settings.upstream_max_requests,
    };
    if !peer.permitted {
        let Some(abuse) = &settings.abuse else {
            return answer(StatusCode::FORBIDDEN, "Forbidden\n");
        };
        let target = Target::Abuse;
        return match send(
            state,
            &settings,
            peer,
            target,
            abuse.addr,
            &state.abuse,
            req,
        )
        .await
        {
            Sent::Answer(resp, conn, lease) => reply(
                &settings,
                peer,
                target,
                &state.abuse,
                (resp, conn, lease),
                limits,
                stream,
            ),
            Sent::Unsent(_, e) | Sent::Lost(e) => {
                tracing::warn!(peer = %peer.addr, "abuse server {}: {e}", abuse.name);
                answer(StatusCode::BAD_GATEWAY, "Bad gateway\n")
            }
        };
    }
    let mut selector = Selector::new(
        &settings,
        &state.servers,
        &state.clients,
        &state.cursor,
        peer.addr,
        clock::now_ms(),
    );
    let mut choice = selector.initial();
    while let Choice::Server(index) = choice {
        let (Some(addr), Some(server)) = (
            settings.servers.get(index).and_then(|s| s.addr()),
            state.servers.get(index),
        ) else {
            choice = selector.failover(index);
            continue;
        };
        let target = Target::Server(index);
        match send(state, &settings, peer, target, addr, server, req).await {
            Sent::Answer(resp, conn, lease) => {
                if selector.tracks() {
                    state
                        .clients
                        .record(peer.addr.ip().to_canonical(), index, clock::now_ms());
                }
                return reply(
                    &settings,
                    peer,
                    target,
                    server,
                    (resp, conn, lease),
                    limits,
                    stream,
                );
            }
            Sent::Unsent(back, e) if is_local_failure(&e) => {
                drop(back);
                tracing::warn!(peer = %peer.addr, "cannot connect to server {index} ({addr}): {e}");
                state.counters.no_server.fetch_add(1, Relaxed);
                return answer(StatusCode::SERVICE_UNAVAILABLE, "Service unavailable\n");
            }
            Sent::Unsent(back, e) => {
                tracing::info!(
                    "server {index} ({addr}) failed: {e}; blacklisted for {} s",
                    settings.blacklist
                );
                state.server_failed(index, settings.blacklist);
                req = back;
                choice = selector.failover(index);
            }
            Sent::Lost(e) => {
                tracing::info!(
                    "server {index} ({addr}) failed during a request: {e}; blacklisted for {} s",
                    settings.blacklist
                );
                state.server_failed(index, settings.blacklist);
                return answer(StatusCode::BAD_GATEWAY, "Bad gateway\n");
            }
        }
    }
    if let Some(em) = &settings.emergency {
        let target = Target::Emergency;
        match send(
            state,
            &settings,
            peer,
            target,
            em.addr,
            &state.emergency,
            req,
        )
        .await
        {
            Sent::Answer(resp, conn, lease) => {
                return reply(
                    &settings,
                    peer,
                    target,
                    &state.emergency,
                    (resp, conn, lease),
                    limits,
                    stream,
                )
            }
            Sent::Unsent(_, e) | Sent::Lost(e) => {
                tracing::warn!("emergency server {} failed: {e}", em.name);
            }
        }
    }
    state.counters.no_server.fetch_add(1, Relaxed);
    answer(StatusCode::SERVICE_UNAVAILABLE, "Service unavailable\n")
}

/// How sending a request to one server went.
enum Sent {
    /// The response head, the connection (for the pool) and the request's lease.
    Answer(Response<Incoming>, Conn, Lease),
    /// Nothing of the request reached the server: it may go to another one.
    Unsent(Request<RequestBody>, std::io::Error),
    /// The server failed after the request (or part of it) was sent.
    Lost(std::io::Error),
}

/// Sends `req` to the server at `addr` over a pooled connection, or a new one. A pooled
/// connection that turns out closed before any of the request was written is replaced by
/// a new one at once (that is not the server's failure).
#[allow(clippy::too_many_arguments)]
async fn send(
    state: &'static State,
    settings: &Settings,
    peer: Peer,
    target: Target,
    addr: SocketAddr,
    server: &'static ServerState,
    mut req: Request<RequestBody>,
) -> Sent {
    req.body_mut().server = Some(server);
    let index = match target {
        Target::Server(i) => Some(i),
        _ => None,
    };
    // A PROXY protocol header describes one client: such connections are never pooled.
    let poolable = super::tcp::proxy_version(settings, index).is_none();
    let mut pooled = if poolable {
        pool::take(target, addr)
    } else {
        None
    };
    loop {
        let reused = pooled.is_some();
        let mut conn = match pooled.take() {
            Some(conn) => conn,
            None => match connect(state, settings, peer, index, addr, server).await {
                Ok(sender) => Conn {
                    sender,
                    uses: 0,
                    addr,
                    poolable,
                },
                Err(e) => return Sent::Unsent(req, e),
            },
        };
        conn.uses += 1;
        let lease = Lease::take(server);
        match conn.sender.try_send_request(req).await {
            Ok(resp) => {
                server.requests.fetch_add(1, Relaxed);
                if reused {
                    server.reused.fetch_add(1, Relaxed);
                }
                return Sent::Answer(resp, conn, lease);
            }
            Err(mut e) => {
                drop(lease);
                let message = e.take_message();
                let error = std::io::Error::other(e.into_error());
                match message {
                    // A kept-alive connection closed under us: try a new one.
                    Some(back) if reused => req = back,
                    Some(back) => return Sent::Unsent(back, error),
                    None => return Sent::Lost(error),
                }
            }
        }
    }
}

/// A new HTTP/1.1 connection to a server (TLS with `upstream_tls`, the PROXY header when
/// configured), driven by a task of its own on this event loop.
async fn connect(
    state: &'static State,
    settings: &Settings,
    peer: Peer,
    index: Option<usize>,
    addr: SocketAddr,
    server: &'static ServerState,
) -> std::io::Result<hyper::client::conn::http1::SendRequest<RequestBody>> {
    let host = match index {
        Some(i) => settings.servers.get(i).and_then(|s| s.host.as_ref()),
        None => None,
    };
    let stream =
        open_upstream(state, settings, addr, index, host, peer.preamble, peer.opts).await?;
    server.total.fetch_add(1, Relaxed);
    let builder = hyper::client::conn::http1::Builder::new();
    let handshake = |e: hyper::Error| std::io::Error::other(e);
    let sender = match stream {
        Server::Plain(s) => {
            let (sender, conn) = builder
                .handshake(TokioIo::new(s))
                .await
                .map_err(handshake)?;
            drive(conn, server);
            sender
        }
        Server::Tls(s) => {
            let (sender, conn) = builder
                .handshake(TokioIo::new(s))
                .await
                .map_err(handshake)?;
            drive(conn, server);
            sender
        }
    };
    Ok(sender)
}

/// Runs a server connection's I/O until it closes, counted in the server's `pool_open`.
fn drive<F>(conn: F, server: &'static ServerState)
where
    F: Future<Output = hyper::Result<()>> + 'static,
{
    server.pool_open.fetch_add(1, Relaxed);
    tokio::task::spawn_local(async move {
        if let Err(e) = conn.await {
            tracing::debug!("server connection ended: {e}");
        }
        server.pool_open.fetch_sub(1, Relaxed);
    });
}

/// The server's response as the client gets it; the connection goes back to the pool
/// once the response body has been read to the end.
fn reply(
    settings: &Settings,
    peer: Peer,
    target: Target,
    server: &'static ServerState,
    (resp, conn, lease): (Response<Incoming>, Conn, Lease),
    limits: Limits,
    stream: InFlight,
) -> Reply {
    if conn.poolable {
        pool::give_back(conn, target, server, limits);
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if peer.tls {
        if let Some(h) = settings.hsts {
            if !parts
                .headers
                .contains_key(header::STRICT_TRANSPORT_SECURITY)
            {
                if let Ok(v) = HeaderValue::from_str(&h.header_value()) {
                    parts.headers.insert(header::STRICT_TRANSPORT_SECURITY, v);
                }
            }
        }
    }
    parts.version = Version::HTTP_2;
    let body = ResponseBody {
        inner: body,
        server,
        _lease: lease,
        _stream: stream,
    };
    Response::from_parts(parts, Either::Left(body))
}

/// quill's own answer.
fn answer(status: StatusCode, text: &'static str) -> Reply {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from_static(
        text.as_bytes(),
    ))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

/// Fields that describe one hop (RFC 9110 7.6.1), never forwarded; HTTP/2 forbids them.
const HOP_BY_HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Fields the `Connection` field names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The request as a server gets it over HTTP/1.1: origin-form target, `Host` from
/// `:authority`, cookies joined, hop-by-hop fields dropped, `X-Forwarded-For` merged with
/// the client appended and `X-Forwarded-Proto` set. `None` when it has no authority.
fn upstream_request(req: Request<Incoming>, peer: Peer) -> Option<Request<RequestBody>> {
    let (mut parts, body) = req.into_parts();
    let authority = parts.uri.authority().cloned();
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    parts.uri = Uri::try_from(target).ok()?;
    parts.version = Version::HTTP_11;
    let trailers_wanted = parts
        .headers
        .get(header::TE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
        });
    strip_hop_by_hop(&mut parts.headers);
    if trailers_wanted {
        parts
            .headers
            .insert(header::TE, HeaderValue::from_static("trailers"));
    }
    match authority {
        Some(a) => {
            let v = HeaderValue::from_str(a.as_str()).ok()?;
            parts.headers.insert(header::HOST, v);
        }
        None if parts.headers.contains_key(header::HOST) => {}
        None => return None,
    }
    // HTTP/2 may split cookies into several fields; HTTP/1.1 wants one (RFC 9113 8.2.3).
    let cookies: Vec<&[u8]> = parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if cookies.len() > 1 {
        let joined = cookies.join(&b"; "[..]);
        let v = HeaderValue::from_bytes(&joined).ok()?;
        parts.headers.insert(header::COOKIE, v);
    }
    let client = client_text(peer.addr.ip());
    let mut xff = Vec::new();
    for v in parts.headers.get_all("x-forwarded-for") {
        let v = v.as_bytes().trim_ascii();
        if !v.is_empty() {
            xff.extend_from_slice(v);
            xff.extend_from_slice(b", ");
        }
    }
    xff.extend_from_slice(client.as_bytes());
    let xff = HeaderValue::from_bytes(&xff).ok()?;
    parts.headers.insert("x-forwarded-for", xff);
    parts.headers.insert(
        "x-forwarded-proto",
        HeaderValue::from_static(if peer.tls { "https" } else { "http" }),
    );
    Some(Request::from_parts(
        parts,
        RequestBody {
            inner: body,
            server: None,
        },
    ))
}

fn client_text(ip: IpAddr) -> String {
    ip.to_canonical().to_string()
}

/// A client stream with bytes already read from it in front (the HTTP/2 preface that
/// `h2c` detection consumed).
pub struct Prefixed<IO> {
    prefix: Vec<u8>,
    at: usize,
    inner: IO,
}

impl<IO> Prefixed<IO> {
    pub fn new(prefix: Vec<u8>, inner: IO) -> Prefixed<IO> {
        Prefixed {
            prefix,
            at: 0,
            inner,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Prefixed<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            if self.at == self.prefix.len() {
                self.prefix = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Prefixed<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Reads the first bytes of a plain client until they either are the HTTP/2 preface or
/// cannot be: returns them, and whether they are. An HTTP/1.x request line differs from
/// the preface by its first or second byte, so this costs HTTP/1.x clients no wait.
pub async fn sniff_preface<IO: AsyncRead + Unpin>(io: &mut IO) -> std::io::Result<(Vec<u8>, bool)> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::with_capacity(PREFACE.len());
    let mut buf = [0u8; 24];
    loop {
        let want = PREFACE.len() - got.len();
        let n = io.read(&mut buf[..want]).await?;
        if n == 0 {
            return Ok((got, false));
        }
        got.extend_from_slice(&buf[..n]);
        if !PREFACE.starts_with(&got) {
            return Ok((got, false));
        }
        if got.len() == PREFACE.len() {
            return Ok((got, true));
        }
    }
}
