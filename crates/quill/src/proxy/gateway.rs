//! Request-level proxying (`http`, `-H`, with HTTP/2 clients or `upstream_keepalive`):
//! every request is sent to a server chosen for it by Pen's rules, over a pooled HTTP/1.1
//! connection (`proxy::pool`), or with `upstream_h2` as a stream of a shared HTTP/2
//! connection (`proxy::pool_h2`), and its response streamed back. `proxy::h2` and `proxy::h1`
//! serve the client connections with hyper and hand each request here. HTTP/1.x
//! `Upgrade` and `CONNECT`, and HTTP/2's extended `CONNECT` (RFC 8441: a WebSocket over a
//! stream, sent to the server as an HTTP/1.1 `Upgrade`), become tunnels.
//!
//! Invariants: a request goes to a server with its hop-by-hop fields removed,
//! `X-Forwarded-For` merged (the client appended) and `X-Forwarded-Proto` replaced, exactly
//! as the byte pump does; a request is sent again only when none of it reached the server
//! (a pooled or shared connection the server had just closed), or when an HTTP/2 server
//! refused its stream and it has neither body nor side effects to repeat (`Spare`: once,
//! on a new connection); a server's `conns` counts the
//! requests in flight to it (a lease held until the response body ends), which is what
//! least-connections and `server N max` compare.

use std::cell::Cell;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{Either, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::ext::Protocol;
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, Uri, Version};
use hyper_util::rt::TokioIo;

use super::candidates::{self, Candidate, Candidates};
use super::grpc;
use super::h1_client::{self, Back, Failure, Outgoing};
use super::h1_pump::{self, Link};
use super::h2_client;
use super::pool::{self, Conn, Limits, Target};
use super::pool_h2::{self, Take};
use super::quickack;
use super::registry::ConnInfo;
use super::signals::NEXT_REQUEST_AT_STOP;
use super::tcp::{open_upstream, Preamble, Server};
use crate::accesslog::{AccessLog, Record, CLIENT_CLOSED_REQUEST};
use crate::balance::{Place, ServerState};
use crate::command::Hsts;
use crate::net::connect::{is_local_failure, SocketOptions};
use crate::settings::Settings;
use crate::state::State;
use crate::tls::Offer;

/// The server a request goes to; its state lives as long as the process.
type To<'a> = Candidate<'a, 'static>;

