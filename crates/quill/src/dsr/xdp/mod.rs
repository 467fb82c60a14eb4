//! The DSR plane's XDP fast path (`dsr_path auto|xdp`): the program built from `dsr.bpf.c`
//! (the object is committed and embedded here) forwards the service's frames in the
//! driver's receive path; the plane keeps its maps in line with what it would do itself —
//! the configuration, the backends that are up (address → MAC, server number) and the
//! Maglev table (slot → backend address) from the same `dsr::maglev` code, so both paths
//! always choose alike — and reads its counters back into quill's.
//!
//! Invariants: the program is attached through a BPF link owned by this process, so the
//! kernel detaches it when the process ends, however it ends; no program is left behind
//! (kernels older than 5.9, which attach through netlink for good, get no fast path).
//! Maps are written in an order that never sends a frame to a backend that is not up: new
//! backends first, then the table's changed slots, then the backends that left are removed
//! (a slot or flow naming a missing backend makes the program pass the frame to the packet
//! socket). Only slots that changed are written (a fresh Maglev table differs from the last
//! in few slots).

use std::io;
use std::net::Ipv4Addr;

use aya::maps::{Array, HashMap, MapData, PerCpuArray};
use aya::programs::{Xdp, XdpFlags};
use aya::Ebpf;

use super::frame::Mac;
use super::maglev::{Maglev, TABLE_SIZE};
use super::Transport;

/// The program, built by `build` in this directory from `dsr.bpf.c`.
static PROGRAM: &[u8] = aya::include_bytes_aligned!("dsr.bpf.o");

/// How the program is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// In the driver (XDP_FLAGS_DRV_MODE): the frame never becomes an skb.
    Native,
    /// On the skb, before the stack (XDP_FLAGS_SKB_MODE): any interface.
    Generic,
}

impl Mode {
    pub fn word(self) -> &'static str {
        match self {
            Mode::Native => "native",
            Mode::Generic => "generic",
        }
    }

    fn flags(self) -> XdpFlags {
        match self {
            Mode::Native => XdpFlags::DRV_MODE,
            Mode::Generic => XdpFlags::SKB_MODE,
        }
    }
}

/// Why the fast path could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum XdpError {
    #[error("cannot load the XDP program: {0}")]
    Load(String),
    #[error("cannot attach the XDP program ({mode} mode): {reason}")]
    Attach {
        mode: &'static str,
        reason: String,
        /// Another program holds the interface (e.g. the process this one upgrades, until
        /// it ends): worth trying again.
        busy: bool,
    },
    #[error("XDP map {map}: {reason}")]
    Map { map: &'static str, reason: String },
}

/// The modes to try on `interface`, best first. A virtual interface (veth, bridge...) has
/// native XDP of a kind whose `XDP_TX` works only when its peer runs an XDP program too,
/// and which loses the checksum state of locally sent frames: generic mode there.
/// `QUILL_XDP_MODE=native|generic` forces one (a diagnostic switch; `bench/dsr` uses it).
fn modes(interface: &str) -> Vec<Mode> {
    match std::env::var("QUILL_XDP_MODE").as_deref() {
        Ok("native") => return vec![Mode::Native],
        Ok("generic") => return vec![Mode::Generic],
        _ => {}
    }
    let physical = std::path::Path::new(&format!("/sys/class/net/{interface}/device")).exists();
    if physical {
        vec![Mode::Native, Mode::Generic]
    } else {
        vec![Mode::Generic]
    }
}

/// The `config` map's one entry, laid out as `struct config` in `dsr.bpf.c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    pub vip: Ipv4Addr,
    pub port: u16,
    pub transport: Transport,
    pub roundrobin: bool,
    pub our_mac: Mac,
    pub targets: u16,
}

impl Config {
    fn bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&self.vip.octets());
        b[4..6].copy_from_slice(&self.port.to_be_bytes());
        b[6] = match self.transport {
            Transport::Tcp => libc::IPPROTO_TCP as u8,
            Transport::Udp => libc::IPPROTO_UDP as u8,
        };
        b[7] = u8::from(self.roundrobin);
        b[8..14].copy_from_slice(&self.our_mac);
        b[14..16].copy_from_slice(&self.targets.to_ne_bytes());
        b
    }
}

