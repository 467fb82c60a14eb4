//! Direct Server Return (`dsr_if IF`): a raw-packet data plane on one interface. quill
//! answers ARP for the VIP, receives the frames addressed to VIP:port, picks a backend by a
//! consistent hash of the flow and sends the frame back out with only the MAC addresses
//! changed; the backend (VIP on its loopback) answers the client directly.
//!
//! Invariants: the plane runs on its own thread and never blocks an event loop; nothing is
//! allocated per packet but the flow table's amortised growth, up to its bound ([`flows`]);
//! settings are read once per tick (not per packet); a flow new to this node gets the
//! backend that depends only on the flow and on the set of backends that are up
//! ([`maglev`]), the same on every node with the same servers, and keeps it (the flow
//! table) while that backend is up and the flow is not idle for long. The tarpit
//! ([`tarpit`]) lives in the same plane.

pub mod arp;
pub mod flows;
pub mod frame;
pub mod maglev;
pub mod packet;
mod plane;
pub mod tarpit;
pub mod xdp;

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::watch;

use crate::command::DsrPath;
use crate::net::ListenAddr;
use crate::settings::Settings;
use crate::state::{DsrCounters, State};

/// Why the DSR plane cannot start. Each variant says what to change.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DsrError {
    #[error(
        "dsr_if {interface}: the listening address must be one IPv4 address and port \
         (the VIP, e.g. 10.0.0.100:80), not {listen}"
    )]
    Listen { interface: String, listen: String },
    #[error(
        "dsr_if {interface}: server {index} ({server}) must be an IPv4 address on the \
         interface's segment with the VIP's port {port}: DSR only rewrites MAC addresses"
    )]
    Server {
        interface: String,
        index: usize,
        server: String,
        port: u16,
    },
    #[error("dsr_if {interface}: no such network interface")]
    NoInterface { interface: String },
    #[error("dsr_if {interface}: cannot read the interface's MAC address: {source}")]
    Mac {
        interface: String,
        source: io::Error,
    },
    #[error(
        "dsr_if {interface}: cannot open a packet socket on it: {source} (quill needs \
         CAP_NET_RAW, e.g. run as root, and the interface must exist)"
    )]
    Socket {
        interface: String,
        source: io::Error,
    },
    #[error(
        "dsr_if {interface}: dsr_path xdp: {source} (quill needs CAP_BPF and \
         CAP_NET_ADMIN; 'dsr_path auto' falls back to the packet socket)"
    )]
    Xdp {
        interface: String,
        source: xdp::XdpError,
    },
}

/// Which transport the VIP serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Udp,
}

/// What the DSR plane serves, checked at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DsrConfig {
    pub interface: String,
    pub vip: Ipv4Addr,
    pub port: u16,
    pub transport: Transport,
    /// How frames are forwarded (`dsr_path`).
    pub path: DsrPath,
}

impl DsrConfig {
    /// Checks the settings for DSR on `interface`: the listening address is the VIP and
    /// port, and every server is an IPv4 address with that port.
    pub fn new(
        interface: &str,
        settings: &Settings,
        listen: &ListenAddr,
        transport: Transport,
    ) -> Result<DsrConfig, DsrError> {
        let (vip, port) = match listen {
            ListenAddr::Tcp(a) => match a.ip().to_canonical() {
                IpAddr::V4(ip) if !ip.is_unspecified() => (ip, a.port()),
                _ => {
                    return Err(DsrError::Listen {
                        interface: interface.to_string(),
                        listen: listen.to_string(),
                    })
                }
            },
            ListenAddr::Unix(_) => {
                return Err(DsrError::Listen {
                    interface: interface.to_string(),
                    listen: listen.to_string(),
                })
            }
        };
        for (index, s) in settings.servers.iter().enumerate() {
            let Some(addr) = s.addr() else { continue };
            if !addr.ip().to_canonical().is_ipv4() || addr.port() != port {
                return Err(DsrError::Server {
                    interface: interface.to_string(),
                    index,
                    server: addr.to_string(),
                    port,
                });
            }
        }
        Ok(DsrConfig {
            interface: interface.to_string(),
            vip,
            port,
            transport,
            path: settings.dsr_path,
        })
    }
}

/// A running DSR plane: its thread and its counters.
#[derive(Debug)]
pub struct Dsr {
    pub thread: JoinHandle<()>,
    pub counters: Arc<DsrCounters>,
}

/// Opens the packet socket: done at start-up, before quill detaches and drops its
/// privileges (the socket needs CAP_NET_RAW only to be opened).
pub fn open(config: DsrConfig) -> Result<Opened, DsrError> {
    Ok(Opened(plane::Plane::open(config)?))
}

/// A DSR plane whose socket is open, not yet running.
#[derive(Debug)]
pub struct Opened(plane::Plane);

impl Opened {
    /// Starts the plane's thread, which runs until `stop` turns true.
    pub fn spawn(self, state: Arc<State>, stop: watch::Receiver<bool>) -> io::Result<Dsr> {
        let counters = self.0.counters();
        let plane = self.0;
        let thread = std::thread::Builder::new()
            .name("quill-dsr".to_string())
            .spawn(move || plane.run(&state, &stop))?;
        Ok(Dsr { thread, counters })
    }
}
