//! Open connections by number, for the control commands `connection N` and `close N`.
//!
//! Only kept when a control socket exists (otherwise nobody could ask). Entries live in
//! shards keyed by connection number, so the event loops rarely wait for each other; an
//! entry is inserted when a connection is accepted (a UDP flow: when it starts) and removed
//! when its task ends, also when it is aborted by `close N` (a UDP flow: when the flow
//! drops), so the registry never outgrows the open connections and flows.
//!
//! `close N` reaches a connection through its [`Closer`]: the task serving it, or the event
//! loop that holds it without a task of its own (its [`Ticket`] into the loop's
//! [`LoopCloses`]): the lot where it is parked (`idle_park`), or, for a UDP flow, its event
//! loop's flow table (a flow's task ending does not take it out of the table). A close
//! that comes while the connection moves between a task and a loop is remembered, and the
//! move ends the connection instead.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use tokio::sync::Notify;
use tokio::task::AbortHandle;

const SHARDS: usize = 16;

/// Which upstream a connection uses: for one served request by request, the latest
/// request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    /// Not chosen yet (selecting or connecting).
    None,
    Server(usize),
    Emergency,
    Abuse,
}

const NONE: usize = usize::MAX;
const EMERGENCY: usize = usize::MAX - 1;
const ABUSE: usize = usize::MAX - 2;

/// What the control plane can see of, and do to, one open connection.
#[derive(Debug)]
pub struct ConnInfo {
    pub id: u64,
    /// The peer address of the client socket.
    pub client: SocketAddr,
    /// The client a PROXY protocol header named (`accept_proxy`), when there was one.
    pub proxied: OnceLock<SocketAddr>,
    /// `clock::now_ms()` at accept.
    pub started: u64,
    upstream: AtomicUsize,
    closer: Mutex<Closer>,
}

/// The part of an event loop that other threads reach to close the connections it holds
/// (its lot of parked connections, `proxy::park`, or its UDP flows, `proxy::udp`): the
/// `close N` requests for them.
#[derive(Debug, Default)]
pub struct LoopCloses {
    /// (ticket key, connection number) of each connection to close.
    closing: Mutex<Vec<(usize, u64)>>,
    wake: Notify,
}

impl LoopCloses {
    /// Ready once a close was asked for since the last [`LoopCloses::take`] (a request
    /// made while nobody waits is kept for the next wait).
    pub async fn requested(&self) {
        self.wake.notified().await;
    }

