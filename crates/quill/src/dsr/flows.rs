//! The DSR plane's flow table: the backend each flow this node forwards went to, so that an
//! established flow keeps its backend when the set of backends changes (a server added by a
//! reload, one back from the blacklist). Maglev alone would move a few of those flows, and a
//! TCP flow that reaches a backend which never saw its SYN is answered with a reset.
//!
//! A flow this node has never seen gets Maglev's choice, which depends only on the set of
//! backends up: the same choice another node with the same servers makes, so a flow the
//! router moves between nodes keeps its backend too. The table only adds memory to that.
//!
//! Invariants: lookups hash with a key chosen per process (the flow keys are the clients'
//! addresses and ports, chosen by whoever sends the frames, so no unkeyed hash); an entry
//! names its backend by address, and one whose backend is not up any more is ignored and
//! replaced, never followed. Memory is bounded: each generation holds at most its capacity
//! (a full generation records no new flows, which then get Maglev's choice, the behaviour
//! without a table). Expiry costs O(1) per tick: entries live in generations, a lookup moves
//! an entry it finds in the previous generation into the current one, and each period the
//! previous generation is dropped whole, so an entry idle for two periods is gone. Flows
//! that have sent only SYNs so far live in their own small table with a short period, so a
//! SYN flood cannot fill the table of established flows.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// Established flows (any packet but a lone SYN): kept for 5 to 10 minutes of silence.
pub const ESTABLISHED_PERIOD: Duration = Duration::from_secs(300);
/// At most this many established flows in each of the two generations (with the hash
/// table's overhead, about 16 B each: at most ~8 MiB for both when full).
pub const ESTABLISHED_CAPACITY: usize = 262_144;
/// Flows that have sent only SYNs: kept for 10 to 20 s (a handshake takes far less).
pub const EMBRYONIC_PERIOD: Duration = Duration::from_secs(10);
/// At most this many half-open flows in each generation (~1 MiB for both).
pub const EMBRYONIC_CAPACITY: usize = 32_768;
/// Entries allocated up front per generation, so that a quiet node uses little memory;
/// the tables grow (amortised) up to their capacity.
const INITIAL: usize = 1024;

/// What the table knows of one flow: its backend's address, and the position the backend
/// had in the plane's list of targets when it was recorded (checked before use: positions
/// change when the list is rebuilt).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub backend: Ipv4Addr,
    pub position: u16,
}

/// Two generations of one kind of flow.
#[derive(Debug)]
struct Generations {
    current: HashMap<u64, Pin>,
    previous: HashMap<u64, Pin>,
    capacity: usize,
    period: Duration,
    started: Instant,
}

impl Generations {
    fn new(capacity: usize, period: Duration, now: Instant) -> Generations {
        Generations {
            current: HashMap::with_capacity(INITIAL.min(capacity)),
            previous: HashMap::new(),
            capacity,
            period,
            started: now,
        }
    }

    /// The flow's pin, moved into the current generation if it was in the previous one.
    fn get(&mut self, key: u64) -> Option<Pin> {
        if let Some(pin) = self.current.get(&key) {
            return Some(*pin);
        }
        let pin = self.previous.remove(&key)?;
        // Moved if there is room; otherwise it stays to die with its generation.
        if !self.insert(key, pin) {
            self.previous.insert(key, pin);
        }
        Some(pin)
    }

    /// Records the flow's pin; returns false when the current generation is full.
    fn insert(&mut self, key: u64, pin: Pin) -> bool {
        if self.current.len() >= self.capacity && !self.current.contains_key(&key) {
            return false;
        }
        self.current.insert(key, pin);
        true
    }

    fn remove(&mut self, key: u64) -> Option<Pin> {
        let a = self.current.remove(&key);
        let b = self.previous.remove(&key);
        a.or(b)
    }

    /// Starts a new generation when the period is over; the previous one is dropped.
    fn tick(&mut self, now: Instant) {
        if now.saturating_duration_since(self.started) < self.period {
            return;
        }
        self.started = now;
        let fresh = HashMap::with_capacity(INITIAL.min(self.capacity));
        self.previous = std::mem::replace(&mut self.current, fresh);
    }

    fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// The flow is pinned to a backend that is up, at this position of the targets.
    Pinned(usize),
    /// The flow is new to this node, or its backend is gone: choose one and [`FlowTable::pin`].
    Unknown,
}

/// The flow table of one DSR plane (owned by its thread).
#[derive(Debug)]
pub struct FlowTable {
    established: Generations,
    embryonic: Generations,
}

impl FlowTable {
    pub fn new(now: Instant) -> FlowTable {
        FlowTable::with_limits(
            (ESTABLISHED_CAPACITY, ESTABLISHED_PERIOD),
            (EMBRYONIC_CAPACITY, EMBRYONIC_PERIOD),
            now,
        )
    }

    /// A table with other capacities and periods (tests).
    pub fn with_limits(
        established: (usize, Duration),
        embryonic: (usize, Duration),
        now: Instant,
    ) -> FlowTable {
        FlowTable {
            established: Generations::new(established.0, established.1, now),
            embryonic: Generations::new(embryonic.0, embryonic.1, now),
        }
    }

