//! Busy polling, only under load, for the event loops (UDP and TCP).
//!
//! A loop that sleeps in epoll whenever its queue is empty for a moment must be woken by
//! the sender of the next packet: an inter-processor interrupt and two context switches,
//! paid mostly by the *sender's* core (measured on the benchmark's 2-core machine: up to a
//! sixth of the load core's time). Under heavy traffic that costs more than the packet
//! itself, so a busy loop polls instead of sleeping. Invariants: a loop that is idle or
//! lightly loaded never polls (an idle quill costs no CPU), and a loop whose core is
//! contended (the kernel preempts it while it polls) stops polling for a while.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Whether busy polling may run at all: `QUILL_BUSY_POLL=off` in the environment turns it
/// off, for the benchmark's A/B of what polling costs the whole machine at paced loads.
pub(crate) fn allowed() -> bool {
    static ALLOWED: OnceLock<bool> = OnceLock::new();
    *ALLOWED.get_or_init(|| !matches!(std::env::var_os("QUILL_BUSY_POLL"), Some(v) if v == "off"))
}

/// How long a busy loop keeps polling after its last piece of work before it sleeps.
const SPIN: Duration = Duration::from_micros(500);
/// The period over which a loop's load is measured.
const LOAD_WINDOW: Duration = Duration::from_millis(10);
/// Preemptions in one window that mean the loop shares its core with other busy threads
/// (measured: well under 1 per window on a core of its own, 40 to 50 when a 2-core box runs
/// the balancer, its servers and its clients on both cores).
const MAX_PREEMPTIONS: i64 = 10;
/// How long a loop that was preempted while polling sleeps between events before it
/// tries polling again.
const CONTENDED_BACKOFF: Duration = Duration::from_secs(1);

/// The share of a window a loop must spend working before it polls, as a fraction.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Share {
    pub(crate) num: u32,
    pub(crate) den: u32,
}

/// UDP loops: a quarter (measured: polling saves a third of the machine CPU per query at
/// 20,000 queries/s).
pub(crate) const UDP_SHARE: Share = Share { num: 1, den: 4 };
/// TCP loops: three quarters. At a quarter, a TCP loop polled at every paced load of the
/// efficiency bench and cost more than it saved (2026-11-24, 3 rounds, machine µs per
/// request over the backend, polling against `QUILL_BUSY_POLL=off`: +0.7 at 1 ms, +2.4 at
/// 5 ms, +1.4 at 20 ms, +10.6 (15 %) for a connection per request at 5 ms, +20 per 1 MiB
/// response); the busiest of those loops worked about half of each window. At saturation,
/// where polling pays (+19 % keep-alive requests/s), the loop works all the time.
pub(crate) const TCP_SHARE: Share = Share { num: 3, den: 4 };

/// The load of one event loop. Once the loop has spent more than its [`Share`] of the last
/// window working, it keeps polling, without sleeping, for [`SPIN`] after each piece of
/// work; the load measured over the current window decides again at its end.
pub(crate) struct Load {
    share: Share,
    window_start: Instant,
    busy: Duration,
    last: Instant,
    hot: bool,
    /// The thread's involuntary context switches at the start of the window.
    preempted: i64,
    /// No polling before this time.
    calm_until: Instant,
}

/// Involuntary context switches of the calling thread so far.
fn preemptions() -> i64 {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(0, |u| u.involuntary_context_switches())
}

/// CPU time (user + system) of the calling thread so far.
fn thread_cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(Duration::ZERO, |u| {
        let (user, system) = (u.user_time(), u.system_time());
        let micros = |t: nix::sys::time::TimeVal| {
            u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000
                + u64::try_from(t.tv_usec()).unwrap_or(0)
        };
        Duration::from_micros(micros(user) + micros(system))
    })
}

impl Load {
    pub(crate) fn new(share: Share) -> Load {
        let now = Instant::now();
        Load {
            share,
            window_start: now,
            busy: Duration::ZERO,
            last: now,
            hot: false,
            preempted: preemptions(),
            calm_until: now,
        }
    }

    /// Work that started at `since` has just ended.
    pub(crate) fn worked(&mut self, since: Instant) {
        let now = Instant::now();
        self.busy += now.saturating_duration_since(since);
        self.last = now;
        let window = now.saturating_duration_since(self.window_start);
        if window >= LOAD_WINDOW {
            self.decide(now, window);
        }
    }

    /// Ends the window at `now`: polling goes on only if the loop was busy enough and its
    /// core was not contended.
    fn decide(&mut self, now: Instant, window: Duration) {
        let preempted = preemptions();
        if self.hot && preempted - self.preempted > MAX_PREEMPTIONS {
            self.calm_until = now + CONTENDED_BACKOFF;
        }
        self.preempted = preempted;
        self.hot = self.busy * self.share.den > window * self.share.num
            && now >= self.calm_until
            && allowed();
        self.busy = Duration::ZERO;
        self.window_start = now;
    }

    /// Whether to poll rather than sleep now. A pause longer than [`SPIN`] sleeps.
    pub(crate) fn spinning(&self) -> bool {
        self.hot && self.last.elapsed() < SPIN
    }
}

/// A turn of the event loop with nothing to do (a zero-timeout epoll_wait and the
/// scheduler's bookkeeping) takes about a microsecond; a longer one ran connections.
const EMPTY_TURN: Duration = Duration::from_micros(4);
/// While a TCP loop is not polling, how often its load is measured (from the thread's CPU
/// time, so an idle loop wakes only this often).
const COLD_WINDOW: Duration = Duration::from_millis(100);
/// While a TCP loop polls but has had nothing to do for [`SPIN`], how long it sleeps
/// before it polls again (the loop still wakes at once for any event meanwhile).
const PAUSE: Duration = Duration::from_millis(1);

/// Keeps a TCP event loop polling while it is busy. Run as one task on each loop: when
/// polling, it yields on every turn, so the runtime polls epoll with a zero timeout between
/// the connections' work instead of sleeping in it; a turn that took longer than
/// [`EMPTY_TURN`] counts as work. When not polling, it measures the loop's CPU time over
/// [`COLD_WINDOW`]s and starts polling once [`TCP_SHARE`] of a window was spent working.
pub(crate) async fn poll_while_busy() {
    if !allowed() {
        return;
    }
    let mut load = Load::new(TCP_SHARE);
    loop {
        if !load.hot {
            let (start, cpu) = (Instant::now(), thread_cpu());
            tokio::time::sleep(COLD_WINDOW).await;
            let now = Instant::now();
            load.busy = thread_cpu().saturating_sub(cpu);
            load.last = now;
            load.decide(now, now.saturating_duration_since(start));
            continue;
        }
        if load.spinning() {
            let turn = Instant::now();
            tokio::task::yield_now().await;
            if turn.elapsed() > EMPTY_TURN {
                load.worked(turn);
                continue;
            }
        } else {
            tokio::time::sleep(PAUSE).await;
            // Poll again for a while: the pause may have been a lull in steady traffic.
            load.last = Instant::now();
        }
        let now = Instant::now();
        let window = now.saturating_duration_since(load.window_start);
        if window >= LOAD_WINDOW {
            load.decide(now, window);
        }
    }
}
