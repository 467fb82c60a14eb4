//! Idle connections parked outside the event loop's tasks (`idle_park`).
//!
//! A raw relay silent for `idle_park` seconds stops, and its session waits here instead of
//! in a task: its sockets leave tokio's reactor (which keeps a 256-byte readiness record per
//! socket) and its task ends (about 900 bytes), so a parked connection costs its session
//! (a few hundred bytes) and two entries in this loop's own epoll set. The first event on
//! either socket (data, EOF, error) takes the session out and spawns a task that relays on.
//! `idle_timeout` keeps counting for parked sessions (a deadline heap), and `close N`
//! reaches them through a queue that the control thread fills.
//!
//! Invariants: one lot per event-loop thread, used only from that thread (the close queue
//! is the only shared part); a session's sockets are in the epoll set exactly while it is
//! in the slab; a deadline or close request names its session by ticket or connection
//! number as well as by slab key, so a stale one never touches a newer session that reuses
//! the key.

use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use rustix::event::epoll::{self, CreateFlags, EventData, EventFlags, EventVec};
use slab::Slab;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::registry::{ConnInfo, LoopCloses, Ticket};

/// Events taken from the epoll set per system call.
const EVENTS: usize = 256;

/// At most how many times `idle_park` a connection that keeps waking soon after parking
/// waits before parking again.
const BACKOFF_MAX: u32 = 32;

/// The silence after which a connection that woke after `parked_for` parks again, when it
/// last parked after `last` (`idle_park`: `base`). Parking and waking cost a connection
/// about 10–15 µs (its sockets out of one epoll set and into another, twice, and a new
/// task: bench/RESULTS.md), paid by every request of a client that thinks a little longer
/// than `idle_park`; so a connection that was parked for less time than it took to park
/// waits twice as long next time (up to `BACKOFF_MAX` × `base`), and one that slept four
/// times that long is back to `base`. `None`: parking is off.
pub(super) fn next_park_after(
    base: Option<Duration>,
    last: Option<Duration>,
    parked_for: Duration,
) -> Option<Duration> {
    let base = base?;
    let last = last.unwrap_or(base).max(base);
    Some(if parked_for < last {
        (last * 2).min(base * BACKOFF_MAX)
    } else if parked_for >= last * 4 {
        base
    } else {
        last
    })
}

/// A session that can wait in a lot. Implemented by the TCP data plane's parked session.
pub(crate) trait Parked {
    /// The client's and the server's socket, watched for any event.
    fn fds(&self) -> [BorrowedFd<'_>; 2];
    /// The connection's registry entry, when a control socket exists.
    fn info(&self) -> Option<&ConnInfo>;
    /// How much longer the connection may stay silent (`idle_timeout`), if limited.
    fn remaining(&self) -> Option<Duration>;
    /// A socket woke: relay on in a new task.
    fn resume(self: Box<Self>);
    /// `idle_timeout` ran out while parked: account for the connection, and close it.
    fn expire(self: Box<Self>);
}

/// One parked session.
struct Slot {
    session: Box<dyn Parked>,
    /// Tells this session's deadline entries from those of earlier sessions at its key.
    ticket: u64,
}

/// The parked sessions of one event loop.
struct Lot {
    epoll: AsyncFd<OwnedFd>,
    slots: RefCell<Slab<Slot>>,
    /// `idle_timeout` deadlines: (when, slab key, ticket), earliest first.
    deadlines: RefCell<BinaryHeap<Reverse<(Instant, usize, u64)>>>,
    next_ticket: Cell<u64>,
    /// Wakes `serve` to look at the deadlines again after a park.
    parked: Notify,
    closes: Arc<LoopCloses>,
    /// Parked sessions of every loop (`State::parked`).
    gauge: &'static AtomicUsize,
}

thread_local! {
    static LOT: RefCell<Option<Rc<Lot>>> = const { RefCell::new(None) };
}

/// Parks `session` in this thread's lot. When it cannot (no lot on this thread, or the
/// kernel refuses to watch the sockets), the session resumes at once in a new task.
pub(crate) fn park(session: Box<dyn Parked>) {
    match LOT.with(|cell| cell.borrow().clone()) {
        Some(lot) => lot.park(session),
        None => session.resume(),
    }
}

/// The epoll set of one event loop's lot, made before the loop's thread starts: its
/// descriptor is there from the start, not from the first idle connection on.
#[derive(Debug)]
pub struct EpollSet(OwnedFd);

impl EpollSet {
    pub fn new() -> io::Result<EpollSet> {
        Ok(EpollSet(epoll::create(CreateFlags::CLOEXEC)?))
    }
}

/// Makes `set` this thread's lot, with the task that serves it. Must run on an event
/// loop's `LocalSet`; `gauge` counts the parked sessions of every loop.
pub(crate) fn install(set: EpollSet, gauge: &'static AtomicUsize) -> io::Result<()> {
    let lot = Rc::new(Lot {
        epoll: register(set.0)?,
        slots: RefCell::new(Slab::new()),
        deadlines: RefCell::new(BinaryHeap::new()),
        next_ticket: Cell::new(0),
        parked: Notify::new(),
        closes: Arc::default(),
        gauge,
    });
    tokio::task::spawn_local(Rc::clone(&lot).serve());
    LOT.with(|cell| *cell.borrow_mut() = Some(lot));
    Ok(())
}

/// The session leaves its lot: false if `close N` came meanwhile, and it must close instead
/// of resuming.
fn leaves(session: &dyn Parked) -> bool {
    session.info().map_or(true, ConnInfo::unpark)
}

/// Registers the lot's epoll set with this thread's reactor: it is readable when a parked
/// socket has an event.
// `AsyncFd::with_interest` is deprecated (tokio#8587) because a type whose descriptor can
// change under the registration would be unsound; an `OwnedFd` owns one descriptor for its
// whole life, so the safe constructor is sound here.
#[allow(deprecated)]
fn register(epoll: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::with_interest(epoll, tokio::io::Interest::READABLE)
}

impl Lot {
    fn park(&self, session: Box<dyn Parked>) {
        let key = self.slots.borrow().vacant_key();
        if let Some(info) = session.info() {
            let ticket = Ticket::new(&self.closes, key);
            if !info.park_at(ticket) {
                return; // `close N` came first: dropping the session closes it.
            }
        }
        if let Err(e) = self.watch(&*session, key) {
            tracing::debug!("cannot park an idle connection: {e}");
            if leaves(&*session) {
                session.resume();
            }
            return;
        }
        let ticket = self.next_ticket.get();
        self.next_ticket.set(ticket.wrapping_add(1));
        if let Some(left) = session.remaining() {
            // `remaining` is bounded far below overflow (tcp.rs caps `idle_timeout`).
            if let Some(when) = Instant::now().checked_add(left) {
                self.deadlines
                    .borrow_mut()
                    .push(Reverse((when, key, ticket)));
            }
        }
        self.slots.borrow_mut().insert(Slot { session, ticket });
        self.drop_stale_deadlines();
        self.gauge.fetch_add(1, Relaxed);
        // A wave of parking sessions frees one task each; the loop, idle once the wave has
        // passed, would keep those pages.
        crate::memory::release_when_quiet();
        self.parked.notify_one();
    }

