//! New UDP flows placed by the kernel (`udp_offload` with `udp_responses`): a client that
//! takes a new port for every query (as DNS resolvers do) never becomes a flow quill could
//! hand over, so every query would wake quill twice. Where Pen's rules need no memory of
//! the client, the program places such flows itself, and quill only keeps its tables true:
//! which servers are in use and with what share (`slots`), and per server the ports of
//! [`PORTS`] sockets it holds (bound, connected to the server, never sent from), each of
//! which carries one flow at a time. Every [`TICK`] it also ends the flows whose answers
//! did not come (`sweep`: the answer timeout, with Pen's blacklisting; idle ones), adds
//! what the program counted to the servers' totals, and reads what comes to a held socket
//! anyway (a late answer, dropped; an ICMP error, the server's failure).
//!
//! Invariants: a held socket is closed only after every flow on its ports was swept, so
//! a port the program may still send from is never another socket's. The program places
//! nothing while quill's rules need to see each flow (`why_not`), and nothing after
//! quill stops placing (the placer's drop empties the table).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::{monotonic_ns, Counters, Offload, OffloadError};
use crate::balance::clock;
use crate::net::listen::ListenAddr;
use crate::settings::Settings;
use crate::state::State;

/// Held ports per server: `PORTS` in `udp.bpf.c`, the most flows in flight to one server
/// the program places (beyond, quill places them).
pub const PORTS: usize = 64;
/// `MAX_SLOTS` and `MAX_SERVERS` in `udp.bpf.c`.
const MAX_SLOTS: usize = 1024;
const MAX_SERVERS: usize = 256;
/// How often the tables are brought up to date and unanswered flows swept: a server taken
/// out of use gets no new flow from the program after at most this long.
pub const TICK: Duration = Duration::from_millis(250);
/// The tick while no client sends (after [`QUIET_AFTER`] ticks without a datagram).
const QUIET_TICK: Duration = Duration::from_secs(1);
const QUIET_AFTER: u32 = 4;

/// `struct held` in `udp.bpf.c`: the server's address, the held sockets' address, the
/// server's port, the number of ports, the way to the server, the ports.
pub type HeldEntry = [u8; 40 + 2 * PORTS];

/// `struct placed`, summed over the CPUs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Totals {
    pub flows: u64,
    pub up_packets: u64,
    pub up_bytes: u64,
    pub down_packets: u64,
    pub down_bytes: u64,
    pub last_down_ns: u64,
}

impl Totals {
    pub(super) fn add(&mut self, v: &[u64; 6]) {
        self.flows += v[0];
        self.up_packets += v[1];
        self.up_bytes += v[2];
        self.down_packets += v[3];
        self.down_bytes += v[4];
        self.last_down_ns = self.last_down_ns.max(v[5]);
    }
}

/// Why the program may not place flows under `settings` (`None`: it may). Each reason
/// is a rule of quill's that needs the flow to come through quill.
pub fn why_not(settings: &Settings) -> Option<&'static str> {
    let p = &settings.policy;
    if settings.udp_responses == 0 {
        Some("udp_responses is not set (a flow is a conversation, not a query)")
    } else if !p.roundrobin || p.hash || p.hash_only || p.stubborn {
        Some("client tracking or hash is on (roundrobin places by no client)")
    } else if !settings.acls[settings.client_acl.index()]
        .rules()
        .is_empty()
        || settings.servers.iter().any(|s| s.acl.is_some())
    {
        Some("an access list applies to clients")
    } else if settings.servers.iter().any(|s| s.max > 0 || s.hard > 0) {
        // `conn_max` is not a reason: a placed flow holds no descriptor of quill's (what
        // the limit protects), and one server has at most PORTS of them in flight.
        Some("a server has a connection limit (max or hard)")
    } else if settings.transparent {
        Some("transparent is on")
    } else if settings.log.is_some() || settings.access_log.is_some() {
        Some("a connection log is written")
    } else if settings.servers.len() > MAX_SERVERS {
        Some("there are more than 256 servers")
    } else {
        None
    }
}

