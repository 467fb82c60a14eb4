//! The UDP data plane (`-U`): datagrams balanced per client flow.
//!
//! A flow is one client address and port. Its first datagram runs the same admission and
//! selection as a TCP connection (`conn_max`, client ACL → abuse server or drop, Pen's
//! [`Selector`] with tracking, `-r`, `-h`, weight, prio, server ACLs and limits, then the
//! emergency server), and opens an upstream socket *connected* to the chosen server. The
//! client's datagrams go out on that socket; the server's replies come back on it (the
//! kernel filters out anyone else) and leave through the listening socket, from the address
//! and port the client sent to. quill never looks inside a datagram: any bytes, of any
//! length from 0 to 65,507, are passed on whole.
//!
//! One [`serve`] runs per event loop, on its own SO_REUSEPORT socket. The kernel hashes a
//! client's address and port to one of those sockets, so every datagram of a flow reaches
//! the same loop: the flow table is per loop, a plain `HashMap` without a lock. Each flow
//! has a small task that waits for replies and for its timer; the loop's main task reads
//! the listening socket in batches of [`LISTEN_BATCH`] (`recvmmsg`) and sends the datagrams
//! of each flow in the batch on at once, in order, with one `sendmmsg` on the flow's
//! socket. A flow's task reads its replies the same way (up to [`REPLY_BATCH`]) and sends
//! them to the client with one `sendmmsg`. Receive buffers are allocated once per loop
//! (the flows of a loop share one); nothing is allocated per datagram. Sockets are
//! registered for readability only. A loop that is busy polls instead of sleeping between
//! datagrams (see [`Load`](super::polling::Load)); an idle one sleeps.
//!
//! A client hash table keyed by what clients send is a target for collisions, so the flow
//! table keeps std's randomly keyed SipHash.
//!
//! A flow ends:
//! * when it has been silent in both directions for `udp_idle_timeout` seconds;
//! * when its server fails: the connected socket reports ICMP port/host unreachable
//!   (ECONNREFUSED...; the flow's task waits for the socket's error readiness too, so the
//!   refusal is read as soon as it arrives), or a datagram went unanswered for `timeout`
//!   seconds. The server is then blacklisted for `blacklist` seconds, and the flow's next
//!   datagram starts a new flow, which selection sends to another server. A refused new
//!   flow's first datagram (kept until the first answer, up to [`RETRY_MAX`] bytes) is
//!   sent on at once that way, so a client that does not retry loses nothing. A datagram
//!   left unanswered while its server answers other flows ends the flow without
//!   blacklisting (the server dropped that one: one client must not be able to take every
//!   server out of use);
//! * when its server is out of use (drained, blacklisted, down) and a datagram of the
//!   client comes while the flow waits for no answer: the datagram starts a new flow on a
//!   server in use (with none, the flow stays);
//! * when `conn_max` flows are open and a new client comes: the loop's oldest flows that
//!   wait for no answer make room (a sixteenth of them at a time);
//! * at shutdown: at once if it is waiting for no answer, otherwise when the answer comes or
//!   the answer timeout passes;
//! * at `close N` (with a control socket, flows are numbered in the registry as TCP
//!   connections are, and `connections` lists them): the request goes to the flow's event
//!   loop, which ends it as an expiry would. Only the loop may end a flow of its table:
//!   aborting the flow's task from elsewhere would leave its entry behind, and the client's
//!   next datagrams would go to a socket nobody reads.
//!
//! Flows are counted in `State::active` (so `conn_max` bounds them) and in their server's
//! connection count (so limits, weights and `prio` see them).
//!
//! With `udp_responses N`, a flow also ends once its server has sent N datagrams for each
//! of the client's (a DNS client that takes a new port for each query would otherwise
//! leave a flow behind per query), and its socket, connected and registered, waits in a
//! small per-loop stock of [`Spares`] for the next flow to the same server: a flow that
//! lives for one query costs no `socket`, `connect`, `epoll_ctl` and `close`. A spare
//! socket that something reached meanwhile (a stray answer, an ICMP error) is closed, never
//! handed on: a flow never sees what was meant for another.
//!
//! With `udp_offload`, a flow answered [`OFFLOAD_AFTER`] times is handed to the kernel
//! (`proxy::offload`): its datagrams and answers no longer reach this module, and the
//! flow's timer reads the kernel's counters into the fields the rules above look at (last
//! activity, the oldest unanswered datagram, bytes), so every rule holds, up to one timer
//! period late. Whatever ends or moves a flow takes it back from the kernel first.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::io::{self, ErrorKind};
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::io::Interest;
use tokio::sync::watch;
use tokio::task::AbortHandle;

use super::offload::{self, Counters, FlowAddrs, Offload};
use super::polling::Load;
use super::registry::{self, LoopCloses, Registered, Ticket};
use crate::balance::{clock, Choice, Place, Selector, ServerState};
use crate::net::udp::{self as sock, Received, RecvBatch, UdpListener};
use crate::settings::Settings;
use crate::state::State;

/// Datagrams read from the listening socket per system call.
pub const LISTEN_BATCH: usize = 32;
/// Replies read from one upstream socket per system call.
pub const REPLY_BATCH: usize = 8;
/// Batches read in a row before letting the loop's other tasks (the flows) run.
const BUDGET: usize = 8;
/// A new flow keeps a copy of its first datagram, if at most this long, until the server
/// answers: a server that refuses it (ICMP port unreachable) is blacklisted and the copy
/// goes to the next server, so the client's first query is not lost. DNS queries and
/// most other request datagrams fit; what does not is left to the client's retry.
const RETRY_MAX: usize = 2048;

/// Which upstream a flow uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Upstream {
    Server(usize),
    Emergency,
    Abuse,
}

/// One client flow, shared by the loop's main task (client → server) and the flow's own
/// task (server → client). Only ever touched by the one thread of its event loop.
struct Flow {
    client: SocketAddr,
    /// The address the client sent to, as the replies' source (pktinfo listeners only).
    local: Option<IpAddr>,
    /// Connected to the server; registered for readability only (a UDP send never waits,
    /// so write readiness would only be wake-ups for nothing). Shared only with the loop's
    /// [`Spares`] once the flow has ended with every answer in.
    sock: Rc<AsyncFd<std::net::UdpSocket>>,
    /// Where the socket may go when the flow ends with every answer in (`None`: it cannot
    /// serve another client, e.g. bound to this client's address by `transparent`).
    spare_key: Option<SpareKey>,
    upstream: Upstream,
    /// Copied from the settings snapshot when the flow started.
    idle_ms: u64,
    /// `udp_responses`: answers owed for each datagram sent; 0 = the flow never ends
    /// for having been answered.
    responses: u32,
    /// Answers still owed (with `responses`): the flow ends when they have all come.
    owed: Cell<u64>,
    answer_ms: u64,
    blacklist_secs: u64,
    /// `clock::now_ms()` of the last datagram in either direction.
    last_active: Cell<u64>,
    /// `clock::now_ms()` of the oldest datagram sent since the last reply; 0 = none.
    awaiting_since: Cell<u64>,
    /// The first datagram, until the first answer (at most [`RETRY_MAX`] bytes).
    first: RefCell<Option<Box<[u8]>>>,
    /// Bytes not yet added to the server's totals (added on the timer and at the end).
    bytes_up: Cell<u64>,
    bytes_down: Cell<u64>,
    /// The flow's place on its server, counted in the server's connections until the
    /// flow ends.
    place: Place<'static>,
    /// Its entry in the registry of open connections (`connections`, `close N`), when
    /// quill keeps one; it leaves the registry as the flow drops.
    registered: Option<Registered>,
    /// Batches of answers relayed or counted: a flow is handed to the kernel
    /// (`udp_offload`) at its [`OFFLOAD_AFTER`]th, when it has shown it is a conversation.
    answers: Cell<u32>,
    /// Whether the flow was offered to the kernel already (once: a full map or an IPv6
    /// flow is not asked again at every answer).
    offer_made: Cell<bool>,
    /// While the kernel carries the flow: its entries and what was last read of them.
    offloaded: RefCell<Option<Offloaded>>,
    state: &'static State,
}

