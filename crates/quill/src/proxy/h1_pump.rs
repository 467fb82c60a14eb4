//! HTTP/1.x clients with `upstream_keepalive`, relayed by the byte pump request by request:
//! each request goes to a server chosen for it by Pen's rules (failover, emergency, abuse)
//! over a kept-alive connection from this loop's pool of server streams; the byte pump's
//! `Exchange` rewrites its head and frames its answer, body and answer pass as bytes, and
//! at the end of the answer the server connection goes back to the pool and the client's
//! next head is awaited. No HTTP library stands between the sockets: a request costs what
//! the byte pump costs, plus the choice of its server (and, with `access_log`, a line made
//! of what the `Exchange` kept of it). (`proxy::h1`, hyper's server in front of
//! `proxy::gateway`, serves the clients of `upstream_h2`.)
//!
//! Invariants: a server connection carries one request at a time, and goes back to the
//! pool only at a boundary (the answer complete, nothing of the next request sent, neither
//! side said the connection ends, the client did not half-close); a request is sent again
//! (once, over a new connection) only when a reused connection ended without a byte of
//! answer and the request has no body and an idempotent method; a server's `conns` counts
//! the requests in flight to it.

use std::cell::RefCell;
use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::thread::LocalKey;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};

use super::candidates::{self, Candidate};
use super::gateway::{secs, Lease, Peer};
use super::h1::Parkable;
use super::http;
use super::pool::{self, Limits, Pool, Pooled};
use super::pump::{self, Http};
use super::relay::{End, RelayOptions};
use super::signals::{self, Since};
use super::tcp::{count_http_end, open_upstream, proxy_version, Held, Server};
use crate::accesslog::{Record, CLIENT_CLOSED_REQUEST};
use crate::balance::ServerState;
use crate::net::connect::is_local_failure;
use crate::settings::Settings;
use crate::state::State;
use crate::tls::Offer;

/// The answers quill gives itself (status, bytes), after which the connection closes (the
/// request's body, if any, was not read to its end).
const BAD_GATEWAY: (u16, &[u8]) = (502, http::BAD_GATEWAY);
const UNAVAILABLE: (u16, &[u8]) = (503, http::UNAVAILABLE);

/// A kept-alive connection to a server, as a stream the byte pump relays over; counted in
/// the server's `pool_open` while it exists.
pub(super) struct Link {
    stream: Server,
    addr: SocketAddr,
    uses: u64,
    server: &'static ServerState,
}

impl Link {
    /// The stream to the server.
    pub(super) fn stream(&mut self) -> &mut Server {
        &mut self.stream
    }

    /// Counts a request sent over it.
    pub(super) fn used(&mut self) {
        self.uses += 1;
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.server.pool_open.fetch_sub(1, Relaxed);
    }
}

/// A waker that does nothing: the pool's look at an idle connection wakes no task.
struct Noop;

impl std::task::Wake for Noop {
    fn wake(self: Arc<Self>) {}
}

thread_local! {
    static LINKS: RefCell<Pool<Link>> = RefCell::default();
    static NOOP: Waker = Waker::from(Arc::new(Noop));
}

impl Pooled for Link {
    fn pool() -> &'static LocalKey<RefCell<Pool<Self>>> {
        &LINKS
    }
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn uses(&self) -> u64 {
        self.uses
    }
    /// Open, and silent: a read that would wait. (It reads only what the kernel already
    /// said is there: no system call while nothing arrived.)
    fn usable(&mut self) -> bool {
        NOOP.with(|noop| {
            let mut cx = Context::from_waker(noop);
            // The usual case, seen without a read through TLS (≈ 800 instructions): no
            // plaintext held (nor a `close_notify`), and the socket not readable (tokio
            // forgets readiness after a read that did not fill its buffer). Else the read.
            let quiet = match &self.stream {
                Server::Plain(s) => s.poll_read_ready(&mut cx).is_pending(),
                Server::Tls(s) => {
                    let (tcp, tls) = s.get_ref();
                    tls.wants_read() && tcp.poll_read_ready(&mut cx).is_pending()
                }
            };
            if quiet {
                return true;
            }
            let mut byte = [0u8; 1];
            let mut buf = ReadBuf::new(&mut byte);
            Pin::new(&mut self.stream)
                .poll_read(&mut cx, &mut buf)
                .is_pending()
        })
    }
}

/// How a request went.
enum Served {
    /// Answered; the client may send the next.
    Next,
    /// The client's connection is over (closed, answered by quill, or failed).
    Over,
}

/// How sending a request to one server went.
enum Tried {
    Served(Served),
    /// No connection could be made: the request may go to another server.
    Unreachable(io::Error),
}