    /// The requests made so far.
    pub fn take(&self) -> Vec<(usize, u64)> {
        std::mem::take(&mut *self.closing.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Where an event loop holds a connection, for `close N`: the loop's requests, and a key
/// of the loop's own (a parked connection's slot in its lot; a UDP loop finds a flow by its
/// number and leaves it 0).
#[derive(Debug, Clone)]
pub struct Ticket {
    closes: Arc<LoopCloses>,
    key: usize,
}

impl Ticket {
    pub fn new(closes: &Arc<LoopCloses>, key: usize) -> Ticket {
        Ticket {
            closes: Arc::clone(closes),
            key,
        }
    }

    /// Asks the loop to close connection `id` (which it holds at this ticket's key).
    fn close(&self, id: u64) {
        self.closes
            .closing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((self.key, id));
        self.closes.wake.notify_one();
    }
}

/// How `close N` reaches one connection.
#[derive(Debug, Default)]
struct Closer {
    /// `close N` was asked for: whatever serves the connection next must end it.
    requested: bool,
    by: By,
}

/// What serves a connection right now.
#[derive(Debug, Default)]
enum By {
    /// Nothing yet (just accepted), or moving between a task and a loop.
    #[default]
    Nothing,
    Task(AbortHandle),
    Loop(Ticket),
}

impl ConnInfo {
    /// The real client: the one a PROXY protocol header named, else the peer.
    pub fn real_client(&self) -> SocketAddr {
        self.proxied.get().copied().unwrap_or(self.client)
    }

    pub fn upstream(&self) -> Upstream {
        match self.upstream.load(Relaxed) {
            NONE => Upstream::None,
            EMERGENCY => Upstream::Emergency,
            ABUSE => Upstream::Abuse,
            i => Upstream::Server(i),
        }
    }

    fn closer(&self) -> MutexGuard<'_, Closer> {
        self.closer.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the task that now serves the connection, or aborts it at once if `close N`
    /// came while the connection had none.
    pub fn served_by(&self, task: AbortHandle) {
        let mut closer = self.closer();
        if closer.requested {
            task.abort();
        }
        closer.by = By::Task(task);
    }

    /// Records where the connection is parked. False if `close N` came first: the caller
    /// closes the connection instead.
    pub fn park_at(&self, ticket: Ticket) -> bool {
        let mut closer = self.closer();
        closer.by = By::Loop(ticket);
        !closer.requested
    }

    /// Records the event loop that now holds the connection (a UDP flow in its loop's
    /// table), and passes a `close N` that came while nothing did on to the loop.
    pub fn held_by(&self, ticket: Ticket) {
        let mut closer = self.closer();
        if closer.requested {
            ticket.close(self.id);
        }
        closer.by = By::Loop(ticket);
    }

    /// The connection leaves its lot. False if `close N` came meanwhile: the caller closes
    /// the connection instead of resuming it.
    pub fn unpark(&self) -> bool {
        let mut closer = self.closer();
        closer.by = By::Nothing;
        !closer.requested
    }

    /// Whether `close N` asked for the connection to end: what ends with it then was not
    /// given up by its client.
    pub fn close_requested(&self) -> bool {
        self.closer().requested
    }

    /// Ends the connection, wherever it is.
    fn close(&self) {
        let mut closer = self.closer();
        closer.requested = true;
        match &closer.by {
            By::Nothing => {}
            By::Task(task) => task.abort(),
            By::Loop(ticket) => ticket.close(self.id),
        }
    }

    pub fn set_upstream(&self, u: Upstream) {
        let v = match u {
            Upstream::None => NONE,
            Upstream::Emergency => EMERGENCY,
            Upstream::Abuse => ABUSE,
            Upstream::Server(i) => i,
        };
        self.upstream.store(v, Relaxed);
    }
}

/// One shard: connection number -> connection.
type Shard = HashMap<u64, Arc<ConnInfo>>;

/// The table of open connections.
#[derive(Debug)]
pub struct Registry {
    next: AtomicU64,
    shards: Box<[Mutex<Shard>]>,
}

impl Default for Registry {
    fn default() -> Registry {
        Registry {
            next: AtomicU64::new(1),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
        }
    }
}

/// Removes its connection from the registry when the connection's task ends.
pub struct Registered {
    registry: Arc<Registry>,
    pub info: Arc<ConnInfo>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.registry.shard(self.info.id).remove(&self.info.id);
    }
}

impl Registry {
    fn shard(&self, id: u64) -> std::sync::MutexGuard<'_, Shard> {
        let i = (id % SHARDS as u64) as usize;
        self.shards[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a new connection from `client`; the returned guard unregisters it.
    pub fn register(self: &Arc<Registry>, client: SocketAddr, now: u64) -> Registered {
        let id = self.next.fetch_add(1, Relaxed);
        let info = Arc::new(ConnInfo {
            id,
            client,
            proxied: OnceLock::new(),
            started: now,
            upstream: AtomicUsize::new(NONE),
            closer: Mutex::default(),
        });
        self.shard(id).insert(id, Arc::clone(&info));
        Registered {
            registry: Arc::clone(self),
            info,
        }
    }

    /// Connection `id`, if open.
    pub fn get(&self, id: u64) -> Option<Arc<ConnInfo>> {
        self.shard(id).get(&id).cloned()
    }

    /// Closes connection `id` (both sockets); false if there is no such connection.
    pub fn close(&self, id: u64) -> bool {
        match self.get(id) {
            Some(c) => {
                c.close();
                true
            }
            None => false,
        }
    }

    /// Every open connection, in no particular order.
    pub fn all(&self) -> Vec<Arc<ConnInfo>> {
        self.shards
            .iter()
            .flat_map(|s| {
                s.lock()
                    .map(|g| g.values().cloned().collect::<Vec<_>>())
                    .unwrap_or_default()
            })
            .collect()
    }
}
