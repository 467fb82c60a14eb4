//! The DSR plane's loop: read a frame, decide (answer ARP, forward to a backend, answer a
//! tarpit SYN, or drop), send; and every [`TICK`], re-read the settings, ask the backends
//! for their MAC addresses and rebuild the Maglev table when the backends that are up
//! change.
//!
//! Invariants: the receive buffer and the send buffer are allocated once; a forwarded
//! frame is rewritten in place (two MAC addresses) and sent from where it was received (the
//! ring slot, with the rest of its batch, or the receive buffer) with its virtio header
//! unchanged. Only frames addressed to our MAC (or broadcast ARP) are
//! looked at, and our own frames never come back (PACKET_IGNORE_OUTGOING).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::arp::ArpTable;
use super::flows::{FlowTable, Found};
use super::frame::{
    self, Arp, Frame, Mac, Payload, ARP_REPLY, ARP_REQUEST, BROADCAST, L4, PROTO_TCP, PROTO_UDP,
};
use super::maglev::{mix64, Maglev};
use super::packet::{BatchReport, FrameRing, PacketSocket, RxRing, TxMode, VNET_HDR_LEN};
use super::tarpit::{self, Syn, Tarpit};
use super::xdp::{self, FastPath, XdpError};
use super::{DsrConfig, DsrError, Transport};
use crate::acl::AclAction;
use crate::balance::clock;
use crate::command::DsrPath;
use crate::settings::Settings;
use crate::state::{DsrCounters, State};

/// How often settings, ARP and the backend set are looked at.
const TICK: Duration = Duration::from_millis(100);
/// Largest frame taken: a 64 KiB GSO super-frame plus headers.
const RX_BUF: usize = VNET_HDR_LEN + 65_536 + 64;
/// The TPACKET_V2 ring (the default): slots larger than any frame (GSO super-frames are up
/// to 64 KiB), 1024 of them to absorb bursts while the thread waits for a core (68 MiB of
/// address space; only the pages a frame reaches are ever touched, 4 KiB a slot for small
/// frames).
const SLOT_SIZE: usize = 68 << 10;
const SLOTS: usize = 1024;
/// Frames handled per wake-up at most, so that ticks are not starved under load.
const BATCH: usize = 256;
/// The TPACKET_V3 ring: blocks larger than any frame, 8 MiB in all; a block is handed over
/// when full or when its timer (at least one kernel tick, 4 ms at HZ=250) runs out.
const RING_BLOCK: usize = 256 << 10;
const RING_BLOCKS: usize = 32;
const RING_RETIRE: Duration = Duration::from_millis(1);

/// How frames are read.
#[derive(Debug)]
enum Reader {
    /// TPACKET_V2 ring: per-frame hand-over, no added latency, batches of what is ready.
    Frames(FrameRing),
    /// TPACKET_V3 ring: per-block hand-over (a block timer adds latency at low rates).
    Blocks(RxRing),
    /// One `recv` per frame, into one buffer.
    Recv(Vec<u8>),
}

/// One backend that can be chosen: server number, address, MAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Target {
    server: usize,
    ip: Ipv4Addr,
    mac: Mac,
}

/// The plane: its socket, its tables and its buffers.
#[derive(Debug)]
pub struct Plane {
    config: DsrConfig,
    sock: PacketSocket,
    our_mac: Mac,
    /// Our address on the interface (sender of ARP requests); 0.0.0.0 (an ARP probe) when
    /// the interface has none.
    our_ip: Ipv4Addr,
    counters: Arc<DsrCounters>,
    /// How frames are read; taken by [`Plane::run`].
    reader: Option<Reader>,
    /// How the rings send the frames they forward.
    tx_mode: TxMode,
    /// The XDP fast path (`dsr_path`), loaded at start-up; attached unless another program
    /// held the interface then (retried every second).
    fast: Option<FastPath>,
}

/// The interface's MAC address, from sysfs.
fn interface_mac(interface: &str) -> std::io::Result<Mac> {
    let text = std::fs::read_to_string(format!("/sys/class/net/{interface}/address"))?;
    parse_mac(text.trim()).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("'{}' is not an Ethernet address", text.trim()),
        )
    })
}

fn parse_mac(s: &str) -> Option<Mac> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// The `xdp_mode` counter's value for a mode.
fn xdp_gauge(mode: xdp::Mode) -> u64 {
    match mode {
        xdp::Mode::Native => 2,
        xdp::Mode::Generic => 1,
    }
}

