//! Runtime state of each server slot: live connection count, blacklist deadline, totals.
//!
//! The table has a fixed size ([`MAX_SERVERS`]) and lives beside the settings snapshot, so a
//! reload never resets a counter and the data plane never sees the table move. Every field
//! is an atomic: the per-connection path takes no lock. Each slot is cache-line aligned so
//! two cores updating neighbouring servers do not contend.

use std::sync::atomic::{
    AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed, Ordering::SeqCst,
};

use tokio::sync::Notify;

use crate::command::MAX_SERVERS;
use crate::settings::Settings;

/// Live state of one server (or of the emergency / abuse server).
#[derive(Debug, Default)]
#[repr(align(64))]
pub struct ServerState {
    /// Connections currently open to this server.
    pub conns: AtomicU32,
    /// `clock::now_ms()` until which the server is blacklisted; 0 = not blacklisted.
    pub blacklisted_until: AtomicU64,
    /// The blacklist was the operator's (`server N blacklist T`), not a failed connect's:
    /// a client with no server left does not try this one anyway.
    pub blacklisted_by_hand: AtomicBool,
    /// Connections ever made to this server.
    pub total: AtomicU64,
    /// Failed connection attempts.
    pub failures: AtomicU64,
    /// Bytes relayed from clients to this server.
    pub bytes_to: AtomicU64,
    /// Bytes relayed from this server to clients.
    pub bytes_from: AtomicU64,
    /// What the active health check says ([`Health`] as a byte); written only by the
    /// server's check task.
    pub health: AtomicU8,
    /// Health checks that passed / failed since the process started.
    pub checks_passed: AtomicU64,
    pub checks_failed: AtomicU64,
    /// `server N drain`: no new connections; open ones finish.
    pub draining: AtomicBool,
    /// `clock::now_ms()` when the health check last brought the server back (0 = never):
    /// the start of its slow-start ramp.
    pub up_since: AtomicU64,
    /// Requests sent to this server one by one (request-level proxying: HTTP/1.x clients
    /// over the pool, HTTP/2 clients' streams).
    pub requests: AtomicU64,
    /// Of those, the ones sent over a pooled connection an earlier request had used.
    pub reused: AtomicU64,
    /// Final answers of the server to HTTP requests (`http`), by status class.
    pub answers: Answers,
    /// Pooled (request-level) connections open to this server, busy or idle.
    pub pool_open: AtomicU32,
    /// Of those, the ones idle in the pool.
    pub pool_idle: AtomicU32,
    /// Clients (connections, or requests) waiting for this server to have room
    /// (`queue_timeout`), low 32 bits, and places handed to them by leases that ended,
    /// not yet taken, high 32 bits (never more than are waiting): one word, so that a
    /// lease ending and a client leaving the queue agree on who has a place.
    queue: AtomicU64,
    /// Rung for one waiting client (the longest waiting) when a place is handed over.
    pub freed: Notify,
    /// The server's `max`, and the limit for tracked clients going back to it (its `hard`,
    /// else its `max`), of the settings published last (0: none): mirrored here by
    /// [`ServerTable::mirror_limits`] at each publication, so that a client that chose
    /// under an older snapshot, or waits in the queue, sees a limit changed since, and an
    /// ending place knows whether it frees room under `max`.
    pub max: AtomicU32,
    pub hard: AtomicU32,
    /// UDP: `clock::now_ms()` when an answer of the server last reached a client (0 =
    /// never): a datagram left unanswered while the server answers others is no sign that
    /// the server failed (a query it chose to drop, a one-way message).
    pub last_answer: AtomicU64,
    /// `clock::now_ms()` when a client last tried this server despite its blacklist (0 =
    /// never): at most one such try a [`PROBE_EVERY_MS`], so that while every server is
    /// down a flood of clients does not become a flood of connects to them.
    pub probed_at: AtomicU64,
}