/// Serves an HTTP/1.x client whose first request head `http` holds (read by
/// `pump::first_head`, with `Exchange::request_by_request` asked for before it), request
/// by request, until the connection ends.
pub(super) async fn serve<C: Parkable>(
    state: &'static State,
    mut client: C,
    mut http: Box<Http>,
    peer: Peer,
) {
    let settings = state.settings();
    let head_limit = http.head_limit;
    // Between requests the next head is due within `http_request_timeout`, and an idle
    // keep-alive connection ends at `idle_timeout`, whichever comes first.
    let between = match (head_limit, secs(settings.idle_timeout)) {
        (Some(h), Some(i)) => Some(h.min(i)),
        (h, i) => h.or(i),
    };
    let park_after = secs(settings.idle_park);
    drop(settings);
    // A reload or drain from now on makes the next answer say `Connection: close`.
    let ask = Since::now(state);
    loop {
        if let Served::Over = one_request(state, &mut client, &mut http, &peer, &ask).await {
            return;
        }
        let answered = Instant::now();
        let deadline = between.map(|b| answered + b);
        http.exchange.resume();
        match wait_for_head(state, &client, &http, answered, deadline, park_after).await {
            Waited::Ready => {}
            Waited::Overdue => {
                count_http_end(state, &End::RequestTimeout { answered: false });
                return close(&mut client).await;
            }
            Waited::Stop => return close(&mut client).await,
        }
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        http.exchange.log_requests(logs_requests(state));
        if let Some(outcome) = pump::first_head(&mut client, &mut http, false, left).await {
            count_http_end(state, &outcome.end);
            return;
        }
    }
}

/// Whether the `Exchange` keeps each request's head for a log: the access log, or
/// penlogd's entry per request (`-l IP:PORT`).
pub(super) fn logs_requests(state: &State) -> bool {
    state.access_log.load().is_some() || state.log.load().as_ref().is_some_and(|l| l.tells())
}

/// How waiting for a next request ended.
enum Waited {
    /// The client sent something (or closed).
    Ready,
    /// Nothing came before the deadline.
    Overdue,
    /// quill stops.
    Stop,
}

/// Waits until the client sends again, counted in `State::parked` once it has been idle
/// for `idle_park`. It holds no buffer meanwhile, so unlike hyper's parking this frees
/// nothing and asks the allocator for no release (which, for clients that all think
/// between requests, handed pages back that the next burst faulted in again: +10–20 %
/// CPU per request). Only quill stopping wakes it (the event loop's bell).
async fn wait_for_head<C: Parkable>(
    state: &State,
    client: &C,
    http: &Http,
    answered: Instant,
    deadline: Option<Instant>,
    park_after: Option<Duration>,
) -> Waited {
    if http.has_held() || client.busy() {
        return Waited::Ready;
    }
    // Registered before the look at the flag: a stop in between still wakes it.
    let stopped = signals::bell().notified();
    if state.asked().stopping() {
        return stopped_between(client, answered, deadline).await;
    }
    let overdue = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d.into()).await,
            None => std::future::pending().await,
        }
    };
    let park = async {
        match park_after {
            Some(p) => tokio::time::sleep(p).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(overdue, park, stopped);
    let mut parked = None;
    loop {
        tokio::select! {
            _ = poll_fn(|cx| client.poll_read_ready(cx)) => return Waited::Ready,
            () = &mut overdue => return Waited::Overdue,
            () = &mut park, if parked.is_none() => {
                state.parked.fetch_add(1, Relaxed);
                parked = Some(Held(&state.parked));
            }
            () = &mut stopped => return stopped_between(client, answered, deadline).await,
        }
    }
}

/// quill stops while the client is between requests: the connection closes once the
/// client has been silent for `signals::NEXT_REQUEST_AT_STOP` since its last answer (at
/// once if it already was); a request that comes before is served, its answer saying
/// `Connection: close`.
async fn stopped_between<C: Parkable>(
    client: &C,
    answered: Instant,
    deadline: Option<Instant>,
) -> Waited {
    // Asked of the socket: the event loop may have woken for the stop before it took the
    // event of a request already there.
    if client.sent() {
        return Waited::Ready;
    }
    let until = deadline.map_or(answered + signals::NEXT_REQUEST_AT_STOP, |d| {
        d.min(answered + signals::NEXT_REQUEST_AT_STOP)
    });
    let next = poll_fn(|cx| client.poll_read_ready(cx));
    match tokio::time::timeout_at(until.into(), next).await {
        Ok(_) => Waited::Ready,
        Err(_) => Waited::Stop,
    }
}

/// Ends a client connection between requests, as an idle one is (TLS: close_notify).
async fn close<C: Parkable>(client: &mut C) {
    let _ = tokio::time::timeout(Duration::from_secs(1), client.shutdown()).await;
}

/// Gives the client one of quill's own answers, then closes.
async fn answer<C: Parkable>(
    client: &mut C,
    http: &Http,
    (status, answer): (u16, &'static [u8]),
    record: Option<&Record>,
) -> Served {
    if let Some(r) = record {
        r.status.set(status);
        r.server.set(None);
    }
    let answer = http.exchange.own_answer(answer);
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        client.write_all(&answer).await?;
        client.shutdown().await
    })
    .await;
    Served::Over
}