/// Loads and attaches the XDP program unless `dsr_path packet`. Under `auto` a failure
/// falls back to the packet socket (said in the log); under `xdp` it stops the start. An
/// interface held by another program (the process this one upgrades) is not a failure:
/// the program is kept and attached when the interface is free.
fn open_fast_path(config: &DsrConfig) -> Result<Option<FastPath>, DsrError> {
    if config.path == DsrPath::Packet {
        return Ok(None);
    }
    let interface = &config.interface;
    let attached = FastPath::load().and_then(|mut fast| match fast.attach(interface) {
        Ok(_) => Ok(fast),
        Err(XdpError::Attach { busy: true, .. }) => {
            tracing::warn!(
                "DSR on {interface}: another XDP program holds the interface; forwarding \
                 through the packet socket until it goes"
            );
            Ok(fast)
        }
        Err(e) => Err(e),
    });
    match attached {
        Ok(fast) => Ok(Some(fast)),
        Err(source) if config.path == DsrPath::Xdp => Err(DsrError::Xdp {
            interface: interface.clone(),
            source,
        }),
        Err(e) => {
            tracing::warn!("DSR on {interface}: no XDP fast path ({e}); using the packet socket");
            Ok(None)
        }
    }
}

/// The first IPv4 address of the interface, if it has one.
fn interface_ipv4(interface: &str) -> Option<Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .ok()?
        .filter(|a| a.interface_name == interface)
        .find_map(|a| a.address?.as_sockaddr_in().map(|s| s.ip()))
}

impl Plane {
    /// Opens the packet socket on the interface and reads its addresses.
    pub fn open(config: DsrConfig) -> Result<Plane, DsrError> {
        let interface = config.interface.clone();
        let our_mac = interface_mac(&interface).map_err(|source| DsrError::Mac {
            interface: interface.clone(),
            source,
        })?;
        let sock = PacketSocket::open(&interface).map_err(|source| DsrError::Socket {
            interface: interface.clone(),
            source,
        })?;
        let timeouts = sock
            .set_read_timeout(TICK)
            .and_then(|()| sock.set_recv_buffer(4 << 20));
        if let Err(source) = timeouts {
            return Err(DsrError::Socket { interface, source });
        }
        let our_ip = interface_ipv4(&interface).unwrap_or(Ipv4Addr::UNSPECIFIED);
        // QUILL_DSR_RING=v2 (default), v3 or off: a diagnostic switch, and what bench/dsr
        // compares.
        // QUILL_DSR_TX=batch (default: one sendmmsg per batch) or single (one send per
        // frame), QUILL_DSR_BYPASS=1 (PACKET_QDISC_BYPASS): likewise.
        let wanted = std::env::var("QUILL_DSR_RING").unwrap_or_default();
        let tx_mode = match std::env::var("QUILL_DSR_TX").as_deref() {
            Ok("single") => TxMode::Single,
            _ => TxMode::Batch,
        };
        if std::env::var("QUILL_DSR_BYPASS").as_deref() == Ok("1") {
            if let Err(source) = sock.set_qdisc_bypass(true) {
                return Err(DsrError::Socket { interface, source });
            }
        }
        let ring = match wanted.as_str() {
            "off" => Ok(None),
            "v3" => sock
                .rx_ring(RING_BLOCK, RING_BLOCKS, RING_RETIRE, tx_mode)
                .map(|r| Some(Reader::Blocks(r))),
            _ => sock
                .frame_ring(SLOT_SIZE, SLOTS, tx_mode)
                .map(|r| Some(Reader::Frames(r))),
        };
        let reader = match ring {
            Ok(Some(reader)) => reader,
            Ok(None) => Reader::Recv(vec![0u8; RX_BUF]),
            Err(e) => {
                tracing::warn!(
                    "DSR on {interface}: no receive ring ({e}); reading one frame per call"
                );
                Reader::Recv(vec![0u8; RX_BUF])
            }
        };
        let fast = open_fast_path(&config)?;
        let counters = Arc::<DsrCounters>::default();
        if let Some(mode) = fast.as_ref().and_then(FastPath::mode) {
            counters.xdp_mode.store(xdp_gauge(mode), Relaxed);
        }
        Ok(Plane {
            config,
            sock,
            our_mac,
            our_ip,
            counters,
            reader: Some(reader),
            tx_mode,
            fast,
        })
    }

    pub fn counters(&self) -> Arc<DsrCounters> {
        Arc::clone(&self.counters)
    }

