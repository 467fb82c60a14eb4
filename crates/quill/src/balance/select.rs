//! Choosing a server for a new connection, with Pen's semantics.
//!
//! Order of decisions for a client that passed the client ACL:
//! 1. Tracking (unless `roundrobin` or `hash_only`): a known client goes back to its last
//!    server if that server is available for it *below the hard limit*.
//! 2. Otherwise the policy picks among servers available *below the soft limit*:
//!    `prio` (lowest value with capacity), `weight` (fewest connections per unit of weight),
//!    `hash` (the client's hash slot, then onwards), or round robin (the server after the
//!    most recently chosen one).
//! 3. `stubborn`: if the initial choice is unavailable (or its connect fails), give up
//!    instead of trying another server.
//!
//! "Available" means: has an address, is not blacklisted, not down by its health check,
//! not being drained, its server ACL permits the
//! client, and it is below the limit that applies (as published last, read from the
//! server's state: a connection choosing under an older snapshot obeys a limit changed
//! since). Nothing here blocks or allocates per
//! server beyond one small bitmap of tried servers for failover.

use std::hash::{Hash, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::servers::{ServerState, ServerTable, PROBE_EVERY_MS};
use super::tracking::ClientTable;
use crate::settings::{ServerConf, Settings};

/// The outcome of a selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Connect to server N.
    Server(usize),
    /// Nothing available: use the emergency server (if configured) or close.
    NoServer,
}

/// One selection (and its failovers) for one client connection.
pub struct Selector<'a> {
    settings: &'a Settings,
    servers: &'a ServerTable,
    clients: &'a ClientTable,
    cursor: &'a AtomicUsize,
    client: SocketAddr,
    now: u64,
    /// Servers already tried for this connection (failover never retries one).
    tried: Vec<bool>,
    /// The first choice has been made (later calls are failovers).
    started: bool,
    /// The last choice was a tracked client's own server (its `hard` limit applied).
    returning: bool,
    /// Choices in a row whose place another event loop took first ([`Selector::lost_race`]).
    races: u32,
}

/// Choices in a row that may lose their place to another event loop before the servers
/// count as full: each one means another client took the place, so this bounds the work
/// of one client under contention.
const RACES: u32 = 4;

