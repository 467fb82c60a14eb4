//! The kernel path for UDP flows (`udp_offload IF[,IF...]`): a TC program, built from
//! `udp.bpf.c` (committed and embedded here), on the interfaces' ingress rewrites the
//! datagrams of the flows quill hands it and sends them on, so that a flow's datagrams
//! and its server's answers no longer wake quill. quill still places every flow (its first
//! datagrams come through `proxy::udp` as before) and keeps it: the flow's socket, its
//! place on the server, its number, its timer. The timer reads the flow's counters back
//! from the program (bytes, the last datagram each way, the first one still unanswered),
//! so that expiry, the answer timeout and the byte totals work as for any flow.
//!
//! Invariants: the program is attached through TCX links owned by this process (Linux
//! 6.6), so the kernel detaches it when the process ends, however it ends (older kernels
//! attach classifiers through netlink, for good: no offload there). A flow's reverse entry
//! is written before its forward entry and removed after it, so a datagram the program
//! carries towards a server always has a way back; an entry the program cannot follow
//! (the other is missing) passes the datagram on untouched, to quill's sockets.

use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use aya::programs::tc::{SchedClassifier, TcAttachOptions, TcAttachType};
use aya::programs::LinkOrder;
use aya::Ebpf;

pub mod placement;

/// The program, built by `build` in this directory from `udp.bpf.c`.
static PROGRAM: &[u8] = aya::include_bytes_aligned!("udp.bpf.o");

/// `struct addrs` in `udp.bpf.c`: source, destination (IPv6, or IPv4-mapped), their
/// ports, in network order.
type Addrs = [u8; 36];
/// `struct forward`: the rewritten addresses, the way on, the counters, then what a flow
/// the program placed itself carries (`placed`, `server`, `owed`, `responses`).
type Forward = [u8; 112];
/// Where the counters start in [`Forward`].
const COUNTERS: usize = 40;
/// Where `placed` and `server` are in [`Forward`].
const PLACED: usize = 96;
const SERVER: usize = 100;
/// `struct reverse`: the rewritten addresses, the forward entry's key, the way on.
type Reverse = [u8; 76];

/// `enum way` in `udp.bpf.c`: how a rewritten datagram goes on.
const WAY_LOCAL: u32 = 1;
const WAY_ROUTE: u32 = 2;

/// `MAX_FLOWS` in `udp.bpf.c`: the most entries each way.
const MAX_FLOWS: usize = 65_536;

/// How long the host's addresses are taken as known before they are read again.
const ADDRESSES_FOR: Duration = Duration::from_secs(1);

/// The host's IPv4 addresses, read again at most once per [`ADDRESSES_FOR`]: a flow
/// handed over asks twice, and reading them is a netlink dump.
#[derive(Default)]
struct Addresses {
    read_at: Option<Instant>,
    ours: Vec<IpAddr>,
}

impl Addresses {
    /// How a datagram rewritten to go to `ip` goes on: up the stack if `ip` is ours,
    /// else routed out.
    fn way_to(&mut self, ip: IpAddr) -> u32 {
        if ip.is_loopback() {
            return WAY_LOCAL;
        }
        if !matches!(self.read_at, Some(at) if at.elapsed() < ADDRESSES_FOR) {
            self.ours = nix::ifaddrs::getifaddrs()
                .map(|addrs| {
                    addrs
                        .filter_map(|a| {
                            let a = a.address?;
                            a.as_sockaddr_in()
                                .map(|s| IpAddr::V4(s.ip()))
                                .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
                        })
                        .collect()
                })
                .unwrap_or_default();
            self.read_at = Some(Instant::now());
        }
        if self.ours.contains(&ip) {
            WAY_LOCAL
        } else {
            WAY_ROUTE
        }
    }
}

/// Why the kernel path could not start, or an entry could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OffloadError {
    #[error("cannot load the UDP offload program: {0}")]
    Load(String),
    #[error("cannot attach the UDP offload program to {interface}: {reason}")]
    Attach { interface: String, reason: String },
    #[error("UDP offload map {map}: {reason}")]
    Map { map: &'static str, reason: String },
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> OffloadError {
    move |e| OffloadError::Map {
        map,
        reason: e.to_string(),
    }
}

/// The four addresses of a flow: the client and the address it sent to, the flow's
/// socket and its server; all of one family (the program rewrites addresses, it does not
/// translate between families).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowAddrs {
    pub client: SocketAddr,
    pub quill: SocketAddr,
    pub socket: SocketAddr,
    pub server: SocketAddr,
}