/// The slot table for `settings` at `now` (ms): the servers in use, each once, or as
/// often as its weight under `weight`; under `prio`, only those of the lowest value.
fn slots(state: &State, settings: &Settings, now: u64) -> Vec<u32> {
    let ramp_ms = settings.slow_start.saturating_mul(1000);
    let mut usable: Vec<(u32, u32, u32)> = state
        .servers_in_use(settings)
        .filter(|(_, conf, _, s)| conf.port != 0 && !s.is_out() && !s.is_blacklisted(now))
        .filter_map(|(i, conf, _, s)| {
            let weight = if settings.policy.weight {
                s.effective_weight(conf.weight, now, ramp_ms)
            } else {
                1
            };
            let i = u32::try_from(i).ok()?;
            (weight > 0).then_some((i, weight, conf.prio))
        })
        .collect();
    if settings.policy.prio {
        if let Some(best) = usable.iter().map(|u| u.2).min() {
            usable.retain(|u| u.2 == best);
        }
    }
    let total: u64 = usable.iter().map(|u| u64::from(u.1)).sum();
    let mut out = Vec::new();
    for (i, weight, _) in usable {
        // Shares scaled down to fit the table, each server at least one slot.
        let share = if total > MAX_SLOTS as u64 {
            (u64::from(weight) * (MAX_SLOTS as u64 - 256) / total).max(1)
        } else {
            u64::from(weight)
        };
        out.extend(std::iter::repeat(i).take(share as usize));
    }
    out.truncate(MAX_SLOTS);
    out
}

/// The ports held for one server.
struct Held {
    server: SocketAddr,
    entry: HeldEntry,
    /// One task per socket, reading what reaches it; aborting it closes the socket.
    readers: Vec<JoinHandle<()>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        for r in &self.readers {
            r.abort();
        }
    }
}

/// Opens [`PORTS`] sockets connected to server `index` at `server`, and their readers.
fn hold(
    state: &Arc<State>,
    index: usize,
    server: SocketAddr,
    way: u32,
    failed: &Arc<Notify>,
) -> std::io::Result<Held> {
    let any: SocketAddr = match server {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let mut entry: HeldEntry = [0; 40 + 2 * PORTS];
    let mapped = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    entry[0..16].copy_from_slice(&mapped(server.ip()));
    entry[32..34].copy_from_slice(&server.port().to_be_bytes());
    entry[36..40].copy_from_slice(&way.to_ne_bytes());
    // Built as it goes, so that a failure half-way closes the sockets opened so far.
    let mut held = Held {
        server,
        entry,
        readers: Vec::with_capacity(PORTS),
    };
    let mut local = None;
    for n in 0..PORTS {
        let sock = UdpSocket::bind(any)?;
        sock.connect(server)?;
        let addr = sock.local_addr()?;
        if *local.get_or_insert(addr.ip()) != addr.ip() {
            // The route changed between two sockets: hold them all again next time.
            return Err(std::io::Error::other("the route to the server changed"));
        }
        held.entry[40 + 2 * n..42 + 2 * n].copy_from_slice(&addr.port().to_be_bytes());
        sock.set_nonblocking(true)?;
        let sock = tokio::net::UdpSocket::from_std(sock)?;
        held.readers.push(tokio::spawn(read_held(
            Arc::clone(state),
            index,
            sock,
            Arc::clone(failed),
        )));
    }
    if let Some(ip) = local {
        held.entry[16..32].copy_from_slice(&mapped(ip));
    }
    let ports = u16::try_from(PORTS).unwrap_or(u16::MAX);
    held.entry[34..36].copy_from_slice(&ports.to_ne_bytes());
    Ok(held)
}

/// Reads what reaches a held socket: an answer after its flow was swept (dropped, as quill
/// drops a late answer), or the server's refusal (ICMP port unreachable): its failure.
async fn read_held(
    state: Arc<State>,
    index: usize,
    sock: tokio::net::UdpSocket,
    failed: Arc<Notify>,
) {
    let mut buf = [0u8; 1];
    loop {
        match sock.recv(&mut buf).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                let blacklist = state.settings().blacklist;
                let peer = sock.peer_addr().map(|a| format!(" ({a})"));
                state.server_failed(
                    index,
                    blacklist,
                    format_args!(
                        "server {index}{} failed for udp flows placed in the kernel: {e}",
                        peer.as_deref().unwrap_or("")
                    ),
                );
                // The tables follow at once rather than at the next tick.
                failed.notify_one();
            }
            Err(e) => {
                tracing::debug!("udp_offload: held socket of server {index}: {e}");
                tokio::time::sleep(TICK).await;
            }
        }
    }
}

