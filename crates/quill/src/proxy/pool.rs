//! The upstream pools of request-level proxying: kept-alive HTTP/1.1 connections to
//! servers, reused across client connections and streams. Two kinds, each in its own pool:
//! hyper's (`Conn`, for `proxy::gateway`'s HTTP/1.x clients and upgrades) and raw streams
//! (`proxy::h1_pump::Link`, for HTTP/1.x clients relayed by the byte pump and HTTP/2
//! clients' streams framed by `proxy::h1_client`); the rules below are the same for both.
//!
//! One pool per event loop and kind (a thread-local: a loop's tasks never leave its thread), so
//! taking and returning a connection costs no lock. Invariants: an idle entry's sender was
//! ready when it was put back (its last response was read to the end); a loop keeps at
//! most its share of `upstream_keepalive` idle entries per server for longer than
//! `TRIM_AFTER` (a burst of answers may leave more idle for a moment: closing them at once
//! would make the next burst of requests open as many again); an entry idle longer
//! than `upstream_idle_timeout`, or made to an address the server no longer has, is never
//! handed out (it is dropped, which closes the connection); the sweeper also closes, within
//! a second, the idle connections of a server that drains or left the configuration (its
//! requests in flight finish on theirs).

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::poll_fn;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::thread::LocalKey;
use std::time::{Duration, Instant};

use hyper::client::conn::http1::SendRequest;

use super::gateway::RequestBody;
use super::registry::Upstream;
use crate::balance::ServerState;
use crate::state::State;

/// How long idle connections beyond a loop's share of `upstream_keepalive` are kept.
const TRIM_AFTER: Duration = Duration::from_secs(1);

/// The event loops sharing `upstream_keepalive` (set once at start-up).
static LOOPS: AtomicUsize = AtomicUsize::new(1);

/// Records how many event loops share each server's `upstream_keepalive`.
pub fn set_loops(n: usize) {
    LOOPS.store(n.max(1), Relaxed);
}

/// Where a pooled connection goes: a server of the table, or one of the two extra ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    Server(usize),
    Emergency,
    Abuse,
}

impl From<Target> for Upstream {
    fn from(target: Target) -> Self {
        match target {
            Target::Server(i) => Upstream::Server(i),
            Target::Emergency => Upstream::Emergency,
            Target::Abuse => Upstream::Abuse,
        }
    }
}

/// A map keyed by [`Target`]: a few small integers quill makes itself, so SipHash's keyed
/// resistance to chosen keys buys nothing, and it cost ≈ 500 instructions a request (a
/// take and a put).
pub type ByTarget<V> = HashMap<Target, V, BuildHasherDefault<TargetHasher>>;

/// One multiply per word written (FxHash's), enough to spread a handful of targets.
#[derive(Default)]
pub struct TargetHasher(u64);

impl Hasher for TargetHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }

    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
}

/// A connection to a server that requests can be sent over, one at a time.
pub struct Conn {
    pub sender: SendRequest<RequestBody>,
    /// Requests sent over it so far.
    pub uses: u64,
    /// The server's address when it was made: a server moved by `server N address`
    /// must not get requests meant for its new address over the old connection.
    pub addr: SocketAddr,
    /// False when it began with a PROXY protocol header (one client's): never reused.
    pub poolable: bool,
}

/// A kind of pooled connection.
pub trait Pooled: Sized + 'static {
    /// This loop's pool of the kind.
    fn pool() -> &'static LocalKey<RefCell<Pool<Self>>>;
    /// The server's address when the connection was made: a server moved by
    /// `server N address` must not get requests meant for its new address over the old
    /// connection.
    fn addr(&self) -> SocketAddr;
    /// Requests sent over it so far.
    fn uses(&self) -> u64;
    /// Whether it can take a request now: open, and nothing unasked-for arrived on it.
    fn usable(&mut self) -> bool;
}

impl Pooled for Conn {
    fn pool() -> &'static LocalKey<RefCell<Pool<Self>>> {
        &POOL
    }
    fn addr(&self) -> SocketAddr {
        self.addr
    }
    fn uses(&self) -> u64 {
        self.uses
    }
    fn usable(&mut self) -> bool {
        !self.sender.is_closed() && self.sender.is_ready()
    }
}

/// The rules a connection is put back under (from the settings of the request that used it).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// `upstream_keepalive`, for the whole process.
    pub keepalive: u32,
    pub idle_timeout: Duration,
    /// `upstream_max_requests` (0 = no limit).
    pub max_requests: u64,
}

struct Idle<C> {
    conn: C,
    since: Instant,
    idle_timeout: Duration,
    /// This loop's share of `upstream_keepalive` for the server.
    share: usize,
    gauge: &'static ServerState,
}

/// One event loop's idle connections of one kind, by server.
pub struct Pool<C> {
    idle: ByTarget<Vec<Idle<C>>>,
    /// A sweeper task is running on this loop.
    sweeping: bool,
}