impl FlowAddrs {
    /// The flow's addresses (IPv4-mapped ones as IPv4), if they are specific and all of
    /// one family.
    pub fn new(
        client: SocketAddr,
        quill: SocketAddr,
        socket: SocketAddr,
        server: SocketAddr,
    ) -> Option<FlowAddrs> {
        let all = [client, quill, socket, server]
            .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()));
        let [client, quill, socket, server] = all;
        let one_family = all.iter().all(|a| a.is_ipv4() == client.is_ipv4());
        if !one_family || all.iter().any(|a| a.ip().is_unspecified()) {
            return None;
        }
        Some(FlowAddrs {
            client,
            quill,
            socket,
            server,
        })
    }

    /// The client's datagrams as they arrive: the forward entry's key.
    fn forward_key(&self) -> Addrs {
        addrs(self.client, self.quill)
    }

    /// The server's answers as they arrive: the reverse entry's key.
    fn reverse_key(&self) -> Addrs {
        addrs(self.server, self.socket)
    }
}

fn addrs(src: SocketAddr, dst: SocketAddr) -> Addrs {
    let v6 = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    let mut b = [0u8; 36];
    b[0..16].copy_from_slice(&v6(src.ip()));
    b[16..32].copy_from_slice(&v6(dst.ip()));
    b[32..34].copy_from_slice(&src.port().to_be_bytes());
    b[34..36].copy_from_slice(&dst.port().to_be_bytes());
    b
}

/// What the program counted for a flow since its entry was written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    pub up_packets: u64,
    pub up_bytes: u64,
    pub down_packets: u64,
    pub down_bytes: u64,
    /// `CLOCK_MONOTONIC` nanoseconds of the last datagram each way (0: none yet).
    pub last_up_ns: u64,
    pub last_down_ns: u64,
    /// The first datagram carried since the last answer (0: none waits).
    pub awaiting_ns: u64,
}

impl Counters {
    fn from_forward(v: &Forward) -> Counters {
        let at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&v[COUNTERS + 8 * i..COUNTERS + 8 * (i + 1)]);
            u64::from_ne_bytes(b)
        };
        Counters {
            up_packets: at(0),
            up_bytes: at(1),
            down_packets: at(2),
            down_bytes: at(3),
            last_up_ns: at(4),
            last_down_ns: at(5),
            awaiting_ns: at(6),
        }
    }
}

struct Maps {
    forwards: HashMap<MapData, Addrs, Forward>,
    reverses: HashMap<MapData, Addrs, Reverse>,
    addresses: Addresses,
    // The kernel's own placement of new flows (`placement`).
    placement: Array<MapData, [u8; 8]>,
    slots: Array<MapData, u32>,
    holds: Array<MapData, placement::HeldEntry>,
    placed: PerCpuArray<MapData, [u64; 6]>,
    listeners: HashMap<MapData, [u8; 20], u32>,
}

/// The attached program and its maps, shared by the UDP event loops (they write an entry
/// when a flow is handed over and read it on the flow's timer: never per datagram).
pub struct Offload {
    maps: Mutex<Maps>,
    /// Owns the program and its links: dropping it detaches the program.
    _ebpf: Ebpf,
    interfaces: Vec<String>,
}

impl std::fmt::Debug for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offload")
            .field("interfaces", &self.interfaces)
            .finish_non_exhaustive()
    }
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, OffloadError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(OffloadError::Map {
        map: name,
        reason: "not in the program".to_string(),
    })?;
    T::try_from(map).map_err(map_err(name))
}

