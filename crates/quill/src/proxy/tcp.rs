//! The TCP data plane: accept -> conn_max -> PROXY header (`accept_proxy`) -> client ACL
//! -> TLS handshake (`ssl_cert`) -> the first request head, whole (`http`, within
//! `http_request_timeout`) -> select -> connect (timeout, failover) -> PROXY header
//! (`proxy_protocol`) -> TLS handshake (`upstream_tls`) -> relay (raw sockets: the fast
//! path; TLS on a side: the stream relay; `http`: the HTTP pump) -> close.
//!
//! One instance of [`serve`] runs per event loop, each on its own listener. A connection
//! task holds only its `Session` (the two sockets and a few words of state) while it
//! relays: everything before the relay (`open`) runs in a boxed future that is freed once
//! the relay starts. A raw connection silent for `idle_park` seconds leaves its task: its
//! session is parked ([`super::park`]) until a socket wakes, and a new task relays on.

use std::cell::Cell;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, BorrowedFd};
use std::pin::Pin;
use std::sync::atomic::{
    AtomicUsize,
    Ordering::{Relaxed, SeqCst},
};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, Interest, Ready};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::{mpsc, watch};

use super::candidates::Candidates;
use super::gateway::Peer;
use super::http::{BadAnswer, Exchange, HttpParams, Scheme};
use super::park::{self, Parked};
use super::proxy_protocol;
use super::pump::{self, Http};
use super::quickack;
use super::registry::{ConnInfo, Registered, Upstream};
use super::relay::{self, relay, Outcome, RelayOptions, Stop, Stream, Totals};
use super::replay::{Prefixed, Recording};
use super::stream;
use crate::balance::{clock, Place};
use crate::command::{Host, ProxyVersion, ServerProxy};
use crate::connlog::{unix_now, Capture, Tell};
use crate::net::connect::{apply_options, connect, is_local_failure, source_for, SocketOptions};
use crate::net::Listener;
use crate::settings::Settings;
use crate::state::State;
use crate::tls::{ClientTlsStream, Offer, ServerTls, ServerTlsStream};

/// The address Unix-domain clients are treated as having, for ACLs and tracking.
const UNIX_CLIENT: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);

/// Pause after an accept error such as EMFILE, so a full fd table does not spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The longest `idle_timeout` or `idle_park` taken literally (about 30 years): longer ones
/// mean "never", and must not overflow a clock.
const FOREVER: Duration = Duration::from_secs(30 * 365 * 86_400);

/// Accepts and serves connections until `shutdown` turns true; `lot` is where this loop
/// parks its idle connections. A listener that arrives on
/// `relisten` (the `listen` command) replaces the current one; connections already
/// established are not affected.
pub async fn serve(
    state: Arc<State>,
    mut listener: Listener,
    mut shutdown: watch::Receiver<bool>,
    mut relisten: mpsc::UnboundedReceiver<Listener>,
    lot: park::EpollSet,
) -> io::Result<()> {
    // The state lives as long as the process. Leaking one reference says so, and lets
    // every connection (and every parked session) borrow it without a reference count.
    let state: &'static State = Box::leak(Box::new(state));
    if let Err(e) = park::install(lot, &state.parked) {
        tracing::warn!("idle connections will not be parked on this event loop: {e}");
    }
    loop {
        let next = match listener {
            Listener::Tcp(l) => {
                let local_port = l.local_addr()?.port();
                let queued = crate::net::listen::prepare(&l)?;
                accept_loop(
                    state,
                    TcpListener::from_std(l)?,
                    local_port,
                    queued,
                    &mut shutdown,
                    &mut relisten,
                )
                .await
            }
            Listener::Unix(l) => {
                accept_loop(
                    state,
                    UnixListener::from_std(l)?,
                    0,
                    0,
                    &mut shutdown,
                    &mut relisten,
                )
                .await
            }
        };
        match next {
            Some(l) => listener = l,
            None => return Ok(()),
        }
    }
}

/// The two kinds of listener, accepted from in the same way.
trait Accept {
    type Stream: ClientStream;
    async fn accept_one(&self) -> io::Result<(Self::Stream, SocketAddr)>;
    /// Asks that new connections wait in the kernel for their client's first bytes, up to
    /// `seconds` (`defer_accept`); returns the seconds in effect.
    fn defer_accept(&self, seconds: u32) -> io::Result<u32>;
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    async fn accept_one(&self) -> io::Result<(TcpStream, SocketAddr)> {
        self.accept().await
    }
    fn defer_accept(&self, seconds: u32) -> io::Result<u32> {
        crate::net::sockopt::set_defer_accept(self, seconds).map(|()| seconds)
    }
}

impl Accept for UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_one(&self) -> io::Result<(tokio::net::UnixStream, SocketAddr)> {
        self.accept().await.map(|(s, _)| (s, UNIX_CLIENT))
    }
    /// A Unix socket has no handshake to hold a connection at: accepted at once.
    fn defer_accept(&self, _: u32) -> io::Result<u32> {
        Ok(0)
    }
}

/// Gives the listener the settings' `defer_accept` when it has another (`current`: what
/// it was given, `None` at first); returns the seconds in effect.
fn defer_accept<L: Accept>(listener: &L, state: &State, current: Option<u32>) -> u32 {
    let wanted = state.settings().defer_accept_seconds();
    if current == Some(wanted) {
        return wanted;
    }
    match listener.defer_accept(wanted) {
        Ok(seconds) => seconds,
        Err(e) => {
            tracing::warn!("cannot set defer_accept {wanted} on the listener: {e}");
            current.unwrap_or(0)
        }
    }
}