    /// Runs until `stop` turns true (checked every tick).
    pub fn run(mut self, state: &State, stop: &watch::Receiver<bool>) {
        tracing::info!(
            "DSR on {} (MAC {}, ifindex {}, {}, {}, {}): {} {}:{}",
            self.config.interface,
            fmt_mac(&self.our_mac),
            self.sock.ifindex(),
            match self.reader {
                Some(Reader::Frames(_)) => "TPACKET_V2 receive ring",
                Some(Reader::Blocks(_)) => "TPACKET_V3 receive ring",
                _ => "one frame per recv",
            },
            match (&self.reader, self.tx_mode) {
                (Some(Reader::Frames(_) | Reader::Blocks(_)), TxMode::Batch) => {
                    "one sendmmsg per batch"
                }
                _ => "one send per frame",
            },
            match self.fast.as_ref().map(FastPath::mode) {
                Some(Some(xdp::Mode::Native)) => "XDP native",
                Some(Some(xdp::Mode::Generic)) => "XDP generic",
                Some(None) => "XDP waiting for the interface",
                None => "no XDP",
            },
            match self.config.transport {
                Transport::Tcp => "TCP",
                Transport::Udp => "UDP",
            },
            self.config.vip,
            self.config.port
        );
        let mut run = Running {
            settings: state.settings(),
            arp: ArpTable::default(),
            targets: Vec::new(),
            maglev: Maglev::build(&[]),
            flows: FlowTable::new(Instant::now()),
            up: Vec::new(),
            tarpit: Tarpit::default(),
            due: Vec::new(),
            backends: Vec::new(),
            tx: [0u8; 128],
            last_tick: None,
            recv_errors: 0,
            configured: false,
            attach_retry: None,
            xdp_errors: 0,
        };
        let mut reader = self
            .reader
            .take()
            .unwrap_or(Reader::Recv(vec![0u8; RX_BUF]));
        while !*stop.borrow() {
            let now = Instant::now();
            if run
                .last_tick
                .map_or(true, |t| now.saturating_duration_since(t) >= TICK)
            {
                run.last_tick = Some(now);
                self.tick(&mut run, state, now);
            }
            let received = match &mut reader {
                Reader::Frames(ring) => ring.next_batch(&self.sock, TICK, BATCH, |frame| {
                    self.handle(&mut run, state, frame, now)
                }),
                Reader::Blocks(ring) => ring.next_block(&self.sock, TICK, |frame| {
                    self.handle(&mut run, state, frame, now)
                }),
                Reader::Recv(rx) => self.sock.recv(rx).map(|got| {
                    let mut report = BatchReport::default();
                    if let Some(n) = got {
                        report.frames = 1;
                        if self.handle(&mut run, state, &mut rx[..n], now) {
                            match self.sock.send(&rx[..n]) {
                                Ok(()) => report.sent = 1,
                                Err(e) => {
                                    report.failed = 1;
                                    report.error = Some(e);
                                }
                            }
                        }
                    }
                    report
                }),
            };
            match received {
                Ok(report) => {
                    run.recv_errors = 0;
                    self.count_sends(report);
                }
                Err(e) => {
                    // The interface went down or away: say so once, then wait a tick
                    // between attempts instead of spinning.
                    if run.recv_errors == 0 {
                        tracing::warn!("DSR on {}: {e}", self.config.interface);
                    }
                    run.recv_errors += 1;
                    std::thread::sleep(TICK);
                }
            }
        }
        let c = &self.counters;
        tracing::info!(
            "DSR on {} stopped: {} frames forwarded ({} by XDP), {} dropped without a backend, \
             {} ARP replies, tarpit {} SYN+ACKs and {} dropped, {} send errors",
            self.config.interface,
            c.forwarded.load(Relaxed),
            c.xdp_forwarded.load(Relaxed),
            c.no_backend.load(Relaxed),
            c.arp_replies.load(Relaxed),
            c.tarpit_synack.load(Relaxed),
            c.tarpit_dropped.load(Relaxed),
            c.send_errors.load(Relaxed)
        );
    }

