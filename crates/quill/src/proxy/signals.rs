//! What quill asks of client connections: to stop, or to move on to a new connection
//! after a reload or a drain. They read it from [`State::asked`] with one load per turn
//! instead of registering with the process-wide watch channels (≈ 2.4 k instructions a
//! request served by the byte pump, ≈ 650 an HTTP/2 request, and a lock that both event
//! loops' cores fought over).
//!
//! Two kinds of sleeper must be woken. A connection served request by request (`h1_pump`)
//! waiting for its client's next request only when quill stops: each event loop keeps one
//! [`bell`] for that. A connection under `gateway::supervise` (hyper's HTTP/1.x and
//! HTTP/2 servers), parked out of hyper (`h1::park`) or relayed whole by the byte pump
//! (`tcp::telling`) at stop and at every reload or drain: it keeps its task's waker in the
//! loop's table of [`Watcher`]s. One task per event loop ([`ring_on_change`]) rings both.
//! Invariant: they are rung only after [`State::stop`] or [`State::recycle`] changed the
//! word, so a sleeper woken by them, or one that starts waiting after them, sees the
//! change.

use std::cell::RefCell;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use slab::Slab;
use tokio::sync::Notify;

use super::pump::{Ask, Asks};
use crate::state::{Asked, State};

thread_local! {
    /// The event loop's bell: one per thread, alive as long as the process.
    static BELL: &'static Notify = Box::leak(Box::new(Notify::new()));
    /// The wakers of the event loop's [`Watcher`]s (none until a watcher first waits).
    static WATCHERS: RefCell<Slab<Option<Waker>>> = const { RefCell::new(Slab::new()) };
}

/// How long after an answer that did not say `Connection: close` a stopping quill still
/// waits for an HTTP/1.x client's next request (which then gets that answer) before it
/// closes the connection (the byte pump's `relay`, `h1_pump`, and hyper's connections in
/// `gateway::supervise`). A keep-alive client sends its next request as soon as it has read
/// an answer: closing at once, quill would reset a request that is on its way or about to
/// be (a loopback client's turn-around is tens of microseconds; a distant one's request can
/// be in flight for a round trip), and no client can tell that from a request lost to a
/// failed server (`wrk` failed once on every connection at a binary upgrade). HAProxy's
/// soft stop answers such a request with `connection: close` too. A client silent for
/// longer is idle, and its connection closes at once.
pub(super) const NEXT_REQUEST_AT_STOP: Duration = Duration::from_secs(1);

/// This event loop's bell, rung when quill stops.
pub fn bell() -> &'static Notify {
    BELL.with(|b| *b)
}

/// Rings this event loop's bell once quill stops, and wakes its watchers then and at every
/// reload or drain before. One task per event loop runs it.
pub async fn ring_on_change(state: Arc<State>) {
    let mut stopping = state.stopping.subscribe();
    let mut recycled = state.recycled.subscribe();
    // `State::stop` and `State::recycle` change the word before they send on the channels.
    loop {
        tokio::select! {
            r = stopping.wait_for(|s| *s) => {
                if r.is_ok() {
                    bell().notify_waiters();
                    wake_watchers();
                }
                return;
            }
            r = recycled.changed() => {
                if r.is_err() {
                    return;
                }
                wake_watchers();
            }
        }
    }
}

fn wake_watchers() {
    // Taken out first: a waker must not run while the table is borrowed.
    let wakers: Vec<Waker> = WATCHERS.with(|w| {
        w.borrow_mut()
            .iter_mut()
            .filter_map(|(_, k)| k.take())
            .collect()
    });
    for waker in wakers {
        waker.wake();
    }
}

/// One connection's watch on what quill asks, from its event loop's task: [`changed`]
/// resolves at each change (a stop, a reload or a drain) since the last one it returned,
/// or since the watcher was made. Polling it reads one word; its waker is kept in the
/// loop's table while it waits, and leaves the table with the watcher.
///
/// [`changed`]: Watcher::changed
pub struct Watcher<'a> {
    state: &'a State,
    seen: Asked,
    key: usize,
}

impl<'a> Watcher<'a> {
    /// Watches from now on; [`Watcher::seen`] is what quill asks now.
    pub fn new(state: &'a State) -> Watcher<'a> {
        Watcher {
            state,
            seen: state.asked(),
            key: WATCHERS.with(|w| w.borrow_mut().insert(None)),
        }
    }

    /// The reading the last change was seen in.
    pub fn seen(&self) -> Asked {
        self.seen
    }

    /// What quill asks once it changed since the last reading.
    pub async fn changed(&mut self) -> Asked {
        poll_fn(|cx| self.poll_changed(cx)).await
    }

    fn poll_changed(&mut self, cx: &mut Context<'_>) -> Poll<Asked> {
        let now = self.state.asked();
        if now != self.seen {
            self.seen = now;
            return Poll::Ready(now);
        }
        WATCHERS.with(|w| {
            if let Some(slot) = w.borrow_mut().get_mut(self.key) {
                if !slot.as_ref().is_some_and(|k| k.will_wake(cx.waker())) {
                    *slot = Some(cx.waker().clone());
                }
            }
        });
        Poll::Pending
    }
}

impl Drop for Watcher<'_> {
    fn drop(&mut self) {
        WATCHERS.with(|w| {
            w.borrow_mut().try_remove(self.key);
        });
    }
}

/// What quill asks of one connection: stop, or move on if a reload or a drain came
/// since it started.
#[derive(Debug, Clone, Copy)]
pub struct Since<'a> {
    state: &'a State,
    start: Asked,
}

impl<'a> Since<'a> {
    /// Reads from now on.
    pub fn now(state: &'a State) -> Since<'a> {
        Since {
            state,
            start: state.asked(),
        }
    }
}

impl Asks for Since<'_> {
    fn ask(&self) -> Ask {
        let now = self.state.asked();
        if now.stopping() {
            Ask::Stop
        } else if now.recycled_since(self.start) {
            Ask::MoveOn
        } else {
            Ask::Nothing
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::settings::Settings;

    /// A watcher whose task sleeps is woken by the event loop's ringer at each reload and
    /// at the stop, and leaves no waker behind when it goes.
    #[test]
    fn a_sleeping_watcher_hears_every_reload_and_the_stop() {
        let state = State::new(Settings::default(), false);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            tokio::task::spawn_local(ring_on_change(Arc::clone(&state)));
            let watched = Arc::clone(&state);
            let watcher = tokio::task::spawn_local(async move {
                let mut w = Watcher::new(&watched);
                let start = w.seen();
                let first = w.changed().await;
                let second = w.changed().await;
                (start, first, second)
            });
            // Both tasks run until they wait: the watcher's only way on is a wake-up.
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            assert_eq!(WATCHERS.with(|w| w.borrow().len()), 1);
            state.recycle();
            for _ in 0..4 {
                tokio::task::yield_now().await;
            }
            state.stop();
            let (start, first, second) = tokio::time::timeout(Duration::from_secs(5), watcher)
                .await
                .expect("the watcher was woken")
                .unwrap();
            assert!(first.recycled_since(start) && !first.stopping());
            assert!(second.stopping());
            assert_eq!(WATCHERS.with(|w| w.borrow().len()), 0);
        });
    }
}