/// A server's final answers to HTTP requests, by status class (`1xx` is a `101` switch to
/// another protocol: interim answers are not counted), and the requests whose clients left
/// before their answers had ended. Answers quill gives itself (its 502 in place of one it
/// could not frame, 503, 504) are not the server's and are not here.
#[derive(Debug, Default)]
pub struct Answers {
    classes: [AtomicU64; 6],
    /// Requests given to the server whose clients left (closed or reset their connection,
    /// or an HTTP/2 stream) before the answer had ended: before its head, or in its body.
    /// Counted apart from the classes: an answer whose body was cut also has its status
    /// counted there.
    abandoned: AtomicU64,
}

impl Answers {
    /// The classes' names, in the order [`Answers::get`] numbers them; `other` is a status
    /// outside 100–599.
    pub const CLASSES: [&'static str; 6] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"];

    /// Counts one answer with status `code`.
    pub fn count(&self, code: u16) {
        self.classes[class(code)].fetch_add(1, Relaxed);
    }

    /// Adds what a connection tallied.
    pub fn add(&self, tally: &Tally) {
        for (total, n) in self.classes.iter().zip(tally.0) {
            if n > 0 {
                total.fetch_add(u64::from(n), Relaxed);
            }
        }
    }

    /// Answers of class `class` (an index into [`Answers::CLASSES`]).
    pub fn get(&self, class: usize) -> u64 {
        self.classes.get(class).map_or(0, |n| n.load(Relaxed))
    }

    /// Counts `n` requests whose clients left before their answers had ended.
    pub fn abandon(&self, n: u64) {
        if n > 0 {
            self.abandoned.fetch_add(n, Relaxed);
        }
    }

    /// Requests whose clients left before their answers had ended.
    pub fn abandoned(&self) -> u64 {
        self.abandoned.load(Relaxed)
    }
}

/// The index of `code`'s class in [`Answers::CLASSES`].
fn class(code: u16) -> usize {
    match code {
        100..=599 => usize::from(code / 100 - 1),
        _ => 5,
    }
}

/// Answers counted on one connection before they are added to their server's
/// [`Answers`]: plain numbers, for code that shares nothing.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally([u32; 6]);

impl Tally {
    /// One answer with status `code` (what a test expects).
    #[cfg(test)]
    pub fn of(code: u16) -> Tally {
        let mut t = Tally::default();
        t.count(code);
        t
    }

    pub fn count(&mut self, code: u16) {
        let class = class(code);
        self.0[class] = self.0[class].saturating_add(1);
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|&n| n == 0)
    }
}

/// How often a blacklisted server is tried anyway by a client with no other server left.
pub const PROBE_EVERY_MS: u64 = 1_000;

/// A place on a server for one connection or request: counted in the server's `conns`
/// while it lives, given back (or handed to a waiting client) when it drops, so that every
/// place taken is given back exactly once. (UDP flows, which never wait, count directly.)
#[derive(Debug)]
#[must_use = "dropping a place gives it back"]
pub struct Place<'s>(&'s ServerState);

impl<'s> Place<'s> {
    /// A place whatever the server's limit (the emergency and abuse servers, a request
    /// sent again on a new connection).
    pub fn take(server: &'s ServerState) -> Place<'s> {
        server.conns.fetch_add(1, Relaxed);
        Place(server)
    }

    /// A place only if the server is below `limit` (0: no limit): the check and the count
    /// in one step, so that event loops choosing at once never pass the limit.
    pub fn claim(server: &'s ServerState, limit: u32) -> Option<Place<'s>> {
        if limit == 0 {
            return Some(Place::take(server));
        }
        server
            .conns
            .fetch_update(Relaxed, Relaxed, |n| (n < limit).then_some(n + 1))
            .ok()
            .map(|_| Place(server))
    }

    /// The server the place is on.
    pub fn server(&self) -> &'s ServerState {
        self.0
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// The two halves of [`ServerState::queue`]: clients waiting, places handed to them.
fn split(queue: u64) -> (u32, u32) {
    (queue as u32, (queue >> 32) as u32)
}

fn join(waiting: u32, handed: u32) -> u64 {
    u64::from(waiting) | (u64::from(handed) << 32)
}

fn waiting(queue: u64) -> u32 {
    split(queue).0
}

/// The verdict of a server's active health check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Health {
    /// No health check applies (or none has answered yet): the server counts as up.
    Unchecked = 0,
    Up = 1,
    /// `check_fall` checks in a row failed: skipped like a blacklisted server.
    Down = 2,
}

impl Health {
    pub fn word(self) -> &'static str {
        match self {
            Health::Unchecked => "unchecked",
            Health::Up => "up",
            Health::Down => "down",
        }
    }
}

/// What a server is doing now, named the same way by every report (`servers`, `status`,
/// JSON, Prometheus's `quill_server_state`, the dashboard). A new condition is one variant
/// here, listed in `ALL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    /// Selectable.
    Up,
    /// Skipped until its blacklist time runs out (a failure, or `server N blacklist T`).
    Blacklisted,
    /// `server N drain`: no new connections; open ones finish.
    Draining,
    /// Its health check failed `check_fall` times in a row.
    Down,
}