    /// A session that wakes leaves its deadline in the heap until it comes due. A client
    /// that wakes its connection every few seconds under a long `idle_timeout` would
    /// grow the heap by one entry each time: once stale entries outnumber the parked
    /// sessions, they go (amortised O(1) per park; the heap stays O(parked sessions)).
    fn drop_stale_deadlines(&self) {
        let slots = self.slots.borrow();
        let mut deadlines = self.deadlines.borrow_mut();
        if deadlines.len() > 2 * slots.len() + 64 {
            deadlines.retain(|Reverse((_, key, ticket))| {
                slots.get(*key).is_some_and(|slot| slot.ticket == *ticket)
            });
        }
    }

    /// Adds both sockets to the epoll set; on failure neither is in it.
    fn watch(&self, session: &dyn Parked, key: usize) -> io::Result<()> {
        let flags = EventFlags::IN | EventFlags::RDHUP;
        let [client, server] = session.fds();
        let data = EventData::new_u64(key as u64);
        epoll::add(self.epoll.get_ref(), client, data, flags)?;
        if let Err(e) = epoll::add(self.epoll.get_ref(), server, data, flags) {
            let _ = epoll::delete(self.epoll.get_ref(), client);
            return Err(e.into());
        }
        Ok(())
    }

    /// Takes the session at `key` out of the lot, its sockets out of the epoll set.
    fn take(&self, key: usize) -> Option<Box<dyn Parked>> {
        let slot = self.slots.borrow_mut().try_remove(key)?;
        for fd in slot.session.fds() {
            // Fails only if the socket is not in the set, which the invariant excludes;
            // closing the socket would remove it anyway.
            let _ = epoll::delete(self.epoll.get_ref(), fd);
        }
        self.gauge.fetch_sub(1, Relaxed);
        Some(slot.session)
    }

