//! `poll_before_sleep N`: an event loop that has just worked keeps polling for new events
//! for up to N µs before it sleeps, as a guest kernel's haltpoll does for a whole CPU.
//!
//! An answer that comes back within the window is taken without the wake-up of a sleeping
//! thread (on the benchmark's virtual machines a halted vCPU, an interrupt, a VM exit):
//! lower latency, paid for with the CPU of the polling. Measured (bench/RESULTS.md,
//! "Polling before sleeping"): at 30 µs a paced keep-alive relay's p99 fell from 1.64 to
//! 1.45 ms (the server's own), for 1–2 µs more machine CPU a request and 4–6 µs more of the
//! loop's own; so it is off by default, a choice for latency. A UDP loop opens a window
//! only after sending queries on ([`Opens::AfterRequests`]): evenly paced queries paid
//! 40 µs each for the windows after their answers. TCP loops open one after any work: the
//! same gate for them, tried, lost most of the latency the window is for (RESULTS.md, "The
//! same gate for TCP loops"). Unlike `proxy::polling` (a busy loop that polls without a
//! time limit, only where its trials find that it saves CPU), the window is short and
//! follows every piece of work, at any load. Invariant: with the setting at 0 a loop never
//! polls here (the hooks read one atomic and this loop's window, and return), and a loop
//! that found nothing in its window sleeps until its next event.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crate::command::MAX_POLL_BEFORE_SLEEP_MICROS;

/// What the windows found, for the metrics.
pub(crate) struct Stats {
    /// Windows in which an event came: a wake-up spared.
    pub(crate) caught: AtomicU64,
    /// Windows that ran out with nothing caught: the loop slept after polling through them.
    pub(crate) missed: AtomicU64,
}

pub(crate) static STATS: Stats = Stats {
    caught: AtomicU64::new(0),
    missed: AtomicU64::new(0),
};

/// A turn from the runtime's return out of epoll to its next attempt to sleep that took
/// longer than this ran connections (an empty one polls the loop's tasks: well under a
/// microsecond), even if it moved no byte (a handshake, a new connection).
const EMPTY_TURN: Duration = Duration::from_micros(4);

/// This loop's window.
#[derive(Clone, Copy)]
struct Window {
    /// When the runtime last came back from epoll.
    unparked: Option<Instant>,
    /// The bytes the loop had moved then (`polling::moved_so_far`).
    moved: u64,
    /// Polling goes on until then.
    until: Option<Instant>,
    /// The last return from epoll was a poll of the window, not a wake-up.
    polling: bool,
    /// An event came while the loop polled since the window last opened: when the window
    /// runs out, it does not count as missed.
    caught: bool,
}

impl Window {
    const CLOSED: Window = Window {
        unparked: None,
        moved: 0,
        until: None,
        polling: false,
        caught: false,
    };
}

thread_local! {
    static WINDOW: Cell<Window> = const {
        Cell::new(Window::CLOSED)
    };
    /// The waker of this loop's [`keeper`]: waking it keeps the runtime from sleeping in
    /// epoll (it polls epoll without a timeout instead, and comes back).
    static KEEPER: Cell<Option<Waker>> = const { Cell::new(None) };
    /// A request went on to a server since the loop last came back from epoll.
    static REQUESTED: Cell<bool> = const { Cell::new(false) };
}

/// After which turns a loop opens a window.
#[derive(Clone, Copy)]
pub(crate) enum Opens {
    /// After any turn that did work (TCP loops).
    AfterWork,
    /// Only after a turn that sent requests on to servers ([`requested`]): the UDP loops,
    /// whose clients (measured with dnsperf) send evenly, so that the window after an
    /// answer relayed to a client ran out before the next query came, costing each query
    /// two windows.
    AfterRequests,
}

/// The loop sent requests on to servers in this turn: their answers may come within the
/// window.
pub(crate) fn requested() {
    REQUESTED.set(true);
}