impl Condition {
    /// Every condition, in the order reports list them.
    pub const ALL: &'static [Condition] = &[
        Condition::Up,
        Condition::Blacklisted,
        Condition::Draining,
        Condition::Down,
    ];

    /// The word reports use.
    pub fn word(self) -> &'static str {
        match self {
            Condition::Up => "up",
            Condition::Blacklisted => "blacklisted",
            Condition::Draining => "draining",
            Condition::Down => "down",
        }
    }
}

impl ServerState {
    /// A place ends ([`Place`]'s drop). A client waiting for room here gets it: it stays
    /// counted in `conns`, so that no client arriving now takes it first, and the longest
    /// waiting is woken to take it ([`ServerState::take_handed`]). A place that leaves the
    /// server at or over its `max` (lowered meanwhile, or passed by tracked clients under
    /// `hard`) frees no room: it is given back, and nobody is woken.
    fn release(&self) {
        let max = self.max.load(Relaxed);
        // The count is looked at only when a client waits for a place.
        let frees_room = || max == 0 || self.conns.load(SeqCst) <= max;
        let handed = self
            .queue
            .fetch_update(SeqCst, SeqCst, |q| {
                let (waiting, handed) = split(q);
                (waiting > handed && frees_room()).then(|| join(waiting, handed + 1))
            })
            .is_ok();
        if handed {
            self.freed.notify_one();
            return;
        }
        let left = self.conns.fetch_sub(1, SeqCst).saturating_sub(1);
        // A client that began to wait since the look above may have looked at `conns`
        // before the decrement (SeqCst both sides: one of the two sees the other).
        if (max == 0 || left < max) && waiting(self.queue.load(SeqCst)) > 0 {
            self.freed.notify_one();
        }
    }

    /// Clients waiting for room here now.
    pub fn waiting(&self) -> u32 {
        waiting(self.queue.load(Relaxed))
    }

    /// A client begins to wait for room here; it looks at `conns` again only after this.
    pub fn start_waiting(&self) {
        self.queue.fetch_add(1, SeqCst);
    }