/// Answers after which a flow is handed to the kernel: a one-query flow (a DNS client
/// that takes a new port for each query) would only pay for writing and removing entries.
const OFFLOAD_AFTER: u32 = 2;

/// A flow the kernel carries (`proxy::offload`).
struct Offloaded {
    offload: Arc<Offload>,
    addrs: FlowAddrs,
    /// The counters as last read, to add only what is new.
    seen: Counters,
}

impl Flow {
    fn server_state(&self) -> &'static ServerState {
        self.place.server()
    }

    /// Its number in the registry of open connections, if it has one.
    fn id(&self) -> Option<u64> {
        self.registered.as_ref().map(|r| r.info.id)
    }

    /// `count` datagrams of `len` bytes in all went to the server at `now`.
    fn sent(&self, now: u64, count: usize, len: usize) {
        if count == 0 {
            return;
        }
        let owed = (count as u64).saturating_mul(u64::from(self.responses));
        self.owed.set(self.owed.get().saturating_add(owed));
        self.last_active.set(now);
        if self.awaiting_since.get() == 0 {
            self.awaiting_since.set(now);
        }
        self.bytes_up.set(self.bytes_up.get() + len as u64);
    }

    /// The server answered at `now` with `count` datagrams of `bytes` in all.
    fn answered(&self, now: u64, count: u64, bytes: u64) {
        self.owed.set(self.owed.get().saturating_sub(count));
        let server = self.server_state();
        if server.last_answer.load(Relaxed) < now {
            server.last_answer.store(now, Relaxed);
        }
        // A server a failure blacklisted that answers (a flow tried it with nothing else
        // left, see `Worker::choose`) is back: in use for every client at once. Of loops
        // lifting it together, the one that found it blacklisted says so.
        if let Upstream::Server(i) = self.upstream {
            if server.is_blacklisted(now)
                && !server.blacklisted_by_hand.load(Relaxed)
                && !server.blacklist(now, 0)
            {
                tracing::warn!("server {i} answers again: no longer blacklisted");
                self.state.servers.changed.notify_waiters();
            }
        }
        self.last_active.set(self.last_active.get().max(now));
        self.awaiting_since.set(0);
        if self.first.borrow().is_some() {
            self.first.replace(None);
        }
        self.bytes_down.set(self.bytes_down.get() + bytes);
        self.answers.set(self.answers.get().saturating_add(1));
    }

    /// Hands the flow to the kernel, if `offload` runs, the flow has been answered
    /// [`OFFLOAD_AFTER`] times and was not offered yet. `quill` is the listener's address.
    /// A flow of `udp_responses` ends when answered: never carried. Nor is a flow whose
    /// server is out of use (it moves at its client's next datagram, or stays in quill
    /// while there is nowhere to move: it is offered again once its server is back).
    fn offer(&self, offload: &Arc<Offload>, quill: SocketAddr) {
        if self.offer_made.get() || self.answers.get() < OFFLOAD_AFTER || self.responses > 0 {
            return;
        }
        if self.taken_out(clock::now_ms()) {
            return;
        }
        self.offer_made.set(true);
        let sock = self.sock.get_ref();
        let quill = SocketAddr::new(self.local.unwrap_or(quill.ip()), quill.port());
        let addrs = match (sock.local_addr(), sock.peer_addr()) {
            (Ok(socket), Ok(server)) => FlowAddrs::new(self.client, quill, socket, server),
            _ => None,
        };
        let Some(addrs) = addrs else {
            return;
        };
        match offload.install(&addrs) {
            Ok(()) => {
                tracing::debug!(client = %self.client, "udp flow offloaded");
                self.state.counters.udp_offloaded.fetch_add(1, Relaxed);
                self.state.counters.udp_carried.fetch_add(1, Relaxed);
                self.offloaded.replace(Some(Offloaded {
                    offload: Arc::clone(offload),
                    addrs,
                    seen: Counters::default(),
                }));
            }
            Err(e) => warn_offload(&e, clock::now_ms()),
        }
    }

    /// Brings the flow up to date with what the kernel carried for it (on its timer).
    fn sync_offloaded(&self, now: u64) {
        let read = {
            let mut offloaded = self.offloaded.borrow_mut();
            let Some(o) = offloaded.as_mut() else {
                return;
            };
            o.offload
                .counters(&o.addrs)
                .map(|c| (std::mem::replace(&mut o.seen, c), c))
        };
        if let Some((seen, c)) = read {
            self.fold(seen, c, now);
        }
    }

    /// Takes the flow back from the kernel: its datagrams come to quill again.
    fn take_back(&self, now: u64) {
        let Some(o) = self.offloaded.borrow_mut().take() else {
            return;
        };
        self.state.counters.udp_carried.fetch_sub(1, Relaxed);
        if let Some(c) = o.offload.remove(&o.addrs) {
            self.fold(o.seen, c, now);
        }
    }

    /// Adds what the kernel counted between two reads, `seen` and `c`: bytes, the last
    /// datagram each way, an answer, the first datagram still unanswered.
    fn fold(&self, seen: Counters, c: Counters, now: u64) {
        let mono = offload::monotonic_ns();
        // The program's clock is CLOCK_MONOTONIC, as `Instant` (and `clock::now_ms`) is.
        let at = |ns: u64| {
            now.saturating_sub(mono.saturating_sub(ns) / 1_000_000)
                .max(1)
        };
        if c.down_packets > seen.down_packets {
            let since = self.awaiting_since.get();
            let answered_at = at(c.last_down_ns);
            self.answered(
                answered_at,
                c.down_packets - seen.down_packets,
                c.down_bytes.saturating_sub(seen.down_bytes),
            );
            // A datagram quill itself sent after that answer still waits for its own.
            if since > answered_at {
                self.awaiting_since.set(since);
            }
        }
        if c.up_packets > seen.up_packets {
            self.last_active
                .set(self.last_active.get().max(at(c.last_up_ns)));
            self.bytes_up
                .set(self.bytes_up.get() + c.up_bytes.saturating_sub(seen.up_bytes));
        }
        if c.awaiting_ns != 0 {
            let since = at(c.awaiting_ns);
            let mine = self.awaiting_since.get();
            self.awaiting_since
                .set(if mine == 0 { since } else { mine.min(since) });
        }
    }

    /// A datagram has waited for an answer longer than the timeout.
    fn answer_overdue(&self, now: u64) -> bool {
        let since = self.awaiting_since.get();
        since != 0 && now.saturating_sub(since) >= self.answer_ms
    }

    /// Its oldest datagram went unanswered for the timeout: the server failed, unless it
    /// answered other clients meanwhile (then the silence is this datagram's: a query the
    /// server chose to drop, which must not let one client take every server out of use).
    fn timed_out(&self) {
        let why = "no answer within the timeout";
        if self.server_state().last_answer.load(Relaxed) >= self.awaiting_since.get() {
            tracing::debug!(client = %self.client, "udp flow ended: {why}; its server answers others");
        } else {
            self.server_failed(&why);
        }
    }

    /// Its server is out of use now (drained, blacklisted, down by its health check).
    fn taken_out(&self, now: u64) -> bool {
        let server = self.server_state();
        matches!(self.upstream, Upstream::Server(_))
            && (server.is_out() || server.is_blacklisted(now))
    }

    /// With `udp_responses`: every datagram sent has had its answers.
    fn all_answered(&self) -> bool {
        self.responses > 0 && self.owed.get() == 0 && self.answers.get() > 0
    }

    fn idle(&self, now: u64) -> bool {
        now.saturating_sub(self.last_active.get()) >= self.idle_ms
    }

    /// When the timer should look at this flow again: at its idle deadline, or when its
    /// oldest unanswered datagram times out, and at least once per answer timeout (a
    /// datagram sent after this point is then found overdue at most one timeout late).
    fn next_check(&self, now: u64) -> u64 {
        let idle_at = self.last_active.get().saturating_add(self.idle_ms);
        let answer_at = match self.awaiting_since.get() {
            0 => now.saturating_add(self.answer_ms),
            since => since.saturating_add(self.answer_ms),
        };
        idle_at.min(answer_at).max(now.saturating_add(1))
    }

    fn flush_bytes(&self) {
        let s = self.server_state();
        let (up, down) = (self.bytes_up.take(), self.bytes_down.take());
        if up > 0 {
            s.bytes_to.fetch_add(up, Relaxed);
        }
        if down > 0 {
            s.bytes_from.fetch_add(down, Relaxed);
        }
    }

    /// The server behind this flow failed: blacklist it (emergency and abuse servers are
    /// not in the table and are only left).
    fn server_failed(&self, why: &dyn std::fmt::Display) {
        match self.upstream {
            Upstream::Server(i) => {
                // The connected socket's peer: the server's address as the flow used it.
                let addr = self.sock.get_ref().peer_addr().map(|a| format!(" ({a})"));
                self.state.server_failed(
                    i,
                    self.blacklist_secs,
                    format_args!(
                        "server {i}{} failed for udp client {}: {why}",
                        addr.as_deref().unwrap_or(""),
                        self.client
                    ),
                );
            }
            other => tracing::info!(
                "{other:?} server failed for udp client {}: {why}",
                self.client
            ),
        }
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.take_back(clock::now_ms());
        self.flush_bytes();
        // The place is given back as the fields drop.
        self.state.active.fetch_sub(1, Relaxed);
    }
}