/// Keeps the program's placement tables true; see the module's documentation.
pub struct Placer {
    state: Arc<State>,
    offload: Arc<Offload>,
    held: HashMap<usize, Held>,
    slots: Vec<u32>,
    responses: u32,
    listeners: Vec<SocketAddr>,
    /// What the program had counted per server at the last tick.
    seen: HashMap<usize, Totals>,
    /// The reason placement is off, as last said in the log.
    said: Option<Option<&'static str>>,
    /// Rung by a held socket's reader when its server refused a flow.
    failed: Arc<Notify>,
    /// Ticks in a row that found no datagram placed or carried.
    quiet: u32,
}

impl Placer {
    pub fn new(state: Arc<State>, offload: Arc<Offload>) -> Placer {
        Placer {
            state,
            offload,
            held: HashMap::new(),
            slots: Vec::new(),
            responses: 0,
            listeners: Vec::new(),
            seen: HashMap::new(),
            said: None,
            failed: Arc::new(Notify::new()),
            quiet: 0,
        }
    }

    /// Brings the tables up to date every [`TICK`], for as long as quill runs.
    /// While the program places nothing and no port is held, only a change of settings
    /// can give the placer work: it sleeps until one (an idle quill is never woken).
    /// While no client sends, it ticks every [`QUIET_TICK`]: a server's change then
    /// reaches the tables up to that late, with no query to misplace meanwhile.
    pub async fn run(mut self) {
        let mut settings = self.state.generation.subscribe();
        loop {
            if let Err(e) = self.tick() {
                tracing::warn!("{e}");
            }
            let failed = Arc::clone(&self.failed);
            if self.slots.is_empty() && self.held.is_empty() && self.said.flatten().is_some() {
                tokio::select! {
                    _ = settings.changed() => {}
                    () = failed.notified() => {}
                }
            } else {
                let period = if self.quiet > QUIET_AFTER {
                    QUIET_TICK
                } else {
                    TICK
                };
                tokio::select! {
                    () = tokio::time::sleep(period) => {}
                    _ = settings.changed() => {}
                    () = failed.notified() => {}
                }
            }
        }
    }

    fn tick(&mut self) -> Result<(), OffloadError> {
        let settings = self.state.settings();
        let now = clock::now_ms();
        let why = why_not(&settings);
        if self.said != Some(why) {
            match why {
                None => tracing::info!(
                    "udp_offload: new flows are placed in the kernel (round robin, udp_responses {})",
                    settings.udp_responses
                ),
                Some(why) if self.said.is_some() => {
                    tracing::info!("udp_offload: new flows are placed by quill: {why}")
                }
                Some(_) => {}
            }
        }
        self.listen(&settings)?;
        // Answers first: the sweep asks whether a server answered since a flow's datagram.
        self.fold(now);
        if !self.held.is_empty() {
            // Only placed flows are swept, and they exist only on held ports.
            self.sweep(&settings, now);
        }
        // After the sweep: a server it blacklisted gets no new flow from now.
        let slots = if why.is_none() {
            slots(&self.state, &settings, now)
        } else {
            Vec::new()
        };
        self.hold_servers(&settings, &slots)?;
        if slots != self.slots || settings.udp_responses != self.responses {
            self.offload.set_slots(&slots, settings.udp_responses)?;
            self.slots = slots;
            self.responses = settings.udp_responses;
        }
        if self.said != Some(why) {
            // Said once the tables are written: whoever reads "kernel" finds it so.
            self.said = Some(why);
            let word = why.map_or_else(|| "kernel".to_string(), |why| format!("quill: {why}"));
            self.state.udp_placement.store(Some(Arc::new(word)));
        }
        Ok(())
    }