/// Accepts until shutdown (returns `None`) or until a new listener arrives (returns it).
/// The first `queued` connections were waiting before the listener was prepared
/// ([`crate::net::listen::prepare`]) and are given its options one by one.
async fn accept_loop<L: Accept>(
    state: &'static State,
    listener: L,
    local_port: u16,
    mut queued: u32,
    shutdown: &mut watch::Receiver<bool>,
    relisten: &mut mpsc::UnboundedReceiver<Listener>,
) -> Option<Listener> {
    // Accepts left before yielding; the settings are read once per batch, not per accept.
    let mut budget = state.settings().multi_accept;
    // `defer_accept` follows the settings (`http`, TLS and the setting itself can change
    // at run time), given to the listener before the first accept and at each change.
    let mut settings_changed = state.generation.subscribe();
    let mut deferred = defer_accept(&listener, state, None);
    loop {
        // Pen's pending_max (that many connections still connecting to their server) and
        // conn_max (that many open): stop accepting and let the kernel's backlog hold the
        // next clients until a place frees, rather than accept them only to close them (as
        // Pen, HAProxy's maxconn and NGINX's worker_connections do).
        if accept_full(state) {
            if state.active.load(Relaxed) >= state.settings().conn_max {
                warn_full(state);
            }
            let resumed = state.accept_resumes.notified();
            // SeqCst here and where the places are given back (`Connecting`, `Admitted`):
            // either this check sees a place freed, or that release sees the pause and
            // notifies; never neither.
            state.accept_paused.fetch_add(1, SeqCst);
            let _paused = Held(&state.accept_paused);
            if accept_full(state) {
                tokio::select! {
                    biased;
                    _ = shutdown.changed() => return None,
                    Some(next) = relisten.recv() => return Some(next),
                    // A limit raised at run time.
                    Ok(()) = settings_changed.changed() => {
                        deferred = defer_accept(&listener, state, Some(deferred));
                    }
                    _ = resumed => {}
                }
            }
            continue;
        }
        tokio::select! {
            biased;
            _ = shutdown.changed() => return None,
            Some(next) = relisten.recv() => return Some(next),
            Ok(()) = settings_changed.changed() => {
                deferred = defer_accept(&listener, state, Some(deferred));
            }
            r = listener.accept_one() => match r {
                Ok((sock, peer)) => {
                    if queued > 0 {
                        queued -= 1;
                        sock.set_listener_options();
                    }
                    // tokio takes an accepted socket for readable before any event (its
                    // first read tries the socket). With `defer_accept` the client's first
                    // bytes are there (the kernel held the connection for them), and that
                    // read takes them without a turn of the event loop. Without it they
                    // have mostly not arrived, and that read would find nothing (one
                    // EAGAIN a connection under wrk's connection-per-request load; NGINX
                    // and Pen make none): here, before any await, no event of the socket
                    // has been taken yet, and the first `epoll_wait` after its
                    // registration reports bytes already there, so the client is read
                    // when the event loop says so and nothing is missed.
                    if deferred == 0 {
                        Stream::forget_readable(&sock);
                    }
                    super::polling::stir();
                    // Counted now, not when its task first runs: the next turn of this
                    // loop (with `multi_accept`, before any of those tasks ran) must see
                    // the place taken.
                    let admitted = Admitted::enter(state);
                    spawn_connection(state, sock, peer, local_port, admitted);
                    budget = yield_when_spent(budget, state).await;
                }
                Err(e) => accept_failed(e).await,
            },
        }
    }
}

/// When [`warn_full`] last warned (`clock::now_ms()`).
static WARNED_FULL: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// New clients wait at `conn_max`: a warning at most every ten seconds.
fn warn_full(state: &State) {
    if super::warn_again(&WARNED_FULL, clock::now_ms(), 10_000) {
        tracing::warn!(
            "conn_max ({}) connections open: none accepted until one ends (new clients wait in the listen queue, -q)",
            state.settings().conn_max
        );
    }
}

/// Whether accepting must wait: `pending_max` connects in progress, or `conn_max` client
/// connections open.
fn accept_full(state: &State) -> bool {
    let settings = state.settings();
    state.pending.load(SeqCst) >= settings.pending_max
        || state.active.load(SeqCst) >= settings.conn_max
}

fn spawn_connection<C: ClientStream>(
    state: &'static State,
    sock: C,
    peer: SocketAddr,
    local_port: u16,
    admitted: (Admitted<'static>, usize),
) {
    let registered = state
        .registry
        .as_ref()
        .map(|r| r.register(peer, clock::now_ms()));
    let info = registered.as_ref().map(|r| Arc::clone(&r.info));
    let task =
        tokio::task::spawn_local(handle(state, sock, peer, local_port, registered, admitted));
    if let Some(info) = info {
        info.served_by(task.abort_handle());
    }
}

/// Pen's `multi_accept`: after that many accepts in a row, let connections run. Returns
/// the budget for the next accepts.
async fn yield_when_spent(budget: usize, state: &State) -> usize {
    if budget > 1 {
        return budget - 1;
    }
    tokio::task::yield_now().await;
    state.settings().multi_accept
}

async fn accept_failed(e: io::Error) {
    tracing::warn!("accept failed: {e}");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

/// A client-side socket: TCP or Unix.
trait ClientStream:
    Sized + Stream + tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static
{
    /// The socket out of the reactor, while its connection is parked.
    type Std: AsFd + 'static;
    /// Gives a connection made before its listener was prepared what the others inherit.
    fn set_listener_options(&self);
    fn set_options(&self, opts: SocketOptions);
    /// The address the client connected to; `None` for a Unix socket.
    fn local(&self) -> Option<SocketAddr>;
    /// Takes the socket out of the reactor.
    fn into_std(self) -> io::Result<Self::Std>;
    /// Puts a socket back into this thread's reactor.
    fn from_std(socket: Self::Std) -> io::Result<Self>;
    /// Waits until the event loop reports any of `interest` (tokio's `ready`): for
    /// [`client_left`], which needs `Interest::ERROR`, which the relay's readiness lacks.
    fn ready_for(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + '_;
}

impl ClientStream for TcpStream {
    type Std = std::net::TcpStream;
    fn set_listener_options(&self) {
        if let Err(e) = crate::net::listen::set_inherited_options(self) {
            tracing::debug!("client socket options: {e}");
        }
    }
    fn set_options(&self, opts: SocketOptions) {
        if let Err(e) = apply_options(self, opts) {
            tracing::debug!("client socket options: {e}");
        }
    }
    fn local(&self) -> Option<SocketAddr> {
        self.local_addr().ok()
    }
    fn into_std(self) -> io::Result<std::net::TcpStream> {
        TcpStream::into_std(self)
    }
    fn from_std(socket: std::net::TcpStream) -> io::Result<TcpStream> {
        TcpStream::from_std(socket)
    }
    fn ready_for(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + '_ {
        TcpStream::ready(self, interest)
    }
}

impl ClientStream for tokio::net::UnixStream {
    type Std = std::os::unix::net::UnixStream;
    fn set_listener_options(&self) {}
    fn set_options(&self, _: SocketOptions) {}
    fn local(&self) -> Option<SocketAddr> {
        None
    }
    fn into_std(self) -> io::Result<Self::Std> {
        tokio::net::UnixStream::into_std(self)
    }
    fn from_std(socket: Self::Std) -> io::Result<Self> {
        tokio::net::UnixStream::from_std(socket)
    }
    fn ready_for(&self, interest: Interest) -> impl Future<Output = io::Result<Ready>> + '_ {
        tokio::net::UnixStream::ready(self, interest)
    }
}

/// A plain HTTP/1.x client served request by request.
impl<C: ClientStream> super::h1::Parkable for Prefixed<C> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Stream::poll_read_ready(self.get_ref(), cx)
    }
    fn unread(&mut self, bytes: &[u8]) {
        Prefixed::unread(self, bytes);
    }
    fn busy(&self) -> bool {
        self.has_prefix()
    }
    fn sent(&self) -> bool {
        self.has_prefix() || self.get_ref().readable_now()
    }
}