struct Entry {
    flow: Rc<Flow>,
    task: AbortHandle,
}

/// The state of one event loop.
struct Worker {
    state: &'static State,
    listener: AsyncFd<std::net::UdpSocket>,
    flows: RefCell<HashMap<SocketAddr, Entry>>,
    /// Receive buffers for replies, shared by the flows of this loop (one runs at a time).
    replies: RefCell<RecvBatch<REPLY_BATCH>>,
    stopping: Cell<bool>,
    /// New flows that may still come in over `conn_max`: flows ended by
    /// [`Worker::make_room`] whose places are being given back.
    room: Cell<usize>,
    /// `clock::now_ms()` when [`Worker::make_room`] last found no flow to end: it looks
    /// again only [`ROOM_LOOK_MS`] later, so that a flood of new clients while every flow
    /// waits for an answer does not walk the whole table at each datagram.
    no_room_at: Cell<u64>,
    /// `close N` requests for the flows of this loop's table.
    closes: Arc<LoopCloses>,
    /// The kernel path for flows (`udp_offload`), with the listener's address.
    offload: Option<(Arc<Offload>, SocketAddr)>,
    /// Sockets of flows that ended with every answer in, for the next flows.
    spares: Spares,
    /// Whether a client's datagram came since [`Worker::tend`] last looked.
    busy: Cell<bool>,
    /// Wakes [`Worker::tend`] when it rests and a datagram comes.
    rested: tokio::sync::Notify,
}

/// How long after finding no flow to end [`Worker::make_room`] looks again.
const ROOM_LOOK_MS: u64 = 10;

/// What a spare socket can serve: flows to one server address from one source address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SpareKey {
    server: SocketAddr,
    source: Option<IpAddr>,
}

/// Sockets of flows that ended with every answer in (`udp_responses`), connected and
/// registered, kept for the loop's next flows to the same server. At most [`SPARES_MAX`]
/// per server: enough for the flows a loop has open at once at tens of thousands of
/// one-query flows a second; more are closed. Each [`Spares::trim`] (every
/// [`SPARES_TRIM_TICKS`] seconds) closes those the seconds since the last did not need, so
/// a burst's sockets, and those of a server a reload took away, do not stay open.
struct Spares {
    stock: RefCell<HashMap<SpareKey, Stock>>,
    /// A waker that does nothing, to look at a spare socket's readiness.
    look: std::task::Waker,
}

/// The spare sockets to one server, the oldest first.
#[derive(Default)]
struct Stock {
    socks: Vec<Rc<AsyncFd<std::net::UdpSocket>>>,
    /// Sockets taken since the last [`Spares::trim`]: as many are kept at the next.
    taken: usize,
}

/// Wakes nothing: a spare socket's readiness is looked at, never waited for.
struct NoWake;

impl std::task::Wake for NoWake {
    fn wake(self: Arc<Self>) {}
}

/// Spare sockets kept per server and event loop.
const SPARES_MAX: usize = 64;

impl Spares {
    fn new() -> Spares {
        Spares {
            stock: RefCell::default(),
            look: Arc::new(NoWake).into(),
        }
    }

    fn put(&self, key: SpareKey, sock: Rc<AsyncFd<std::net::UdpSocket>>) {
        let mut spares = self.stock.borrow_mut();
        let stock = spares.entry(key).or_default();
        if stock.socks.len() < SPARES_MAX {
            stock.socks.push(sock);
        }
    }