    /// The listeners' addresses as the program matches them.
    fn listen(&mut self, settings: &Settings) -> Result<(), OffloadError> {
        let addrs = match &settings.listen {
            Some(ListenAddr::Tcp(a)) => vec![*a],
            _ => Vec::new(),
        };
        if addrs != self.listeners {
            self.offload.set_listeners(&addrs)?;
            self.listeners = addrs;
        }
        Ok(())
    }

    /// Held ports for every server a slot names; those of servers gone from the table, or
    /// readdressed, closed once no flow of theirs is left.
    fn hold_servers(&mut self, settings: &Settings, slots: &[u32]) -> Result<(), OffloadError> {
        let wanted: HashMap<usize, SocketAddr> = slots
            .iter()
            .filter_map(|&i| {
                let i = i as usize;
                Some((i, settings.servers.get(i)?.addr()?))
            })
            .collect();
        let stale: Vec<usize> = self
            .held
            .iter()
            .filter(|(i, h)| {
                let addr = settings.servers.get(**i).and_then(|s| s.addr());
                addr != Some(h.server)
            })
            .map(|(i, _)| *i)
            .collect();
        for i in stale {
            // No new flow from here; the flows on its ports are ended first.
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            self.offload.set_held(index, &[0; 40 + 2 * PORTS])?;
            self.offload.sweep(|_, server| server == i);
            self.held.remove(&i);
        }
        for (i, addr) in wanted {
            if self.held.contains_key(&i) {
                continue;
            }
            let way = self.offload.way_to(addr.ip());
            match hold(&self.state, i, addr, way, &self.failed) {
                Ok(held) => {
                    let index = u32::try_from(i).unwrap_or(u32::MAX);
                    self.offload.set_held(index, &held.entry)?;
                    self.held.insert(i, held);
                }
                Err(e) => tracing::warn!("udp_offload: cannot hold ports for server {i}: {e}"),
            }
        }
        Ok(())
    }

    /// Ends the placed flows whose oldest datagram went unanswered for the timeout (the
    /// server failed, unless it answered other flows since, as for quill's own flows), and
    /// those idle for `udp_idle_timeout` (owed answers that never came).
    fn sweep(&mut self, settings: &Settings, now: u64) {
        let mono = monotonic_ns();
        let answer_ns = settings.timeout.max(1).saturating_mul(1_000_000_000);
        let idle_ns = settings
            .udp_idle_timeout
            .max(1)
            .saturating_mul(1_000_000_000);
        let over = |c: &Counters, _: usize| {
            let last = c.last_up_ns.max(c.last_down_ns);
            (c.awaiting_ns != 0 && mono.saturating_sub(c.awaiting_ns) >= answer_ns)
                || mono.saturating_sub(last) >= idle_ns
        };
        for swept in self.offload.sweep(over) {
            if swept.awaiting_ns == 0 {
                continue;
            }
            // `last_answer` is on quill's clock (ms), the program's on CLOCK_MONOTONIC.
            let sent = now.saturating_sub(mono.saturating_sub(swept.awaiting_ns) / 1_000_000);
            let answered = self
                .state
                .servers
                .get(swept.server)
                .map_or(0, |s| s.last_answer.load(Relaxed));
            if answered < sent {
                let i = swept.server;
                self.state.server_failed(
                    i,
                    settings.blacklist,
                    format_args!("server {i} failed for a udp flow placed in the kernel: no answer within the timeout"),
                );
            }
        }
    }