/// An HTTP/1.x client over TLS served request by request: idle when rustls has no record
/// left to write and no decrypted byte left to read either.
impl<C: ClientStream> super::h1::Parkable for Prefixed<Box<ServerTlsStream<C>>> {
    fn poll_read_ready(&self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Stream::poll_read_ready(self.get_ref().get_ref().0, cx)
    }
    fn unread(&mut self, bytes: &[u8]) {
        Prefixed::unread(self, bytes);
    }
    fn busy(&self) -> bool {
        // Decrypted bytes not read yet count too (rustls then wants no more records).
        let tls = self.get_ref().get_ref().1;
        self.has_prefix() || tls.wants_write() || !tls.wants_read()
    }
    fn sent(&self) -> bool {
        let (tcp, tls) = self.get_ref().get_ref();
        self.has_prefix() || !tls.wants_read() || tcp.readable_now()
    }
}

/// Decrements a counter when dropped: every exit path (an aborted task's too) releases
/// what it took.
pub(super) struct Held<'a>(pub(super) &'a AtomicUsize);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

/// One upstream connect in progress, counted in `State::pending` until dropped; accept
/// loops paused at `pending_max` are woken when it ends.
struct Connecting<'a>(&'a State);

impl<'a> Connecting<'a> {
    fn start(state: &'a State) -> Connecting<'a> {
        state.pending.fetch_add(1, Relaxed);
        Connecting(state)
    }
}

impl Drop for Connecting<'_> {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, SeqCst);
        if self.0.accept_paused.load(SeqCst) > 0 {
            self.0.accept_resumes.notify_waiters();
        }
    }
}

/// A client connection's place under `conn_max`, counted in `State::active` until
/// dropped; accept loops paused at `conn_max` are woken when it ends.
pub(super) struct Admitted<'a>(&'a State);

impl<'a> Admitted<'a> {
    /// Counts one more connection; the count with it.
    fn enter(state: &'a State) -> (Admitted<'a>, usize) {
        let active = state.active.fetch_add(1, SeqCst) + 1;
        (Admitted(state), active)
    }

    /// Waits until a place under `conn_max` frees, and takes it.
    async fn wait(state: &'a State) -> Admitted<'a> {
        loop {
            let resumed = state.accept_resumes.notified();
            state.accept_paused.fetch_add(1, SeqCst);
            let _paused = Held(&state.accept_paused);
            let max = state.settings().conn_max;
            if state
                .active
                .fetch_update(SeqCst, SeqCst, |n| (n < max).then_some(n + 1))
                .is_ok()
            {
                return Admitted(state);
            }
            resumed.await;
        }
    }
}

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, SeqCst);
        if self.0.accept_paused.load(SeqCst) > 0 {
            self.0.accept_resumes.notify_waiters();
        }
    }
}

/// A connection's place on one upstream (server, emergency or abuse), and which it is.
struct Lease<'a> {
    place: Place<'a>,
    /// The server's index in the table (none for the emergency and abuse servers).
    index: Option<usize>,
}

async fn handle<C: ClientStream>(
    state: &'static State,
    client: C,
    peer: SocketAddr,
    local_port: u16,
    registered: Option<Registered>,
    admitted: (Admitted<'static>, usize),
) {
    // Everything up to the relay runs in a boxed future that is freed when the relay
    // starts: the task, allocated for the whole life of the connection, holds only the
    // `Session`. (`let ... else` keeps the boxed future's result a temporary: a local
    // moved into the next `.await` would keep its storage in the task.)
    let Some(mut session) =
        Box::pin(open(state, client, peer, local_port, registered, admitted)).await
    else {
        return;
    };
    let from = Totals::new(session.books.capture());
    if let Some(totals) = session.run(state, from).await {
        session.park(state, totals);
    }
}

/// Relays on for a parked connection whose socket woke, in a task of its own.
async fn wake<C: ClientStream>(asleep: Asleep<C>) {
    let Asleep {
        state,
        mut session,
        totals,
        parked_at,
    } = asleep;
    let opts = &mut session.books.opts;
    let idle_park = state.settings().idle_park;
    opts.park_after = park::next_park_after(
        (idle_park > 0).then(|| Duration::from_secs(idle_park).min(FOREVER)),
        opts.park_after,
        parked_at.elapsed(),
    );
    let mut session = match session.map_ends(Resting::into_live) {
        Ok(session) => session,
        Err((session, e)) => {
            tracing::debug!(peer = %session.books.peer, "closed: could not resume a parked connection: {e}");
            session.finish(totals.ended(relay::End::Error(e)));
            return;
        }
    };
    if let Some(totals) = session.run(state, totals).await {
        session.park(state, totals);
    }
}

/// What an established connection keeps while it relays (`E` = [`Live`]) or is parked
/// (`E` = [`Resting`]): its two ends and its books.
struct Session<'a, E> {
    /// Declared first, so dropped first: the connection leaves the registry (`connection
    /// N`, `close N`) before its sockets close, and a client that sees the close never
    /// finds itself still listed.
    registered: Option<Registered>,
    ends: E,
    books: Books<'a>,
}

/// The few words an established connection keeps besides its sockets: what it holds (its
/// upstream slot, its place among the open connections), how it relays, and what its end
/// reports (counters, the log line, a failed server).
struct Books<'a> {
    /// The connection slot on the chosen upstream, released when the session ends.
    lease: Lease<'a>,
    /// This connection's place in `State::active`.
    _active: Admitted<'a>,
    /// With `http`: the exchange and the first request head, read before connecting.
    http: Option<Box<Http>>,
    opts: RelayOptions,
    peer: SocketAddr,
    /// The connection log line's fields; `log` is `None` when the log is off.
    log: Option<Arc<crate::connlog::ConnLog>>,
    started_unix: u64,
    ip: IpAddr,
    server_ip: Option<IpAddr>,
}

impl Books<'_> {
    /// What a new relay keeps of the client's first bytes: nothing without a connection
    /// log; penlogd told as they come unless `http` read them first (told at connect).
    fn capture(&self) -> Option<Capture> {
        let log = self.log.as_ref()?;
        let tell = (log.tells() && self.http.is_none()).then(|| {
            Box::new(Tell {
                log: Arc::clone(log),
                client: self.ip,
                server: self.server_ip,
            })
        });
        Some(Capture::new(tell))
    }
}

/// The ends of a relaying connection.
struct Live<C> {
    client: Client<C>,
    server: Server,
}

/// The ends of a parked connection: raw sockets, out of the reactor.
struct Resting<C: ClientStream> {
    client: C::Std,
    server: std::net::TcpStream,
}