    /// A spare socket for `key` that no flow holds any more and nothing reached since its
    /// flow ended; the others are closed.
    fn take(&self, key: &SpareKey) -> Option<Rc<AsyncFd<std::net::UdpSocket>>> {
        let mut spares = self.stock.borrow_mut();
        let stock = spares.get_mut(key)?;
        while let Some(sock) = stock.socks.pop() {
            if Rc::strong_count(&sock) == 1 && untouched(&sock, &self.look) {
                stock.taken += 1;
                return Some(sock);
            }
        }
        None
    }

    /// Closes, for each server, the spare sockets beyond those taken since the last trim
    /// (the oldest first), and forgets servers with none left: after a trim period with no
    /// flow to a server (it went quiet, or a reload took it away), its spares are closed.
    fn trim(&self) {
        self.stock.borrow_mut().retain(|_, stock| {
            let excess = stock.socks.len().saturating_sub(stock.taken);
            stock.socks.drain(..excess);
            let used = stock.taken > 0;
            stock.taken = 0;
            used || !stock.socks.is_empty()
        });
    }

    fn is_empty(&self) -> bool {
        self.stock.borrow().is_empty()
    }

    fn clear(&self) {
        self.stock.borrow_mut().clear();
    }
}

/// Whether nothing is waiting on a spare socket: no datagram (a server's answer beyond
/// those counted, a late one) and no error. Its readiness was cleared when its flow read
/// its last answers, and the event loop has set it again if anything came since: looked
/// at without a system call.
fn untouched(sock: &AsyncFd<std::net::UdpSocket>, look: &std::task::Waker) -> bool {
    let ready = sock.ready(Interest::READABLE | Interest::ERROR);
    let mut ready = std::pin::pin!(ready);
    let mut cx = std::task::Context::from_waker(look);
    ready.as_mut().poll(&mut cx).is_pending()
}

/// A socket for a new flow: a spare one, or one just made (not registered yet).
enum Connected {
    Spare(Rc<AsyncFd<std::net::UdpSocket>>),
    New(std::net::UdpSocket),
}

/// A new flow's upstream, as selection found it.
struct Chosen {
    sock: Connected,
    spare_key: Option<SpareKey>,
    upstream: Upstream,
    place: Place<'static>,
}

impl Chosen {
    fn new(
        (sock, spare_key): (Connected, Option<SpareKey>),
        upstream: Upstream,
        place: Place<'static>,
    ) -> Chosen {
        Chosen {
            sock,
            spare_key,
            upstream,
            place,
        }
    }
}

/// Whether a send or receive error on a connected upstream socket means the server (or
/// the way to it) is gone, as opposed to a local, passing condition.
fn is_server_failure(e: &io::Error) -> bool {
    use rustix::io::Errno;
    matches!(e.kind(), ErrorKind::ConnectionRefused)
        || [Errno::HOSTUNREACH, Errno::NETUNREACH, Errno::HOSTDOWN]
            .iter()
            .any(|errno| e.raw_os_error() == Some(errno.raw_os_error()))
}

/// Errors of the local system (descriptors, memory), which say nothing about a server.
fn is_local_shortage(e: &io::Error) -> bool {
    use rustix::io::Errno;
    [Errno::MFILE, Errno::NFILE, Errno::NOBUFS, Errno::NOMEM]
        .iter()
        .any(|errno| e.raw_os_error() == Some(errno.raw_os_error()))
}

/// Starts one event loop thread per listener, each a current-thread runtime serving
/// [`serve`] in a `LocalSet`, as the TCP loops do. The threads run until the process ends;
/// after `shutdown` their flows wind down and `State::active` falls to 0.
pub fn spawn_loops(
    state: &Arc<State>,
    listeners: Vec<UdpListener>,
    shutdown: &watch::Receiver<bool>,
    offload: Option<Arc<Offload>>,
) -> io::Result<Vec<std::thread::JoinHandle<()>>> {
    let mut threads = Vec::with_capacity(listeners.len());
    for (i, listener) in listeners.into_iter().enumerate() {
        let state = Arc::clone(state);
        let stop = shutdown.clone();
        let offload = offload.clone();
        let rt = crate::proxy::poll_before_sleep::event_loop_runtime(
            &state,
            crate::proxy::poll_before_sleep::Opens::AfterRequests,
        )?;
        let thread = std::thread::Builder::new()
            .name(format!("quill-udp-{i}"))
            .spawn(move || {
                let local = tokio::task::LocalSet::new();
                local.block_on(&rt, async move {
                    tokio::task::spawn_local(crate::proxy::poll_before_sleep::keeper());
                    // A task of its own, as the TCP loops' accept loop (see `daemon`): the
                    // future given to `block_on` is polled again at every flow task's
                    // wake-up.
                    tokio::task::spawn_local(async move {
                        if let Err(e) = serve(state, listener, stop, offload).await {
                            tracing::error!("udp event loop {i}: {e}");
                        }
                    });
                    // Let the flows still waiting for an answer finish (bounded by main).
                    std::future::pending::<()>().await;
                });
            })?;
        threads.push(thread);
    }
    Ok(threads)
}

/// Serves UDP flows on `listener` until `shutdown` turns true; then lets the flows that
/// wait for an answer finish (bounded by the answer timeout) and ends the others.
pub async fn serve(
    state: Arc<State>,
    listener: UdpListener,
    mut shutdown: watch::Receiver<bool>,
    offload: Option<Arc<Offload>>,
) -> io::Result<()> {
    let pktinfo = listener.pktinfo;
    let offload = match offload {
        Some(o) => Some((o, listener.socket.local_addr()?)),
        None => None,
    };
    // The state lives as long as the process (as for the TCP loops): each flow's place
    // borrows it without a reference count.
    let state: &'static State = Box::leak(Box::new(state));
    let worker = Rc::new(Worker {
        state,
        listener: sock::register_readable(listener.socket)?,
        flows: RefCell::new(HashMap::new()),
        replies: RefCell::new(RecvBatch::new(false)),
        stopping: Cell::new(false),
        room: Cell::new(0),
        no_room_at: Cell::new(0),
        closes: Arc::default(),
        offload,
        spares: Spares::new(),
        busy: Cell::new(false),
        rested: tokio::sync::Notify::new(),
    });
    if state.registry.is_some() {
        tokio::task::spawn_local(Rc::clone(&worker).serve_closes());
    }
    let pace = tokio::task::spawn_local(Rc::clone(&worker).tend());
    let mut batch: Box<RecvBatch<LISTEN_BATCH>> = Box::new(RecvBatch::new(pktinfo));
    let mut load = Load::new(super::polling::UDP_SHARE);
    // Made once: a `changed()` made in each turn would register with the channel and leave
    // it again for every datagram that wakes the loop (with the readiness below, ≈ 500 of
    // 7,900 instructions a query at low rates, where each query is a turn of its own).
    let stop = shutdown.changed();
    tokio::pin!(stop);
    // The listener's reserved reader slot, not a waiter queued and unqueued each turn.
    let readable = || std::future::poll_fn(|cx| worker.listener.poll_read_ready(cx));
    loop {
        // The listener first: `stop` is then looked at only when there is nothing to read,
        // once a query instead of twice (≈ 125 of 7,300 instructions a query at low rates).
        let mut guard = if load.spinning() {
            tokio::select! {
                biased;
                g = readable() => g?,
                _ = &mut stop => break,
                () = tokio::task::yield_now() => continue,
            }
        } else {
            tokio::select! {
                biased;
                g = readable() => g?,
                _ = &mut stop => break,
            }
        };
        let woke = Instant::now();
        let mut rounds = 0;
        let more = loop {
            let result = guard.try_io(|fd| {
                let n = batch.recv(fd.get_ref())?;
                // The loop's work, for its busy-polling trials: datagrams in.
                super::polling::moved(n as u64);
                if n > 0 {
                    // Sent on below: answers may come within a `poll_before_sleep` window.
                    super::poll_before_sleep::requested();
                }
                if n < LISTEN_BATCH {
                    // The queue is empty: say so, so that the event loop's cached
                    // readiness is cleared without another (empty) recvmmsg.
                    return Err(ErrorKind::WouldBlock.into());
                }
                Ok(n)
            });
            worker.datagrams(&batch, clock::now_ms());
            match result {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.kind() == ErrorKind::Interrupted => {}
                Ok(Err(e)) => {
                    tracing::warn!("udp receive failed: {e}");
                    break false;
                }
                // Drained; readiness cleared.
                Err(_) => break false,
            }
            rounds += 1;
            if rounds >= BUDGET {
                break true;
            }
        };
        drop(guard);
        load.worked(woke);
        if more {
            // Let the flows relay their replies before reading on.
            tokio::task::yield_now().await;
            // A flood keeps the listener readable, and the selects above would never
            // come to `stop`: look at it once a full batch.
            let stopped =
                std::future::poll_fn(|cx| Poll::Ready(Future::poll(stop.as_mut(), cx).is_ready()))
                    .await;
            if stopped {
                break;
            }
        }
    }
    pace.abort();
    worker.stop();
    Ok(())
}

