//! Busy polling, only under load and only where it pays, for the event loops (UDP and TCP).
//!
//! A loop that sleeps in epoll whenever its queue is empty for a moment must be woken by
//! the sender of the next packet: an inter-processor interrupt and two context switches,
//! paid mostly by the *sender's* core (measured on the benchmark's 2-core machine: up to a
//! sixth of the load core's time). Under heavy traffic that can cost more than the packet
//! itself, so a busy loop may poll instead of sleeping. Whether it does depends on the
//! hardware behind the cores (how a halted virtual CPU is woken, what shares the physical
//! core): the same build gained 19 % keep-alive requests/s by polling on one host and next
//! to nothing on another. So a busy loop tries both ([`Judge`]) and polls only where that
//! moved more bytes per second, or per unit of the whole machine's CPU. Invariants: a loop
//! that is idle or lightly loaded never polls (an idle quill costs no CPU), and a loop whose
//! core is contended (the kernel preempts it while it polls) stops polling for a while.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// What `QUILL_BUSY_POLL` in the environment asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `off`: never poll (the benchmark's `quill-nopoll`).
    Off,
    /// `always`: poll whenever the loop is busy enough, without trying (the rule before
    /// [`Judge`]; the benchmark's `quill-poll`).
    Always,
    /// Anything else, or unset: busy loops try both and keep the better.
    Auto,
}

fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var_os("QUILL_BUSY_POLL") {
        Some(v) if v == "off" => Mode::Off,
        Some(v) if v == "always" => Mode::Always,
        _ => Mode::Auto,
    })
}

/// Whether busy polling may run at all: `QUILL_BUSY_POLL=off` in the environment turns it
/// off, for the benchmark's A/B of what polling costs the whole machine at paced loads.
pub(crate) fn allowed() -> bool {
    mode() != Mode::Off
}

/// What the loops' polling does, for the metrics (`event_loops_polling`, `polling_trials`).
pub(crate) struct Stats {
    /// Event loops polling now.
    pub(crate) polling: AtomicU64,
    /// Trials that kept polling, and trials that chose sleeping.
    pub(crate) trials_poll: AtomicU64,
    pub(crate) trials_sleep: AtomicU64,
}

pub(crate) static STATS: Stats = Stats {
    polling: AtomicU64::new(0),
    trials_poll: AtomicU64::new(0),
    trials_sleep: AtomicU64::new(0),
};

thread_local! {
    /// Bytes this thread's event loop has moved (read from one peer for another): the work
    /// a [`Judge`] compares between polling and sleeping.
    static MOVED: Cell<u64> = const { Cell::new(0) };
}

/// The data plane moved `bytes` (or, for UDP, received datagrams: any unit a loop counts
/// the same way in both modes).
#[inline]
pub(crate) fn moved(bytes: u64) {
    MOVED.with(|m| m.set(m.get().wrapping_add(bytes)));
}

/// What this thread's loop has moved so far ([`moved`]; wraps).
pub(crate) fn moved_so_far() -> u64 {
    MOVED.get()
}

/// The whole machine's busy time so far, in clock ticks (user, nice, system, irq, softirq
/// and steal of every CPU, from the first line of `/proc/stat`); `None` where it cannot be
/// read.
fn machine_busy() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    parse_machine_busy(stat.lines().next()?)
}

fn parse_machine_busy(line: &str) -> Option<u64> {
    let mut fields = line.split_ascii_whitespace();
    if fields.next()? != "cpu" {
        return None;
    }
    let ticks: Vec<u64> = fields.map(|f| f.parse().ok()).collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
    let busy = |i: usize| ticks.get(i).copied().unwrap_or(0);
    (ticks.len() >= 4).then(|| busy(0) + busy(1) + busy(2) + busy(5) + busy(6) + busy(7))
}

/// A reading taken at a trial window's edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    /// [`moved`] so far on this thread.
    pub(crate) work: u64,
    /// [`machine_busy`] so far.
    pub(crate) busy: u64,
}

impl Sample {
    fn now() -> Option<Sample> {
        Some(Sample {
            work: MOVED.with(Cell::get),
            busy: machine_busy()?,
        })
    }
}