impl<C: ClientStream> Live<C> {
    /// Only raw connections park: TLS keeps state that a socket alone cannot hold.
    fn into_resting(self) -> io::Result<Resting<C>> {
        match (self.client, self.server) {
            (Client::Plain(c), Server::Plain(s)) => Ok(Resting {
                client: c.into_std()?,
                server: s.into_std()?,
            }),
            _ => Err(io::Error::other("only raw connections can be parked")),
        }
    }
}

impl<C: ClientStream> Resting<C> {
    fn into_live(self) -> io::Result<Live<C>> {
        Ok(Live {
            client: Client::Plain(C::from_std(self.client)?),
            server: Server::Plain(TcpStream::from_std(self.server)?),
        })
    }
}

/// A parked connection, as its lot keeps it.
struct Asleep<C: ClientStream> {
    state: &'static State,
    session: Session<'static, Resting<C>>,
    /// Where its relay stopped.
    totals: Totals,
    /// When it parked (how soon it woke decides when it parks next: see
    /// [`park::next_park_after`]).
    parked_at: Instant,
}

impl<C: ClientStream> Parked for Asleep<C> {
    fn fds(&self) -> [BorrowedFd<'_>; 2] {
        let ends = &self.session.ends;
        [ends.client.as_fd(), ends.server.as_fd()]
    }

    fn info(&self) -> Option<&ConnInfo> {
        self.session.registered.as_ref().map(|r| &*r.info)
    }

    fn remaining(&self) -> Option<Duration> {
        let limit = self.session.books.opts.idle_timeout?;
        Some(limit.saturating_sub(self.totals.silent))
    }

    fn resume(self: Box<Self>) {
        let info = self
            .session
            .registered
            .as_ref()
            .map(|r| Arc::clone(&r.info));
        let task = tokio::task::spawn_local(wake(*self));
        if let Some(info) = info {
            info.served_by(task.abort_handle());
        }
    }

    fn expire(self: Box<Self>) {
        let Asleep {
            session, totals, ..
        } = *self;
        session.finish(totals.ended(relay::End::Idle));
    }
}

impl<'a, E> Session<'a, E> {
    /// The same session with other ends. When they cannot be made, the old ends are gone
    /// (their sockets closed): the rest comes back, for the accounting.
    // Both variants carry a session, so the error is no larger than the success.
    #[allow(clippy::result_large_err)]
    fn map_ends<F>(
        self,
        f: impl FnOnce(E) -> io::Result<F>,
    ) -> Result<Session<'a, F>, (Session<'a, ()>, io::Error)> {
        let Session {
            registered,
            ends,
            books,
        } = self;
        match f(ends) {
            Ok(ends) => Ok(Session {
                registered,
                ends,
                books,
            }),
            Err(e) => Err((
                Session {
                    registered,
                    ends: (),
                    books,
                },
                e,
            )),
        }
    }

    /// Accounts for the connection once it is over: byte counters, the log line, and a
    /// server that failed mid-connection said in the log.
    fn finish(&self, outcome: Outcome) {
        let books = &self.books;
        let lease = &books.lease;
        lease.place.server().bytes_to.fetch_add(outcome.up, Relaxed);
        lease
            .place
            .server()
            .bytes_from
            .fetch_add(outcome.down, Relaxed);
        if let Some(log) = &books.log {
            log.record(
                books.ip,
                books.started_unix,
                books.server_ip,
                &outcome.first,
            );
        }
        let peer = books.peer;
        match &outcome.end {
            relay::End::Error(e) => {
                tracing::debug!(%peer, server = ?lease.index, "connection ended: {e}");
            }
            // Not blacklisted (see `candidates::lost`): a client can make a sound server
            // reset its connection (bytes it will not read, then its close).
            relay::End::ServerError(e) => match lease.index {
                Some(index) => {
                    tracing::info!(%peer, "server {index} failed mid-connection: {e}");
                }
                None => tracing::debug!(%peer, "emergency or abuse server failed: {e}"),
            },
            _ => {}
        }
    }
}