impl<'a> Selector<'a> {
    pub fn new(
        settings: &'a Settings,
        servers: &'a ServerTable,
        clients: &'a ClientTable,
        cursor: &'a AtomicUsize,
        client: SocketAddr,
        now: u64,
    ) -> Selector<'a> {
        Selector {
            settings,
            servers,
            clients,
            cursor,
            client,
            now,
            tried: Vec::new(),
            started: false,
            returning: false,
            races: 0,
        }
    }

    fn ip(&self) -> IpAddr {
        self.client.ip().to_canonical()
    }

    /// Whether server `i` can take this client now; `returning` selects the hard limit.
    fn available(&self, i: usize, returning: bool) -> bool {
        self.eligible(i).is_some_and(|(_, state)| {
            let limit = limit(state, returning);
            limit == 0 || state.conns.load(Relaxed) < limit
        })
    }

    /// Server `i`, if it could take this client were it below its limits.
    fn eligible(&self, i: usize) -> Option<(&'a ServerConf, &'a ServerState)> {
        self.eligible_but_blacklist(i)
            .filter(|(_, state)| !state.is_blacklisted(self.now))
    }

    /// Server `i`, if it could take this client were it below its limits and not
    /// blacklisted.
    fn eligible_but_blacklist(&self, i: usize) -> Option<(&'a ServerConf, &'a ServerState)> {
        if self.tried.get(i).copied().unwrap_or(false) {
            return None;
        }
        let conf = self.settings.servers.get(i)?;
        conf.addr()?;
        let state = self.servers.get(i)?;
        // A server the health check took down, or one being drained, is skipped exactly
        // like a blacklisted one (tracked clients of it move elsewhere too).
        if state.is_out() {
            return None;
        }
        if let Some(acl) = conf.acl {
            if !self.settings.acls[acl.index()].permits(self.ip()) {
                return None;
            }
        }
        Some((conf, state))
    }

    /// When the first blacklisted server this client could otherwise use comes back
    /// (milliseconds of [`super::clock`]), if any is blacklisted now: a client waiting for
    /// room looks again then.
    pub fn soonest_back(&self) -> Option<u64> {
        (0..self.settings.servers.len())
            .filter_map(|i| {
                let (_, state) = self.eligible_but_blacklist(i)?;
                let until = state.blacklisted_until.load(Relaxed);
                (until > self.now).then_some(until)
            })
            .min()
    }

    /// Whether server `i` could take this client, its limits aside (a place handed to the
    /// client while it waited is used only then).
    pub fn could_take(&self, i: usize) -> bool {
        self.eligible(i).is_some()
    }

    /// The connection limit under which server `i`, the last choice, was chosen (its `hard`
    /// for a tracked client going back to it, else its `max`; 0: none).
    pub fn limit_of(&self, i: usize) -> u32 {
        self.servers
            .get(i)
            .map_or(0, |state| limit(state, self.returning))
    }

    /// The servers that could take this client but are at their limit (`max`): what a
    /// client with nowhere to go may wait for (`queue_timeout`).
    pub fn full(&self) -> Vec<usize> {
        (0..self.settings.servers.len())
            .filter(|&i| {
                self.eligible(i).is_some_and(|(_, state)| {
                    let max = state.max.load(Relaxed);
                    max != 0 && state.conns.load(Relaxed) >= max
                })
            })
            .collect()
    }

    /// With no server left for this client (and no last resort that took it): the server
    /// that a failed connect blacklisted and whose blacklist ends first, to try anyway —
    /// none is known to work, and a server back from a restart would else wait out its
    /// blacklist with every client turned away (as NGINX never marks a lone server
    /// unavailable, and HAProxy without checks always tries). Not one the operator
    /// blacklisted, and each server at most once a [`PROBE_EVERY_MS`] whichever client or
    /// event loop asks. It counts as tried.
    pub fn despite_blacklist(&mut self) -> Option<usize> {
        let n = self.settings.servers.len();
        if self.tried.len() < n {
            self.tried.resize(n, false);
        }
        loop {
            let (_, best) = (0..n)
                .filter_map(|i| {
                    let (_, state) = self.eligible_but_blacklist(i)?;
                    let until = state.blacklisted_until.load(Relaxed);
                    let limit = limit(state, false);
                    (until > self.now
                        && !state.blacklisted_by_hand.load(Relaxed)
                        && self.now.saturating_sub(state.probed_at.load(Relaxed)) >= PROBE_EVERY_MS
                        && (limit == 0 || state.conns.load(Relaxed) < limit))
                        .then_some((until, i))
                })
                .min()?;
            if let Some(t) = self.tried.get_mut(best) {
                *t = true;
            }
            let state = self.servers.get(best)?;
            let probed = state.probed_at.load(Relaxed);
            // Of clients choosing at once, one probes.
            if self.now.saturating_sub(probed) >= PROBE_EVERY_MS
                && state
                    .probed_at
                    .compare_exchange(probed, self.now.max(1), Relaxed, Relaxed)
                    .is_ok()
            {
                return Some(best);
            }
        }
    }

    /// The time the next look is made at (blacklist deadlines are compared with it).
    pub fn set_now(&mut self, now: u64) {
        self.now = now;
    }

    /// The choice made again, at `now`, after a wait for room; servers that failed stay
    /// tried.
    pub fn again(&mut self, now: u64) -> Choice {
        self.races = 0;
        self.now = now;
        self.initial()
    }

    /// The last choice had no place left when its place was to be taken (another event
    /// loop took it since the look): the choice made again at `now`; after
    /// [`RACES`] such in a row, `NoServer` (the servers count as full).
    pub fn lost_race(&mut self, now: u64) -> Choice {
        self.races += 1;
        if self.races > RACES {
            return Choice::NoServer;
        }
        self.now = now;
        self.initial()
    }

    /// The first choice for this connection.
    pub fn initial(&mut self) -> Choice {
        self.started = true;
        self.returning = false;
        let policy = self.settings.policy;
        if !policy.roundrobin && !policy.hash_only {
            let tracking_ms = self.settings.tracking.saturating_mul(1000);
            if let Some(i) = self.clients.lookup(self.ip(), self.now, tracking_ms) {
                if self.available(i, true) {
                    self.returning = true;
                    return Choice::Server(i);
                }
                if policy.stubborn {
                    return Choice::NoServer;
                }
            }
        }
        if policy.prio {
            return self.by_prio();
        }
        if policy.weight {
            return self.by_weight();
        }
        if policy.hash {
            let n = self.settings.servers.len();
            if n == 0 {
                return Choice::NoServer;
            }
            let start = self.hash_slot(n);
            if policy.stubborn {
                return if self.available(start, false) {
                    Choice::Server(start)
                } else {
                    Choice::NoServer
                };
            }
            return self.scan_from(start);
        }
        self.by_roundrobin()
    }

    /// After server `failed` could not be reached: the next choice, or `NoServer` when
    /// stubborn or when every server has been tried.
    pub fn failover(&mut self, failed: usize) -> Choice {
        if self.settings.policy.stubborn || !self.started {
            return Choice::NoServer;
        }
        let n = self.settings.servers.len();
        if self.tried.len() < n {
            self.tried.resize(n, false);
        }
        if let Some(t) = self.tried.get_mut(failed) {
            *t = true;
        }
        self.races = 0;
        self.initial()
    }

    /// Whether the chosen server should be remembered for this client. Clients are
    /// recorded in round-robin mode too (so `recent` lists them and turning tracking back
    /// on finds them), but not with `hash_only`, whose point is to keep no table.
    pub fn tracks(&self) -> bool {
        !self.settings.policy.hash_only
    }

    fn hash_slot(&self, n: usize) -> usize {
        // SipHash with fixed keys: stable across restarts and well mixed, so that clients
        // with consecutive addresses or ports do not fall on the same server (a linear hash
        // like crc32 keeps low bits constant over even ports).
        #[allow(deprecated)]
        let mut h = std::hash::SipHasher::new_with_keys(0x7175_696c_6c21, 0x7065_6e21);
        self.ip().hash(&mut h);
        if self.settings.policy.roundrobin {
            // As Pen: with round robin on, the hash covers the client port too.
            self.client.port().hash(&mut h);
        }
        (h.finish() % n as u64) as usize
    }

    /// First available server at or after `start`, wrapping around.
    fn scan_from(&self, start: usize) -> Choice {
        let n = self.settings.servers.len();
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| self.available(i, false))
            .map_or(Choice::NoServer, Choice::Server)
    }

    fn by_roundrobin(&self) -> Choice {
        let n = self.settings.servers.len();
        if n == 0 {
            return Choice::NoServer;
        }
        // The server after the most recently chosen one. The cursor is shared by all event
        // loops; a lost race only means two loops pick the same next server once.
        let last = self.cursor.load(Relaxed);
        let choice = self.scan_from(last.wrapping_add(1) % n);
        if let Choice::Server(i) = choice {
            self.cursor.store(i, Relaxed);
        }
        choice
    }

    fn by_prio(&self) -> Choice {
        let servers = &self.settings.servers;
        let best = (0..servers.len())
            .filter(|&i| self.available(i, false))
            .min_by_key(|&i| (servers[i].prio, self.conns(i), i));
        best.map_or(Choice::NoServer, Choice::Server)
    }

    fn by_weight(&self) -> Choice {
        let servers = &self.settings.servers;
        let mut best: Option<(usize, u64, u64)> = None;
        let ramp_ms = self.settings.slow_start.saturating_mul(1000);
        for (i, conf) in servers.iter().enumerate() {
            // During slow start a returning server counts with a part of its weight.
            let weight = u64::from(self.servers.get(i).map_or(conf.weight, |s| {
                s.effective_weight(conf.weight, self.now, ramp_ms)
            }));
            if weight == 0 || !self.available(i, false) {
                continue;
            }
            // Compare conns_i / weight_i < conns_b / weight_b without division; ties go to
            // the heavier server, then to the lower number.
            let conns = u64::from(self.conns(i));
            let better = match best {
                None => true,
                Some((_, bc, bw)) => {
                    let (l, r) = (
                        u128::from(conns) * u128::from(bw),
                        u128::from(bc) * u128::from(weight),
                    );
                    l < r || (l == r && weight > bw)
                }
            };
            if better {
                best = Some((i, conns, weight));
            }
        }
        best.map_or(Choice::NoServer, |(i, _, _)| Choice::Server(i))
    }

    fn conns(&self, i: usize) -> u32 {
        self.servers.get(i).map_or(0, |s| s.conns.load(Relaxed))
    }
}