/// How far ahead [`Worker::tend`] keeps its timer: no more than the shortest time a
/// flow's timer can be set for.
const AHEAD_MS: u64 = 1_000;

/// Every how many of [`Worker::tend`]'s ticks the spare sockets are trimmed: a spare not
/// needed for about five seconds is closed.
const SPARES_TRIM_TICKS: u32 = 5;

impl Worker {
    /// While the loop has flows or clients, keeps a timer of the event loop always due
    /// within [`AHEAD_MS`], before any flow's first look at itself (a flow's timer is at
    /// least 1 s away: `-t` and `udp_idle_timeout` are whole seconds). tokio's timer wakes
    /// its own event loop through its eventfd whenever a timer is set earlier than every
    /// pending one: without this, each flow that ends before the next starts
    /// (`udp_responses`: a query at a time) cost a `write` to the eventfd and a turn of the
    /// loop for nothing. It also trims the spare sockets. A second with no flow, no spare
    /// socket and no client datagram rests it until the next datagram: an idle loop is not
    /// woken for it.
    async fn tend(self: Rc<Self>) {
        let mut ticks: u32 = 0;
        loop {
            tokio::time::sleep(Duration::from_millis(AHEAD_MS)).await;
            ticks = ticks.wrapping_add(1);
            if ticks % SPARES_TRIM_TICKS == 0 {
                self.spares.trim();
            }
            let quiet = !self.busy.replace(false);
            if quiet && self.flows.borrow().is_empty() && self.spares.is_empty() {
                self.rested.notified().await;
            }
        }
    }

    /// A client's datagram came: [`Worker::tend`] ticks on, or again. Called once a
    /// batch, before any flow it starts sets its timer.
    fn stir(&self) {
        if !self.busy.replace(true) {
            // At most once a tick; with no task waiting, a permit its next rest takes.
            self.rested.notify_one();
        }
    }

    /// A batch of client datagrams: those of one flow go out together, in order, with one
    /// `sendmmsg` on the flow's socket.
    fn datagrams<const N: usize>(self: &Rc<Self>, batch: &RecvBatch<N>, now: u64) {
        let n = batch.len();
        if n > 0 {
            self.stir();
        }
        let mut done = [false; N];
        let mut group: [&[u8]; N] = [&[]; N];
        for i in 0..n {
            if done[i] {
                continue;
            }
            let Some((first, data)) = batch.get(i) else {
                continue;
            };
            group[0] = data;
            let mut k = 1;
            for (j, taken) in done.iter_mut().enumerate().take(n).skip(i + 1) {
                if let Some((_, d)) = batch.get(j).filter(|(r, _)| r.from == first.from) {
                    *taken = true;
                    if let Some(slot) = group.get_mut(k) {
                        *slot = d;
                        k += 1;
                    }
                }
            }
            self.flow_datagrams(first, &group[..k], now);
        }
    }

    /// Datagrams of one client, in order: on its flow, or on a new one.
    fn flow_datagrams(self: &Rc<Self>, r: &Received, datagrams: &[&[u8]], now: u64) {
        let existing = self.flows.borrow().get(&r.from).map(|e| Rc::clone(&e.flow));
        let mut rest = datagrams;
        if let Some(flow) = existing {
            if flow.answer_overdue(now) {
                flow.timed_out();
                self.end(&r.from);
            } else {
                // On a server out of use, the flow moves to one in use (it lives as long as
                // its client sends: a drain or a blacklist would never reach a client that
                // keeps its port, and a one-way sender always waits for an answer); with
                // none in use, it stays.
                if flow.taken_out(now) && self.open_flow(r, rest, now, Opening::Move) {
                    tracing::debug!(client = %r.from, "udp flow moved: its server is out of use");
                    return;
                }
                let (sent, err) = sock::send_many(flow.sock.get_ref(), rest, None);
                flow.sent(now, sent, rest[..sent].iter().map(|d| d.len()).sum());
                rest = &rest[sent..];
                match err {
                    None => return,
                    Some(e) if is_server_failure(&e) => {
                        // The error was reported instead of sending: the datagrams are
                        // still ours, and go to the next server below.
                        flow.server_failed(&e);
                        self.end(&r.from);
                    }
                    Some(e) => {
                        tracing::debug!(client = %r.from, "{} datagram(s) dropped: {e}", rest.len());
                        return;
                    }
                }
            }
        }
        self.open_flow(r, rest, now, Opening::New);
    }

    /// Starts a flow for the client of `r` (in place of its flow, if it has one) and sends
    /// `datagrams` on it; whether a server took it.
    fn open_flow(
        self: &Rc<Self>,
        r: &Received,
        datagrams: &[&[u8]],
        now: u64,
        opening: Opening,
    ) -> bool {
        let Some(flow) = self.new_flow(r, now, opening) else {
            return false;
        };
        if let Some(first) = datagrams.first().filter(|d| d.len() <= RETRY_MAX) {
            flow.first.replace(Some(Box::from(*first)));
        }
        let (sent, err) = sock::send_many(flow.sock.get_ref(), datagrams, None);
        flow.sent(now, sent, datagrams[..sent].iter().map(|d| d.len()).sum());
        if let Some(e) = err {
            tracing::debug!(client = %r.from, "{} datagram(s) dropped: {e}", datagrams.len() - sent);
        }
        true
    }