/// Accepts the connection into quill: conn_max, the PROXY header, `dummy`, the client
/// ACL, the TLS handshake, server selection and the upstream connect. `None` when the
/// connection ended on the way (refused, denied, failed, or served by `dummy`).
async fn open<C: ClientStream>(
    state: &'static State,
    client: C,
    mut peer: SocketAddr,
    local_port: u16,
    registered: Option<Registered>,
    (mut held, active): (Admitted<'static>, usize),
) -> Option<Session<'static, Live<C>>> {
    let settings = state.settings();
    let log = state.log.load_full();
    let started_unix = if log.is_some() { unix_now() } else { 0 };
    state.counters.accepted.fetch_add(1, Relaxed);
    if active > settings.conn_max {
        // Accept loops wait below `conn_max`, but one whose accept was under way while
        // another loop took the last place gets a connection beyond it: that one waits
        // here for a place, as it would have in the listen queue.
        drop(held);
        tracing::debug!(%peer, "conn_max {} reached: waiting for a place", settings.conn_max);
        held = Admitted::wait(state).await;
    }
    // The destination the client reached, when a PROXY header (in or out) needs it: the
    // listener, or what the client's own PROXY header says.
    let mut destination = None;
    if settings.accept_proxy {
        // Boxed, as every phase that plain connections skip. Built inside
        // `Box::pin(...)`: a future first bound to a local would keep its storage in this
        // future even after being moved into the box.
        match Box::pin(tokio::time::timeout(
            timeout(&settings),
            proxy_protocol::read_header(&client),
        ))
        .await
        {
            Ok(Ok(header)) => {
                if let Some((source, dest)) = header.addrs {
                    peer = source;
                    destination = Some(dest);
                    if let Some(r) = &registered {
                        let _ = r.info.proxied.set(source);
                    }
                }
            }
            Ok(Err(e)) => {
                state.counters.bad_proxy_header.fetch_add(1, Relaxed);
                tracing::debug!(%peer, "closed: {e}");
                return None;
            }
            Err(_) => {
                state.counters.bad_proxy_header.fetch_add(1, Relaxed);
                tracing::debug!(%peer, "closed: no PROXY protocol header in time");
                return None;
            }
        }
    }
    let opts = SocketOptions {
        nodelay: settings.tcp_nodelay,
        keepalive: settings.keepalive,
        transparent: settings.transparent,
    };
    if settings.dummy {
        match &settings.tls_built.server {
            None => Box::pin(super::dummy::serve(client, local_port)).await,
            Some(tls) => {
                client.set_options(opts);
                // One boxed future for both steps: the TLS stream (rustls's state, over a
                // kilobyte) must not live here, not even moved-from.
                let limit = timeout(&settings);
                Box::pin(async {
                    if let Some(c) = handshake(state, tls, client, peer, limit).await {
                        super::dummy::serve(c, local_port).await;
                    }
                })
                .await;
            }
        }
        return None;
    }
    client.set_options(opts);

    let ip = peer.ip().to_canonical();
    let permitted = settings.acls[settings.client_acl.index()].permits(ip);
    if !permitted && settings.abuse.is_none() {
        state.counters.refused_acl.fetch_add(1, Relaxed);
        tracing::debug!(%peer, "denied by client_acl {}", settings.client_acl);
        if let Some(log) = &log {
            log.record(ip, started_unix, None, b"");
        }
        return None;
    }
    // The listener's address costs a system call: asked for only when a PROXY header may
    // be sent.
    let sends_proxy = settings.may_send_proxy_header();
    let preamble = Preamble {
        peer,
        destination: destination.or_else(|| sends_proxy.then(|| client.local()).flatten()),
    };
    // The handshake comes after the cheap refusals, so a denied client costs no crypto.
    // Boxed like every phase plain connections skip: rustls's state is over a kilobyte.
    let client = match &settings.tls_built.server {
        None => Client::Plain(client),
        Some(tls) => {
            match Box::pin(handshake(state, tls, client, peer, timeout(&settings))).await {
                Some(c) => Client::Tls(Box::new(c)),
                None => return None,
            }
        }
    };
    let seconds = |n: u64| (n > 0).then(|| Duration::from_secs(n).min(FOREVER));
    // With `http`, no server is chosen before the client's first request head is whole:
    // a client that trickles its head (slowloris) or sends nothing never costs a backend
    // connection, only its own socket and the partial head (at most `http_header_max`).
    let mut client = client;
    // HTTP/2 (ALPN `h2`, or the preface on a plain listener with `h2c`) is served request
    // by request; so is HTTP/1.x with `upstream_keepalive`, after the checks of its first
    // head below. Else HTTP/1.x goes on to the byte pump.
    let mut sniffed = Vec::new();
    let conn = registered.as_ref().map(|r| Arc::clone(&r.info));
    let peer_info = |tls| Peer {
        addr: peer,
        conn: conn.clone(),
        tls,
        permitted,
        preamble,
        opts,
    };
    // `-l` for an HTTP/2 connection: its servers are chosen per request (the access log
    // has them); the request field is the preface's request line.
    let log_h2 = || {
        if let Some(log) = &log {
            log.record(ip, started_unix, None, b"PRI * HTTP/2.0");
        }
    };
    if settings.http {
        match client {
            Client::Tls(c) if c.get_ref().1.alpn_protocol() == Some(b"h2") => {
                log_h2();
                Box::pin(super::h2::serve(state, c, peer_info(true))).await;
                return None;
            }
            Client::Plain(mut c) if settings.h2c => {
                let limit = timeout(&settings);
                let first = tokio::time::timeout(limit, super::h2::sniff_preface(&mut c)).await;
                match first {
                    Ok(Ok((bytes, true))) => {
                        log_h2();
                        let io = Prefixed::new(bytes, c);
                        Box::pin(super::h2::serve(state, io, peer_info(false))).await;
                        return None;
                    }
                    Ok(Ok((bytes, false))) => {
                        sniffed = bytes;
                        client = Client::Plain(c);
                    }
                    Ok(Err(_)) | Err(_) => return None,
                }
            }
            other => client = other,
        }
    }
    let mut http = if settings.http {
        let exchange = Exchange::new(HttpParams {
            client: ip,
            scheme: match client {
                Client::Plain(_) => Scheme::Http,
                Client::Tls(_) => Scheme::Https,
            },
            header_max: settings.http_header_max,
            hsts: settings.hsts,
        });
        let mut http = Box::new(Http::new(exchange, seconds(settings.http_request_timeout)));
        let capture = log.is_some();
        // Request by request (`upstream_keepalive`), the byte pump relays each request
        // over a pooled server connection (and keeps what the access log needs of each);
        // hyper serves the clients whose requests must become messages (`upstream_h2`),
        // and reads the head again: what was read is kept for it.
        let per_request = settings.upstream_keepalive > 0;
        let pumped = per_request && !settings.upstream_h2;
        if pumped {
            http.exchange.request_by_request();
        }
        if pumped {
            // Each request's head kept for the access log or penlogd, taken by `h1_pump`.
            http.exchange
                .log_requests(super::h1_pump::logs_requests(state));
        } else if !per_request {
            // Only the access log takes them here (`pump::Lines`): none kept for penlogd,
            // told once at connect.
            http.exchange
                .log_requests(state.access_log.load().is_some());
        }
        let per_request = per_request && !pumped;
        let limit = http.head_limit;
        let seen;
        let ended = match &mut client {
            Client::Plain(c) => {
                let mut c = Prefixed::new(std::mem::take(&mut sniffed), &mut *c);
                let mut c = Recording::new(&mut c, per_request);
                let ended = Box::pin(pump::first_head(&mut c, &mut http, capture, limit)).await;
                seen = c.seen;
                ended
            }
            Client::Tls(c) => {
                let mut c = Recording::new(&mut **c, per_request);
                let ended = Box::pin(pump::first_head(&mut c, &mut http, capture, limit)).await;
                seen = c.seen;
                ended
            }
        };
        if let Some(outcome) = ended {
            count_http_end(state, &outcome.end);
            tracing::debug!(%peer, "closed before a whole request head: {:?}", outcome.end);
            if let Some(log) = &log {
                log.record(ip, started_unix, None, &outcome.first);
            }
            return None;
        }
        if pumped {
            if let Some(log) = &log {
                log.record(ip, started_unix, None, &http.first_bytes());
            }
            match client {
                Client::Plain(c) => {
                    let io = Prefixed::new(Vec::new(), c);
                    Box::pin(super::h1_pump::serve(state, io, http, peer_info(false))).await;
                }
                Client::Tls(c) => {
                    let io = Prefixed::new(Vec::new(), c);
                    Box::pin(super::h1_pump::serve(state, io, http, peer_info(true))).await;
                }
            }
            return None;
        }
        // A bad request right behind the first, in the same read, is the byte pump's to
        // refuse after the first answer (hyper would drop the connection unanswered).
        if per_request && http.exchange.refusal().is_none() {
            if let Some(log) = &log {
                let first = &seen[..seen.len().min(crate::connlog::REQUEST_BYTES)];
                log.record(ip, started_unix, None, first);
            }
            drop(http);
            match client {
                Client::Plain(c) => {
                    let io = Prefixed::new(seen, c);
                    Box::pin(super::h1::serve(state, io, peer_info(false))).await;
                }
                Client::Tls(c) => {
                    let io = Prefixed::new(seen, c);
                    Box::pin(super::h1::serve(state, io, peer_info(true))).await;
                }
            }
            return None;
        }
        Some(http)
    } else {
        None
    };
    if !permitted {
        tracing::debug!(%peer, "denied by client_acl {}: sent to the abuse server", settings.client_acl);
    }
    // A raw relay's client that chose HTTP/2 (`alpn h2` without `http`) speaks it to the
    // server, which TLS must then ask for (a gRPC server insists on it).
    let offer = match &client {
        Client::Tls(c) if http.is_none() && c.get_ref().1.alpn_protocol() == Some(b"h2") => {
            Offer::H2Only
        }
        _ => Offer::Nothing,
    };
    // Whether the client already sent bytes quill holds: its request head (`http`), or
    // over TLS, records rustls took with the handshake (decrypted bytes, a close_notify).
    // Such a client is taken as gone, while it waits, only on an error: the byte pump too
    // passes a half-close after the head on to the server and relays its answer.
    let (socket, sent) = match &client {
        Client::Plain(c) => (c, http.is_some()),
        Client::Tls(c) => {
            let (c, tls) = c.get_ref();
            (c, http.is_some() || !tls.wants_read())
        }
    };
    let upstream = Box::pin(choose_and_connect(
        state,
        &settings,
        preamble,
        opts,
        permitted,
        offer,
        client_left(socket, sent),
        registered.as_ref().map(|r| &*r.info),
    ))
    .await;
    // The access log's lines of a connection relayed whole (request by request, the
    // requests went to `h1_pump` or hyper above).
    let access_log = http.as_ref().and_then(|_| state.access_log.load_full());
    let (server, lease) = match upstream {
        Ok(upstream) => upstream,
        Err(unserved) => {
            if let Some(log) = &log {
                log.record(ip, started_unix, None, b"");
            }
            if let Some(http) = &mut http {
                if let Some(log) = access_log {
                    http.lines = Some(pump::Lines {
                        log,
                        client: ip,
                        server: None,
                    });
                }
                match unserved {
                    // The client's request came whole: it is answered (a 503, as request
                    // by request does), not left with a connection closed in silence.
                    Unserved::NoServer => Box::pin(answer_unserved(&mut client, http)).await,
                    // Reset while it waited: nothing can reach it; its request is logged
                    // 499, as one request by request that left the queue.
                    Unserved::Left => {
                        http.exchange.client_left();
                        http.log_the_rest();
                    }
                }
            }
            return None;
        }
    };
    // Read before relaying (once the server has closed, its address is gone), and only
    // for a log.
    let server_addr = (log.is_some() || access_log.is_some())
        .then(|| server.peer_addr().ok())
        .flatten();
    if let (Some(http), Some(log)) = (&mut http, access_log) {
        http.lines = Some(pump::Lines {
            log,
            client: ip,
            server: server_addr,
        });
    }
    if let Some(http) = &mut http {
        http.answers = Some(&lease.place.server().answers);
    }
    if let (Some(http), Some(log)) = (&http, &log) {
        // The head came before the server was chosen: penlogd hears of it now.
        log.tell(ip, server_addr.map(|a| a.ip()), http.first_bytes_kept());
    }
    if let Some(r) = &registered {
        r.info.set_upstream(match lease.index {
            Some(i) => Upstream::Server(i),
            None if permitted => Upstream::Emergency,
            None => Upstream::Abuse,
        });
    }
    let relay_opts = RelayOptions {
        fastclose: settings.fastclose,
        idle_timeout: seconds(settings.idle_timeout),
        park_after: seconds(settings.idle_park),
        capture: log.is_some(),
    };
    let server_ip = server_addr.filter(|_| log.is_some()).map(|a| a.ip());
    Some(Session {
        registered,
        ends: Live { client, server },
        books: Books {
            lease,
            _active: held,
            http,
            opts: relay_opts,
            peer,
            log,
            started_unix,
            ip,
            server_ip,
        },
    })
}