/// How long one trial window lasts. Windows are cut on one clock for every loop of the
/// process, so all loops poll, or sleep, in the same windows: the machine's CPU, what the
/// work is divided by, is theirs together. Short, so that the host's own swings (a
/// neighbour's burst moved a 0.3 s window's work by half on the benchmark's virtual
/// machine) fall on both kinds alike.
const TRIAL_WINDOW: Duration = Duration::from_millis(100);
/// Windows of each kind in one trial (alternating). Enough for the machine's clock ticks
/// (10 ms each) to count its busy time within a few percent.
const TRIAL_PAIRS: u64 = 10;
/// How long a verdict holds before a loop that is still busy tries again: the load may
/// have changed its kind, or the host its neighbours. Each trial that finds the same
/// doubles it, up to [`MAX_HOLD`]; one that finds the other resets it. A trial spends half
/// its windows in the worse mode: at first 1 s in every 17 s of sustained load, then 1 s
/// in every 4 minutes.
const VERDICT_HOLD: Duration = Duration::from_secs(15);
const MAX_HOLD: Duration = Duration::from_secs(240);
/// Polling spins a core: it is kept only when it does this much more work than sleeping,
/// per second or per unit of machine CPU (percent); within the noise, sleeping wins.
const POLL_MARGIN_PERCENT: u64 = 3;
/// A trial ends early, for sleeping, once [`EARLY_PAIRS`] of each kind show polling
/// this much (percent) less work per unit of machine CPU and no more per second: a
/// moderately loaded loop that polls spins for nothing (measured: +13 µs of machine CPU per
/// UDP query at 10,000 q/s while trials ran whole).
const CLEARLY_WORSE_PERCENT: u64 = 10;
const EARLY_PAIRS: u64 = 3;

/// Work, machine time and wall time summed over the windows of one kind.
#[derive(Debug, Default, Clone, Copy)]
struct Sum {
    work: u64,
    busy: u64,
    /// Microseconds from each window's first look to the next window's: a polling loop
    /// looks up to a load window late.
    micros: u64,
    windows: u64,
}

#[derive(Debug)]
enum Phase {
    /// A verdict (`poll`), good until `until`.
    Settled { poll: bool, until: Instant },
    /// A trial under way: the window index, time and sample of the last edge seen, and
    /// the sums of the whole windows measured so far (polling, sleeping).
    Trying {
        last: Option<(u64, Instant, Sample)>,
        polled: Sum,
        slept: Sum,
    },
}

/// Decides, by trying, whether a busy loop polls: even trial windows poll, odd ones sleep,
/// and after [`TRIAL_PAIRS`] of each polling is kept for [`VERDICT_HOLD`] if it moved more
/// bytes per second (the loop's clients were waiting for its wake-ups: saturation), or as
/// many for less of the machine's CPU (the senders' wake-ups saved); else sleeping is. Sans-IO: readings come from the caller. A window whose
/// start edge was missed (the loop did not look in time) is not counted.
#[derive(Debug)]
pub(crate) struct Judge {
    epoch: Instant,
    phase: Phase,
    /// The last trial's verdict, and how long it held.
    verdict: Option<bool>,
    hold: Duration,
}

impl Judge {
    pub(crate) fn new(epoch: Instant) -> Judge {
        Judge {
            epoch,
            phase: Phase::Settled {
                poll: false,
                until: epoch,
            },
            verdict: None,
            hold: VERDICT_HOLD,
        }
    }

    /// Ends a trial at `now` with `poll`.
    fn settle(&mut self, now: Instant, poll: bool) -> bool {
        self.hold = if self.verdict == Some(poll) {
            (self.hold * 2).min(MAX_HOLD)
        } else {
            VERDICT_HOLD
        };
        self.verdict = Some(poll);
        let count = if poll {
            &STATS.trials_poll
        } else {
            &STATS.trials_sleep
        };
        count.fetch_add(1, Relaxed);
        self.phase = Phase::Settled {
            poll,
            until: now + self.hold,
        };
        poll
    }