/// A backend as the program's `targets` map holds it (`struct target`).
fn target_bytes(mac: Mac, server: usize) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0..6].copy_from_slice(&mac);
    b[6..8].copy_from_slice(&(server.min(usize::from(u16::MAX)) as u16).to_ne_bytes());
    b
}

/// An address as the program compares it: the bytes in network order, read natively.
fn key(ip: Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

/// Indices of the program's global counters (`enum` in `dsr.bpf.c`).
const COUNT_FORWARDED: u32 = 0;
const COUNT_FLOWS_NEW: u32 = 2;

/// What the counters said at the last read, to add only what is new.
#[derive(Debug, Default)]
pub struct Totals {
    pub forwarded: u64,
    pub flows_new: u64,
}

/// Per-server counter deltas since the last read: frames, bytes, new connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerDelta {
    pub frames: u64,
    pub bytes: u64,
    pub syns: u64,
}

/// The attached program and its maps.
pub struct FastPath {
    // Owns the program and its link: dropping it detaches the program.
    ebpf: Ebpf,
    mode: Option<Mode>,
    config: Array<MapData, [u8; 16]>,
    maglev: Array<MapData, u32>,
    targets: HashMap<MapData, u32, [u8; 8]>,
    server_counts: PerCpuArray<MapData, [u64; 3]>,
    counters: PerCpuArray<MapData, u64>,
    /// What was last written: the configuration, each slot's backend, the backends.
    written_config: Option<[u8; 16]>,
    written_slots: Vec<u32>,
    written_targets: Vec<(Ipv4Addr, [u8; 8])>,
    /// Counter values at the last read.
    last: Totals,
    last_servers: std::collections::HashMap<usize, [u64; 3]>,
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> XdpError {
    move |e| XdpError::Map {
        map,
        reason: e.to_string(),
    }
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, XdpError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(XdpError::Map {
        map: name,
        reason: "not in the program".to_string(),
    })?;
    T::try_from(map).map_err(map_err(name))
}

/// Whether `e`, or an error it wraps, is EBUSY.
fn is_busy(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<io::Error>() {
            if io.raw_os_error() == Some(libc::EBUSY) {
                return true;
            }
        }
        cause = c.source();
    }
    false
}