    /// A waiting client takes a place a lease handed over (counted in `conns` already),
    /// and no longer waits here; `None` when none is there.
    pub fn take_handed(&self) -> Option<Place<'_>> {
        self.queue
            .fetch_update(SeqCst, SeqCst, |q| {
                let (waiting, handed) = split(q);
                (handed > 0).then(|| join(waiting - 1, handed - 1))
            })
            .ok()
            .map(|_| Place(self))
    }

    /// A waiting client leaves without a handed place (it found room elsewhere, gave up,
    /// or went away). A place handed over that no client is left to take is given back.
    pub fn stop_waiting(&self) {
        let before = self
            .queue
            .fetch_update(SeqCst, SeqCst, |q| {
                let (waiting, handed) = split(q);
                let waiting = waiting.saturating_sub(1);
                Some(join(waiting, handed.min(waiting)))
            })
            .unwrap_or_default();
        let (waiting, handed) = split(before);
        if handed > waiting.saturating_sub(1) {
            self.conns.fetch_sub(1, SeqCst);
        }
    }

    /// Whether the server is blacklisted at `now` (milliseconds of [`super::clock`]).
    pub fn is_blacklisted(&self, now: u64) -> bool {
        self.blacklisted_until.load(Relaxed) > now
    }

    /// Avoid this server for `seconds` from `now`; 0 whitelists it. Whether the server
    /// was in use until now (not blacklisted at `now`): of event loops that blacklist it
    /// at once, one sees that.
    pub fn blacklist(&self, now: u64, seconds: u64) -> bool {
        self.blacklisted_by_hand.store(false, Relaxed);
        self.put_on_blacklist(now, seconds)
    }

    /// [`ServerState::blacklist`], by the operator's command.
    pub fn blacklist_by_hand(&self, now: u64, seconds: u64) -> bool {
        self.blacklisted_by_hand.store(seconds > 0, Relaxed);
        self.put_on_blacklist(now, seconds)
    }

    fn put_on_blacklist(&self, now: u64, seconds: u64) -> bool {
        let until = if seconds == 0 {
            0
        } else {
            now.saturating_add(seconds.saturating_mul(1000))
        };
        self.blacklisted_until.swap(until, Relaxed) <= now
    }

    /// The health check's verdict.
    pub fn health(&self) -> Health {
        match self.health.load(Relaxed) {
            1 => Health::Up,
            2 => Health::Down,
            _ => Health::Unchecked,
        }
    }

    pub fn set_health(&self, h: Health) {
        self.health.store(h as u8, Relaxed);
    }

    /// Whether new connections must avoid this server for a reason other than the
    /// blacklist: its health check says down, or it is being drained.
    pub fn is_out(&self) -> bool {
        self.health.load(Relaxed) == Health::Down as u8 || self.draining.load(Relaxed)
    }

    /// The state word of reports: down, draining, blacklisted or up.
    pub fn state_word(&self, now: u64) -> &'static str {
        self.condition(now).word()
    }

    /// What the server is doing at `now`; the first that applies of down, draining,
    /// blacklisted, up.
    pub fn condition(&self, now: u64) -> Condition {
        if self.health() == Health::Down {
            Condition::Down
        } else if self.draining.load(Relaxed) {
            Condition::Draining
        } else if self.is_blacklisted(now) {
            Condition::Blacklisted
        } else {
            Condition::Up
        }
    }

    /// The weight to balance with at `now`: during the slow-start ramp after the server
    /// came back, a share of `weight` growing linearly over `ramp_ms` (at least 1).
    pub fn effective_weight(&self, weight: u32, now: u64, ramp_ms: u64) -> u32 {
        let since = self.up_since.load(Relaxed);
        if ramp_ms == 0 || since == 0 || weight == 0 {
            return weight;
        }
        let elapsed = now.saturating_sub(since);
        if elapsed >= ramp_ms {
            return weight;
        }
        let w = u128::from(weight) * u128::from(elapsed) / u128::from(ramp_ms);
        u32::try_from(w).unwrap_or(weight).max(1)
    }

    /// Seconds of blacklist left at `now` (0 when not blacklisted).
    pub fn blacklist_left(&self, now: u64) -> u64 {
        self.blacklisted_until
            .load(Relaxed)
            .saturating_sub(now)
            .div_ceil(1000)
    }
}

/// The fixed table of server states, indexed by server number.
#[derive(Debug)]
pub struct ServerTable {
    slots: Box<[ServerState]>,
    /// Rung for every waiting client when a change may have given them room elsewhere
    /// than in the queues they wait in: settings with other servers (a `max` raised, a
    /// server added or readdressed), a server back (its health check, the end of a drain,
    /// a blacklist lifted by command). They look again, and wait again at the back if it
    /// did not.
    pub changed: Notify,
}

impl Default for ServerTable {
    fn default() -> ServerTable {
        ServerTable {
            slots: (0..MAX_SERVERS).map(|_| ServerState::default()).collect(),
            changed: Notify::new(),
        }
    }
}

impl ServerTable {
    /// State of server `index`; indexes come from settings, which the parser bounds.
    pub fn get(&self, index: usize) -> Option<&ServerState> {
        self.slots.get(index)
    }