impl<C: ClientStream> Session<'static, Live<C>> {
    /// Relays (continuing from `from`) until the connection ends, then accounts for it;
    /// or until a raw connection has been silent for `idle_park`: then returns where it
    /// stopped, for [`Session::park`]. Borrows the session, so that the task stores it
    /// once (a session moved into this future would also keep its slot in the caller's).
    async fn run(&mut self, state: &State, from: Totals) -> Option<Totals> {
        let opts = self.books.opts;
        let server = Which(self.books.lease.index);
        // Raw sockets on both sides without `http` take the fast path.
        let outcome = match (&mut self.ends.client, &mut self.ends.server) {
            (Client::Plain(c), Server::Plain(s)) if self.books.http.is_none() => {
                match relay(&*c, &*s, opts, from).await {
                    Stop::Ended(outcome) => outcome,
                    Stop::Quiet(totals) => return Some(totals),
                }
            }
            (Client::Plain(c), Server::Plain(s)) => {
                let http = self.books.http.take();
                pump_streams(state, c, s, http, opts, from.first, server).await
            }
            (Client::Plain(c), Server::Tls(s)) => {
                let http = self.books.http.take();
                pump_streams(state, c, &mut **s, http, opts, from.first, server).await
            }
            (Client::Tls(c), Server::Plain(s)) => {
                let http = self.books.http.take();
                pump_streams(state, &mut **c, s, http, opts, from.first, server).await
            }
            (Client::Tls(c), Server::Tls(s)) => {
                let http = self.books.http.take();
                pump_streams(state, &mut **c, &mut **s, http, opts, from.first, server).await
            }
        };
        self.finish(outcome);
        None
    }

    /// Parks the connection (see [`super::park`]); its task ends.
    fn park(self, state: &'static State, totals: Totals) {
        match self.map_ends(Live::into_resting) {
            Ok(session) => park::park(Box::new(Asleep {
                state,
                session,
                totals,
                parked_at: Instant::now(),
            })),
            Err((session, e)) => {
                tracing::debug!(peer = %session.books.peer, "closed: could not park an idle connection: {e}");
                session.finish(totals.ended(relay::End::Error(e)));
            }
        }
    }
}

/// Relays between two streams of which at least one is not a raw socket, or through the
/// HTTP exchange with `http`. Boxed: plain connections never need this state.
async fn pump_streams<C, S>(
    state: &State,
    client: &mut C,
    server: &mut S,
    http: Option<Box<Http>>,
    opts: RelayOptions,
    first: Option<Capture>,
    which: Which,
) -> Outcome
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized,
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + quickack::Acknowledge + Unpin + ?Sized,
{
    match http {
        None => Box::pin(stream::relay(client, server, opts, first)).await,
        Some(mut http) => {
            let ask = Cell::new(pump::Ask::Nothing);
            let relay = pump::relay(client, server, Some(&mut *http), opts, &ask);
            let outcome = Box::pin(telling(state, relay, &ask)).await;
            count_http_end(state, &outcome.end);
            if let Some(why) = http.exchange.take_bad_answer() {
                bad_answer(state, which.describe(state), why);
            }
            http.log_the_rest();
            outcome
        }
    }
}