    /// Adds what the program counted since the last tick to the servers' totals.
    fn fold(&mut self, now: u64) {
        let mono = monotonic_ns();
        self.quiet = self.quiet.saturating_add(1);
        for &i in self.held.keys() {
            let Some(server) = self.state.servers.get(i) else {
                continue;
            };
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            let t = self.offload.placed_totals(index);
            let seen = self.seen.insert(i, t).unwrap_or_default();
            let flows = t.flows.saturating_sub(seen.flows);
            if t.up_packets > seen.up_packets {
                self.quiet = 0;
            }
            server.total.fetch_add(flows, Relaxed);
            self.state.counters.udp_placed.fetch_add(flows, Relaxed);
            server
                .bytes_to
                .fetch_add(t.up_bytes.saturating_sub(seen.up_bytes), Relaxed);
            server
                .bytes_from
                .fetch_add(t.down_bytes.saturating_sub(seen.down_bytes), Relaxed);
            if t.down_packets > seen.down_packets {
                let at = now.saturating_sub(mono.saturating_sub(t.last_down_ns) / 1_000_000);
                server.last_answer.fetch_max(at.max(1), Relaxed);
            }
        }
    }
}

impl Drop for Placer {
    /// quill stops placing: the program must not place flows on ports about to close.
    fn drop(&mut self) {
        let _ = self.offload.set_slots(&[], 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;

    fn settings(lines: &[&str]) -> Settings {
        let mut settings = Settings::default();
        for l in lines {
            settings.apply(&l.parse::<Command>().unwrap()).unwrap();
        }
        settings
    }

    const TWO: [&str; 2] = [
        "server 0 address 127.0.0.1 port 1",
        "server 1 address 127.0.0.1 port 2",
    ];

    #[test]
    fn the_kernel_places_only_where_no_rule_needs_the_flow() {
        let ok = settings(&[TWO[0], TWO[1], "roundrobin", "udp_responses 1"]);
        assert_eq!(why_not(&ok), None);
        for extra in [
            "no roundrobin",
            "udp_responses 0",
            "hash",
            "acl 1 deny 10.0.0.0 255.0.0.0",
            "server 0 max 5",
            "transparent",
        ] {
            let mut s = ok.clone();
            s.apply(&extra.parse::<Command>().unwrap()).unwrap();
            if extra.starts_with("acl") {
                s.apply(&"client_acl 1".parse::<Command>().unwrap())
                    .unwrap();
            }
            assert!(why_not(&s).is_some(), "{extra}");
        }
    }

    #[test]
    fn slots_follow_weight_prio_and_use() {
        let now = clock::now_ms();
        let s = settings(&[TWO[0], TWO[1], "roundrobin", "udp_responses 1"]);
        let state = State::new(s.clone(), false);
        assert_eq!(slots(&state, &s, now), [0, 1]);

        let s = settings(&[
            "server 0 address 127.0.0.1 port 1 weight 1",
            "server 1 address 127.0.0.1 port 2 weight 3",
            "weight",
        ]);
        let state = State::new(s.clone(), false);
        assert_eq!(slots(&state, &s, now), [0, 1, 1, 1]);

        let s = settings(&[
            "server 0 address 127.0.0.1 port 1 prio 2",
            "server 1 address 127.0.0.1 port 2 prio 1",
            "prio",
        ]);
        let state = State::new(s.clone(), false);
        assert_eq!(slots(&state, &s, now), [1]);
        // Out of use (blacklisted, drained): no slot; none left, none at all.
        state.servers.get(1).unwrap().blacklist(now, 60);
        assert_eq!(slots(&state, &s, now), [0]);
        state.servers.get(0).unwrap().draining.store(true, Relaxed);
        assert!(slots(&state, &s, now).is_empty());
    }

    #[test]
    fn many_heavy_servers_fit_the_table() {
        let lines: Vec<String> = (0..200)
            .map(|i| format!("server {i} address 127.0.0.1 port {} weight 1000", i + 1))
            .chain(["weight".to_string()])
            .collect();
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let s = settings(&refs);
        let state = State::new(s.clone(), false);
        let table = slots(&state, &s, clock::now_ms());
        assert!(table.len() <= MAX_SLOTS);
        for i in 0..200 {
            assert!(table.contains(&i), "server {i} has no slot");
        }
    }
}