impl Offload {
    /// Loads the program and attaches it to the ingress of each of `interfaces`
    /// (CAP_BPF and CAP_NET_ADMIN: done at start-up, before privileges are dropped).
    pub fn start(interfaces: &[&str]) -> Result<Offload, OffloadError> {
        // TCX links (Linux 6.6) go with the process that holds them.
        if !crate::bpf::kernel_at_least(6, 6) {
            return Err(OffloadError::Load(
                "this kernel is older than 6.6: without TCX links a killed quill would leave \
                 its program attached"
                    .into(),
            ));
        }
        let mut ebpf = Ebpf::load(PROGRAM).map_err(|e| OffloadError::Load(e.to_string()))?;
        let program: &mut SchedClassifier = ebpf
            .program_mut("quill_udp")
            .ok_or_else(|| OffloadError::Load("no program quill_udp in the object".into()))?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| OffloadError::Load(e.to_string()))?;
        program
            .load()
            .map_err(|e| OffloadError::Load(crate::bpf::verifier_error(&e)))?;
        for interface in interfaces {
            program
                .attach_with_options(
                    interface,
                    TcAttachType::Ingress,
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                )
                .map_err(|e| OffloadError::Attach {
                    interface: interface.to_string(),
                    reason: e.to_string(),
                })?;
        }
        let maps = Maps {
            forwards: take(&mut ebpf, "forwards")?,
            reverses: take(&mut ebpf, "reverses")?,
            addresses: Addresses::default(),
            placement: take(&mut ebpf, "placement")?,
            slots: take(&mut ebpf, "slots")?,
            holds: take(&mut ebpf, "holds")?,
            placed: take(&mut ebpf, "placed")?,
            listeners: take(&mut ebpf, "listeners")?,
        };
        Ok(Offload {
            maps: Mutex::new(maps),
            _ebpf: ebpf,
            interfaces: interfaces.iter().map(|s| s.to_string()).collect(),
        })
    }

    fn maps(&self) -> std::sync::MutexGuard<'_, Maps> {
        // A panic while holding the lock leaves the maps as they were: still usable.
        self.maps.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands `flow` to the program: from now on its datagrams go around quill.
    pub fn install(&self, flow: &FlowAddrs) -> Result<(), OffloadError> {
        let mut maps = self.maps();
        let forward_key = flow.forward_key();
        let mut reverse: Reverse = [0u8; 76];
        reverse[..36].copy_from_slice(&addrs(flow.quill, flow.client));
        reverse[36..72].copy_from_slice(&forward_key);
        let way = maps.addresses.way_to(flow.client.ip());
        reverse[72..76].copy_from_slice(&way.to_ne_bytes());
        let mut forward: Forward = [0u8; 112];
        forward[..36].copy_from_slice(&addrs(flow.socket, flow.server));
        let way = maps.addresses.way_to(flow.server.ip());
        forward[36..40].copy_from_slice(&way.to_ne_bytes());
        maps.reverses
            .insert(flow.reverse_key(), reverse, 0)
            .map_err(map_err("reverses"))?;
        if let Err(e) = maps.forwards.insert(forward_key, forward, 0) {
            let _ = maps.reverses.remove(&flow.reverse_key());
            return Err(map_err("forwards")(e));
        }
        Ok(())
    }

    /// What the program counted for `flow` (`None`: it has no entry).
    pub fn counters(&self, flow: &FlowAddrs) -> Option<Counters> {
        let maps = self.maps();
        let value = maps.forwards.get(&flow.forward_key(), 0).ok()?;
        Some(Counters::from_forward(&value))
    }

    /// Takes `flow` back: its next datagrams come to quill's sockets again. What the
    /// program counted up to its removal.
    pub fn remove(&self, flow: &FlowAddrs) -> Option<Counters> {
        let mut maps = self.maps();
        let key = flow.forward_key();
        let last = maps.forwards.get(&key, 0).ok();
        let _ = maps.forwards.remove(&key);
        let _ = maps.reverses.remove(&flow.reverse_key());
        last.map(|v| Counters::from_forward(&v))
    }
}

/// A flow the program placed itself that [`Offload::sweep`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Its server's index.
    pub server: usize,
    /// When its first unanswered datagram came (`CLOCK_MONOTONIC` ns; 0: it had answers
    /// and went idle).
    pub awaiting_ns: u64,
}

impl Offload {
    /// The way from the host to `ip` (`enum way`).
    fn way_to(&self, ip: IpAddr) -> u32 {
        self.maps().addresses.way_to(ip)
    }