/// Runs an `http` relay, telling it through `ask` when quill stops, or when a reload or a
/// drain wants clients to move on to new connections (read from one word at each wake-up
/// of the connection, not from two watch channels).
pub(super) async fn telling<F: std::future::Future>(
    state: &State,
    relay: F,
    ask: &Cell<pump::Ask>,
) -> F::Output {
    let mut asked = super::signals::Watcher::new(state);
    if asked.seen().stopping() {
        ask.set(pump::Ask::Stop);
    }
    tokio::pin!(relay);
    loop {
        tokio::select! {
            out = &mut relay => return out,
            now = asked.changed(), if ask.get() != pump::Ask::Stop => {
                if now.stopping() {
                    ask.set(pump::Ask::Stop);
                } else {
                    ask.set(pump::Ask::MoveOn);
                }
            }
        }
    }
}

/// Counts how an `http` connection ended, when quill answered or cut it.
pub(super) fn count_http_end(state: &State, end: &relay::End) {
    match end {
        relay::End::Refused => {
            state.counters.http_refused.fetch_add(1, Relaxed);
        }
        relay::End::RequestTimeout { answered } => {
            state.counters.http_request_timeouts.fetch_add(1, Relaxed);
            if *answered {
                state.counters.http_refused.fetch_add(1, Relaxed);
            }
        }
        _ => {}
    }
}

/// The server of a one-to-one connection, by its index (none for the emergency and abuse
/// servers). Its address, for a message, is looked up only when one is written: the
/// connection keeps no more than the index.
#[derive(Clone, Copy)]
struct Which(Option<usize>);

impl Which {
    /// As `Candidate` words it: `server N (ADDRESS)`, from the settings in force.
    fn describe(self, state: &State) -> String {
        let settings = state.settings();
        match self.0 {
            Some(i) => match settings.servers.get(i).and_then(|s| Some((s.ip?, s.port))) {
                Some(addr) => format!("server {i} ({})", SocketAddr::from(addr)),
                None => format!("server {i}"),
            },
            None => "the emergency or abuse server".to_string(),
        }
    }
}

/// When [`bad_answer`] last warned (`clock::now_ms()`).
static WARNED_BAD_ANSWER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `server`'s answer was replaced by quill's 502 (`http::Exchange::take_bad_answer`):
/// counted, and said at most every ten seconds (a broken server sends many). The server
/// is not blacklisted: it accepts connections, and the next answer may be sound.
pub(super) fn bad_answer(state: &State, server: impl std::fmt::Display, why: BadAnswer) {
    state.counters.http_bad_answers.fetch_add(1, Relaxed);
    if super::warn_again(&WARNED_BAD_ANSWER, clock::now_ms(), 10_000) {
        tracing::warn!("{server} sent an answer quill cannot frame ({why}): the client got a 502");
    }
}

/// The client side of a connection: the socket itself, or TLS terminated on it.
enum Client<C> {
    Plain(C),
    Tls(Box<ServerTlsStream<C>>),
}

/// The upstream side of a connection: a socket, or TLS originated on it.
pub(super) enum Server {
    Plain(TcpStream),
    Tls(Box<ClientTlsStream<TcpStream>>),
}

impl quickack::Acknowledge for Server {
    fn acknowledge(&self) {
        match self {
            Server::Plain(s) => s.acknowledge(),
            Server::Tls(s) => s.acknowledge(),
        }
    }
}

impl Server {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Server::Plain(s) => s.peer_addr(),
            Server::Tls(s) => s.get_ref().0.peer_addr(),
        }
    }

    /// The server picked ALPN `h2` in the TLS handshake.
    pub(super) fn picked_h2(&self) -> bool {
        match self {
            Server::Plain(_) => false,
            Server::Tls(s) => s.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }
}

impl AsyncRead for Server {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Server::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Server::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Server {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Server::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Server::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Server::Plain(s) => Pin::new(s).poll_flush(cx),
            Server::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Server::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Server::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

/// Answers the request whose head `http` holds when no server could take it
/// ([`Exchange::unserved`]), writes its access log lines, and shuts the client's side. A
/// client that does not read gets a second at most.
async fn answer_unserved<C: ClientStream>(client: &mut Client<C>, http: &mut Http) {
    let answer = http.exchange.unserved();
    http.log_the_rest();
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        match client {
            Client::Plain(c) => {
                c.write_all(&answer).await?;
                c.shutdown().await
            }
            Client::Tls(c) => {
                c.write_all(&answer).await?;
                c.shutdown().await
            }
        }
    })
    .await;
}

/// Who the client is and where it connected to, for the PROXY header sent to a server.
#[derive(Debug, Clone, Copy)]
pub(super) struct Preamble {
    peer: SocketAddr,
    /// `None` for a Unix-socket client (the header's LOCAL / UNKNOWN form).
    destination: Option<SocketAddr>,
}

/// Terminates TLS on a client connection; `None` (counted and logged) when it fails.
async fn handshake<C: ClientStream>(
    state: &State,
    tls: &ServerTls,
    client: C,
    peer: SocketAddr,
    limit: Duration,
) -> Option<ServerTlsStream<C>> {
    match tls.accept(client, limit).await {
        Ok(s) => {
            state.counters.tls_handshakes.fetch_add(1, Relaxed);
            Some(s)
        }
        Err(e) => {
            state.counters.tls_failures.fetch_add(1, Relaxed);
            tracing::info!(%peer, "{e}");
            None
        }
    }
}

/// The PROXY protocol version for server `index` (`None`: emergency or abuse server).
pub(super) fn proxy_version(settings: &Settings, index: Option<usize>) -> Option<ProxyVersion> {
    match index.and_then(|i| settings.servers.get(i)) {
        Some(conf) => match conf.proxy_protocol {
            ServerProxy::Global => settings.proxy_protocol,
            ServerProxy::Off => None,
            ServerProxy::On(v) => Some(v),
        },
        None => settings.proxy_protocol,
    }
}