/// Sends the request whose head `http` holds to a server chosen for it (failover as for a
/// connection: a server that cannot be reached is blacklisted and the next one tried, then
/// the emergency server; a denied client's requests go to the abuse server), and relays
/// its answer. With `access_log`, the request's line is written when its answer has
/// ended.
async fn one_request<C: Parkable>(
    state: &'static State,
    client: &mut C,
    http: &mut Http,
    peer: &Peer,
    ask: &Since<'_>,
) -> Served {
    // The logs are looked up only for a request whose head was kept for them. penlogd's
    // line first: the access log's record takes the method and target out of the head.
    let penlogd = http.exchange.logged_newest().and_then(|l| {
        let log = state.log.load_full().filter(|log| log.tells())?;
        let version = if l.http10 { "HTTP/1.0" } else { "HTTP/1.1" };
        Some((log, format!("{} {} {version}", l.method, l.target)))
    });
    let record = http.exchange.logged_newest().and_then(|l| {
        let log = state.access_log.load_full()?;
        Some(pump::record(log, peer.addr.ip(), l))
    });
    let tell = |to: &To<'_>| {
        if let Some((log, line)) = &penlogd {
            log.tell(peer.addr.ip(), Some(to.addr.ip()), line.as_bytes());
        }
    };
    let served = choose_and_send(state, client, http, peer, ask, record.as_ref(), tell).await;
    if let (Some(r), Some(l)) = (&record, http.exchange.take_logged()) {
        pump::tally(r, &l);
    }
    served
}