    fn window(&self, now: Instant) -> u64 {
        let since = now.saturating_duration_since(self.epoch).as_millis();
        u64::try_from(since / TRIAL_WINDOW.as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a trial is under way (it runs to its end even if the loop's load dips).
    pub(crate) fn trying(&self) -> bool {
        matches!(self.phase, Phase::Trying { .. })
    }

    /// When the current trial window ends, during a trial: a loop that sleeps must look
    /// again then.
    pub(crate) fn window_end(&self, now: Instant) -> Option<Instant> {
        self.trying().then(|| {
            let next = u32::try_from(self.window(now) + 1).unwrap_or(u32::MAX);
            self.epoch + TRIAL_WINDOW * next
        })
    }

    /// Whether a loop that is busy enough to poll should poll now. `sample` is called at
    /// most once, and only at a window's edge during a trial; `None` (no `/proc/stat`)
    /// gives up trying and polls, as the rule without a judge did.
    pub(crate) fn polls(&mut self, now: Instant, sample: impl FnOnce() -> Option<Sample>) -> bool {
        if let Phase::Settled { poll, until } = self.phase {
            if now < until {
                return poll;
            }
            self.phase = Phase::Trying {
                last: None,
                polled: Sum::default(),
                slept: Sum::default(),
            };
        }
        let index = self.window(now);
        let Phase::Trying {
            last,
            polled,
            slept,
        } = &mut self.phase
        else {
            return false;
        };
        if last.map_or(true, |(seen, _, _)| seen != index) {
            let Some(reading) = sample() else {
                self.phase = Phase::Settled {
                    poll: true,
                    until: now + VERDICT_HOLD * 40,
                };
                return true;
            };
            if let Some((seen, then, before)) = *last {
                if seen + 1 == index {
                    let sum = if seen % 2 == 0 {
                        &mut *polled
                    } else {
                        &mut *slept
                    };
                    sum.work += reading.work.wrapping_sub(before.work);
                    sum.busy += reading.busy.saturating_sub(before.busy);
                    let took = now.saturating_duration_since(then).as_micros();
                    sum.micros += u64::try_from(took).unwrap_or(u64::MAX);
                    sum.windows += 1;
                }
            }
            *last = Some((index, now, reading));
            let (polled, slept) = (*polled, *slept);
            let whole = polled.windows >= TRIAL_PAIRS && slept.windows >= TRIAL_PAIRS;
            let early = polled.windows >= EARLY_PAIRS
                && slept.windows >= EARLY_PAIRS
                && clearly_worse_polling(polled, slept);
            if whole || early {
                let poll = !early && better_polling(polled, slept);
                tracing::debug!(
                    poll,
                    early,
                    polled_work = polled.work,
                    polled_busy = polled.busy,
                    slept_work = slept.work,
                    slept_busy = slept.busy,
                    "busy polling trial"
                );
                return self.settle(now, poll);
            }
        }
        index % 2 == 0
    }
}

/// `a / b` exceeds `c / d` by more than `percent`, without division (false without time).
fn ahead(a: u64, b: u64, c: u64, d: u64, percent: u64) -> bool {
    b > 0
        && d > 0
        && u128::from(a) * u128::from(d) * 100
            > u128::from(c) * u128::from(b) * u128::from(100 + percent)
}

/// Whether polling did more work than sleeping, by the margin, per second or per unit of
/// machine time.
fn better_polling(polled: Sum, slept: Sum) -> bool {
    let margin = POLL_MARGIN_PERCENT;
    ahead(polled.work, polled.micros, slept.work, slept.micros, margin)
        || ahead(polled.work, polled.busy, slept.work, slept.busy, margin)
}

/// Whether polling is already clearly the worse: no more work per second, and far less
/// per unit of machine time.
fn clearly_worse_polling(polled: Sum, slept: Sum) -> bool {
    !ahead(
        polled.work,
        polled.micros,
        slept.work,
        slept.micros,
        POLL_MARGIN_PERCENT,
    ) && ahead(
        slept.work,
        slept.busy,
        polled.work,
        polled.busy,
        CLEARLY_WORSE_PERCENT,
    )
}

/// The instant trial windows are counted from, one for the whole process.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
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

/// The share of a window a loop must spend working before it polls (`num / den`), and the
/// share below which a polling loop goes back to sleeping (`stay_num / den`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Share {
    pub(crate) num: u32,
    pub(crate) stay_num: u32,
    pub(crate) den: u32,
}

impl Share {
    /// Whether `busy` of a `window` is enough to poll, for a loop that is `polling` now
    /// (then the lower share to go on counts) or sleeping.
    fn exceeded(self, busy: Duration, window: Duration, polling: bool) -> bool {
        let num = if polling { self.stay_num } else { self.num };
        busy * self.den > window * num
    }
}

/// UDP loops: a quarter (measured: polling saves a third of the machine CPU per query at
/// 20,000 queries/s).
pub(crate) const UDP_SHARE: Share = Share {
    num: 1,
    stay_num: 1,
    den: 4,
};
/// TCP loops: half a window to start polling, a quarter to go on. Before the [`Judge`]
/// tried polling against sleeping, the share alone decided, and it was three quarters: at
/// a quarter a TCP loop polled at every paced load of the efficiency bench and cost more
/// than it saved (2026-11-24). With the judge deciding, the share only says which loops
/// are worth a trial, and three quarters left out the case polling is for: at saturated
/// keep-alive with the load generator and the server on the other core, the loop works
/// 0.52–0.76 of its time (the other core is the bottleneck; polling spares it the loop's
/// wake-ups), so it seldom polled, even with `QUILL_BUSY_POLL=always` (2026-11-28, AMD
/// host: 0.64–0.75 of the time busy, 13–19 k context switches a second either way). At
/// the 5 ms pace the loop works a quarter of its time, at the 1 ms pace 0.46, with a new
/// connection per request at 5 ms 0.78. Once polling, the loop measures its work by its
/// turns, which take less time without the wake-ups: it goes on at a quarter, so that a
/// loop the judge found polling pays for does not drop out of it at the next window.
pub(crate) const TCP_SHARE: Share = Share {
    num: 2,
    stay_num: 1,
    den: 4,
};

/// The load of one event loop. Once the loop has spent more than its [`Share`] of the last
/// window working, and its [`Judge`] finds that polling pays, it keeps polling, without
/// sleeping, for [`SPIN`] after each piece of work; the load measured over the current
/// window decides again at its end.
pub(crate) struct Load {
    share: Share,
    window_start: Instant,
    busy: Duration,
    last: Instant,
    hot: bool,
    judge: Judge,
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
            judge: Judge::new(epoch()),
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

    /// Ends the window at `now`: polling goes on only if the loop was busy enough (or is
    /// in the middle of a trial), its core was not contended, and polling pays.
    fn decide(&mut self, now: Instant, window: Duration) {
        let preempted = preemptions();
        if self.hot && preempted - self.preempted > MAX_PREEMPTIONS {
            self.calm_until = now + CONTENDED_BACKOFF;
        }
        self.preempted = preempted;
        let was = self.hot;
        let busy = self.share.exceeded(self.busy, window, was);
        self.hot = (busy || self.judge.trying())
            && now >= self.calm_until
            && match mode() {
                Mode::Off => false,
                Mode::Always => true,
                Mode::Auto => self.judge.polls(now, Sample::now),
            };
        if self.hot != was {
            if self.hot {
                STATS.polling.fetch_add(1, Relaxed);
            } else {
                STATS.polling.fetch_sub(1, Relaxed);
            }
        }
        self.busy = Duration::ZERO;
        self.window_start = now;
    }

    /// Whether to poll rather than sleep now. A pause longer than [`SPIN`] sleeps.
    pub(crate) fn spinning(&self) -> bool {
        self.hot && self.last.elapsed() < SPIN
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        if self.hot {
            STATS.polling.fetch_sub(1, Relaxed);
        }
    }
}

/// A turn of the event loop with nothing to do (a zero-timeout epoll_wait and the
/// scheduler's bookkeeping) takes about a microsecond; a longer one ran connections.
const EMPTY_TURN: Duration = Duration::from_micros(4);
/// While a TCP loop is not polling, how often its load is measured (from the thread's CPU
/// time, so a loop with work wakes only this often for it).
const COLD_WINDOW: Duration = Duration::from_millis(100);
/// How far the cold window grows, doubling each time, while the loop stays idle: the
/// loop of an idle process wakes for it about once in two seconds instead of ten times a
/// second. A new client connection ends such a window at once ([`stir`]); load that rises
/// on connections already open is seen at most this much later.
const IDLE_WINDOW: Duration = Duration::from_millis(3200);
/// The share of a cold window (a hundredth) below which the loop counts as idle: far
/// below [`TCP_SHARE`], and above what the measurement's own wake-up costs: on the 2-core
/// virtual machines of bench/RESULTS.md a return from a sleeping epoll_wait is charged
/// 40–130 µs of the thread's run time (`bench/wakeup`), most of a thousandth of 100 ms.
const IDLE_PERCENT: u32 = 1;
/// While a TCP loop polls but has had nothing to do for [`SPIN`], how long it sleeps
/// before it polls again (the loop still wakes at once for any event meanwhile).
const PAUSE: Duration = Duration::from_millis(1);

thread_local! {
    /// The waker of this loop's [`poll_while_busy`] while it sleeps through a grown idle
    /// window.
    static DOZING: Cell<Option<Waker>> = const { Cell::new(None) };
}

/// A client connection came to this event loop: if the loop's load measurement is dozing
/// through a long idle window, a short window starts now, so that a loop going from idle
/// to busy is judged as soon as one going from busy to busier. A thread-local read per
/// connection.
pub(crate) fn stir() {
    if let Some(w) = DOZING.take() {
        w.wake();
    }
}

/// Sleeps until `deadline`, or until [`stir`] is called first: whether it was.
async fn doze_until(deadline: Instant) -> bool {
    let sleep = tokio::time::sleep_until(deadline.into());
    tokio::pin!(sleep);
    let mut dozing = false;
    let stirred = std::future::poll_fn(|cx| {
        if std::future::Future::poll(sleep.as_mut(), cx).is_ready() {
            return Poll::Ready(false);
        }
        // `stir` takes the waker; the timer's own wake-ups before the deadline leave it.
        let waker = DOZING.take();
        if dozing && waker.is_none() {
            return Poll::Ready(true);
        }
        DOZING.set(Some(match waker {
            Some(w) if w.will_wake(cx.waker()) => w,
            _ => cx.waker().clone(),
        }));
        dozing = true;
        Poll::Pending
    })
    .await;
    DOZING.set(None);
    stirred
}

/// Keeps a TCP event loop polling while it is busy. Run as one task on each loop: when
/// polling, it yields on every turn, so the runtime polls epoll with a zero timeout between
/// the connections' work instead of sleeping in it; a turn that took longer than
/// [`EMPTY_TURN`] counts as work. When not polling, it measures the loop's CPU time over
/// [`COLD_WINDOW`]s (growing to [`IDLE_WINDOW`] while the loop is idle) and starts polling
/// once [`TCP_SHARE`] of a window was spent working and its [`Judge`] finds that polling
/// pays.
pub(crate) async fn poll_while_busy() {
    if !allowed() {
        return;
    }
    let mut load = Load::new(TCP_SHARE);
    let mut cold = COLD_WINDOW;
    loop {
        if !load.hot {
            let (start, cpu) = (Instant::now(), thread_cpu());
            let stirred = match load.judge.window_end(start) {
                // During a trial, look again when its window ends: the next one may poll.
                Some(end) => {
                    tokio::time::sleep_until(end.min(start + COLD_WINDOW).into()).await;
                    false
                }
                None if cold > COLD_WINDOW => doze_until(start + cold).await,
                None => {
                    tokio::time::sleep_until((start + cold).into()).await;
                    false
                }
            };
            if stirred {
                cold = COLD_WINDOW;
                continue;
            }
            let now = Instant::now();
            load.busy = thread_cpu().saturating_sub(cpu);
            cold = next_cold_window(cold, load.busy, now.saturating_duration_since(start));
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

/// The cold window after one of `length` in which the loop worked `busy`: twice as long
/// (up to [`IDLE_WINDOW`]) if the loop was idle, else back to [`COLD_WINDOW`].
fn next_cold_window(cold: Duration, busy: Duration, length: Duration) -> Duration {
    if busy * 100 < length * IDLE_PERCENT {
        (cold * 2).min(IDLE_WINDOW)
    } else {
        COLD_WINDOW
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tcp_loop_starts_polling_at_half_its_time_busy_and_goes_on_down_to_a_quarter() {
        let ms = Duration::from_millis;
        let window = ms(100);
        assert!(TCP_SHARE.exceeded(ms(60), window, false));
        assert!(!TCP_SHARE.exceeded(ms(45), window, false));
        assert!(TCP_SHARE.exceeded(ms(45), window, true));
        assert!(TCP_SHARE.exceeded(ms(30), window, true));
        assert!(!TCP_SHARE.exceeded(ms(20), window, true));
        // UDP loops start and go on at the same quarter.
        assert!(UDP_SHARE.exceeded(ms(30), window, false));
        assert!(!UDP_SHARE.exceeded(ms(20), window, true));
    }

    #[test]
    fn an_idle_loop_measures_its_load_less_often_and_a_busy_one_at_once_again() {
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        let mut cold = COLD_WINDOW;
        let mut seen = vec![];
        for _ in 0..6 {
            // 100 µs of a wake-up in a whole window: idle.
            cold = next_cold_window(cold, us(100), cold);
            seen.push(cold.as_millis());
        }
        assert_eq!(seen, [200, 400, 800, 1600, 3200, 3200]);
        // 40 ms of work in 3.2 s is more than a hundredth: measured often again.
        assert_eq!(
            next_cold_window(IDLE_WINDOW, ms(40), IDLE_WINDOW),
            COLD_WINDOW
        );
    }

    /// What one window of each kind does: bytes moved, machine ticks.
    #[derive(Clone, Copy)]
    struct Rates {
        polling: (u64, u64),
        sleeping: (u64, u64),
    }

    /// The cumulative reading at the start of window `i`, for windows counted from `first`.
    fn reading(rates: Rates, first: u64, i: u64) -> Sample {
        let (mut work, mut busy) = (0, 0);
        for w in first..first + i {
            let (w, b) = if w % 2 == 0 {
                rates.polling
            } else {
                rates.sleeping
            };
            work += w;
            busy += b;
        }
        Sample { work, busy }
    }

    /// Drives a judge through `windows` whole trial windows from window `first`, looking
    /// just after each edge, and returns what it said in each.
    fn trial(judge: &mut Judge, first: u64, windows: u64, rates: Rates) -> Vec<bool> {
        (0..windows)
            .map(|i| {
                let index = u32::try_from(first + i).unwrap();
                let at = judge.epoch + TRIAL_WINDOW * index + Duration::from_millis(1);
                judge.polls(at, || Some(reading(rates, first, i)))
            })
            .collect()
    }

    /// Whether a judge trying `rates` keeps polling.
    fn verdict(rates: Rates) -> bool {
        let mut judge = Judge::new(Instant::now());
        let said = trial(&mut judge, 0, 2 * TRIAL_PAIRS + 1, rates);
        assert!(!judge.trying());
        said[said.len() - 1]
    }

    #[test]
    fn a_trial_alternates_polling_and_sleeping_then_keeps_its_verdict() {
        let epoch = Instant::now();
        let mut judge = Judge::new(epoch);
        let rates = Rates {
            polling: (1_150, 100),
            sleeping: (1_000, 100),
        };
        let said = trial(&mut judge, 0, 2 * TRIAL_PAIRS + 1, rates);
        // Polling first, until enough windows of each kind are measured; then the verdict.
        let alternating = (0..2 * TRIAL_PAIRS).map(|i| i % 2 == 0);
        assert_eq!(said, alternating.chain([true]).collect::<Vec<_>>());
        assert!(!judge.trying());
        let later = epoch + TRIAL_WINDOW * 100;
        assert!(judge.polls(later, || panic!("no reading while a verdict holds")));
    }

    #[test]
    fn polling_is_kept_where_it_moves_more_per_second_even_at_more_machine_time() {
        // Saturation: the clients waited for the loop's wake-ups; the machine idled then.
        assert!(verdict(Rates {
            polling: (1_170, 100),
            sleeping: (1_000, 80)
        }));
    }

    #[test]
    fn polling_is_kept_where_it_moves_as_much_for_less_machine_time() {
        // A paced load: the senders no longer pay for waking the loop.
        assert!(verdict(Rates {
            polling: (1_000, 80),
            sleeping: (1_000, 100)
        }));
    }

    #[test]
    fn sleeping_is_kept_where_polling_gains_less_than_the_margin() {
        assert!(!verdict(Rates {
            polling: (1_020, 100),
            sleeping: (1_000, 100)
        }));
        assert!(!verdict(Rates {
            polling: (1_000, 110),
            sleeping: (1_000, 100)
        }));
    }

    #[test]
    fn a_verdict_is_tried_again_once_it_has_held() {
        let epoch = Instant::now();
        let mut judge = Judge::new(epoch);
        trial(
            &mut judge,
            0,
            2 * TRIAL_PAIRS + 1,
            Rates {
                polling: (1_000, 100),
                sleeping: (2_000, 100),
            },
        );
        let end = epoch + TRIAL_WINDOW * u32::try_from(2 * TRIAL_PAIRS + 1).unwrap();
        assert!(!judge.polls(end, || None));
        // Once the verdict has held, the next look starts a trial, which finds polling
        // better this time.
        let index = judge.window(end + VERDICT_HOLD) + 1;
        let said = trial(
            &mut judge,
            index,
            2 * TRIAL_PAIRS + 1,
            Rates {
                polling: (3_000, 100),
                sleeping: (1_000, 100),
            },
        );
        assert!(!judge.trying());
        assert_eq!(said.last(), Some(&true));
    }

    #[test]
    fn a_trial_ends_early_where_polling_is_clearly_the_worse() {
        let mut judge = Judge::new(Instant::now());
        let rates = Rates {
            polling: (1_000, 150),
            sleeping: (1_000, 100),
        };
        let said = trial(&mut judge, 0, 2 * EARLY_PAIRS + 1, rates);
        assert!(!judge.trying());
        assert_eq!(said.last(), Some(&false));
    }

    #[test]
    fn a_verdict_found_again_holds_twice_as_long_up_to_a_limit() {
        let mut judge = Judge::new(Instant::now());
        let rates = Rates {
            polling: (1_200, 100),
            sleeping: (1_000, 100),
        };
        let mut first = 0;
        let mut holds = Vec::new();
        for _ in 0..7 {
            trial(&mut judge, first, 2 * TRIAL_PAIRS + 1, rates);
            let Phase::Settled { poll: true, until } = judge.phase else {
                panic!("polling wins: {:?}", judge.phase);
            };
            holds.push(judge.hold);
            first = judge.window(until) + 2;
        }
        let secs: Vec<u64> = holds.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [15, 30, 60, 120, 240, 240, 240]);
        // The other verdict starts again from the shortest hold.
        let rates = Rates {
            polling: (1_000, 100),
            sleeping: (1_000, 100),
        };
        trial(&mut judge, first, 2 * TRIAL_PAIRS + 1, rates);
        assert_eq!((judge.verdict, judge.hold), (Some(false), VERDICT_HOLD));
    }

    #[test]
    fn a_window_whose_start_was_missed_does_not_count() {
        let epoch = Instant::now();
        let mut judge = Judge::new(epoch);
        let rates = Rates {
            polling: (1_150, 100),
            sleeping: (1_000, 100),
        };
        let look = |judge: &mut Judge, edge: u64| {
            let at = epoch + TRIAL_WINDOW * u32::try_from(edge).unwrap() + Duration::from_millis(1);
            judge.polls(at, || Some(reading(rates, 0, edge)));
        };
        // Every edge up to the last a whole trial needs, but edge 2: neither window 1
        // (sleeping) nor window 2 (polling) can be measured.
        let last = 2 * TRIAL_PAIRS + 1;
        for edge in (0..=last).filter(|&e| e != 2) {
            look(&mut judge, edge);
        }
        // Enough polling windows, one sleeping window short.
        assert!(judge.trying());
        look(&mut judge, last + 1);
        assert!(!judge.trying());
    }

    #[test]
    fn without_the_machine_time_a_busy_loop_polls() {
        let epoch = Instant::now();
        let mut judge = Judge::new(epoch);
        assert!(judge.polls(epoch, || None));
        assert!(!judge.trying());
    }

    #[test]
    fn machine_busy_time_is_everything_but_idle_and_iowait() {
        let line = "cpu  100 2 30 5000 7 4 6 8 50 0";
        assert_eq!(parse_machine_busy(line), Some(100 + 2 + 30 + 4 + 6 + 8));
        assert_eq!(parse_machine_busy("cpu0 1 2 3 4"), None);
        assert_eq!(parse_machine_busy("cpu  1 2 x 4"), None);
        assert_eq!(parse_machine_busy("cpu  1 2"), None);
        assert!(machine_busy().is_some(), "this Linux has /proc/stat");
    }
}