/// Connects to an upstream, sends the PROXY header if one is configured, and with
/// `upstream_tls` runs the TLS handshake (verifying the server's certificate). The PROXY
/// header goes first, in clear, as PROXY-aware TLS servers expect. Any failure is the
/// server's: the caller blacklists it and fails over. `offer`: what TLS offers in ALPN
/// (`Server::picked_h2` tells what the server picked).
#[allow(clippy::too_many_arguments)]
pub(super) async fn open_upstream(
    state: &State,
    settings: &Settings,
    addr: SocketAddr,
    index: Option<usize>,
    host: Option<&Host>,
    preamble: Preamble,
    opts: SocketOptions,
    offer: Offer,
) -> io::Result<Server> {
    let mut stream = connect(
        addr,
        source_for(settings, preamble.peer),
        timeout(settings),
        opts,
    )
    .await?;
    if let Some(version) = proxy_version(settings, index) {
        send_proxy_header(&mut stream, version, preamble.peer, preamble.destination)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("PROXY protocol header: {e}")))?;
    }
    match &settings.tls_built.upstream {
        None => Ok(Server::Plain(stream)),
        Some(tls) => match tls
            .connect(stream, host, addr.ip(), timeout(settings), offer)
            .await
        {
            Ok(s) => Ok(Server::Tls(Box::new(s))),
            Err(e) => {
                state.counters.upstream_tls_failures.fetch_add(1, Relaxed);
                Err(io::Error::new(e.kind(), format!("TLS: {e}")))
            }
        },
    }
}

/// Writes the PROXY protocol header announcing `client` -> `destination` (`None`, a Unix
/// socket client: the LOCAL / UNKNOWN form) as the first bytes to the server.
async fn send_proxy_header(
    server: &mut TcpStream,
    version: ProxyVersion,
    client: SocketAddr,
    destination: Option<SocketAddr>,
) -> io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let addrs = destination.map(|d| (client, d));
    server
        .write_all(&proxy_protocol::encode(version, addrs))
        .await
}

fn timeout(settings: &Settings) -> Duration {
    Duration::from_secs(settings.timeout.max(1))
}

/// Why [`choose_and_connect`] brought no server.
enum Unserved {
    /// None was left (or this host failed to connect): counted as `no_server`.
    NoServer,
    /// The client left while it waited for room (`queue_timeout`): counted by the queue
    /// as `queue_abandoned`.
    Left,
}

/// Ready when a client waiting for a server (`queue_timeout`) is gone, seen on its socket
/// without taking a byte of it (what it sent is the server's): an error (a reset), or an
/// end with nothing before it (peeked: the client sent nothing and closed). A client that
/// sent something (`sent`: quill already read some of it, its request head or, over TLS,
/// bytes rustls holds; or a peek finds bytes) may have half-closed after its request and
/// still want the answer, as Pen relays it (`nc -N`): from then on only an error counts.
async fn client_left<C: ClientStream>(socket: &C, mut sent: bool) {
    loop {
        // Once bytes wait, readability stays set until they are read, which the relay
        // does, not this: waiting for it again would return at once, forever. Errors only.
        let interest = if sent {
            Interest::ERROR
        } else {
            Interest::READABLE | Interest::ERROR
        };
        let Ok(ready) = socket.ready_for(interest).await else {
            return; // the event loop is shutting down
        };
        if ready.is_error() {
            return;
        }
        // A peek that finds nothing (a readiness gone stale) clears it in the event loop,
        // so that the next wait is for a new event: no loop without one.
        match socket.try_peek(&mut [0u8; 1], &mut |_| false) {
            Ok(0) => return,
            Ok(_) => sent = true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Selection with transparent failover, then the emergency server as a last resort; for
/// a client the ACL denies (`permitted` false), the abuse server. `offer`: what TLS to the
/// server offers in ALPN. `left`: [`client_left`], watched only while the client waits in
/// the queue for room. `conn`: the connection in the registry, if it is in one.
#[allow(clippy::too_many_arguments)]
async fn choose_and_connect<'s>(
    state: &'s State,
    settings: &Settings,
    preamble: Preamble,
    opts: SocketOptions,
    permitted: bool,
    offer: Offer,
    left: impl Future<Output = ()>,
    conn: Option<&ConnInfo>,
) -> Result<(Server, Lease<'s>), Unserved> {
    let peer = preamble.peer;
    // The accept loop keeps this near `pending_max`; a burst accepted before the limit
    // was seen may pass it briefly, which is better than closing those clients.
    let _pending = Connecting::start(state);
    let mut candidates = Candidates::new(state, settings, peer, permitted, conn);
    let mut left = std::pin::pin!(left);
    loop {
        // Only the choice races the client's leaving, not the connect: a choice that does
        // not wait is ready at its first poll, and then `left` is never polled (no system
        // call, no registration: a client pays for the watch only when it waits), and a
        // connect is bounded by `timeout` anyway. Dropped while it waits, the choice gives
        // back the client's place in the queue and counts it as `queue_abandoned`.
        let next = tokio::select! {
            biased;
            next = candidates.next() => next,
            () = &mut left => {
                tracing::debug!(%peer, "client left while waiting for a server");
                return Err(Unserved::Left);
            }
        };
        let Some((c, place)) = next else {
            break;
        };
        let lease = Lease {
            place,
            index: c.index,
        };
        match open_upstream(
            state, settings, c.addr, c.index, c.host, preamble, opts, offer,
        )
        .await
        {
            Ok(stream) => {
                c.server.total.fetch_add(1, Relaxed);
                candidates.served(&c);
                tracing::debug!(%peer, "{c}");
                return Ok((stream, lease));
            }
            Err(e) if is_local_failure(&e) => {
                tracing::warn!(%peer, "cannot connect to {c}: {e}");
                state.counters.no_server.fetch_add(1, Relaxed);
                return Err(Unserved::NoServer);
            }
            Err(e) => {
                drop(lease);
                candidates.failed(&c, &e);
            }
        }
    }
    state.counters.no_server.fetch_add(1, Relaxed);
    tracing::debug!(%peer, "no server available: closing the client");
    Err(Unserved::NoServer)
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::task::Waker;

    use super::*;

    async fn accepted(listener: &TcpListener) -> TcpStream {
        let (sock, _) = listener.accept().await.unwrap();
        Stream::forget_readable(&sock);
        sock
    }

    #[tokio::test]
    async fn a_new_client_is_read_when_the_event_loop_says_so() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let sock = accepted(&listener).await;
        // Silent so far: tokio's assumption is gone, so no read is tried.
        let mut cx = Context::from_waker(Waker::noop());
        assert!(Stream::poll_read_ready(&sock, &mut cx).is_pending());
        client.write_all(b"request").unwrap();
        sock.readable().await.unwrap();
        assert_eq!(sock.try_read(&mut [0; 16]).unwrap(), 7);
    }

    #[tokio::test]
    async fn a_client_that_spoke_before_its_accept_is_read_all_the_same() {
        // Its bytes came before the socket was registered: the registration reports them.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.write_all(b"early").unwrap();
        let sock = accepted(&listener).await;
        tokio::time::timeout(Duration::from_secs(10), sock.readable())
            .await
            .expect("the bytes sent before the accept were announced")
            .unwrap();
        assert_eq!(sock.try_read(&mut [0; 16]).unwrap(), 5);
    }
}