/// The runtime's `on_thread_park` hook: called each time the loop has nothing left to run
/// and is about to sleep in epoll. Within `micros` of the end of the last turn that did work,
/// wakes the [`keeper`] so that the runtime polls instead.
pub(crate) fn before_park(micros: u32, opens: Opens) {
    if micros == 0 {
        // Turned off: a window open then must not count as missed when it is turned on
        // again.
        if WINDOW.get().until.is_some() {
            WINDOW.set(Window::CLOSED);
        }
        return;
    }
    let now = Instant::now();
    let mut w = WINDOW.get();
    // The turn since the loop came back from epoll did something: bytes or datagrams
    // moved, or (a TCP loop: a handshake, a new connection) it was too long to be empty.
    let busy = w.unparked.is_some_and(|u| {
        super::polling::moved_so_far() != w.moved
            || matches!(opens, Opens::AfterWork) && now.saturating_duration_since(u) > EMPTY_TURN
    });
    if busy && w.polling && !w.caught {
        // Whatever came (a gated loop's answers too) came without a wake-up; a window
        // counts once.
        STATS.caught.fetch_add(1, Relaxed);
        w.caught = true;
    }
    // Work that opens a window: requests sent on (a gated loop), else any busy turn. A gated
    // loop's window stays open to its end after the first answer: with queries in flight,
    // more answers come (closing it at the first cost more CPU a query and gained no
    // latency, 2026-12-01).
    let worked = match opens {
        Opens::AfterRequests => REQUESTED.take(),
        Opens::AfterWork => busy,
    };
    if worked {
        w.until =
            Some(now + Duration::from_micros(u64::from(micros.min(MAX_POLL_BEFORE_SLEEP_MICROS))));
        w.caught = false;
    }
    w.polling = match w.until {
        Some(until) if now < until => {
            if let Some(keeper) = KEEPER.take() {
                keeper.wake();
            }
            true
        }
        _ => {
            if w.polling && !w.caught {
                STATS.missed.fetch_add(1, Relaxed);
            }
            w.until = None;
            false
        }
    };
    WINDOW.set(w);
}

/// The runtime's `on_thread_unpark` hook: the loop came back from epoll (events, a timer,
/// or a poll of the window).
pub(crate) fn after_unpark(micros: u32) {
    if micros == 0 {
        return;
    }
    let mut w = WINDOW.get();
    w.unparked = Some(Instant::now());
    w.moved = super::polling::moved_so_far();
    WINDOW.set(w);
}

/// The task [`before_park`] wakes; run as one task on each event loop. It does nothing but
/// leave its waker where the hook finds it.
pub(crate) async fn keeper() {
    std::future::poll_fn(|cx| {
        match KEEPER.take() {
            Some(w) if w.will_wake(cx.waker()) => KEEPER.set(Some(w)),
            _ => KEEPER.set(Some(cx.waker().clone())),
        }
        Poll::<()>::Pending
    })
    .await
}

/// The runtime of one event loop (TCP or UDP): current-thread, with the hooks that poll
/// before sleeping as `state`'s published `poll_before_sleep` says, windows opening as
/// `opens` says. Its `LocalSet` must run a [`keeper`].
pub(crate) fn event_loop_runtime(
    state: &std::sync::Arc<crate::state::State>,
    opens: Opens,
) -> std::io::Result<tokio::runtime::Runtime> {
    let (parking, unparking) = (std::sync::Arc::clone(state), std::sync::Arc::clone(state));
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .on_thread_park(move || before_park(parking.poll_before_sleep(), opens))
        .on_thread_unpark(move || after_unpark(unparking.poll_before_sleep()))
        .build()
}

#[cfg(test)]
mod tests {
    use super::super::polling::moved;
    use super::*;

    /// Runs one turn of a loop as the runtime's hooks see it: back from epoll, `work`,
    /// about to sleep again. Returns whether the loop polls instead of sleeping.
    fn turn(micros: u32, opens: Opens, work: impl FnOnce()) -> bool {
        after_unpark(micros);
        work();
        before_park(micros, opens);
        WINDOW.get().polling
    }

    fn counts() -> (u64, u64) {
        (STATS.caught.load(Relaxed), STATS.missed.load(Relaxed))
    }

    /// Each test runs on its own thread: the window is thread-local, the counters are not
    /// (other tests' loops may add to them, never take from them).
    #[test]
    fn a_udp_loop_polls_after_sending_queries_and_counts_the_answer_it_catches() {
        const MICROS: u32 = 2_000;
        assert!(!turn(MICROS, Opens::AfterRequests, || {}), "no window yet");
        // A datagram relayed to a client is no query: no window.
        assert!(!turn(MICROS, Opens::AfterRequests, || moved(1)));
        let (caught, _) = counts();
        assert!(turn(MICROS, Opens::AfterRequests, || {
            moved(1);
            requested();
        }));
        // The answer comes while the loop polls: caught, and the window stays open.
        assert!(turn(MICROS, Opens::AfterRequests, || moved(1)));
        assert!(counts().0 > caught, "the answer counts as caught");
        // Nothing more comes: the window runs out.
        let deadline = Instant::now() + Duration::from_secs(5);
        while turn(MICROS, Opens::AfterRequests, || {}) {
            assert!(Instant::now() < deadline, "the window never ends");
        }
        assert_eq!(WINDOW.get().until, None);
    }

    #[test]
    fn a_window_in_which_nothing_comes_counts_as_missed() {
        const MICROS: u32 = 100;
        let missed = counts().1;
        assert!(turn(MICROS, Opens::AfterRequests, requested));
        while turn(MICROS, Opens::AfterRequests, || {}) {}
        assert!(counts().1 > missed);
    }

    #[test]
    fn at_zero_a_loop_never_polls() {
        assert!(!turn(0, Opens::AfterWork, || moved(1)));
        assert!(!turn(0, Opens::AfterRequests, requested));
    }
}