    /// Makes the program place new flows among `slots` (server indexes, each once per
    /// share), owing `responses` answers per datagram; none: it places nothing.
    fn set_slots(&self, slots: &[u32], responses: u32) -> Result<(), OffloadError> {
        let mut maps = self.maps();
        let config = |n: u32| {
            let mut v = [0u8; 8];
            v[..4].copy_from_slice(&n.to_ne_bytes());
            v[4..].copy_from_slice(&responses.to_ne_bytes());
            v
        };
        // Off while the table changes: a datagram placed meanwhile goes to quill.
        maps.placement
            .set(0, config(0), 0)
            .map_err(map_err("placement"))?;
        for (i, server) in (0u32..).zip(slots) {
            maps.slots.set(i, server, 0).map_err(map_err("slots"))?;
        }
        let n = u32::try_from(slots.len()).unwrap_or(0);
        if n > 0 {
            maps.placement
                .set(0, config(n), 0)
                .map_err(map_err("placement"))?;
        }
        Ok(())
    }

    /// Writes server `index`'s held ports (none: the program places nothing there).
    fn set_held(&self, index: u32, entry: &placement::HeldEntry) -> Result<(), OffloadError> {
        self.maps()
            .holds
            .set(index, entry, 0)
            .map_err(map_err("holds"))
    }

    /// Makes `listeners` the addresses whose new clients the program may place.
    fn set_listeners(&self, listeners: &[SocketAddr]) -> Result<(), OffloadError> {
        let mut maps = self.maps();
        let old: Vec<[u8; 20]> = maps.listeners.keys().filter_map(Result::ok).collect();
        for key in &old {
            let _ = maps.listeners.remove(key);
        }
        for l in listeners {
            // A wildcard is written as `::` (IPv6, dual-stack) or `::ffff:0.0.0.0`.
            let ip = match l.ip() {
                IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                IpAddr::V6(v6) => v6.octets(),
            };
            let mut key = [0u8; 20];
            key[..16].copy_from_slice(&ip);
            key[16..18].copy_from_slice(&l.port().to_be_bytes());
            maps.listeners
                .insert(key, 1, 0)
                .map_err(map_err("listeners"))?;
        }
        Ok(())
    }

    /// What the program placed and carried of its own flows to server `index`, summed
    /// over the CPUs.
    fn placed_totals(&self, index: u32) -> placement::Totals {
        let maps = self.maps();
        let mut t = placement::Totals::default();
        if let Ok(per_cpu) = maps.placed.get(&index, 0) {
            for v in per_cpu.iter() {
                t.add(v);
            }
        }
        t
    }

    /// Ends the flows the program placed that `over` says are done (it is given each
    /// one's counters and server), forward entry first; returns them.
    fn sweep(&self, mut over: impl FnMut(&Counters, usize) -> bool) -> Vec<Swept> {
        let mut maps = self.maps();
        let mut done = Vec::new();
        // Bounded: a walk restarts when the program removes the entry it stood on.
        let walk = maps.forwards.iter().filter_map(Result::ok).take(MAX_FLOWS);
        for entry in walk {
            let (key, v) = entry;
            let word = |at: usize| {
                let mut b = [0u8; 4];
                b.copy_from_slice(&v[at..at + 4]);
                u32::from_ne_bytes(b)
            };
            if word(PLACED) == 0 {
                continue;
            }
            let server = word(SERVER) as usize;
            let c = Counters::from_forward(&v);
            if over(&c, server) {
                // The reverse entry's key: the server's answers to the claimed port.
                let mut reverse = [0u8; 36];
                reverse[0..16].copy_from_slice(&v[16..32]);
                reverse[16..32].copy_from_slice(&v[0..16]);
                reverse[32..34].copy_from_slice(&v[34..36]);
                reverse[34..36].copy_from_slice(&v[32..34]);
                done.push((key, reverse, server, c.awaiting_ns));
            }
        }
        done.into_iter()
            .map(|(key, reverse, server, awaiting_ns)| {
                let _ = maps.forwards.remove(&key);
                let _ = maps.reverses.remove(&reverse);
                Swept {
                    server,
                    awaiting_ns,
                }
            })
            .collect()
    }
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: the program's clock (`bpf_ktime_get_ns`).
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    u64::try_from(t.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(t.tv_nsec).unwrap_or(0))
}