    /// Copies the servers' limits of `settings`, about to be published, into their states
    /// (a slot without a server: none).
    pub fn mirror_limits(&self, settings: &Settings) {
        for (i, slot) in self.slots.iter().enumerate() {
            let (max, hard) = settings
                .servers
                .get(i)
                .map_or((0, 0), |conf| (conf.max, conf.hard_limit()));
            slot.max.store(max, Relaxed);
            slot.hard.store(hard, Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conns(s: &ServerState) -> u32 {
        s.conns.load(Relaxed)
    }

    #[test]
    fn a_claim_stops_at_the_limit() {
        let s = ServerState::default();
        let (a, b) = (Place::claim(&s, 2), Place::claim(&s, 2));
        assert!(a.is_some() && b.is_some());
        assert!(Place::claim(&s, 2).is_none(), "a third place under max 2");
        let c = Place::claim(&s, 0);
        assert!(c.is_some(), "no limit");
        assert_eq!(conns(&s), 3);
        drop((a, b, c));
        assert_eq!(conns(&s), 0);
    }

    #[test]
    fn an_ending_lease_hands_its_place_to_a_waiting_client() {
        let s = ServerState::default();
        let first = Place::claim(&s, 1);
        s.start_waiting();
        drop(first);
        // The place stays counted: a client arriving now finds the server full.
        assert_eq!(conns(&s), 1);
        assert!(Place::claim(&s, 1).is_none());
        let handed = s.take_handed();
        assert!(handed.is_some());
        assert_eq!(s.waiting(), 0);
        assert!(s.take_handed().is_none(), "one place, taken once");
        drop(handed);
        assert_eq!(conns(&s), 0, "nobody waits: the place is free");
    }

    #[test]
    fn a_place_handed_to_a_client_that_left_is_given_back() {
        let s = ServerState::default();
        let first = Place::claim(&s, 1);
        s.start_waiting();
        s.start_waiting();
        drop(first);
        // One of two waiters leaves: the other is there to take the place.
        s.stop_waiting();
        assert_eq!(conns(&s), 1);
        // The last one leaves too without taking it: nobody will; it is free again.
        s.stop_waiting();
        assert_eq!((conns(&s), s.waiting()), (0, 0));
        assert!(Place::claim(&s, 1).is_some());
    }

    #[test]
    fn answers_are_counted_by_status_class() {
        let mut tally = Tally::default();
        assert!(tally.is_empty());
        for code in [101, 200, 204, 299, 301, 404, 500, 599, 600, 0, 99] {
            tally.count(code);
        }
        let answers = Answers::default();
        answers.add(&tally);
        answers.count(503);
        let counts: Vec<u64> = (0..Answers::CLASSES.len())
            .map(|c| answers.get(c))
            .collect();
        assert_eq!(counts, [1, 3, 1, 1, 3, 3]);
        assert_eq!(Answers::CLASSES[5], "other");
        assert_eq!(answers.get(6), 0, "no class beyond the last");
    }

    #[test]
    fn a_place_over_a_lowered_max_is_given_back_not_handed_on() {
        let s = ServerState::default();
        s.max.store(3, Relaxed);
        let places: Vec<_> = (0..3).filter_map(|_| Place::claim(&s, 3)).collect();
        s.start_waiting();
        s.max.store(1, Relaxed);
        let mut places = places.into_iter();
        // Three open under max 1: the first two that end free no room.
        drop(places.next());
        drop(places.next());
        assert_eq!((conns(&s), s.waiting()), (1, 1));
        assert!(s.take_handed().is_none());
        // The last one's place is room under max 1: the waiting client gets it.
        drop(places.next());
        assert_eq!(conns(&s), 1);
        assert!(s.take_handed().is_some());
    }

    #[test]
    fn a_waiting_client_that_leaves_before_any_lease_ends_changes_nothing() {
        let s = ServerState::default();
        let first = Place::claim(&s, 1);
        s.start_waiting();
        s.stop_waiting();
        assert_eq!((conns(&s), s.waiting()), (1, 0));
        drop(first);
        assert_eq!(conns(&s), 0);
    }
}