    /// Ends the flows `close N` asks for, for the life of the event loop.
    async fn serve_closes(self: Rc<Self>) {
        loop {
            self.closes.requested().await;
            for (_, id) in self.closes.take() {
                // Not found: the flow ended meanwhile (or left the table to wait for its
                // last answers, and is closed through its task then).
                let client = self
                    .flows
                    .borrow()
                    .iter()
                    .find(|(_, e)| e.flow.id() == Some(id))
                    .map(|(client, _)| *client);
                if let Some(client) = client {
                    tracing::debug!(%client, "udp flow {id} closed (close {id})");
                    self.end(&client);
                }
            }
        }
    }

    /// Removes the flow of `client` and stops its task.
    fn end(&self, client: &SocketAddr) {
        let entry = self.flows.borrow_mut().remove(client);
        if let Some(e) = entry {
            // Now, not as the aborted task drops: a new flow of the client may start at
            // once, and the kernel must not carry its datagrams to the old server.
            e.flow.take_back(clock::now_ms());
            e.task.abort();
        }
    }

    /// Removes `flow` from the table, if it is still the flow of its client.
    fn remove(&self, flow: &Rc<Flow>) {
        let mut flows = self.flows.borrow_mut();
        if flows
            .get(&flow.client)
            .is_some_and(|e| Rc::ptr_eq(&e.flow, flow))
        {
            flows.remove(&flow.client);
        }
    }

    /// A new flow for the client of `r`: admission, selection, upstream socket, task.
    fn new_flow(self: &Rc<Self>, r: &Received, now: u64, opening: Opening) -> Option<Rc<Flow>> {
        if self.stopping.get() {
            return None;
        }
        let state = self.state;
        let settings = state.settings();
        // Counted like a TCP accept: every new flow, including those refused below (a
        // flow that could not move is not one).
        if opening == Opening::New {
            state.counters.accepted.fetch_add(1, Relaxed);
        }
        let active = state.active.fetch_add(1, Relaxed) + 1;
        if active <= settings.conn_max {
            self.room.set(0);
        } else if !self.make_room(now) {
            state.active.fetch_sub(1, Relaxed);
            state.counters.refused_conn_max.fetch_add(1, Relaxed);
            tracing::debug!(client = %r.from, "udp datagram dropped: conn_max {} reached", settings.conn_max);
            warn_full(settings.conn_max, now);
            return None;
        }
        let ip = r.from.ip().to_canonical();
        let opened = if settings.acls[settings.client_acl.index()].permits(ip) {
            self.choose(&settings, r.from, now, opening)
        } else if let Some(abuse) = &settings.abuse {
            tracing::debug!(client = %r.from, "denied by client_acl {}: sent to the abuse server", settings.client_acl);
            match self.connect(abuse.addr, &settings, r.from) {
                Ok(sock) => Some(Chosen::new(
                    sock,
                    Upstream::Abuse,
                    Place::take(&state.abuse),
                )),
                Err(e) => {
                    tracing::warn!(client = %r.from, "abuse server {}: {e}", abuse.name);
                    None
                }
            }
        } else {
            if opening == Opening::New {
                state.counters.refused_acl.fetch_add(1, Relaxed);
            }
            tracing::debug!(client = %r.from, "denied by client_acl {}", settings.client_acl);
            None
        };
        let Some(Chosen {
            sock,
            spare_key,
            upstream,
            place,
        }) = opened
        else {
            state.active.fetch_sub(1, Relaxed);
            return None;
        };
        place.server().total.fetch_add(1, Relaxed);
        // From here on the flow's Drop gives back what was taken above.
        let sock = match sock {
            Connected::Spare(s) => s,
            Connected::New(s) => match sock::register_readable(s) {
                Ok(s) => Rc::new(s),
                Err(e) => {
                    tracing::warn!("cannot register an upstream udp socket: {e}");
                    state.active.fetch_sub(1, Relaxed);
                    return None;
                }
            },
        };
        let registered = state.registry.as_ref().map(|registry| {
            let registered = registry.register(r.from, now);
            registered.info.set_upstream(match upstream {
                Upstream::Server(i) => registry::Upstream::Server(i),
                Upstream::Emergency => registry::Upstream::Emergency,
                Upstream::Abuse => registry::Upstream::Abuse,
            });
            registered
        });
        let flow = Rc::new(Flow {
            client: r.from,
            local: r.local,
            sock,
            spare_key,
            upstream,
            idle_ms: settings.udp_idle_timeout.saturating_mul(1000).max(1),
            responses: settings.udp_responses,
            owed: Cell::new(0),
            answer_ms: settings.timeout.max(1).saturating_mul(1000),
            blacklist_secs: settings.blacklist,
            last_active: Cell::new(now),
            awaiting_since: Cell::new(0),
            first: RefCell::new(None),
            bytes_up: Cell::new(0),
            bytes_down: Cell::new(0),
            place,
            registered,
            answers: Cell::new(0),
            offer_made: Cell::new(false),
            offloaded: RefCell::new(None),
            state,
        });
        drop(settings);
        tracing::debug!(client = %r.from, "udp flow to {upstream:?}");
        let task =
            tokio::task::spawn_local(run_flow(Rc::clone(self), Rc::clone(&flow), Role::Serving));
        let old = self.flows.borrow_mut().insert(
            r.from,
            Entry {
                flow: Rc::clone(&flow),
                task: task.abort_handle(),
            },
        );
        if let Some(r) = &flow.registered {
            r.info.held_by(Ticket::new(&self.closes, 0));
        }
        if let Some(old) = old {
            old.flow.take_back(now);
            old.task.abort();
            if old.flow.awaiting_since.get() != 0 {
                // It moved with datagrams unanswered: their answers may still come. Out of
                // the table, it is closed through its task.
                let info = old.flow.registered.as_ref().map(|r| Arc::clone(&r.info));
                let task =
                    tokio::task::spawn_local(run_flow(Rc::clone(self), old.flow, Role::Leaving));
                if let Some(info) = info {
                    info.served_by(task.abort_handle());
                }
            }
        }
        if opening == Opening::Move {
            state.counters.accepted.fetch_add(1, Relaxed);
        }
        Some(flow)
    }