/// Server `state`'s limit for a client new to it (`max`) or a tracked one going back
/// (`returning`: its `hard`), as last published (0: none).
fn limit(state: &ServerState, returning: bool) -> u32 {
    if returning {
        state.hard.load(Relaxed)
    } else {
        state.max.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;

    struct World {
        settings: Settings,
        servers: ServerTable,
        clients: ClientTable,
        cursor: AtomicUsize,
    }

    impl World {
        fn new(lines: &[&str]) -> World {
            let mut settings = Settings::default();
            for l in lines {
                settings.apply(&l.parse::<Command>().unwrap()).unwrap();
            }
            let servers = ServerTable::default();
            servers.mirror_limits(&settings);
            World {
                settings,
                servers,
                clients: ClientTable::new(64),
                cursor: AtomicUsize::new(usize::MAX),
            }
        }

        fn pick(&self, client: &str) -> Choice {
            let addr: SocketAddr = client.parse().unwrap();
            let mut s = Selector::new(
                &self.settings,
                &self.servers,
                &self.clients,
                &self.cursor,
                addr,
                1000,
            );
            let c = s.initial();
            if let (Choice::Server(i), true) = (c, s.tracks()) {
                self.clients.record(addr.ip(), i, 1000);
            }
            c
        }

        fn hold(&self, i: usize, n: u32) {
            self.servers.get(i).unwrap().conns.fetch_add(n, Relaxed);
        }
    }

    const TWO: [&str; 2] = [
        "server 0 address 127.0.0.1 port 1",
        "server 1 address 127.0.0.1 port 2",
    ];

    #[test]
    fn round_robin_alternates() {
        let w = World::new(&[TWO[0], TWO[1], "roundrobin"]);
        let picks: Vec<_> = (0..4).map(|_| w.pick("10.0.0.1:1000")).collect();
        assert_eq!(
            picks,
            [
                Choice::Server(0),
                Choice::Server(1),
                Choice::Server(0),
                Choice::Server(1)
            ]
        );
    }

    #[test]
    fn tracking_sends_a_client_back() {
        let w = World::new(&TWO);
        assert_eq!(w.pick("10.0.0.1:1000"), Choice::Server(0));
        assert_eq!(w.pick("10.0.0.2:1000"), Choice::Server(1));
        assert_eq!(w.pick("10.0.0.1:1001"), Choice::Server(0));
        assert_eq!(w.pick("10.0.0.1:1002"), Choice::Server(0));
    }

    #[test]
    fn soft_limit_for_new_clients_hard_limit_for_known_ones() {
        let w = World::new(&["server 0 address 127.0.0.1 port 1 max 2 hard 4", TWO[1]]);
        assert_eq!(w.pick("10.0.0.1:1"), Choice::Server(0));
        w.hold(0, 2);
        assert_eq!(
            w.pick("10.0.0.9:1"),
            Choice::Server(1),
            "new client skips a full server"
        );
        assert_eq!(
            w.pick("10.0.0.1:2"),
            Choice::Server(0),
            "known client may exceed the soft limit"
        );
        w.hold(0, 2);
        assert_ne!(
            w.pick("10.0.0.1:3"),
            Choice::Server(0),
            "but not the hard limit"
        );
    }

    #[test]
    fn blacklisted_servers_are_skipped_and_stubborn_gives_up() {
        let w = World::new(&TWO);
        assert_eq!(w.pick("10.0.0.1:1"), Choice::Server(0));
        w.servers.get(0).unwrap().blacklist(1000, 30);
        assert_eq!(w.pick("10.0.0.1:2"), Choice::Server(1));
        let s = World::new(&[TWO[0], TWO[1], "stubborn"]);
        assert_eq!(s.pick("10.0.0.1:1"), Choice::Server(0));
        s.servers.get(0).unwrap().blacklist(1000, 30);
        assert_eq!(s.pick("10.0.0.1:2"), Choice::NoServer);
    }

    #[test]
    fn the_first_blacklisted_server_back_is_the_one_a_client_could_use() {
        let w = World::new(&[TWO[0], TWO[1], "server 2 address 127.0.0.1 port 3"]);
        fn selector(w: &World) -> Selector<'_> {
            let addr = "10.0.0.1:1".parse().unwrap();
            Selector::new(&w.settings, &w.servers, &w.clients, &w.cursor, addr, 1000)
        }
        assert_eq!(selector(&w).soonest_back(), None);
        w.servers.get(0).unwrap().blacklist(1000, 30);
        w.servers.get(1).unwrap().blacklist(1000, 10);
        w.servers.get(2).unwrap().blacklist(1000, 5);
        assert_eq!(selector(&w).soonest_back(), Some(6000));
        // Drained meanwhile, server 2 is no sooner back for clients.
        w.servers.get(2).unwrap().draining.store(true, Relaxed);
        assert_eq!(selector(&w).soonest_back(), Some(11000));
        // Nor is one this client already failed on.
        let mut s = selector(&w);
        s.initial();
        s.failover(1);
        assert_eq!(s.soonest_back(), Some(31000));
    }

    #[test]
    fn down_and_draining_servers_are_skipped_even_for_tracked_clients() {
        use crate::balance::servers::Health;
        let w = World::new(&TWO);
        assert_eq!(w.pick("10.0.0.1:1"), Choice::Server(0));
        w.servers.get(0).unwrap().set_health(Health::Down);
        assert_eq!(w.pick("10.0.0.1:2"), Choice::Server(1));
        w.servers.get(0).unwrap().set_health(Health::Up);
        w.servers.get(1).unwrap().draining.store(true, Relaxed);
        assert_eq!(w.pick("10.0.0.1:3"), Choice::Server(0));
        assert_eq!(w.pick("10.0.0.7:3"), Choice::Server(0));
        w.servers.get(0).unwrap().draining.store(true, Relaxed);
        assert_eq!(w.pick("10.0.0.1:4"), Choice::NoServer);
    }

    #[test]
    fn slow_start_ramps_the_weight() {
        let w = World::new(&[
            "server 0 address 127.0.0.1 port 1 weight 10",
            "server 1 address 127.0.0.1 port 2 weight 10",
            "weight",
            "roundrobin",
            "slow_start 10",
        ]);
        let s0 = w.servers.get(0).unwrap();
        // World picks at now = 1000 ms: server 0 came back 1 s into a 10 s ramp.
        s0.up_since.store(1, Relaxed);
        assert_eq!(s0.effective_weight(10, 1000, 10_000), 1);
        assert_eq!(s0.effective_weight(10, 6000, 10_000), 5);
        assert_eq!(s0.effective_weight(10, 20_000, 10_000), 10);
        let mut counts = [0u32; 2];
        for _ in 0..110 {
            if let Choice::Server(i) = w.pick("10.0.0.1:1") {
                counts[i] += 1;
                w.hold(i, 1);
            }
        }
        assert_eq!(counts, [10, 100]);
    }

    #[test]
    fn hash_is_stable_per_client() {
        let w = World::new(&[
            TWO[0],
            TWO[1],
            "server 2 address 127.0.0.1 port 3",
            "hash_only",
        ]);
        for n in 1..50 {
            let a = w.pick(&format!("10.0.{n}.1:1000"));
            let b = w.pick(&format!("10.0.{n}.1:2000"));
            assert_eq!(a, b);
        }
    }

    #[test]
    fn hash_spreads_clients() {
        let w = World::new(&[TWO[0], TWO[1], "hash", "hash_only"]);
        let zeros = (0..100)
            .filter(|n| w.pick(&format!("10.0.0.{n}:1")) == Choice::Server(0))
            .count();
        assert!((25..=75).contains(&zeros), "{zeros} of 100 on server 0");
    }

    #[test]
    fn weight_is_least_connections_per_weight() {
        let w = World::new(&[
            "server 0 address 127.0.0.1 port 1 weight 1",
            "server 1 address 127.0.0.1 port 2 weight 3",
            "weight",
            "roundrobin",
        ]);
        let mut counts = [0u32; 2];
        for _ in 0..400 {
            if let Choice::Server(i) = w.pick("10.0.0.1:1") {
                counts[i] += 1;
                w.hold(i, 1);
            }
        }
        assert_eq!(counts, [100, 300]);
    }

    #[test]
    fn prio_fills_the_lowest_value_first() {
        let w = World::new(&[
            "server 0 address 127.0.0.1 port 1 prio 2",
            "server 1 address 127.0.0.1 port 2 prio 1 max 3",
            "prio",
            "roundrobin",
        ]);
        for _ in 0..3 {
            assert_eq!(w.pick("10.0.0.1:1"), Choice::Server(1));
            w.hold(1, 1);
        }
        assert_eq!(w.pick("10.0.0.1:1"), Choice::Server(0));
    }

    #[test]
    fn server_acl_excludes_clients() {
        let w = World::new(&[
            TWO[0],
            TWO[1],
            "acl 3 deny 10.0.0.5",
            "server 0 acl 3",
            "roundrobin",
        ]);
        for _ in 0..4 {
            assert_eq!(w.pick("10.0.0.5:1"), Choice::Server(1));
        }
    }

    #[test]
    fn failover_tries_each_server_once() {
        let w = World::new(&TWO);
        let addr = "10.0.0.1:1".parse().unwrap();
        let mut s = Selector::new(&w.settings, &w.servers, &w.clients, &w.cursor, addr, 1000);
        let Choice::Server(first) = s.initial() else {
            panic!()
        };
        let Choice::Server(second) = s.failover(first) else {
            panic!()
        };
        assert_ne!(first, second);
        assert_eq!(s.failover(second), Choice::NoServer);
    }
}