impl<C> Default for Pool<C> {
    fn default() -> Self {
        Pool {
            idle: ByTarget::default(),
            sweeping: false,
        }
    }
}

thread_local! {
    static POOL: RefCell<Pool<Conn>> = RefCell::default();
}

/// The most recently used idle connection to `target` at `addr`, if one is still good.
pub fn take<C: Pooled>(target: Target, addr: SocketAddr) -> Option<C> {
    let now = Instant::now();
    C::pool().with(|pool| {
        let mut pool = pool.borrow_mut();
        let list = pool.idle.get_mut(&target)?;
        while let Some(mut idle) = list.pop() {
            idle.gauge.pool_idle.fetch_sub(1, Relaxed);
            if idle.conn.addr() == addr
                && now.duration_since(idle.since) < idle.idle_timeout
                && idle.conn.usable()
            {
                return Some(idle.conn);
            }
        }
        None
    })
}

/// Whether a connection that served its last request may go back to the pool.
pub fn wanted<C: Pooled>(conn: &C, limits: Limits) -> bool {
    limits.keepalive > 0 && (limits.max_requests == 0 || conn.uses() < limits.max_requests)
}

/// Puts `conn` back once its response has been read to the end, if the server keeps it
/// open and the limits allow; else lets it close.
pub fn give_back(
    state: &'static State,
    mut conn: Conn,
    target: Target,
    server: &'static ServerState,
    limits: Limits,
) {
    if !wanted(&conn, limits) {
        return;
    }
    tokio::task::spawn_local(async move {
        // Ready again only after the response body was read to the end and the server
        // did not ask to close.
        if poll_fn(|cx| conn.sender.poll_ready(cx)).await.is_err() {
            return;
        }
        put(state, conn, target, server, limits);
    });
}

/// Puts `conn`, which can take a request now, among the idle ones (the caller checked
/// [`wanted`]).
pub fn put<C: Pooled>(
    state: &'static State,
    conn: C,
    target: Target,
    server: &'static ServerState,
    limits: Limits,
) {
    let share = limits.keepalive.div_ceil(LOOPS.load(Relaxed).max(1) as u32) as usize;
    let start_sweeper = C::pool().with(|pool| {
        let mut pool = pool.borrow_mut();
        let list = pool.idle.entry(target).or_default();
        server.pool_idle.fetch_add(1, Relaxed);
        list.push(Idle {
            conn,
            since: Instant::now(),
            idle_timeout: limits.idle_timeout,
            share: share.max(1),
            gauge: server,
        });
        !std::mem::replace(&mut pool.sweeping, true)
    });
    if start_sweeper {
        tokio::task::spawn_local(sweep::<C>(state));
    }
}

/// Whether idle connections to `target` at `addr` may still serve: the server is still
/// configured at that address and not draining.
fn still_wanted(
    state: &State,
    settings: &crate::settings::Settings,
    target: Target,
    addr: SocketAddr,
) -> bool {
    match target {
        Target::Server(i) => {
            settings.servers.get(i).and_then(|s| s.addr()) == Some(addr)
                && !state
                    .servers
                    .get(i)
                    .is_some_and(|s| s.draining.load(Relaxed))
        }
        Target::Emergency => settings.emergency.as_ref().map(|e| e.addr) == Some(addr),
        Target::Abuse => settings.abuse.as_ref().map(|e| e.addr) == Some(addr),
    }
}

/// Closes idle connections past their timeout (or closed by their server, or to a server
/// no longer wanted), and the least recently used ones beyond the share idle for
/// `TRIM_AFTER`, every second, until the pool of this loop is empty.
async fn sweep<C: Pooled>(state: &'static State) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = Instant::now();
        let settings = state.settings();
        let empty = C::pool().with(|pool| {
            let mut pool = pool.borrow_mut();
            pool.idle.retain(|&target, list| {
                // Oldest first: beyond the share, those idle for TRIM_AFTER go.
                let mut excess = list
                    .len()
                    .saturating_sub(list.first().map_or(0, |i| i.share));
                list.retain_mut(|idle| {
                    let idle_for = now.duration_since(idle.since);
                    let trimmed = excess > 0 && idle_for >= TRIM_AFTER;
                    if trimmed {
                        excess -= 1;
                    }
                    let keep = !trimmed
                        && idle_for < idle.idle_timeout
                        && idle.conn.usable()
                        && still_wanted(state, &settings, target, idle.conn.addr());
                    if !keep {
                        idle.gauge.pool_idle.fetch_sub(1, Relaxed);
                    }
                    keep
                });
                !list.is_empty()
            });
            let empty = pool.idle.is_empty();
            if empty {
                pool.sweeping = false;
            }
            empty
        });
        if empty {
            return;
        }
    }
}