    /// `conn_max` flows are open: ends this loop's oldest flows that wait for no answer (a
    /// sixteenth of its flows, at least one), so that new clients are not turned away by
    /// flows that only sit out `udp_idle_timeout` (a DNS client that takes a new port for
    /// each query leaves one behind per query). Whether the new flow may come in: the
    /// ended flows give their places back as their tasks drop, just after.
    fn make_room(&self, now: u64) -> bool {
        if let Some(left) = self.room.get().checked_sub(1) {
            self.room.set(left);
            return true;
        }
        let looked = self.no_room_at.get();
        if looked != 0 && now.saturating_sub(looked) < ROOM_LOOK_MS {
            return false;
        }
        let mut quiet: Vec<(u64, SocketAddr)> = {
            let flows = self.flows.borrow();
            // What the kernel carried is read back on each flow's timer only: brought up
            // to date first, or a flow busy in the kernel would look the most silent (and
            // one whose answer only the kernel saw, still waiting).
            for e in flows.values() {
                e.flow.sync_offloaded(now);
            }
            flows
                .iter()
                .filter(|(_, e)| e.flow.awaiting_since.get() == 0)
                .map(|(client, e)| (e.flow.last_active.get(), *client))
                .collect()
        };
        if quiet.is_empty() {
            self.no_room_at.set(now.max(1));
            return false;
        }
        let n = (self.flows.borrow().len() / 16).clamp(1, quiet.len());
        if n < quiet.len() {
            quiet.select_nth_unstable(n - 1);
        }
        for (_, client) in &quiet[..n] {
            self.end(client);
        }
        tracing::debug!("conn_max reached: {n} udp flow(s) waiting for no answer ended");
        self.state.counters.udp_evicted.fetch_add(n as u64, Relaxed);
        self.room.set(n - 1);
        true
    }

    /// A socket to `addr` for `client`'s flow: a spare one if the loop has one, else a new
    /// one; and where it may go when the flow ends (sockets bound to the client's own
    /// address by `transparent` serve no one else).
    fn connect(
        &self,
        addr: SocketAddr,
        settings: &Settings,
        client: SocketAddr,
    ) -> io::Result<(Connected, Option<SpareKey>)> {
        let key = (!settings.transparent).then(|| SpareKey {
            server: SocketAddr::new(addr.ip().to_canonical(), addr.port()),
            source: settings.source.map(|ip| ip.to_canonical()),
        });
        if let Some(sock) = key.as_ref().and_then(|k| self.spares.take(k)) {
            self.state.counters.udp_reused.fetch_add(1, Relaxed);
            return Ok((Connected::Spare(sock), key));
        }
        let sock = match sock::upstream(addr, settings, client) {
            // Spare sockets hold descriptors outside `conn_max`: out of descriptors, they
            // go before a flow is refused.
            Err(e) if is_local_shortage(&e) && !self.spares.is_empty() => {
                tracing::debug!("{e}: the loop's spare udp sockets closed");
                self.spares.clear();
                sock::upstream(addr, settings, client)
            }
            other => other,
        };
        sock.map(|s| (Connected::New(s), key))
    }

    /// Selection with failover (servers whose socket cannot even be connected), then the
    /// emergency server; the server's place taken in the step that checks its limit.
    fn choose(
        &self,
        settings: &Settings,
        client: SocketAddr,
        now: u64,
        opening: Opening,
    ) -> Option<Chosen> {
        let state = self.state;
        let mut selector = Selector::new(
            settings,
            &state.servers,
            &state.clients,
            &state.cursor,
            client,
            now,
        );
        let mut choice = selector.initial();
        while let Choice::Server(index) = choice {
            let spec = settings.servers.get(index);
            let (Some(addr), Some(server)) =
                (spec.and_then(|s| s.addr()), state.servers.get(index))
            else {
                choice = selector.failover(index);
                continue;
            };
            // Another event loop took the last place since the selector looked.
            let Some(place) = Place::claim(server, selector.limit_of(index)) else {
                choice = selector.lost_race(now);
                continue;
            };
            match self.connect(addr, settings, client) {
                Ok(sock) => {
                    if selector.tracks() {
                        state.clients.record(client.ip().to_canonical(), index, now);
                    }
                    return Some(Chosen::new(sock, Upstream::Server(index), place));
                }
                Err(e) if is_local_shortage(&e) => {
                    tracing::warn!(%client, "cannot open an upstream udp socket: {e}");
                    return None;
                }
                Err(e) => {
                    state.server_failed(
                        index,
                        settings.blacklist,
                        format_args!("server {index} ({addr}) failed: {e}"),
                    );
                    choice = selector.failover(index);
                }
            }
        }
        if let Some(em) = &settings.emergency {
            match self.connect(em.addr, settings, client) {
                Ok(sock) => {
                    tracing::debug!(%client, "emergency server {}", em.name);
                    let place = Place::take(&state.emergency);
                    return Some(Chosen::new(sock, Upstream::Emergency, place));
                }
                Err(e) => tracing::warn!("emergency server {} failed: {e}", em.name),
            }
        }
        // Nothing else left: a server a failure blacklisted is tried anyway (as for TCP,
        // `proxy::candidates`); its first answer puts it back in use (`Flow::answered`).
        // Not to move a flow: it would only move onto such a server.
        if opening == Opening::New {
            while let Some(index) = selector.despite_blacklist() {
                let spec = settings.servers.get(index);
                let (Some(addr), Some(server)) =
                    (spec.and_then(|s| s.addr()), state.servers.get(index))
                else {
                    continue;
                };
                let Some(place) = Place::claim(server, selector.limit_of(index)) else {
                    continue;
                };
                if let Ok(sock) = self.connect(addr, settings, client) {
                    tracing::debug!(%client, "server {index} tried despite its blacklist");
                    return Some(Chosen::new(sock, Upstream::Server(index), place));
                }
            }
        }
        if opening == Opening::New {
            state.counters.no_server.fetch_add(1, Relaxed);
            tracing::debug!(%client, "no server available: udp datagram dropped");
        }
        None
    }

    /// Passes the replies queued on `flow`'s socket to its client, with one `sendmmsg` per
    /// batch (one `sendmsg` per reply on pktinfo listeners, whose source address travels
    /// in a control message). An error is a failure of the server or of the way to it.
    fn relay_replies(
        &self,
        flow: &Flow,
        guard: &mut AsyncFdReadyGuard<'_, std::net::UdpSocket>,
    ) -> io::Result<()> {
        let mut batch = self.replies.borrow_mut();
        for _ in 0..BUDGET {
            let result = guard.try_io(|fd| {
                let n = batch.recv(fd.get_ref())?;
                // The loop's work, for its busy-polling trials: datagrams in.
                super::polling::moved(n as u64);
                if n < REPLY_BATCH {
                    return Err(ErrorKind::WouldBlock.into());
                }
                Ok(n)
            });
            let n = batch.len();
            if n > 0 {
                let mut replies: [&[u8]; REPLY_BATCH] = [&[]; REPLY_BATCH];
                for (slot, (_, data)) in replies.iter_mut().zip(batch.iter()) {
                    *slot = data;
                }
                let replies = &replies[..n];
                let listener = self.listener.get_ref();
                let mut bytes = 0u64;
                if flow.local.is_some() {
                    for data in replies {
                        match sock::send_to(listener, data, flow.client, flow.local) {
                            Ok(_) => bytes += data.len() as u64,
                            Err(e) => tracing::debug!(client = %flow.client, "reply dropped: {e}"),
                        }
                    }
                } else {
                    let (sent, err) = sock::send_many(listener, replies, Some(flow.client));
                    bytes = replies[..sent].iter().map(|d| d.len() as u64).sum();
                    if let Some(e) = err {
                        tracing::debug!(client = %flow.client, "{} reply(ies) dropped: {e}", n - sent);
                    }
                }
                flow.answered(clock::now_ms(), n as u64, bytes);
            }
            match result {
                Ok(Ok(_)) => {}
                Ok(Err(e)) if e.kind() == ErrorKind::Interrupted => {}
                Ok(Err(e)) => return Err(e),
                // Drained; readiness cleared.
                Err(_) => return Ok(()),
            }
        }
        Ok(())
    }