    /// The periodic work: settings, ARP refresh, the set of backends that are up.
    fn tick(&mut self, run: &mut Running, state: &State, now: Instant) {
        let settings = state.settings();
        if !run.configured {
            // Announce the VIP (gratuitous ARP): neighbours that still map it to another
            // MAC address, e.g. a balancer this one replaces, learn ours at once.
            let vip = self.config.vip;
            let announce = Arp {
                op: ARP_REQUEST,
                sender_mac: self.our_mac,
                sender_ip: vip,
                target_mac: [0; 6],
                target_ip: vip,
            };
            self.send_built(run, |buf, mac| {
                frame::build_arp(buf, BROADCAST, mac, &announce)
            });
        }
        if !Arc::ptr_eq(&settings, &run.settings) || !run.configured {
            run.configured = true;
            run.settings = settings;
            run.backends.clear();
            for (index, s) in run.settings.servers.iter().enumerate() {
                if let Some(IpAddr::V4(ip)) = s.addr().map(|a| a.ip().to_canonical()) {
                    run.backends.push((index, ip));
                }
            }
            let ips: Vec<Ipv4Addr> = run.backends.iter().map(|b| b.1).collect();
            run.arp.set_targets(&ips);
        }
        run.due.clear();
        run.arp.due(now, &mut run.due);
        for i in 0..run.due.len() {
            let target_ip = run.due[i];
            let request = Arp {
                op: ARP_REQUEST,
                sender_mac: self.our_mac,
                sender_ip: self.our_ip,
                target_mac: [0; 6],
                target_ip,
            };
            self.send_built(run, |buf, mac| {
                frame::build_arp(buf, BROADCAST, mac, &request)
            });
        }
        let now_ms = clock::now_ms();
        let mut targets: Vec<Target> = Vec::with_capacity(run.backends.len());
        for &(server, ip) in &run.backends {
            let blacklisted = state
                .servers
                .get(server)
                .is_some_and(|s| s.is_blacklisted(now_ms));
            if let (false, Some(mac)) = (blacklisted, run.arp.lookup(ip, now)) {
                targets.push(Target { server, ip, mac });
            }
        }
        run.flows.tick(now);
        self.counters.flows.store(run.flows.len() as u64, Relaxed);
        if targets != run.targets {
            let keys: Vec<(usize, u64)> = targets
                .iter()
                .enumerate()
                .map(|(pos, t)| (pos, u64::from(u32::from(t.ip))))
                .collect();
            // A fresh table, never patched from the last one: see `maglev`.
            run.maglev = Maglev::build(&keys);
            run.up = targets.iter().map(|t| t.ip).collect();
            let up: Vec<String> = targets.iter().map(|t| t.ip.to_string()).collect();
            tracing::info!(
                "DSR on {}: backends up: [{}]",
                self.config.interface,
                up.join(", ")
            );
            run.targets = targets;
        }
        self.counters
            .backends_up
            .store(run.targets.len() as u64, Relaxed);
        self.counters.started.store(true, Relaxed);
        self.tick_fast_path(run, state, now);
    }

    /// Keeps the XDP program's maps in line with this tick's decisions and adds what it
    /// forwarded to the counters; retries attaching while another program holds the
    /// interface.
    fn tick_fast_path(&mut self, run: &mut Running, state: &State, now: Instant) {
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        if fast.mode().is_none() {
            if run.attach_retry.is_some_and(|t| now < t) {
                return;
            }
            run.attach_retry = Some(now + Duration::from_secs(1));
            match fast.attach(&self.config.interface) {
                Ok(mode) => {
                    tracing::info!(
                        "DSR on {}: XDP program attached ({} mode)",
                        self.config.interface,
                        mode.word()
                    );
                    self.counters.xdp_mode.store(xdp_gauge(mode), Relaxed);
                }
                Err(XdpError::Attach { busy: true, .. }) => return,
                Err(e) => {
                    tracing::warn!(
                        "DSR on {}: {e}; staying on the packet socket",
                        self.config.interface
                    );
                    self.fast = None;
                    return;
                }
            }
        }
        let Some(fast) = self.fast.as_mut() else {
            return;
        };
        let config = xdp::Config {
            vip: self.config.vip,
            port: self.config.port,
            transport: self.config.transport,
            roundrobin: run.settings.policy.roundrobin,
            our_mac: self.our_mac,
            targets: u16::try_from(run.targets.len()).unwrap_or(u16::MAX),
        };
        let up: Vec<(Ipv4Addr, frame::Mac, usize)> = run
            .targets
            .iter()
            .map(|t| (t.ip, t.mac, t.server))
            .collect();
        let result = fast
            .sync(&config, &up, &run.maglev)
            .and_then(|()| fast.collect(run.backends.iter().map(|b| b.0)));
        match result {
            Ok((totals, servers)) => {
                run.xdp_errors = 0;
                self.counters.forwarded.fetch_add(totals.forwarded, Relaxed);
                self.counters
                    .xdp_forwarded
                    .fetch_add(totals.forwarded, Relaxed);
                for (server, delta) in servers {
                    if let Some(s) = state.servers.get(server) {
                        s.bytes_to.fetch_add(delta.bytes, Relaxed);
                        s.total.fetch_add(delta.syns, Relaxed);
                    }
                }
            }
            Err(e) => {
                if run.xdp_errors == 0 {
                    tracing::error!("DSR on {}: {e}", self.config.interface);
                }
                run.xdp_errors += 1;
            }
        }
    }