/// [`one_request`] without the logs' bookkeeping; `tell` hears of each server tried
/// before the request goes to it (penlogd's entry).
async fn choose_and_send<C: Parkable>(
    state: &'static State,
    client: &mut C,
    http: &mut Http,
    peer: &Peer,
    ask: &Since<'_>,
    record: Option<&Record>,
    tell: impl Fn(&To<'_>),
) -> Served {
    let settings = state.settings();
    let mut candidates = peer.candidates(state, &settings);
    loop {
        let next = tokio::select! {
            biased;
            next = candidates.next() => next,
            () = leaves(client, http) => {
                // Gone while its request waited in the queue: never sent (NGINX's 499,
                // HAProxy's `abortonclose`); the queue counted it.
                if let Some(r) = record {
                    r.status.set(CLIENT_CLOSED_REQUEST);
                    r.server.set(None);
                }
                return Served::Over;
            }
        };
        let Some((c, place)) = next else {
            break;
        };
        peer.going_to(c.target);
        tell(&c);
        match send(state, &settings, client, http, peer, c, place, ask, record).await {
            Tried::Served(served) => {
                candidates.served(&c);
                return served;
            }
            Tried::Unreachable(e) if is_local_failure(&e) => {
                tracing::warn!(peer = %peer.addr, "cannot connect to {c}: {e}");
                state.counters.no_server.fetch_add(1, Relaxed);
                return answer(client, http, UNAVAILABLE, record).await;
            }
            Tried::Unreachable(e) => candidates.failed(&c, &e),
        }
    }
    state.counters.no_server.fetch_add(1, Relaxed);
    answer(client, http, UNAVAILABLE, record).await
}

/// Where a request goes.
type To<'a> = Candidate<'a, 'static>;

/// The client's bytes read ahead while its request waits for a server, at most: beyond,
/// the client is left to its socket's buffer (and is not watched).
const READ_AHEAD_MAX: usize = 64 << 10;

/// Reads what the client sends while its request waits for a server (in the queue, with
/// `queue_timeout`), holding it for the relay: ends when the client closes or fails. A
/// client that half-closes there is taken as gone: nothing of its request was sent yet.
async fn leaves<C: Parkable>(client: &mut C, http: &mut Http) {
    // On the heap, and only once the wait begins: an array would grow every connection's
    // task by its size, polled or not.
    let mut buf = vec![0u8; 4096];
    while http.held_len() < READ_AHEAD_MAX {
        match tokio::io::AsyncReadExt::read(client, &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => http.hold(&buf[..n]),
        }
    }
    std::future::pending().await
}

/// Relays the request over a pooled connection to `to`, or a new one; a reused connection
/// that ends without a byte of answer is replaced by a new one for a request that can be
/// sent again (that is not the server's failure).
#[allow(clippy::too_many_arguments)]
async fn send<C: Parkable>(
    state: &'static State,
    settings: &Settings,
    client: &mut C,
    http: &mut Http,
    peer: &Peer,
    to: To<'_>,
    place: Lease,
    ask: &Since<'_>,
    record: Option<&Record>,
) -> Tried {
    let limits = Limits {
        keepalive: settings.upstream_keepalive,
        idle_timeout: Duration::from_secs(settings.upstream_idle_timeout.max(1)),
        max_requests: settings.upstream_max_requests,
    };
    // A PROXY protocol header describes one client: such connections are never pooled.
    let poolable = proxy_version(settings, to.index).is_none();
    let opts = RelayOptions {
        fastclose: settings.fastclose,
        idle_timeout: secs(settings.idle_timeout),
        park_after: None,
        capture: false,
    };
    let mut reuse = poolable;
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
            None => match connect(state, settings, peer, to).await {
                Ok(link) => link,
                Err(e) => return Tried::Unreachable(e),
            },
        };
        let again = (reused && http.exchange.replayable()).then(|| http.request_bytes());
        link.used();
        to.server.requests.fetch_add(1, Relaxed);
        if reused {
            to.server.reused.fetch_add(1, Relaxed);
        }
        http.exchange.new_server(reused);
        http.answers = Some(&to.server.answers);
        let lease = early.take().unwrap_or_else(|| Lease::take(to.server));
        // Boxed: between requests the connection's task keeps none of the relay's state.
        let outcome = match &mut link.stream {
            Server::Plain(s) => Box::pin(pump::relay(client, s, Some(&mut *http), opts, ask)).await,
            Server::Tls(s) => {
                Box::pin(pump::relay(client, &mut **s, Some(&mut *http), opts, ask)).await
            }
        };
        drop(lease);
        if let Some(why) = http.exchange.take_bad_answer() {
            super::tcp::bad_answer(state, to, why);
        }
        to.server.bytes_to.fetch_add(outcome.up, Relaxed);
        to.server.bytes_from.fetch_add(outcome.down, Relaxed);
        // The server that answered, or that the request waited on until the client left
        // or the idle timeout; not one that failed before answering (the request goes
        // again, or quill answers).
        let waited = !matches!(outcome.end, End::ServerError(_));
        if let Some(r) = record.filter(|_| outcome.down > 0 || waited) {
            r.server.set(Some(to.addr));
        }
        return Tried::Served(match outcome.end {
            End::Boundary => {
                if poolable && http.exchange.server_keeps() && pool::wanted(&link, limits) {
                    pool::put(state, link, to.target, to.server, limits);
                }
                if http.exchange.client_keeps() {
                    Served::Next
                } else {
                    // The request or its answer said `Connection: close`: the client
                    // waits for the end of the connection.
                    close(client).await;
                    Served::Over
                }
            }
            End::ServerError(e) if outcome.down == 0 => {
                if let Some(bytes) = again {
                    // The server had closed the idle connection: the request was not seen.
                    http.unsend(bytes);
                    reuse = false;
                    continue;
                }
                server_failed(to, reused, &e);
                answer(client, http, BAD_GATEWAY, record).await
            }
            End::ServerError(e) => {
                // Part of the answer went out: the client sees its connection end.
                server_failed(to, reused, &e);
                Served::Over
            }
            end => {
                count_http_end(state, &end);
                if let End::Error(e) = &end {
                    tracing::debug!(peer = %peer.addr, "connection ended: {e}");
                }
                Served::Over
            }
        });
    }
}

/// A server that failed during a request: logged (see `candidates::lost`); over a reused
/// connection only a debug line (a kept-alive connection may end for reasons of its own).
fn server_failed(to: To<'_>, reused: bool, e: &io::Error) {
    if reused {
        tracing::debug!("{to}, over a reused connection, failed during a request: {e}");
    } else {
        candidates::lost(&to, e);
    }
}

/// A new connection to the server (TLS with `upstream_tls`, the PROXY header when
/// configured).
pub(super) async fn connect(
    state: &State,
    settings: &Settings,
    peer: &Peer,
    to: To<'_>,
) -> io::Result<Link> {
    let stream = Box::pin(open_upstream(
        state,
        settings,
        to.addr,
        to.index,
        to.host,
        peer.preamble,
        peer.opts,
        Offer::Nothing,
    ))
    .await?;
    to.server.total.fetch_add(1, Relaxed);
    to.server.pool_open.fetch_add(1, Relaxed);
    Ok(Link {
        stream,
        addr: to.addr,
        uses: 0,
        server: to.server,
    })
}