    /// Shutdown: no new flows; flows waiting for no answer end now, the others when their
    /// answer comes or times out.
    fn stop(&self) {
        self.stopping.set(true);
        self.spares.clear();
        // Answers still due come to quill's sockets, where the flows wait for them.
        let now = clock::now_ms();
        for e in self.flows.borrow().values() {
            e.flow.take_back(now);
        }
        self.flows.borrow_mut().retain(|_, e| {
            let keep = e.flow.awaiting_since.get() != 0;
            if !keep {
                e.task.abort();
            }
            keep
        });
    }
}

/// Why a flow is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// A client without one (or whose flow ended): no server for it drops its datagrams.
    New,
    /// A flow moving off a server out of use: with no server for it, it stays.
    Move,
}

/// When [`warn_offload`] last warned (`clock::now_ms()`).
static WARNED_OFFLOAD: AtomicU64 = AtomicU64::new(0);

/// A flow could not be handed to the kernel (its maps full, most likely): it goes on
/// through quill. A warning at most every ten seconds.
fn warn_offload(e: &offload::OffloadError, now: u64) {
    if super::warn_again(&WARNED_OFFLOAD, now, 10_000) {
        tracing::warn!("udp flows stay in quill: {e}");
    }
}

/// When [`warn_full`] last warned (`clock::now_ms()`).
static WARNED_FULL: AtomicU64 = AtomicU64::new(0);

/// New clients' datagrams are being dropped at `conn_max` (every flow waits for an
/// answer): a warning at most every ten seconds, so that a flood does not flood the log.
fn warn_full(conn_max: usize, now: u64) {
    if super::warn_again(&WARNED_FULL, now, 10_000) {
        tracing::warn!(
            "udp datagrams of new clients dropped: {conn_max} flows open (conn_max), each \
             waiting for an answer (counted in quill_connections_refused_total{{reason=\"conn_max\"}})"
        );
    }
}

/// Why a flow's task ended.
enum End {
    Idle,
    /// Every datagram sent had its `udp_responses` answers.
    Answered,
    Stopped,
    /// The server did not answer in time.
    TimedOut,
    /// The flow's socket failed.
    Failed(String),
    /// The server refused (ICMP port or host unreachable, read back as the socket's
    /// error): its first datagram, if still unanswered, goes to the next server.
    Refused(io::Error),
}

/// What a flow's task does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The client's flow: its datagrams go out on it.
    Serving,
    /// A flow its client moved off (its server was taken out of use) while datagrams sent
    /// on it were unanswered: it only passes their answers on, until they have all come,
    /// the answer timeout passes, or [`LEAVE_MS`] — whichever is first. It keeps its place
    /// on the server meanwhile.
    Leaving,
}

/// How long a flow its client moved off waits at most for the answers still due on it:
/// a one-way sender (syslog, with a `-t` of a day) would otherwise hold its drained
/// server's place for the whole answer timeout.
const LEAVE_MS: u64 = 2_000;

/// The task of one flow: replies to the client, idle expiry, answer timeout.
async fn run_flow(worker: Rc<Worker>, flow: Rc<Flow>, role: Role) {
    let left_at = clock::now_ms();
    let deadline = |flow: &Flow| {
        let now = clock::now_ms();
        let mut at = flow.next_check(now);
        if role == Role::Leaving {
            at = at.min(left_at.saturating_add(LEAVE_MS)).max(now + 1);
        }
        tokio::time::Instant::now() + Duration::from_millis(at - now)
    };
    let sleep = tokio::time::sleep_until(deadline(&flow));
    tokio::pin!(sleep);
    let end = loop {
        tokio::select! {
            // ERROR too: an ICMP error queued on the connected socket raises EPOLLERR
            // alone, which readability does not include, and the error is only read back
            // by the next receive. Without it a refusing server was noticed only through
            // the answer timeout or the client's next datagram.
            r = flow.sock.ready(Interest::READABLE | Interest::ERROR) => {
                let mut guard = match r {
                    Ok(g) => g,
                    Err(e) => break End::Failed(e.to_string()),
                };
                match worker.relay_replies(&flow, &mut guard) {
                    Ok(()) => {}
                    Err(e) if is_server_failure(&e) && role == Role::Serving => {
                        break End::Refused(e)
                    }
                    Err(e) => {
                        tracing::debug!(client = %flow.client, "udp flow ended: {e}");
                        break End::Stopped;
                    }
                }
                if flow.all_answered() {
                    break End::Answered;
                }
                if (role == Role::Leaving || worker.stopping.get())
                    && flow.awaiting_since.get() == 0
                {
                    break End::Stopped;
                }
                if let (Role::Serving, Some((offload, quill))) = (role, &worker.offload) {
                    if !worker.stopping.get() {
                        flow.offer(offload, *quill);
                    }
                }
            }
            () = &mut sleep => {
                let now = clock::now_ms();
                flow.sync_offloaded(now);
                flow.flush_bytes();
                if role == Role::Leaving {
                    // Its server is out of use: a silence now says nothing of it.
                    break End::Stopped;
                }
                if flow.answer_overdue(now) {
                    if worker.stopping.get() {
                        break End::Stopped;
                    }
                    break End::TimedOut;
                }
                if flow.idle(now) {
                    break End::Idle;
                }
                // Its server left use: the client's next datagram comes to quill, which
                // moves the flow (see `flow_datagrams`).
                if flow.taken_out(now) && flow.offloaded.borrow().is_some() {
                    flow.take_back(now);
                    flow.offer_made.set(false);
                }
                sleep.as_mut().reset(deadline(&flow));
            }
        }
    };
    match &end {
        End::TimedOut => flow.timed_out(),
        End::Failed(why) => flow.server_failed(why),
        End::Refused(e) => flow.server_failed(e),
        End::Idle => tracing::debug!(client = %flow.client, "udp flow expired"),
        End::Answered => {
            tracing::debug!(client = %flow.client, "udp flow answered");
            flow.state.counters.udp_answered.fetch_add(1, Relaxed);
        }
        End::Stopped => {}
    }
    worker.remove(&flow);
    if let (End::Answered, Some(key)) = (&end, flow.spare_key) {
        if !worker.stopping.get() && flow.offloaded.borrow().is_none() {
            worker.spares.put(key, Rc::clone(&flow.sock));
        }
    }
    if matches!(end, End::Refused(_)) && !worker.stopping.get() {
        // The refused server is blacklisted now, so selection picks the next one.
        if let Some(first) = flow.first.take() {
            let from = Received {
                from: flow.client,
                local: flow.local,
                len: first.len(),
            };
            worker.flow_datagrams(&from, &[&first], clock::now_ms());
        }
    }
}