    /// Counts the forwarded frames a batch sent, and those the kernel refused.
    fn count_sends(&self, report: BatchReport) {
        if report.sent > 0 {
            self.counters
                .forwarded
                .fetch_add(report.sent as u64, Relaxed);
        }
        if report.failed > 0 {
            self.counters
                .send_errors
                .fetch_add(report.failed as u64, Relaxed);
            if let Some(e) = report.error {
                tracing::debug!("DSR forward on {}: {e}", self.config.interface);
            }
        }
    }

    /// Builds a frame with `build` after a zeroed virtio header and sends it.
    fn send_built(
        &self,
        run: &mut Running,
        build: impl FnOnce(&mut [u8], Mac) -> Option<usize>,
    ) -> bool {
        run.tx[..VNET_HDR_LEN].fill(0);
        let Some(n) = build(&mut run.tx[VNET_HDR_LEN..], self.our_mac) else {
            return false;
        };
        match self.sock.send(&run.tx[..VNET_HDR_LEN + n]) {
            Ok(()) => true,
            Err(e) => {
                self.counters.send_errors.fetch_add(1, Relaxed);
                tracing::debug!("DSR send: {e}");
                false
            }
        }
    }

    /// Whether `ip` is tarpitted: permitted by a rule of the tarpit list, and none of the
    /// VIP, our own address or a backend's.
    fn tarpitted(&self, run: &Running, ip: Ipv4Addr) -> bool {
        let Some(list) = run.settings.tarpit_acl else {
            return false;
        };
        let acl = &run.settings.acls[list.index()];
        ip != self.config.vip
            && ip != self.our_ip
            && acl.first_match(IpAddr::V4(ip)) == Some(AclAction::Permit)
            && !run.backends.iter().any(|b| b.1 == ip)
    }

    /// One received frame (virtio header first). Returns true when the frame, rewritten in
    /// place, is to be sent back out (forwarded to a backend); replies of our own (ARP,
    /// tarpit) are sent here.
    fn handle(&self, run: &mut Running, state: &State, buf: &mut [u8], now: Instant) -> bool {
        let Some(frame_bytes) = buf.get(VNET_HDR_LEN..) else {
            return false;
        };
        let Ok(Frame { dst, src, payload }) = frame::parse(frame_bytes) else {
            return false;
        };
        match payload {
            Payload::Arp(arp) => self.handle_arp(run, &arp, now),
            Payload::Ipv4(ip) if dst == self.our_mac => {
                if ip.dst == self.config.vip {
                    return self.forward(run, state, buf, &ip);
                } else if self.tarpitted(run, ip.dst) {
                    match ip.l4 {
                        L4::Tcp {
                            src_port,
                            dst_port,
                            seq,
                            flags,
                        } if tarpit::is_syn(flags) => {
                            let syn = Syn {
                                client_mac: src,
                                client: ip.src,
                                client_port: src_port,
                                addr: ip.dst,
                                port: dst_port,
                                seq,
                            };
                            let tarpit = run.tarpit.clone();
                            if self.send_built(run, |b, mac| tarpit.syn_ack(b, mac, &syn)) {
                                self.counters.tarpit_synack.fetch_add(1, Relaxed);
                            }
                        }
                        _ => {
                            self.counters.tarpit_dropped.fetch_add(1, Relaxed);
                        }
                    }
                }
            }
            _ => {}
        }
        false
    }

    fn handle_arp(&self, run: &mut Running, arp: &Arp, now: Instant) {
        // Replies to our requests and the backends' own requests both tell their MAC.
        if !arp.sender_ip.is_unspecified() {
            run.arp.heard(arp.sender_ip, arp.sender_mac, now);
        }
        if arp.op != ARP_REQUEST {
            return;
        }
        if arp.target_ip == self.config.vip || self.tarpitted(run, arp.target_ip) {
            let reply = Arp {
                op: ARP_REPLY,
                sender_mac: self.our_mac,
                sender_ip: arp.target_ip,
                target_mac: arp.sender_mac,
                target_ip: arp.sender_ip,
            };
            let to = arp.sender_mac;
            if self.send_built(run, |buf, mac| frame::build_arp(buf, to, mac, &reply)) {
                self.counters.arp_replies.fetch_add(1, Relaxed);
            }
        }
    }