    /// Serves the lot for the life of the event loop: socket events, close requests and
    /// `idle_timeout` deadlines.
    async fn serve(self: Rc<Self>) {
        let mut events = EventVec::with_capacity(EVENTS);
        loop {
            let next = self
                .deadlines
                .borrow()
                .peek()
                .map(|Reverse((when, ..))| *when);
            let timer = async {
                match next {
                    Some(when) => tokio::time::sleep_until(when).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                ready = self.epoll.readable() => match ready {
                    Ok(mut guard) => {
                        if let Err(e) = epoll::wait(self.epoll.get_ref(), &mut events, 0) {
                            tracing::warn!("parked connections: epoll_wait: {e}");
                        }
                        if events.len() < EVENTS {
                            guard.clear_ready();
                        }
                        drop(guard);
                        for event in events.iter() {
                            // Both sockets of a session may report in one batch: the
                            // second finds the key empty (nothing parks during the batch).
                            if let Some(session) = usize::try_from(event.data.u64())
                                .ok()
                                .and_then(|key| self.take(key))
                            {
                                if leaves(&*session) {
                                    session.resume();
                                }
                            }
                        }
                    }
                    Err(e) => {
                        tracing::error!("parked connections: {e}");
                        return;
                    }
                },
                () = self.closes.requested() => self.close_requested(),
                () = self.parked.notified() => {} // a new deadline
                () = timer => self.expire_due(),
            }
        }
    }

    fn close_requested(&self) {
        for (key, id) in self.closes.take() {
            let same = self
                .slots
                .borrow()
                .get(key)
                .and_then(|slot| slot.session.info().map(|info| info.id == id))
                .unwrap_or(false);
            if same {
                drop(self.take(key));
            }
        }
    }

    fn expire_due(&self) {
        let now = Instant::now();
        loop {
            let due = {
                let mut deadlines = self.deadlines.borrow_mut();
                match deadlines.peek() {
                    Some(Reverse((when, ..))) if *when <= now => deadlines.pop(),
                    _ => None,
                }
            };
            let Some(Reverse((_, key, ticket))) = due else {
                return;
            };
            let current = self
                .slots
                .borrow()
                .get(key)
                .is_some_and(|slot| slot.ticket == ticket);
            if let Some(session) = current.then(|| self.take(key)).flatten() {
                session.expire();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_connection_that_wakes_soon_after_parking_parks_later_next_time() {
        let s = Duration::from_secs;
        // Parked for less than it took to park: twice as long next time, up to 32 times.
        assert_eq!(next_park_after(Some(s(1)), Some(s(1)), s(0)), Some(s(2)));
        assert_eq!(next_park_after(Some(s(1)), Some(s(2)), s(1)), Some(s(4)));
        assert_eq!(next_park_after(Some(s(1)), Some(s(32)), s(3)), Some(s(32)));
        // Parked for about as long: as before.
        assert_eq!(next_park_after(Some(s(1)), Some(s(1)), s(2)), Some(s(1)));
        assert_eq!(next_park_after(Some(s(1)), Some(s(4)), s(15)), Some(s(4)));
        // Asleep for four times as long: back to `idle_park`.
        assert_eq!(next_park_after(Some(s(1)), Some(s(4)), s(16)), Some(s(1)));
        // A reload changed `idle_park`: never below it; off is off.
        assert_eq!(next_park_after(Some(s(5)), Some(s(2)), s(6)), Some(s(5)));
        assert_eq!(next_park_after(None, Some(s(2)), s(0)), None);
    }

    /// A parked session of two socket pairs, with a long `idle_timeout`.
    struct Fake {
        client: (UnixStream, UnixStream),
        server: (UnixStream, UnixStream),
    }

    impl Fake {
        fn new() -> Fake {
            Fake {
                client: UnixStream::pair().unwrap(),
                server: UnixStream::pair().unwrap(),
            }
        }
    }

    impl Parked for Fake {
        fn fds(&self) -> [BorrowedFd<'_>; 2] {
            [self.client.0.as_fd(), self.server.0.as_fd()]
        }
        fn info(&self) -> Option<&ConnInfo> {
            None
        }
        fn remaining(&self) -> Option<Duration> {
            Some(Duration::from_secs(3600))
        }
        fn resume(self: Box<Self>) {}
        fn expire(self: Box<Self>) {}
    }

    static GAUGE: AtomicUsize = AtomicUsize::new(0);

    #[test]
    fn sessions_that_keep_waking_do_not_grow_the_deadline_heap() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        tokio::task::LocalSet::new().block_on(&rt, async {
            install(EpollSet::new().unwrap(), &GAUGE).unwrap();
            let lot = LOT.with(|cell| cell.borrow().clone()).unwrap();
            let steady: Vec<usize> = (0..10)
                .map(|_| {
                    park(Box::new(Fake::new()));
                    lot.slots.borrow().len() - 1
                })
                .collect();
            // One connection parks and wakes 10,000 times beside ten that stay parked.
            for _ in 0..10_000 {
                park(Box::new(Fake::new()));
                let key = lot.slots.borrow().iter().map(|(k, _)| k).max().unwrap();
                assert!(lot.take(key).is_some());
            }
            assert_eq!(lot.slots.borrow().len(), steady.len());
            let heap = lot.deadlines.borrow().len();
            assert!(heap <= 2 * (steady.len() + 1) + 64, "{heap} deadlines kept");
            // The ten parked sessions kept theirs.
            for key in steady {
                let ticket = lot.slots.borrow()[key].ticket;
                assert!(lot
                    .deadlines
                    .borrow()
                    .iter()
                    .any(|Reverse((_, k, t))| *k == key && *t == ticket));
            }
        });
    }
}