impl FastPath {
    /// Loads the program and takes its maps; nothing is attached yet. Needs CAP_BPF (done
    /// at start-up, before privileges are dropped).
    pub fn load() -> Result<FastPath, XdpError> {
        // BPF links for XDP (Linux 5.9) go with the process that holds them; older kernels
        // attach through netlink, for good.
        if !crate::bpf::kernel_at_least(5, 9) {
            return Err(XdpError::Load(
                "this kernel is older than 5.9: without BPF links a killed quill would leave \
                 its program attached"
                    .into(),
            ));
        }
        let mut ebpf = Ebpf::load(PROGRAM).map_err(|e| XdpError::Load(e.to_string()))?;
        let program: &mut Xdp = ebpf
            .program_mut("quill_dsr")
            .ok_or_else(|| XdpError::Load("no program quill_dsr in the object".into()))?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| XdpError::Load(e.to_string()))?;
        program
            .load()
            .map_err(|e| XdpError::Load(crate::bpf::verifier_error(&e)))?;
        let config = take(&mut ebpf, "config")?;
        let maglev = take(&mut ebpf, "maglev")?;
        let targets = take(&mut ebpf, "targets")?;
        let server_counts = take(&mut ebpf, "server_counts")?;
        let counters = take(&mut ebpf, "counters")?;
        Ok(FastPath {
            ebpf,
            mode: None,
            config,
            maglev,
            targets,
            server_counts,
            counters,
            written_config: None,
            written_slots: vec![0; TABLE_SIZE],
            written_targets: Vec::new(),
            last: Totals::default(),
            last_servers: std::collections::HashMap::new(),
        })
    }

    /// Attaches the program to `interface` in the best mode that works (CAP_NET_ADMIN).
    pub fn attach(&mut self, interface: &str) -> Result<Mode, XdpError> {
        let program: &mut Xdp = self
            .ebpf
            .program_mut("quill_dsr")
            .ok_or_else(|| XdpError::Load("no program quill_dsr in the object".into()))?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| XdpError::Load(e.to_string()))?;
        let mut failure = None;
        for mode in modes(interface) {
            match program.attach(interface, mode.flags()) {
                Ok(_) => {
                    self.mode = Some(mode);
                    return Ok(mode);
                }
                Err(e) => {
                    failure = Some(XdpError::Attach {
                        mode: mode.word(),
                        busy: is_busy(&e),
                        reason: e.to_string(),
                    })
                }
            }
        }
        Err(failure.unwrap_or(XdpError::Attach {
            mode: "any",
            reason: "no mode to try".into(),
            busy: false,
        }))
    }

    /// How the program is attached; `None` before [`FastPath::attach`] succeeds.
    pub fn mode(&self) -> Option<Mode> {
        self.mode
    }

    /// Brings the maps in line with the plane: `up` are the backends that are up
    /// (address, MAC, server number) in the order `maglev`'s positions refer to.
    pub fn sync(
        &mut self,
        config: &Config,
        up: &[(Ipv4Addr, Mac, usize)],
        maglev: &Maglev,
    ) -> Result<(), XdpError> {
        let wanted: Vec<(Ipv4Addr, [u8; 8])> = up
            .iter()
            .map(|&(ip, mac, server)| (ip, target_bytes(mac, server)))
            .collect();
        if wanted != self.written_targets {
            // Backends that joined (or whose MAC changed) first.
            for (ip, value) in &wanted {
                if !self.written_targets.contains(&(*ip, *value)) {
                    self.targets
                        .insert(key(*ip), value, 0)
                        .map_err(map_err("targets"))?;
                }
            }
            // Then the table's slots that changed.
            for slot in 0..TABLE_SIZE {
                let ip = maglev
                    .lookup(slot as u64)
                    .and_then(|pos| up.get(pos))
                    .map_or(0, |t| key(t.0));
                if self.written_slots[slot] != ip {
                    self.maglev
                        .set(slot as u32, ip, 0)
                        .map_err(map_err("maglev"))?;
                    self.written_slots[slot] = ip;
                }
            }
            // Then the backends that left.
            for (ip, _) in &self.written_targets {
                if !wanted.iter().any(|(w, _)| w == ip) {
                    match self.targets.remove(&key(*ip)) {
                        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => {}
                        Err(e) => return Err(map_err("targets")(e)),
                    }
                }
            }
            self.written_targets = wanted;
        }
        let bytes = config.bytes();
        if self.written_config != Some(bytes) {
            self.config.set(0, bytes, 0).map_err(map_err("config"))?;
            self.written_config = Some(bytes);
        }
        Ok(())
    }

    /// What the program did since the last call: frames forwarded and flows pinned, and
    /// per server (of `servers`) what it sent there.
    pub fn collect(
        &mut self,
        servers: impl Iterator<Item = usize>,
    ) -> Result<(Totals, Vec<(usize, ServerDelta)>), XdpError> {
        let sum = |values: aya::maps::PerCpuValues<u64>| values.iter().sum::<u64>();
        let forwarded = sum(self
            .counters
            .get(&COUNT_FORWARDED, 0)
            .map_err(map_err("counters"))?);
        let flows_new = sum(self
            .counters
            .get(&COUNT_FLOWS_NEW, 0)
            .map_err(map_err("counters"))?);
        let totals = Totals {
            forwarded: forwarded.saturating_sub(self.last.forwarded),
            flows_new: flows_new.saturating_sub(self.last.flows_new),
        };
        self.last = Totals {
            forwarded,
            flows_new,
        };
        let mut deltas = Vec::new();
        for server in servers {
            let Ok(index) = u32::try_from(server) else {
                continue;
            };
            let values = self
                .server_counts
                .get(&index, 0)
                .map_err(map_err("server_counts"))?;
            let mut now = [0u64; 3];
            for v in values.iter() {
                for (n, x) in now.iter_mut().zip(v) {
                    *n += x;
                }
            }
            let before = self.last_servers.insert(server, now).unwrap_or_default();
            let delta = ServerDelta {
                frames: now[0].saturating_sub(before[0]),
                bytes: now[1].saturating_sub(before[1]),
                syns: now[2].saturating_sub(before[2]),
            };
            if delta != ServerDelta::default() {
                deltas.push((server, delta));
            }
        }
        Ok((totals, deltas))
    }
}