    /// Rewrites a frame for the VIP to go to the flow's backend, if it is for our port;
    /// returns whether to send it (the caller sends, alone or in a batch).
    fn forward(&self, run: &mut Running, state: &State, buf: &mut [u8], ip: &frame::Ipv4) -> bool {
        let want = match self.config.transport {
            Transport::Tcp => PROTO_TCP,
            Transport::Udp => PROTO_UDP,
        };
        let port = self.config.port;
        // `syn`: a new connection for the totals (a TCP SYN, every UDP datagram);
        // `syn_only`: a flow that may never become one (a lone SYN), for the flow table.
        let (client_port, syn, syn_only) = match ip.l4 {
            L4::Tcp {
                src_port,
                dst_port,
                flags,
                ..
            } if want == PROTO_TCP && dst_port == port => {
                let syn = tarpit::is_syn(flags);
                (Some(src_port), syn, syn)
            }
            L4::Udp { src_port, dst_port } if want == PROTO_UDP && dst_port == port => {
                (Some(src_port), true, false)
            }
            L4::Fragment { proto } if proto == want => (None, false, false),
            _ => return false,
        };
        // Pen's tracking (the default) keeps a client on one server: hash its address only.
        // Round robin (-r) spreads the flows of a client: hash its address and port.
        // Fragments carry no ports and go by the address.
        let client = u64::from(u32::from(ip.src));
        let key = match client_port {
            Some(p) if run.settings.policy.roundrobin && !ip.fragmented => {
                (client << 16) | u64::from(p)
            }
            _ => client,
        };
        let position = match run.flows.lookup(key, syn_only, &run.up) {
            Found::Pinned(position) => Some(position),
            Found::Unknown => run.maglev.lookup(mix64(key)).inspect(|&position| {
                if !run.flows.pin(key, syn_only, &run.up, position) {
                    self.counters.flows_unrecorded.fetch_add(1, Relaxed);
                }
            }),
        };
        let Some(target) = position.and_then(|p| run.targets.get(p)).copied() else {
            self.counters.no_backend.fetch_add(1, Relaxed);
            return false;
        };
        if !frame::set_macs(&mut buf[VNET_HDR_LEN..], target.mac, self.our_mac) {
            return false;
        }
        // Counted per server when decided (a send the kernel refuses later, rare on a
        // packet socket, is counted in `send_errors`).
        if let Some(s) = state.servers.get(target.server) {
            s.bytes_to
                .fetch_add((buf.len() - VNET_HDR_LEN) as u64, Relaxed);
            if syn {
                s.total.fetch_add(1, Relaxed);
            }
        }
        true
    }
}

/// The plane's mutable state, owned by its thread.
struct Running {
    settings: Arc<Settings>,
    arp: ArpTable,
    /// The backends that are up, in server order; Maglev returns positions in it.
    targets: Vec<Target>,
    maglev: Maglev,
    /// The backend of each flow this node forwards.
    flows: FlowTable,
    /// The addresses of `targets`, in the same order (what the flow table checks).
    up: Vec<Ipv4Addr>,
    tarpit: Tarpit,
    /// Scratch list of ARP requests to send (kept to reuse its allocation).
    due: Vec<Ipv4Addr>,
    /// Configured IPv4 backends: (server number, address).
    backends: Vec<(usize, Ipv4Addr)>,
    tx: [u8; 128],
    last_tick: Option<Instant>,
    recv_errors: u64,
    /// The backends were read from the settings at least once.
    configured: bool,
    /// When to try attaching the XDP program again (while another one holds the interface).
    attach_retry: Option<Instant>,
    /// XDP map errors in a row (logged once).
    xdp_errors: u64,
}

fn fmt_mac(m: &Mac) -> String {
    format!(
        "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
        m[0], m[1], m[2], m[3], m[4], m[5]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_parsing() {
        assert_eq!(
            parse_mac("02:e5:a1:15:e1:01"),
            Some([2, 0xe5, 0xa1, 0x15, 0xe1, 1])
        );
        assert_eq!(parse_mac("02:e5:a1:15:e1"), None);
        assert_eq!(parse_mac("02:e5:a1:15:e1:01:00"), None);
        assert_eq!(parse_mac("zz:e5:a1:15:e1:01"), None);
    }
}