    /// The backend of the flow `key`, if it is pinned to one that is still up. `up` is the
    /// plane's list of backends that are up (their addresses, in target order). A lone SYN
    /// (`syn_only`) looks only at half-open flows; any other packet also promotes a
    /// half-open flow to an established one.
    pub fn lookup(&mut self, key: u64, syn_only: bool, up: &[Ipv4Addr]) -> Found {
        let pin = if syn_only {
            self.embryonic.get(key)
        } else {
            match self.established.get(key) {
                Some(pin) => Some(pin),
                None => self.embryonic.remove(key).inspect(|&pin| {
                    if !self.established.insert(key, pin) {
                        self.embryonic.insert(key, pin);
                    }
                }),
            }
        };
        let Some(pin) = pin else {
            return Found::Unknown;
        };
        let at = usize::from(pin.position);
        if up.get(at) == Some(&pin.backend) {
            return Found::Pinned(at);
        }
        // The list was rebuilt: find the backend by address (rare; the entry is fixed).
        match up.iter().position(|&ip| ip == pin.backend) {
            Some(at) => {
                if let Ok(position) = u16::try_from(at) {
                    let pin = Pin { position, ..pin };
                    self.table(syn_only).insert(key, pin);
                }
                Found::Pinned(at)
            }
            None => Found::Unknown,
        }
    }

    /// Pins the flow `key` to the backend at `position` of `up`; returns false when the
    /// table is full (the flow is served, just not remembered).
    pub fn pin(&mut self, key: u64, syn_only: bool, up: &[Ipv4Addr], position: usize) -> bool {
        let (Some(&backend), Ok(position)) = (up.get(position), u16::try_from(position)) else {
            return false;
        };
        self.table(syn_only).insert(key, Pin { backend, position })
    }

    fn table(&mut self, syn_only: bool) -> &mut Generations {
        if syn_only {
            &mut self.embryonic
        } else {
            &mut self.established
        }
    }

    /// Ages the table (call it every tick of the plane).
    pub fn tick(&mut self, now: Instant) {
        self.established.tick(now);
        self.embryonic.tick(now);
    }

    /// Flows in the table (both kinds, both generations).
    pub fn len(&self) -> usize {
        self.established.len() + self.embryonic.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 11);
    const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 12);
    const C: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 13);

    fn table(now: Instant) -> FlowTable {
        FlowTable::with_limits(
            (4, Duration::from_secs(60)),
            (2, Duration::from_secs(5)),
            now,
        )
    }

    #[test]
    fn a_pinned_flow_keeps_its_backend_when_others_join() {
        let now = Instant::now();
        let mut t = table(now);
        assert_eq!(t.lookup(7, false, &[A, B]), Found::Unknown);
        assert!(t.pin(7, false, &[A, B], 1));
        assert_eq!(t.lookup(7, false, &[A, B]), Found::Pinned(1));
        // C joins before B in the list: the flow follows B to its new position.
        assert_eq!(t.lookup(7, false, &[A, C, B]), Found::Pinned(2));
        assert_eq!(t.lookup(7, false, &[A, C, B]), Found::Pinned(2));
    }

    #[test]
    fn a_flow_whose_backend_left_is_unknown_again() {
        let now = Instant::now();
        let mut t = table(now);
        t.pin(7, false, &[A, B], 1);
        assert_eq!(t.lookup(7, false, &[A]), Found::Unknown);
        // Chosen again and pinned anew.
        t.pin(7, false, &[A], 0);
        assert_eq!(t.lookup(7, false, &[A, B]), Found::Pinned(0));
    }

    #[test]
    fn a_handshake_promotes_a_half_open_flow() {
        let now = Instant::now();
        let mut t = table(now);
        t.pin(9, true, &[A, B], 0);
        assert_eq!(t.lookup(9, true, &[A, B]), Found::Pinned(0));
        // The handshake's ACK finds it and moves it to the established flows...
        assert_eq!(t.lookup(9, false, &[A, B]), Found::Pinned(0));
        // ...which outlive the half-open ones' short period.
        t.tick(now + Duration::from_secs(6));
        t.tick(now + Duration::from_secs(12));
        assert_eq!(t.lookup(9, false, &[A, B]), Found::Pinned(0));
    }

    #[test]
    fn idle_flows_expire_after_two_periods_and_active_ones_stay() {
        let now = Instant::now();
        let mut t = table(now);
        t.pin(1, false, &[A], 0);
        t.pin(2, false, &[A], 0);
        t.pin(3, true, &[A], 0);
        t.tick(now + Duration::from_secs(6));
        // Half-open flow 3: one period idle, still there (previous generation).
        assert_eq!(t.lookup(3, true, &[A]), Found::Pinned(0));
        t.tick(now + Duration::from_secs(12));
        t.tick(now + Duration::from_secs(18));
        assert_eq!(
            t.lookup(3, true, &[A]),
            Found::Unknown,
            "half-open, idle 2 periods"
        );
        t.tick(now + Duration::from_secs(61));
        // Flow 1 is active in the second period, flow 2 is not.
        assert_eq!(t.lookup(1, false, &[A]), Found::Pinned(0));
        t.tick(now + Duration::from_secs(122));
        assert_eq!(t.lookup(1, false, &[A]), Found::Pinned(0));
        assert_eq!(t.lookup(2, false, &[A]), Found::Unknown);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_full_table_records_no_new_flow_and_keeps_the_old_ones() {
        let now = Instant::now();
        let mut t = table(now);
        for key in 0..4 {
            assert!(t.pin(key, false, &[A, B], 0));
        }
        assert!(!t.pin(99, false, &[A, B], 1));
        assert_eq!(t.lookup(99, false, &[A, B]), Found::Unknown);
        assert_eq!(t.lookup(3, false, &[A, B]), Found::Pinned(0));
        // A SYN flood fills only the half-open table.
        assert!(t.pin(100, true, &[A], 0));
        assert!(t.pin(101, true, &[A], 0));
        assert!(!t.pin(102, true, &[A], 0));
        assert_eq!(t.len(), 6);
    }
}