/// How long a connection with no request left may stay open after quill asked it to end
/// (GOAWAY): a client that does not close by then is closed.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// A request body on its way to a server, counted into the server's `bytes_to`.
pub struct RequestBody {
    /// `None`: no body (a request rebuilt to be sent again, see [`Spare`]).
    inner: Option<Incoming>,
    /// An HTTP/2 client's: given up before its end, the rest is drained ([`drain`]).
    h2: bool,
    server: Option<&'static ServerState>,
    activity: Rc<Activity>,
    record: Option<Rc<Record>>,
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None | Some(Err(_)))) || self.is_end_stream() {
            self.activity.uploading.set(false);
        }
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.activity.progress();
            if let (Some(data), Some(server)) = (frame.data_ref(), self.server) {
                server.bytes_to.fetch_add(data.len() as u64, Relaxed);
                super::polling::moved(data.len() as u64);
                if let Some(r) = &self.record {
                    r.bytes_in.set(r.bytes_in.get() + data.len() as u64);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().map_or(true, Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let Some(rest) = self.inner.take().filter(|b| self.h2 && !b.is_end_stream()) {
            tokio::task::spawn_local(drain(rest));
        }
    }
}

/// How long, and how much of, an HTTP/2 client's request body is read and dropped after
/// quill gave it up ([`drain`]).
const DRAIN: Duration = super::pump::LINGER;
const DRAIN_BYTES: usize = 16 << 20;

/// Reads and drops the rest of an HTTP/2 client's request body that quill gave up (its
/// server answered early, a 413, or failed) until the client ends it, `DRAIN` passes or
/// `DRAIN_BYTES` were dropped. Dropped at once, h2 would reset the stream (RST_STREAM
/// NO_ERROR, as RFC 9113 8.1 allows), and Debian's curl 7.88 then discards the answer it
/// was sent (exit 92): the client stops sending when it has the whole answer instead
/// (as with HAProxy). Hyper gives the client's window back as the data is read.
async fn drain(mut rest: Incoming) {
    use http_body_util::BodyExt;
    let _ = tokio::time::timeout(DRAIN, async {
        let mut dropped = 0;
        while let Some(Ok(frame)) = rest.frame().await {
            dropped += frame.data_ref().map_or(0, Bytes::len);
            if dropped > DRAIN_BYTES {
                break;
            }
        }
    })
    .await;
}

/// A server's response body on its way to the client: counted into the server's
/// `bytes_from`; holds the request's lease on the server and its place among the
/// connection's streams in flight until the body ends (or the client resets the stream).
pub struct ResponseBody {
    inner: Answer,
    server: &'static ServerState,
    _lease: Lease,
    stream: InFlight,
    /// Its stream on a shared HTTP/2 connection, counted there until the body ends.
    _h2: Option<pool_h2::Stream>,
    /// The answer to a gRPC call: when it breaks off, trailers with the call's status end
    /// it ([`grpc::broken_off`]) instead of an error that resets the client's stream.
    grpc: bool,
    /// Those trailers were sent: the body has ended.
    broken_off: bool,
    /// The body ended, or failed on the server's side.
    ended: bool,
}

/// A server's answer body: read by hyper's client, or by quill's own (`h1_client`,
/// `h2_client`).
pub(super) enum Answer {
    Hyper(Incoming),
    Own(h1_client::Answer),
    H2(h2_client::Answer),
}

impl Body for Answer {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            Answer::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Answer::Own(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Answer::H2(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Answer::Hyper(b) => b.is_end_stream(),
            Answer::Own(b) => b.is_end_stream(),
            Answer::H2(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Answer::Hyper(b) => b.size_hint(),
            Answer::Own(b) => b.size_hint(),
            Answer::H2(b) => b.size_hint(),
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.broken_off {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None | Some(Err(_))) = &polled {
            self.ended = true;
        }
        if let Poll::Ready(Some(Err(e))) = &polled {
            if self.grpc {
                tracing::debug!("a gRPC call's answer broke off: {e}");
                self.broken_off = true;
                return Poll::Ready(Some(Ok(Frame::trailers(grpc::broken_off(&**e)))));
            }
        }
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            self.stream.activity.progress();
            if let Some(data) = frame.data_ref() {
                self.server.bytes_from.fetch_add(data.len() as u64, Relaxed);
                super::polling::moved(data.len() as u64);
                if let Some(r) = &self.stream.record {
                    r.bytes_out.set(r.bytes_out.get() + data.len() as u64);
                }
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.broken_off || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.broken_off {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

/// hyper drops an answer's body before its end when the client left (it reset the stream,
/// closed or failed the connection): the request was abandoned in its answer's body.
impl Drop for ResponseBody {
    fn drop(&mut self) {
        // A gRPC answer that broke off (`broken_off`) failed first: `ended` says so.
        let ended = self.ended || self.inner.is_end_stream();
        if !ended && !self.stream.activity.quill_ends.get() {
            self.server.answers.abandon(1);
        }
    }
}

pub(super) type Reply = Response<Either<ResponseBody, Full<Bytes>>>;

/// A request's place on its server (counted as a request in flight for `max`, `servers`
/// and the queue), from its choice to the end of its answer.
pub(super) type Lease = Place<'static>;

/// The requests of one client connection in flight, and when bytes last moved for one:
/// the connection's watchdog ([`supervise`]) reads both.
#[derive(Default)]
pub(super) struct Activity {
    in_flight: Cell<usize>,
    /// When a request last started, moved body bytes or ended (`None`: none yet).
    last: Cell<Option<Instant>>,
    /// The tunnel an `Upgrade` or `CONNECT` request opened: it runs once hyper has let go
    /// of the client connection, in the connection's own task.
    tunnel: Cell<Option<Pin<Box<dyn Future<Output = ()>>>>>,
    /// An HTTP/1.x connection's next response says `Connection: close` (see
    /// [`Graceful::recycle`]).
    pub(super) close_next: Cell<bool>,
    /// An HTTP/1.x client's request body is on its way to the server and has not ended
    /// (one request at a time there; HTTP/2 streams set it too, but it is read only for
    /// HTTP/1.x connections).
    uploading: Cell<bool>,
    /// quill ends the connection (its watchdog, or its task aborted): the requests dropped
    /// with it were not abandoned by their client.
    quill_ends: Cell<bool>,
}

impl Activity {
    fn progress(&self) {
        self.last.set(Some(Instant::now()));
    }

    /// When a request last started, moved body bytes or ended.
    pub(super) fn last(&self) -> Option<Instant> {
        self.last.get()
    }
}

/// Ends a connection's requests as quill's doing, not their clients': when dropped before
/// [`QuillEnds::disarm`] (the connection's task aborted: `close N`, a stop's last moment),
/// and declared after the connection, so that it drops first.
pub(super) struct QuillEnds<'a>(Option<&'a Activity>);

impl<'a> QuillEnds<'a> {
    pub(super) fn new(activity: &'a Activity) -> QuillEnds<'a> {
        QuillEnds(Some(activity))
    }

    /// The connection ended by itself (its client left, or it was closed gracefully).
    pub(super) fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for QuillEnds<'_> {
    fn drop(&mut self) {
        if let Some(a) = self.0 {
            a.quill_ends.set(true);
        }
    }
}

/// A request until its answer's head is ready (quill's own, or a server's). hyper drops
/// the request's future when its client resets the stream or leaves: the request was
/// abandoned, waiting on the server chosen for it if one was (logged 499 with it).
struct Awaiting {
    activity: Rc<Activity>,
    record: Option<Rc<Record>>,
    server: Cell<Option<(&'static ServerState, SocketAddr)>>,
    answered: bool,
}

impl Awaiting {
    /// The request goes to `to` now.
    fn going_to(&self, to: &To<'_>) {
        self.server.set(Some((to.server, to.addr)));
    }
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let server = self.server.get();
        // Ended by quill (its watchdog found the server silent): logged with status 0, at
        // the server it waited on.
        let abandoned = !self.activity.quill_ends.get();
        if let Some(r) = self.record.as_deref().filter(|r| r.status.get() == 0) {
            r.server.set(server.map(|(_, addr)| addr));
            if abandoned {
                r.status.set(CLIENT_CLOSED_REQUEST);
            }
        }
        if let Some((s, _)) = server.filter(|_| abandoned) {
            s.answers.abandon(1);
        }
    }
}

/// One request in flight (dropped when its response has ended), with its access log
/// record when there is an access log.
pub(super) struct InFlight {
    activity: Rc<Activity>,
    record: Option<Rc<Record>>,
}

impl InFlight {
    pub(super) fn start(activity: &Rc<Activity>) -> InFlight {
        activity.in_flight.set(activity.in_flight.get() + 1);
        activity.progress();
        InFlight {
            activity: Rc::clone(activity),
            record: None,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.activity;
        a.in_flight.set(a.in_flight.get().saturating_sub(1));
        a.progress();
    }
}

/// What is known of the client for all its requests.
#[derive(Debug, Clone)]
pub(super) struct Peer {
    pub addr: SocketAddr,
    /// The connection's entry for `connection N` (kept only with a control socket):
    /// each request shows the server it goes to there.
    pub conn: Option<Arc<ConnInfo>>,
    /// Over TLS (`X-Forwarded-Proto: https`, HSTS).
    pub tls: bool,
    /// The client ACL lets it in; else its requests go to the abuse server.
    pub permitted: bool,
    /// For a PROXY protocol header to servers (such connections are not pooled).
    pub preamble: Preamble,
    pub opts: SocketOptions,
}

impl Peer {
    /// The search for a server for one of its requests.
    pub fn candidates<'a, 's: 'a>(
        &'a self,
        state: &'s State,
        settings: &'a Settings,
    ) -> Candidates<'a, 's> {
        Candidates::new(
            state,
            settings,
            self.addr,
            self.permitted,
            self.conn.as_deref(),
        )
    }

    /// A request goes to `target` (each server tried, in turn): `connection N` says so.
    pub fn going_to(&self, target: Target) {
        if let Some(conn) = &self.conn {
            conn.set_upstream(target.into());
        }
    }
}

/// Spawns hyper's per-stream tasks on the connection's event loop.
#[derive(Clone, Copy)]
pub(super) struct LocalExec;

impl<F> hyper::rt::Executor<F> for LocalExec
where
    F: Future + 'static,
    F::Output: 'static,
{
    fn execute(&self, fut: F) {
        tokio::task::spawn_local(fut);
    }
}

/// A hyper server connection that can be asked to end after the requests it has.
pub(super) trait Graceful: Future {
    fn shut(self: Pin<&mut Self>);

    /// Asks the client to move on to a new connection without failing a request (after a
    /// reload, or when the node drains): HTTP/2 sends GOAWAY (the client knows which
    /// streams were not taken and sends them again elsewhere) and returns true; HTTP/1.x
    /// cannot close an idle connection without racing the client's next request, so its
    /// next response says `Connection: close` instead (`activity.close_next`), and false.
    fn recycle(self: Pin<&mut Self>, activity: &Activity) -> bool;
}

/// The timers of a served client connection.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timers {
    /// Before the first request (`http_request_timeout`).
    pub first: Option<Duration>,
    /// Between requests.
    pub between: Option<Duration>,
    /// `between` bounds the time to send the next head (HTTP/1.x: counted as a request
    /// timeout), not just an idle connection (HTTP/2).
    pub between_is_head: bool,
    /// A request in flight whose bytes do not move (`idle_timeout`).
    pub stalled: Option<Duration>,
    /// An idle connection (no request in flight) is handed back to be parked after this
    /// long (`idle_park`; HTTP/1.x only).
    pub park: Option<Duration>,
}

/// How [`supervise`] let go of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// The connection ended; with how a head did not come in time, if one did not.
    Closed(Option<HeadTimeout>),
    /// Idle for `timers.park` with nothing of a next request read and nothing left to
    /// write: the caller may take the connection apart and wait on its socket alone.
    Idle,
}

/// Drives `conn` until it ends, and ends it: asked to (GOAWAY, or a close after the
/// response in flight; an HTTP/1.x client active within `NEXT_REQUEST_AT_STOP` may send
/// one more request first, answered with `Connection: close`) when quill stops or no
/// request came within `timers`; asked to move on ([`Graceful::recycle`]) after a reload
/// and when the node drains; dropped when a request in flight moves no byte for
/// `timers.stalled`, or when the client stays longer than `CLOSE_GRACE` after being asked
/// to go. When `timers.between` passes, `late_head` is asked first whether the client had
/// started a head since `last` (it then answers the client 408 itself). Then runs the
/// tunnel a request upgraded to, if any. Returns how a head did not come in time, if one
/// did not; or [`Ended::Idle`] once the connection has been idle for `timers.park` and
/// `parkable` (asked with the time of the last answer) agrees.
pub(super) async fn supervise<G: Graceful>(
    state: &State,
    mut conn: Pin<&mut G>,
    activity: &Activity,
    timers: Timers,
    late_head: &dyn Fn(Instant) -> bool,
    parkable: &dyn Fn(Instant) -> bool,
) -> Ended {
    let started = Instant::now();
    // Read at every wake-up of the connection: one load, not two watch channels' locks.
    let mut asked = super::signals::Watcher::new(state);
    let mut shut: Option<Instant> = None;
    // quill stops, and this HTTP/1.x connection's next response says `Connection: close`:
    // it is shut once its client has been quiet for `NEXT_REQUEST_AT_STOP` (the request
    // it may be sending right after an answer is answered, not closed under it).
    let mut stopping = false;
    let mut timed_out = None;
    if asked.seen().stopping() {
        shut = stop(conn.as_mut(), activity, &mut stopping);
    }
    loop {
        // The watchdog looks again every second at most (a stopping connection when its
        // client's time to send is up).
        let wait = match activity.last.get() {
            Some(last) if stopping && activity.in_flight.get() == 0 => {
                (last + NEXT_REQUEST_AT_STOP).saturating_duration_since(Instant::now())
            }
            _ => Duration::from_secs(1),
        };
        let tick = tokio::time::sleep(wait.min(Duration::from_secs(1)));
        tokio::select! {
            _ = conn.as_mut() => break,
            now = asked.changed(), if shut.is_none() && !stopping => {
                // A stop outranks a reload or a drain that came with it.
                if now.stopping() {
                    shut = stop(conn.as_mut(), activity, &mut stopping);
                } else if conn.as_mut().recycle(activity) {
                    shut = Some(Instant::now());
                }
            }
            () = tick => {
                let last = activity.last.get();
                let quiet = last.unwrap_or(started).elapsed();
                if activity.in_flight.get() > 0 {
                    if timers.stalled.is_some_and(|l| quiet >= l) {
                        // The requests in flight end with the connection: quill's doing.
                        activity.quill_ends.set(true);
                        return Ended::Closed(timed_out);
                    }
                    continue;
                }
                if stopping && shut.is_none() {
                    if quiet >= NEXT_REQUEST_AT_STOP {
                        conn.as_mut().shut();
                        shut = Some(Instant::now());
                    }
                    continue;
                }
                if let Some(at) = shut {
                    if last.map_or(at, |l| l.max(at)).elapsed() >= CLOSE_GRACE {
                        return Ended::Closed(timed_out);
                    }
                    continue;
                }
                let limit = if last.is_none() { timers.first } else { timers.between };
                if limit.is_some_and(|l| quiet >= l) {
                    timed_out = match last {
                        None => Some(HeadTimeout::Silent),
                        Some(at) if late_head(at) => Some(HeadTimeout::Answered),
                        Some(_) if timers.between_is_head => Some(HeadTimeout::Silent),
                        Some(_) => None,
                    };
                    // A late head is answered by the read that ends it; asked to shut
                    // first, hyper would close before that read.
                    if timed_out != Some(HeadTimeout::Answered) {
                        conn.as_mut().shut();
                    }
                    shut = Some(Instant::now());
                } else if let Some(answered) = last {
                    if timers.park.is_some_and(|p| quiet >= p) && parkable(answered) {
                        return Ended::Idle;
                    }
                }
            }
        }
    }
    let tunnel = activity.tunnel.take();
    if let Some(tunnel) = tunnel {
        tunnel.await;
    }
    Ended::Closed(timed_out)
}

/// quill stops: an HTTP/2 connection gets GOAWAY at once (its client knows which streams
/// were not taken), and so does an HTTP/1.x one whose client has been quiet for
/// `NEXT_REQUEST_AT_STOP`; a busier HTTP/1.x one is only asked to close after its next
/// response (`stopping`), and shut by the watchdog once its client is quiet that long.
/// Returns when the connection was shut.
fn stop<G: Graceful>(
    mut conn: Pin<&mut G>,
    activity: &Activity,
    stopping: &mut bool,
) -> Option<Instant> {
    if conn.as_mut().recycle(activity) {
        return Some(Instant::now());
    }
    let quiet = activity.in_flight.get() == 0
        && activity
            .last
            .get()
            .map_or(true, |last| last.elapsed() >= NEXT_REQUEST_AT_STOP);
    if quiet {
        conn.shut();
        Some(Instant::now())
    } else {
        *stopping = true;
        None
    }
}

thread_local! {
    /// The last `hsts` policy's header value on this event loop: made once per policy, not
    /// formatted and validated for every response (a clone shares its bytes).
    static HSTS: std::cell::RefCell<Option<(Hsts, HeaderValue)>> =
        const { std::cell::RefCell::new(None) };
}

/// `hsts` on a TLS client's answer (the server's or quill's own) that has none.
fn add_hsts(settings: &Settings, peer: &Peer, headers: &mut HeaderMap) {
    let Some(h) = settings.hsts.filter(|_| peer.tls) else {
        return;
    };
    if !headers.contains_key(header::STRICT_TRANSPORT_SECURITY) {
        if let Some(v) = hsts_value(h) {
            headers.insert(header::STRICT_TRANSPORT_SECURITY, v);
        }
    }
}

/// The `Strict-Transport-Security` value of `hsts`.
fn hsts_value(hsts: Hsts) -> Option<HeaderValue> {
    HSTS.with(|cached| {
        let mut cached = cached.borrow_mut();
        match &*cached {
            Some((policy, value)) if *policy == hsts => Some(value.clone()),
            _ => {
                let value = HeaderValue::try_from(hsts.header_value().to_string()).ok()?;
                *cached = Some((hsts, value.clone()));
                Some(value)
            }
        }
    })
}

/// How a client connection ended for want of a request head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeadTimeout {
    /// Closed without a word (nothing of a head had come).
    Silent,
    /// Answered 408 (part of a head had come).
    Answered,
}

impl HeadTimeout {
    /// Counts it as the byte pump does.
    pub(super) fn count(self, state: &State) {
        state.counters.http_request_timeouts.fetch_add(1, Relaxed);
        if self == HeadTimeout::Answered {
            state.counters.http_refused.fetch_add(1, Relaxed);
        }
    }
}

pub(super) fn secs(n: u64) -> Option<Duration> {
    (n > 0).then(|| Duration::from_secs(n))
}

/// The hyper service of a client connection: every request to [`forward`], counted in
/// flight in `activity` until its response has ended.
pub(super) fn service(
    state: &'static State,
    peer: Peer,
    activity: &Rc<Activity>,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Reply,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<Reply, std::convert::Infallible>>,
> {
    let activity = Rc::clone(activity);
    hyper::service::service_fn(move |req| {
        let stream = InFlight::start(&activity);
        // Boxed: the request's state (≈ 5 KB) is written once, not moved along as hyper
        // wraps the future and spawns the stream's task.
        let forwarding = Box::pin(forward(state, peer.clone(), req, stream));
        async move { Ok(forwarding.await) }
    })
}

/// Sends one request to a server chosen for it and returns the server's response, or
/// quill's own answer when no server could take it (502, 503). An HTTP/1.x `Upgrade` or
/// `CONNECT` that the server accepts becomes a tunnel between the two connections.
pub(super) async fn forward(
    state: &'static State,
    peer: Peer,
    req: Request<Incoming>,
    mut stream: InFlight,
) -> Reply {
    let record = state
        .access_log
        .load_full()
        .map(|log| Rc::new(record(log, &peer, &req)));
    stream.record = record.clone();
    let grpc = grpc::is_call(req.version(), req.headers());
    let mut awaiting = Awaiting {
        activity: Rc::clone(&stream.activity),
        record: record.clone(),
        server: Cell::new(None),
        answered: false,
    };
    let mut reply = route(state, &peer, req, stream, &awaiting).await;
    awaiting.answered = true;
    // The line is written when the last holder lets go: here for quill's own answers and
    // tunnels, at the end of the body for a server's response. A gRPC call's own answer
    // is logged with the HTTP status it stands for.
    if let Some(r) = record {
        r.status.set(reply.status().as_u16());
    }
    if !grpc || reply.extensions().get::<Unprocessed>().is_some() {
        if reply.extensions().get::<Own>().is_some() {
            add_hsts(&state.settings(), &peer, reply.headers_mut());
        }
        return reply;
    }
    if let Some(&Own(text)) = reply.extensions().get::<Own>() {
        let mut reply = grpc::answer(reply.status(), text);
        add_hsts(&state.settings(), &peer, reply.headers_mut());
        return reply;
    }
    if let Either::Left(body) = reply.body_mut() {
        body.grpc = true;
    }
    reply
}

/// The access log record of a request, as the client sent it.
fn record(log: Arc<AccessLog>, peer: &Peer, req: &Request<Incoming>) -> Record {
    let authority = req.uri().authority().map(|a| a.as_str()).or_else(|| {
        req.headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
    });
    let target = if req.method() == Method::CONNECT && req.extensions().get::<Protocol>().is_none()
    {
        authority.unwrap_or("-")
    } else {
        req.uri().path_and_query().map_or("/", |p| p.as_str())
    };
    let protocol = match req.version() {
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        _ => "HTTP/1.1",
    };
    Record::new(
        log,
        peer.addr.ip(),
        req.method().as_str(),
        authority,
        target,
        protocol,
    )
}

/// [`forward`] without the access log's bookkeeping.
async fn route(
    state: &'static State,
    peer: &Peer,
    mut req: Request<Incoming>,
    stream: InFlight,
    awaiting: &Awaiting,
) -> Reply {
    let settings = state.settings();
    let version = req.version();
    let tunnel = if version == Version::HTTP_2 {
        state.counters.h2_requests.fetch_add(1, Relaxed);
        if req.method() != Method::CONNECT {
            None
        } else if let Some(protocol) = req.extensions().get::<Protocol>() {
            if !protocol.as_str().eq_ignore_ascii_case("websocket") {
                // RFC 8441 defines the extended CONNECT for WebSocket only; any other
                // protocol would become an HTTP/1.1 `Upgrade` to it, `h2c` a raw HTTP/2
                // tunnel to the server whose requests quill never sees. 501, as for a
                // plain CONNECT: a method quill does not proxy, not a malformed request.
                return answer(
                    StatusCode::NOT_IMPLEMENTED,
                    "Only WebSocket is proxied by an extended CONNECT\n",
                );
            }
            // RFC 8441's extended CONNECT (a WebSocket over a stream): the server gets it
            // as an HTTP/1.1 `Upgrade` (see `upstream_request`).
            Some(hyper::upgrade::on(&mut req))
        } else {
            return answer(
                StatusCode::NOT_IMPLEMENTED,
                "CONNECT is not proxied over HTTP/2\n",
            );
        }
    } else if let Some(why) = ambiguous_host(&req) {
        state.counters.http_refused.fetch_add(1, Relaxed);
        return answer(StatusCode::BAD_REQUEST, why);
    } else if req.method() == Method::CONNECT || upgrade_to(req.headers()).is_some() {
        Some(hyper::upgrade::on(&mut req))
    } else {
        None
    };
    // An HTTP/1.0 client keeps its connection only when it asks and the answer says so.
    let keep_alive_10 = version == Version::HTTP_10
        && req
            .headers()
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case("keep-alive"));
    let Some(mut req) = upstream_request(req, peer, &stream) else {
        return answer(StatusCode::BAD_REQUEST, "Bad request\n");
    };
    let how = How {
        limits: Limits {
            keepalive: settings.upstream_keepalive,
            idle_timeout: Duration::from_secs(settings.upstream_idle_timeout.max(1)),
            max_requests: settings.upstream_max_requests,
        },
        upgrade: tunnel.is_some(),
        version,
        keep_alive_10,
    };
    if !peer.permitted && settings.abuse.is_none() {
        return answer(StatusCode::FORBIDDEN, "Forbidden\n");
    }
    // penlogd's entry (`-l IP:PORT`) for each server the request goes to, before it has
    // it: the request line as the server logs it.
    let penlogd = state
        .log
        .load()
        .as_ref()
        .filter(|log| log.tells())
        .map(|log| {
            let log = Arc::clone(log);
            let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
            let version = if settings.upstream_h2 {
                "HTTP/2.0"
            } else {
                "HTTP/1.1"
            };
            let line = format!("{} {target} {version}", req.method());
            (log, line)
        });
    let mut candidates = peer.candidates(state, &settings);
    while let Some((c, place)) = candidates.next().await {
        peer.going_to(c.target);
        awaiting.going_to(&c);
        if let Some((log, line)) = &penlogd {
            log.tell(peer.addr.ip(), Some(c.addr.ip()), line.as_bytes());
        }
        match send(state, &settings, peer, &c, place, req, how).await {
            Sent::Answer(answered) => {
                candidates.served(&c);
                return reply(
                    state, &settings, peer, c.target, c.server, answered, how, stream, tunnel,
                );
            }
            Sent::Unsent(_, e) if is_local_failure(&e) => {
                tracing::warn!(peer = %peer.addr, "cannot connect to {c}: {e}");
                state.counters.no_server.fetch_add(1, Relaxed);
                return answer(StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable\n");
            }
            Sent::Unsent(back, e) => {
                candidates.failed(&c, &e);
                req = back;
            }
            Sent::Refused(e) => {
                tracing::info!("{c} refused a request's stream: {e}");
                // Not processed, so not a bad gateway: unavailable for now, and the
                // client may send it again.
                let mut refused = answer(StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable\n");
                refused
                    .headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                refused.extensions_mut().insert(Unprocessed);
                return refused;
            }
            Sent::Lost(e) => {
                match bad_answer(&e) {
                    Some(why) => super::tcp::bad_answer(state, c, why),
                    None => candidates::lost(&c, &e),
                }
                return answer(StatusCode::BAD_GATEWAY, "Bad Gateway\n");
            }
            Sent::Failed(e) => {
                match bad_answer(&e) {
                    // Over a reused connection too: the answer came, and was unusable.
                    Some(why) => super::tcp::bad_answer(state, c, why),
                    None => tracing::debug!(peer = %peer.addr, "{c} failed a request: {e}"),
                }
                return answer(StatusCode::BAD_GATEWAY, "Bad Gateway\n");
            }
        }
    }
    state.counters.no_server.fetch_add(1, Relaxed);
    answer(StatusCode::SERVICE_UNAVAILABLE, "Service Unavailable\n")
}

/// How a request is sent: the pool's rules, whether it asks for a tunnel (then a new
/// connection, never pooled), and the client's HTTP version (for the response).
#[derive(Debug, Clone, Copy)]
struct How {
    limits: Limits,
    upgrade: bool,
    version: Version,
    /// An HTTP/1.0 client asked to keep its connection (`Connection: keep-alive`).
    keep_alive_10: bool,
}

/// The connection a request goes over.
enum Upstream {
    /// HTTP/1.1, one request at a time (pooled when `poolable`).
    H1(Conn),
    /// A stream of a shared HTTP/2 connection.
    H2(pool_h2::Stream),
}

/// The server's answer: its response head, the connection (for the pool; `None` when the
/// answer's body holds it, see `h1_client`) and the request's lease on the server.
struct Answered {
    resp: Response<Answer>,
    conn: Option<Upstream>,
    lease: Lease,
}

/// How sending a request to one server went.
enum Sent {
    Answer(Answered),
    /// Nothing of the request reached the server: it may go to another one.
    Unsent(Request<RequestBody>, std::io::Error),
    /// The server failed after the request (or part of it) was sent.
    Lost(std::io::Error),
    /// The request failed, not provably by the server's doing: a reused connection broke
    /// (a kept-alive connection may end for reasons of its own), or the client's body did.
    Failed(std::io::Error),
    /// An HTTP/2 server refused the request's stream (`REFUSED_STREAM`, or a GOAWAY that
    /// came as it was sent): not processed, not the server's failure, but the request was
    /// consumed and cannot be sent again.
    Refused(std::io::Error),
}

/// Sends `req` to the server `to` over a pooled or shared connection, or a new one.
/// A reused connection that turns out closed before any of the request was written is
/// replaced by a new one at once (that is not the server's failure).
async fn send(
    state: &'static State,
    settings: &Settings,
    peer: &Peer,
    to: &To<'_>,
    place: Lease,
    mut req: Request<RequestBody>,
    how: How,
) -> Sent {
    let (server, addr) = (to.server, to.addr);
    req.body_mut().server = Some(server);
    let record = req.body().record.clone();
    // A PROXY protocol header describes one client, and a tunnel takes the connection:
    // neither kind is ever pooled, nor shared over HTTP/2 (such requests take HTTP/1.1).
    let poolable = !how.upgrade && super::tcp::proxy_version(settings, to.index).is_none();
    let h2 = poolable && settings.upstream_h2;
    if poolable && !h2 && how.version == Version::HTTP_2 {
        // HTTP/1.x clients' field names keep their case through hyper's client; HTTP/2's
        // are lowercase, and quill's own framing writes them in title case.
        return send_own(state, settings, peer, to, place, req, how).await;
    }
    let mut retried = false;
    // Counted from the choice (`Candidates` took the place), before any connect.
    let mut early = Some(place);
    loop {
        // Sent again after a refusal (or a GOAWAY on a new connection), a request takes a
        // new connection, on which it is the first stream: no GOAWAY can cross it there.
        let (mut conn, reused) =
            match pick(state, settings, peer, to, how, poolable, h2 && !retried, h2).await {
                Ok(picked) => picked,
                Err(e) => return Sent::Unsent(req, e),
            };
        let lease = early.take().unwrap_or_else(|| Lease::take(server));
        // Per request, whichever connection it takes: a flag left from an earlier request
        // must not excuse this one's failure.
        let activity = Rc::clone(&req.body().activity);
        activity.uploading.set(!req.body().is_end_stream());
        let resp = match &mut conn {
            Upstream::H1(c) => {
                c.uses += 1;
                match c.sender.try_send_request(req).await {
                    Ok(resp) => resp.map(Answer::Hyper),
                    Err(mut e) => {
                        drop(lease);
                        let message = e.take_message();
                        let error = std::io::Error::other(e.into_error());
                        match message {
                            // A kept-alive connection closed under us: try a new one.
                            Some(back) if reused => {
                                req = back;
                                continue;
                            }
                            Some(back) => return Sent::Unsent(back, error),
                            // Failed while the body was being written: the server may
                            // have answered early (a 413) and reset the rest, and hyper's
                            // client never reads that answer. Whatever it was, a client's
                            // upload is no reason to take the server out of service.
                            None if how.version != Version::HTTP_2 && activity.uploading.get() => {
                                return Sent::Failed(error)
                            }
                            None => return Sent::Lost(error),
                        }
                    }
                }
            }
            Upstream::H2(s) => {
                let spare = Spare::of(&req);
                let tls = settings.tls_built.upstream.is_some();
                match h2_client::send(&mut s.sender, req, tls, addr).await {
                    Ok(resp) => resp.map(Answer::H2),
                    Err(failure) => {
                        drop(lease);
                        match h2_failed(failure, s, spare, reused, &mut retried, how, &activity) {
                            Next::Again(again) => {
                                req = again;
                                continue;
                            }
                            Next::Done(sent) => return sent,
                        }
                    }
                }
            }
        };
        answered(to, record.as_deref(), reused, resp.status());
        return Sent::Answer(Answered {
            resp,
            conn: Some(conn),
            lease,
        });
    }
}

/// What becomes of a request whose stream failed.
enum Next {
    /// Sent again, over another connection.
    Again(Request<RequestBody>),
    Done(Sent),
}

/// What becomes of a request whose stream failed on `stream`.
fn h2_failed(
    failure: h2_client::Failure,
    stream: &pool_h2::Stream,
    spare: Option<Spare>,
    reused: bool,
    retried: &mut bool,
    how: How,
    activity: &Activity,
) -> Next {
    use h2_client::Failure;
    match failure {
        Failure::Unsent {
            req,
            error,
            going_away,
        } => {
            stream.retire();
            if reused {
                // A shared connection the server is ending: try another.
                Next::Again(*req)
            } else if going_away && !*retried {
                // A new connection the server sent GOAWAY on before its first stream
                // (NGINX does so to shed connections at its `worker_connections`): it is
                // busy, not failing. Once more on a new connection.
                *retried = true;
                Next::Again(*req)
            } else if going_away {
                Next::Done(Sent::Refused(error))
            } else {
                Next::Done(Sent::Unsent(*req, error))
            }
        }
        Failure::Refused(error) => {
            stream.retire();
            match spare {
                // Processed by no server, and harmless if it were: once more.
                Some(again) if !*retried => {
                    *retried = true;
                    Next::Again(again.rebuild())
                }
                _ => Next::Done(Sent::Refused(error)),
            }
        }
        // quill reset the stream: the client's body failed, or the request could not be
        // framed for HTTP/2; neither is the server's doing.
        Failure::Broken { error, ours: true } => Next::Done(Sent::Failed(error)),
        // Failed while the body was being sent: as over HTTP/1.1, a client's upload is no
        // reason to take the server out of service.
        Failure::Broken { error, .. }
            if how.version != Version::HTTP_2 && activity.uploading.get() =>
        {
            Next::Done(Sent::Failed(error))
        }
        Failure::Broken { error, .. } => Next::Done(Sent::Lost(error)),
    }
}

/// Counts a request the server `to` answered with `status`.
fn answered(to: &To<'_>, record: Option<&Record>, reused: bool, status: StatusCode) {
    if let Some(r) = record {
        r.server.set(Some(to.addr));
    }
    to.server.requests.fetch_add(1, Relaxed);
    to.server.answers.count(status.as_u16());
    if reused {
        to.server.reused.fetch_add(1, Relaxed);
    }
}

/// [`send`] for an HTTP/2 client's request to an HTTP/1.1 server: over a pooled stream of
/// the byte pump's (or a new one), framed by quill (`h1_client`). A reused connection that
/// ends before a byte of answer is replaced by a new one for a request that can be sent
/// again.
async fn send_own(
    state: &'static State,
    settings: &Settings,
    peer: &Peer,
    to: &To<'_>,
    place: Lease,
    req: Request<RequestBody>,
    how: How,
) -> Sent {
    let record = req.body().record.clone();
    let mut req = Some(req);
    let mut out: Option<Outgoing> = None;
    let mut reuse = true;
    // Counted from the choice (`Candidates` took the place), before any connect.
    let mut early = Some(place);
    loop {
        let pooled = if reuse {
            pool::take::<Link>(to.target, to.addr)
        } else {
            None
        };
        let reused = pooled.is_some();
        let mut link = match pooled {
            Some(link) => link,
            None => match Box::pin(h1_pump::connect(state, settings, peer, *to)).await {
                Ok(link) => link,
                Err(e) => {
                    return match req.take() {
                        Some(req) => Sent::Unsent(req, e),
                        // Its first connection had taken it.
                        None => Sent::Lost(e),
                    };
                }
            },
        };
        if let Some(mut req) = req.take() {
            req.body_mut().server = Some(to.server);
            out = Some(Outgoing::new(req));
        }
        let Some(o) = out.as_mut() else {
            return Sent::Failed(std::io::Error::other("request lost"));
        };
        link.used();
        let lease = early.take().unwrap_or_else(|| Lease::take(to.server));
        let back = Back {
            state,
            target: to.target,
            server: to.server,
            limits: how.limits,
        };
        match h1_client::exchange(link, o, back).await {
            Ok(resp) => {
                answered(to, record.as_deref(), reused, resp.status());
                return Sent::Answer(Answered {
                    resp: resp.map(Answer::Own),
                    conn: None,
                    lease,
                });
            }
            // The server had closed the idle connection: the request was not seen.
            Err(Failure::Unanswered(_)) if reused && o.replayable() => reuse = false,
            Err(Failure::Unanswered(e) | Failure::Broken(e)) if reused => return Sent::Failed(e),
            Err(Failure::Unanswered(e) | Failure::Broken(e)) => return Sent::Lost(e),
            Err(Failure::Client(e)) => return Sent::Failed(e),
        }
    }
}

/// Why a server's answer could not be framed, when that is what `e` says
/// (`h1_client`'s framing errors), whether or not its connection was reused.
fn bad_answer(e: &std::io::Error) -> Option<super::http::BadAnswer> {
    e.get_ref()?.downcast_ref().copied()
}

/// What it takes to send a request again after the HTTP/2 server refused its stream: only
/// for a request without a body (nothing consumed) whose method is idempotent (harmless
/// even if the refusal was a GOAWAY that crossed a request being processed).
struct Spare {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: RequestBody,
}

impl Spare {
    fn of(req: &Request<RequestBody>) -> Option<Spare> {
        if !h1_client::idempotent(req.method()) || !req.body().is_end_stream() {
            return None;
        }
        let b = req.body();
        Some(Spare {
            method: req.method().clone(),
            uri: req.uri().clone(),
            headers: req.headers().clone(),
            body: RequestBody {
                inner: None,
                h2: false,
                server: b.server,
                activity: Rc::clone(&b.activity),
                record: b.record.clone(),
            },
        })
    }

    /// The request as it was before it became HTTP/2 (the next connection may not be).
    fn rebuild(self) -> Request<RequestBody> {
        let mut req = Request::new(self.body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.version_mut() = Version::HTTP_11;
        *req.headers_mut() = self.headers;
        req
    }
}

/// The connection for a request: a stream of a shared HTTP/2 connection (`shared`), else a
/// pooled HTTP/1.1 one (`poolable`, and `shared` unless `h2`), else a new connection
/// (offering HTTP/2 when `h2`; over TLS the server may pick HTTP/1.1). True when the
/// connection was reused.
#[allow(clippy::too_many_arguments)]
async fn pick(
    state: &'static State,
    settings: &Settings,
    peer: &Peer,
    to: &To<'_>,
    how: How,
    poolable: bool,
    shared: bool,
    h2: bool,
) -> std::io::Result<(Upstream, bool)> {
    let (target, addr) = (to.target, to.addr);
    if shared {
        loop {
            match pool_h2::take(target, addr, how.limits) {
                Take::Stream(s) => return Ok((Upstream::H2(s), true)),
                Take::Wait(notify) => notify.notified().await,
                Take::Open => break,
            }
        }
    }
    if poolable && (shared || !h2) {
        if let Some(conn) = pool::take(target, addr) {
            return Ok((Upstream::H1(conn), true));
        }
    }
    let _opening = h2.then(|| pool_h2::opening(target));
    // Boxed: a new connection is the rare case (a TCP and a TLS handshake besides), and
    // its future, inline, would make every request's future — copied into its task and
    // moved on each await — kilobytes larger.
    let fresh = Box::pin(connect(state, settings, peer, to, how.upgrade, h2)).await?;
    Ok(match fresh {
        Fresh::H1(sender) => (
            Upstream::H1(Conn {
                sender,
                uses: 0,
                addr,
                poolable,
            }),
            false,
        ),
        Fresh::H2(connected) => (
            Upstream::H2(pool_h2::add(target, connected, addr, how.limits)),
            false,
        ),
    })
}

/// A new connection to a server, and the protocol it speaks.
enum Fresh {
    H1(hyper::client::conn::http1::SendRequest<RequestBody>),
    H2(h2_client::Connected),
}

/// A new connection to a server (TLS with `upstream_tls`, the PROXY header when
/// configured), driven by a task of its own on this event loop: HTTP/2 when `h2` (prior
/// knowledge in plain, ALPN over TLS when the server picks it), else HTTP/1.1.
async fn connect(
    state: &'static State,
    settings: &Settings,
    peer: &Peer,
    to: &To<'_>,
    upgrades: bool,
    h2: bool,
) -> std::io::Result<Fresh> {
    let (addr, server) = (to.addr, to.server);
    let stream = open_upstream(
        state,
        settings,
        addr,
        to.index,
        to.host,
        peer.preamble,
        peer.opts,
        if h2 { Offer::H2First } else { Offer::Nothing },
    )
    .await?;
    server.total.fetch_add(1, Relaxed);
    let tls = settings.tls_built.upstream.is_some();
    if h2 && (!tls || stream.picked_h2()) {
        let limit = Duration::from_secs(settings.timeout.max(1));
        let connected = match stream {
            Server::Plain(s) => h2_client::connect(s, server, limit).await,
            Server::Tls(s) => h2_client::connect(s, server, limit).await,
        };
        return connected.map(Fresh::H2);
    }
    let mut builder = hyper::client::conn::http1::Builder::new();
    // Field names go out as the client wrote them (HTTP/1.x clients), the others (HTTP/2's
    // lowercase ones, quill's own) in title case, as the byte pump writes its fields.
    builder.preserve_header_case(true).title_case_headers(true);
    let failed = |e: hyper::Error| std::io::Error::other(e);
    let sender = match stream {
        Server::Plain(s) => {
            let io = TokioIo::new(quickack::WatchedServer::new(s));
            let (sender, conn) = builder.handshake(io).await.map_err(failed)?;
            if upgrades {
                drive(conn.with_upgrades(), server);
            } else {
                drive(conn, server);
            }
            sender
        }
        Server::Tls(s) => {
            let io = TokioIo::new(quickack::WatchedServer::new(s));
            let (sender, conn) = builder.handshake(io).await.map_err(failed)?;
            if upgrades {
                drive(conn.with_upgrades(), server);
            } else {
                drive(conn, server);
            }
            sender
        }
    };
    Ok(Fresh::H1(sender))
}

/// Runs a server connection's I/O until it closes, counted in the server's `pool_open`.
pub(super) fn drive<F, E>(conn: F, server: &'static ServerState)
where
    F: Future<Output = Result<(), E>> + 'static,
    E: std::fmt::Display,
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
/// once the response body has been read to the end. A `101` to an `Upgrade` (a `2xx` to a
/// `CONNECT`) leaves the tunnel to the client connection's task.
#[allow(clippy::too_many_arguments)]
fn reply(
    state: &'static State,
    settings: &Settings,
    peer: &Peer,
    target: Target,
    server: &'static ServerState,
    answered: Answered,
    how: How,
    stream: InFlight,
    tunnel: Option<hyper::upgrade::OnUpgrade>,
) -> Reply {
    let Answered {
        mut resp,
        conn,
        lease,
    } = answered;
    let status = resp.status();
    let upgraded = status == StatusCode::SWITCHING_PROTOCOLS
        || (how.version != Version::HTTP_2 && status.is_success() && tunnel.is_some());
    if how.version == Version::HTTP_2 && tunnel.is_some() && !upgraded && status.is_success() {
        // To an extended CONNECT a 2xx means "the tunnel is open": a server that answered
        // its `Upgrade` with a plain response has not opened one.
        return answer(
            StatusCode::BAD_GATEWAY,
            "The server did not switch protocols\n",
        );
    }
    let kept = upgraded.then(|| {
        (
            resp.headers().get(header::UPGRADE).cloned(),
            hyper::upgrade::on(&mut resp),
        )
    });
    // A tunnel's server connection is the tunnel's (hyper hands it over once the 101 is
    // read); its sender lives as long as the tunnel.
    let mut unpooled = None;
    let mut h2 = None;
    match conn {
        Some(Upstream::H1(conn)) if conn.poolable && !upgraded => {
            pool::give_back(state, conn, target, server, how.limits);
        }
        Some(Upstream::H1(conn)) => unpooled = Some(conn),
        Some(Upstream::H2(s)) => h2 = Some(s),
        None => {}
    }
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    add_hsts(settings, peer, &mut parts.headers);
    parts.version = how.version;
    if how.version != Version::HTTP_2 && !upgraded && stream.activity.close_next.get() {
        // hyper closes the connection after a response that says so.
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    } else if how.keep_alive_10 {
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
    }
    if let (Some((protocol, server_side)), Some(client_side)) = (kept, tunnel) {
        if how.version == Version::HTTP_2 {
            // RFC 8441 section 5: the server's 101 is a 200 on the stream.
            parts.status = StatusCode::OK;
            parts.headers.remove("sec-websocket-accept");
        } else if let Some(p) = protocol {
            parts.headers.insert(header::UPGRADE, p);
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        let idle = secs(settings.idle_timeout);
        let activity = Rc::clone(&stream.activity);
        let run = async move {
            // The lease and the request's place in flight last as long as the tunnel.
            let _held = (lease, unpooled);
            if let (Ok(c), Ok(s)) = (client_side.await, server_side.await) {
                let mut c = TokioIo::new(c);
                let mut s = Marked {
                    inner: TokioIo::new(s),
                    activity: Rc::clone(&stream.activity),
                };
                let copy = tokio::io::copy_bidirectional(&mut c, &mut s);
                let _ = stalls_after(copy, &stream.activity, idle).await;
            }
            drop(stream);
        };
        if how.version == Version::HTTP_2 {
            // One stream of many: the connection goes on serving the others.
            tokio::task::spawn_local(run);
        } else {
            activity.tunnel.set(Some(Box::pin(run)));
        }
        return Response::from_parts(parts, Either::Right(Full::new(Bytes::new())));
    }
    let body = ResponseBody {
        inner: body,
        server,
        _lease: lease,
        stream,
        _h2: h2,
        grpc: false,
        broken_off: false,
        ended: false,
    };
    Response::from_parts(parts, Either::Left(body))
}

/// Runs `fut`, or gives up once `activity` has seen no progress for `limit`.
async fn stalls_after<F: Future>(
    fut: F,
    activity: &Activity,
    limit: Option<Duration>,
) -> Option<F::Output> {
    let Some(limit) = limit else {
        return Some(fut.await);
    };
    tokio::pin!(fut);
    loop {
        tokio::select! {
            out = fut.as_mut() => return Some(out),
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                if activity.last.get().is_some_and(|l| l.elapsed() >= limit) {
                    return None;
                }
            }
        }
    }
}

/// A tunnel's server side, marking progress on every read and write.
struct Marked<IO> {
    inner: IO,
    activity: Rc<Activity>,
}

impl<IO: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Marked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if polled.is_ready() {
            self.activity.progress();
        }
        polled
    }
}

impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Marked<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if polled.is_ready() {
            self.activity.progress();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Marks quill's own answers (their text), which [`forward`] turns into gRPC's form for
/// gRPC calls.
#[derive(Debug, Clone, Copy)]
struct Own(&'static str);

/// Marks quill's answer to a request that a server refused unprocessed (HTTP/2
/// `REFUSED_STREAM`, or GOAWAY as it was sent) and quill could not send again: an HTTP/2
/// client's stream is reset with `REFUSED_STREAM` instead (`h2::serve`), which tells the
/// client that it may send the request again, whatever its method (RFC 9113 8.7; browsers
/// and gRPC do so by themselves); an HTTP/1.x client gets 503 with `Retry-After: 1`
/// (RFC 9110 15.6.4: unavailable for now; not 502, which says the request failed).
#[derive(Debug, Clone, Copy)]
pub(super) struct Unprocessed;

/// quill's own answer.
fn answer(status: StatusCode, text: &'static str) -> Reply {
    let mut resp = Response::new(Either::Right(Full::new(Bytes::from_static(
        text.as_bytes(),
    ))));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp.extensions_mut().insert(Own(text));
    resp
}

const HOPS: usize = 7;

/// Fields that describe one hop (RFC 9110 7.6.1), never forwarded; HTTP/2 forbids them.
/// `Connection` first: [`strip_hop_by_hop`] reads the fields it names. `HTTP2-Settings`
/// is one whether or not `Connection` names it (RFC 7540 3.2.1): with `Upgrade: h2c` it
/// would switch an h2c server's connection to HTTP/2.
const HOP_BY_HOP: [HeaderName; HOPS] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::TE,
    HeaderName::from_static("http2-settings"),
];

/// The `Upgrade` an HTTP/1.x request goes on with: the client's protocols without HTTP/2
/// (`h2c`, `h2`: a server that switched to it would carry requests quill never sees, see
/// `http::is_http2_token`). `None` when nothing is left: the request goes on as a plain
/// one, as NGINX forwards requests unless told to pass `Upgrade`.
fn upgrade_to(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut kept: Vec<&[u8]> = Vec::new();
    for v in headers.get_all(header::UPGRADE) {
        kept.extend(
            v.as_bytes()
                .split(|&b| b == b',')
                .map(<[u8]>::trim_ascii)
                .filter(|p| !p.is_empty() && !super::http::is_http2_token(p)),
        );
    }
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_bytes(&kept.join(&b", "[..])).ok()
}

/// Why an HTTP/1.x request's site is ambiguous, as the byte pump refuses it
/// (`http::Exchange`): two `Host` fields, or an absolute-form target whose authority is
/// not its `Host`. `None` for an HTTP/2 request (`:authority` is its one name) and for a
/// request without `Host`.
fn ambiguous_host<B>(req: &Request<B>) -> Option<&'static str> {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next()?;
    if hosts.next().is_some() {
        return Some("Two Host fields\n");
    }
    if req.method() == Method::CONNECT {
        return None;
    }
    let target = req.uri().authority()?.as_str();
    let default_port: &[u8] = if req.uri().scheme() == Some(&hyper::http::uri::Scheme::HTTPS) {
        b"443"
    } else {
        b"80"
    };
    let same = super::http::same_authority((target.as_bytes(), default_port), host.as_bytes());
    (!same).then_some("Host is not the target's authority\n")
}

// Named once: a `&str` name is parsed and validated on every use.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names first: a lookup hashes its name, and most requests carry
    // none of these (HTTP/2 forbids them), most responses one (`Connection`).
    let mut found = [false; HOPS];
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|h| h == name) {
            found[i] = true;
        }
    }
    if found[0] {
        // Fields the `Connection` field names are hop-by-hop too. Its usual tokens name
        // none (`close`) or one already in `HOP_BY_HOP` (`keep-alive`): skipped, so that
        // the usual answer allocates and parses nothing here.
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|n| !n.eq_ignore_ascii_case("close") && !n.eq_ignore_ascii_case("keep-alive"))
            .filter_map(|n| HeaderName::from_bytes(n.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for (name, _) in HOP_BY_HOP.iter().zip(found).filter(|(_, f)| *f) {
        headers.remove(name);
    }
}

/// The request as a server gets it over HTTP/1.1: origin-form target (a `CONNECT` keeps
/// its authority-form), `Host` from `:authority`, cookies joined, hop-by-hop fields
/// dropped (but `Upgrade` kept for a tunnel and `TE: trailers`), `X-Forwarded-For` merged
/// with the client appended and `X-Forwarded-Proto` set. `None` when a field cannot be
/// rebuilt.
fn upstream_request(
    req: Request<Incoming>,
    peer: &Peer,
    stream: &InFlight,
) -> Option<Request<RequestBody>> {
    let (mut parts, body) = req.into_parts();
    let authority = parts.uri.authority().cloned();
    // RFC 8441: `CONNECT` with `:protocol` is HTTP/1.1's `GET` with `Upgrade` (RFC 6455's
    // handshake, for a WebSocket).
    let extended = parts.extensions.remove::<Protocol>();
    if extended.is_some() {
        parts.method = Method::GET;
    }
    if parts.method != Method::CONNECT {
        let target = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        parts.uri = Uri::try_from(target).ok()?;
    }
    let h1 = parts.version != Version::HTTP_2;
    // Servers are always spoken to in HTTP/1.1 (an HTTP/1.0 request would close the
    // pooled connection after its answer).
    parts.version = Version::HTTP_11;
    let trailers_wanted = parts
        .headers
        .get(header::TE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',')
                .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
        });
    let upgrade = if h1 {
        upgrade_to(&parts.headers)
    } else {
        match &extended {
            Some(p) => Some(HeaderValue::from_str(p.as_str()).ok()?),
            None => None,
        }
    };
    if extended.is_some_and(|p| p.as_str().eq_ignore_ascii_case("websocket")) {
        // HTTP/2 has no key (RFC 8441 section 5); an HTTP/1.1 server needs one. The
        // server's `Sec-WebSocket-Accept` proves nothing to an HTTP/2 client and is dropped.
        parts.headers.insert("sec-websocket-key", websocket_key()?);
    }
    strip_hop_by_hop(&mut parts.headers);
    if trailers_wanted {
        parts
            .headers
            .insert(header::TE, HeaderValue::from_static("trailers"));
    }
    if let Some(protocol) = upgrade {
        parts.headers.insert(header::UPGRADE, protocol);
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    // An HTTP/1.x request keeps its own `Host` (an absolute-form target's authority wins
    // only where it has none); without either, it goes on without, as it came.
    if let Some(a) = authority {
        if !h1 || !parts.headers.contains_key(header::HOST) {
            let v = HeaderValue::from_str(a.as_str()).ok()?;
            parts.headers.insert(header::HOST, v);
        }
    }
    // HTTP/2 may split cookies into several fields; HTTP/1.1 wants one (RFC 9113 8.2.3).
    let cookies: Vec<&[u8]> = parts
        .headers
        .get_all(header::COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if cookies.len() > 1 && !h1 {
        let joined = cookies.join(&b"; "[..]);
        let v = HeaderValue::from_bytes(&joined).ok()?;
        parts.headers.insert(header::COOKIE, v);
    }
    let mut xff = Vec::with_capacity(64);
    for v in parts.headers.get_all(&X_FORWARDED_FOR) {
        let v = v.as_bytes().trim_ascii();
        if !v.is_empty() {
            xff.extend_from_slice(v);
            xff.extend_from_slice(b", ");
        }
    }
    crate::net::text::push_ip(&mut xff, peer.addr.ip());
    let xff = HeaderValue::from_bytes(&xff).ok()?;
    parts.headers.insert(X_FORWARDED_FOR, xff);
    parts.headers.insert(
        X_FORWARDED_PROTO,
        HeaderValue::from_static(if peer.tls { "https" } else { "http" }),
    );
    Some(Request::from_parts(
        parts,
        RequestBody {
            inner: Some(body),
            h2: !h1,
            server: None,
            activity: Rc::clone(&stream.activity),
            record: stream.record.clone(),
        },
    ))
}

/// A fresh `Sec-WebSocket-Key`: 16 random bytes in base64 (RFC 6455 section 4.1). `None`
/// when the system cannot give random bytes.
fn websocket_key() -> Option<HeaderValue> {
    use base64::Engine as _;
    // The provider is built once, only for its (static) random generator.
    static RANDOM: std::sync::OnceLock<&'static dyn rustls::crypto::SecureRandom> =
        std::sync::OnceLock::new();
    let random = RANDOM.get_or_init(|| rustls::crypto::aws_lc_rs::default_provider().secure_random);
    let mut nonce = [0u8; 16];
    random.fill(&mut nonce).ok()?;
    let key = base64::engine::general_purpose::STANDARD.encode(nonce);
    HeaderValue::from_str(&key).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_that_is_not_the_absolute_targets_authority_is_ambiguous() {
        let req = |target: &str, hosts: &[&str]| {
            let mut b = Request::builder().uri(target);
            for h in hosts {
                b = b.header(header::HOST, *h);
            }
            b.body(()).unwrap()
        };
        assert_eq!(ambiguous_host(&req("/x", &["a.test"])), None);
        assert_eq!(ambiguous_host(&req("/x", &[])), None);
        assert!(ambiguous_host(&req("/x", &["a.test", "b.test"])).is_some());
        for (target, host) in [
            ("http://a.test/x", "A.test"),
            ("http://a.test/x", "a.test:80"),
            ("https://a.test:443/x", "a.test"),
            ("http://u:p@a.test:8080/x", " a.test:8080 "),
            ("http://[::1]/x", "[::1]:80"),
        ] {
            assert_eq!(
                ambiguous_host(&req(target, &[host])),
                None,
                "{target} {host}"
            );
        }
        for (target, host) in [
            ("http://a.test/x", "b.test"),
            ("http://a.test/x", "a.test:8080"),
            ("https://a.test/x", "a.test:80"),
            ("http://a.test@b.test/x", "a.test"),
        ] {
            assert!(
                ambiguous_host(&req(target, &[host])).is_some(),
                "{target} {host}"
            );
        }
    }

    #[test]
    fn the_hsts_value_follows_the_policy_it_was_made_for() {
        let year = Hsts {
            max_age: 31_536_000,
            include_subdomains: true,
            preload: false,
        };
        let short = Hsts {
            max_age: 600,
            include_subdomains: false,
            preload: true,
        };
        for _ in 0..2 {
            assert_eq!(
                hsts_value(year).unwrap(),
                "max-age=31536000; includeSubDomains"
            );
            assert_eq!(hsts_value(short).unwrap(), "max-age=600; preload");
        }
    }
}
