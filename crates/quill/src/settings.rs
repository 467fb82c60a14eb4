//! The configuration model and [`Settings::apply`], the only code that changes it.
//!
//! A `Settings` value is immutable once published: the daemon builds a new one by applying
//! commands to a copy and swaps it in atomically, so a data plane reads one consistent
//! snapshot per connection. Runtime state (connection counts, blacklist deadlines, the client
//! table) is not here; commands that touch it return an [`Action`] for the caller to carry
//! out on the runtime, which keeps this module free of shared mutable state.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use std::sync::Arc;

use crate::acl::{Acl, AclId, GeoRef, ACL_LISTS};
use crate::command::{
    parse_port, split_host_port, Command, DeferAccept, DsrPath, FastClose, Host, HostPort, Hsts,
    Millis, Probe, ProxyVersion, ServerCheck, ServerField, ServerProxy, Word, MAX_SERVERS,
};
use crate::geoip::GeoIp;
use crate::net::ListenAddr;
use crate::tls::{self, TlsConf, TlsError};

/// One backend server slot. A slot without an address is unused and never selected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConf {
    /// The host as the user wrote it (kept for printing the configuration back).
    pub host: Option<Host>,
    /// The resolved address; `None` for an unused slot.
    pub ip: Option<IpAddr>,
    pub port: u16,
    /// Soft limit: new clients are not sent here at or above it (0 = unlimited).
    pub max: u32,
    /// Hard limit for returning (tracked) clients (0 = same as `max`).
    pub hard: u32,
    pub weight: u32,
    pub prio: u32,
    /// Only clients permitted by this list may be sent here.
    pub acl: Option<AclId>,
    /// PROXY protocol towards this server (`server N proxy_protocol`).
    pub proxy_protocol: ServerProxy,
    /// This server's own health check, or the global one.
    pub check: ServerCheck,
}

impl Default for ServerConf {
    fn default() -> ServerConf {
        ServerConf {
            host: None,
            ip: None,
            port: 0,
            max: 0,
            hard: 0,
            weight: 1,
            prio: 0,
            acl: None,
            proxy_protocol: ServerProxy::Global,
            check: ServerCheck::Inherit,
        }
    }
}

impl ServerConf {
    /// The address to connect to, when the slot is in use.
    pub fn addr(&self) -> Option<SocketAddr> {
        match self.ip {
            Some(ip) if self.port != 0 => Some(SocketAddr::new(ip, self.port)),
            _ => None,
        }
    }

    /// The connection limit for a client that has used this server before.
    pub fn hard_limit(&self) -> u32 {
        if self.hard == 0 {
            self.max
        } else {
            self.hard
        }
    }
}

/// Active health checking (`check`, `check_interval`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HealthCheck {
    /// The check of servers that do not choose their own; `None` = no check.
    pub probe: Option<Probe>,
    pub interval: Millis,
    pub timeout: Millis,
    /// Successes in a row that bring a down server back.
    pub rise: u32,
    /// Failures in a row that take a server down.
    pub fall: u32,
}

impl Default for HealthCheck {
    /// HAProxy's defaults, which operators know: every 2 s, rise 2, fall 3.
    fn default() -> HealthCheck {
        HealthCheck {
            probe: None,
            interval: Millis(2000),
            timeout: Millis(1000),
            rise: 2,
            fall: 3,
        }
    }
}

impl Settings {
    /// The health check that applies to server `index`, if any.
    pub fn probe_of(&self, index: usize) -> Option<&Probe> {
        match &self.servers.get(index)?.check {
            ServerCheck::Inherit => self.check.probe.as_ref(),
            ServerCheck::Off => None,
            ServerCheck::Probe(p) => Some(p),
        }
    }

    /// The seconds a new TCP connection waits in the kernel for its client's first bytes
    /// (TCP_DEFER_ACCEPT; 0 = none). Under `defer_accept auto`, clients speak first where
    /// quill speaks HTTP (`http`, or its own `dummy` server), terminates TLS (a ClientHello
    /// comes first) or expects a PROXY protocol header (`accept_proxy`).
    pub fn defer_accept_seconds(&self) -> u32 {
        let clients_speak_first =
            self.http || self.dummy || self.tls_built.server.is_some() || self.accept_proxy;
        self.defer_accept.seconds(clients_speak_first)
    }
}

/// A resolved upstream that is not part of the server table (emergency, abuse servers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub name: HostPort,
    pub addr: SocketAddr,
}

/// Which server-selection behaviours are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Policy {
    pub roundrobin: bool,
    pub hash: bool,
    pub hash_only: bool,
    pub stubborn: bool,
    pub weight: bool,
    pub prio: bool,
}

/// The whole configuration of a running quill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// Server table; the index is the server number of `server N`.
    pub servers: Vec<ServerConf>,
    /// Some server sends its own PROXY header (`server N proxy_protocol v1|v2`). Derived
    /// from `servers` where they change (`apply_server`), so that a connection learns in
    /// O(1) whether it may need one.
    server_proxy: bool,
    pub policy: Policy,
    /// Seconds a tracked client is remembered (0 = until evicted).
    pub tracking: u64,
    /// Seconds a failed server is avoided.
    pub blacklist: u64,
    /// Connect timeout in seconds (at least 1).
    pub timeout: u64,
    /// Maximum simultaneous client connections.
    pub conn_max: usize,
    /// Size of the client tracking table.
    pub clients_max: usize,
    /// Upstream connects allowed in progress at once.
    pub pending_max: usize,
    pub acls: [Acl; ACL_LISTS],
    pub client_acl: AclId,
    /// TCP_NODELAY on both sockets of a proxied connection (default on).
    pub tcp_nodelay: bool,
    pub fastclose: FastClose,
    pub keepalive: bool,
    /// Seconds of silence after which a connection is closed (0 = never).
    pub idle_timeout: u64,
    /// How long new TCP connections wait in the kernel for their client's first bytes
    /// (`defer_accept`; see [`Settings::defer_accept_seconds`]).
    pub defer_accept: DeferAccept,
    /// Seconds of silence after which a raw TCP connection is parked, or an HTTP/1.x client
    /// served request by request leaves hyper (0 = never).
    pub idle_park: u64,
    /// Microseconds an event loop that has just worked polls before it sleeps
    /// (`proxy::poll_before_sleep`; 0 = never).
    pub poll_before_sleep: u32,
    pub source: Option<IpAddr>,
    pub dummy: bool,
    pub debug: u32,
    pub emergency: Option<Upstream>,
    pub abuse: Option<Upstream>,
    pub multi_accept: usize,
    pub backlog: u32,
    /// Event loops; 0 = one per available core. Read at start-up only.
    pub workers: usize,
    /// Seconds after which a silent UDP flow is forgotten (at least 1).
    pub udp_idle_timeout: u64,
    /// Datagrams a server sends back for each client datagram, after which a UDP flow
    /// ends; 0 = never (Pen's behaviour).
    pub udp_responses: u32,
    /// The words of the Pen compatibility no-ops, so that `write` can print them back.
    pub compat: Vec<Command>,
    /// Where clients connect (`listen`, or the first argument of the command line).
    pub listen: Option<ListenAddr>,
    /// Access list checked for TCP control-socket clients (and for control requests on
    /// the metrics listener).
    pub control_acl: AclId,
    /// Where the HTTP metrics / status / dashboard listener is (`metrics_listen`).
    pub metrics_listen: Option<SocketAddr>,
    /// The connection log file (`-l`, `log FILE`).
    pub log: Option<Word>,
    /// The access log of request-level proxying (`access_log FILE`).
    pub access_log: Option<Word>,
    /// The HTML status file written on SIGUSR1 (`-w`, `web_stats FILE`).
    pub web_stats: Option<Word>,
    /// Abort (core dump) instead of exiting on a fatal error.
    pub abort_on_error: bool,
    /// The GeoIP database (`geoip_db FILE`) and the name it was given as.
    pub geoip: Option<(Word, GeoRef)>,
    /// TLS settings as given (`ssl_*`, `upstream_*`).
    pub tls: TlsConf,
    /// The rustls configurations built from `tls` by [`Settings::build_tls`]; published
    /// with the rest of the snapshot, so a connection uses one consistent pair.
    pub tls_built: tls::Built,
    /// `http` (`-H`): HTTP/1.x framing with `X-Forwarded-For` / `X-Forwarded-Proto`.
    pub http: bool,
    /// Largest request head with `http` (`http_header_max`).
    pub http_header_max: usize,
    /// Seconds a client has to send a whole request head with `http`
    /// (`http_request_timeout`; 0 = no bound).
    pub http_request_timeout: u64,
    /// `Strict-Transport-Security` for TLS-terminated HTTP responses (`hsts`).
    pub hsts: Option<Hsts>,
    /// With `http`, plain listeners take HTTP/2 with prior knowledge too (`h2c`).
    pub h2c: bool,
    /// Concurrent streams per HTTP/2 client connection (`h2_max_streams`).
    pub h2_max_streams: u32,
    /// Idle pooled connections per server and event loop (`upstream_keepalive`; 0: a
    /// connection per request).
    pub upstream_keepalive: u32,
    /// Seconds an idle pooled connection is kept (`upstream_idle_timeout`).
    pub upstream_idle_timeout: u64,
    /// Seconds a client with every server it may use full waits for room (`queue_timeout`;
    /// 0: none, as Pen).
    pub queue_timeout: u64,
    /// Clients that may wait at once (`queue_max`; 0: no limit but `conn_max`).
    pub queue_max: u64,
    /// Requests over one pooled connection (`upstream_max_requests`; 0 = no limit).
    pub upstream_max_requests: u64,
    /// Requests served per request go to servers over HTTP/2 where they speak it
    /// (`upstream_h2`).
    pub upstream_h2: bool,
    /// PROXY protocol header sent to backends (`proxy_protocol`), unless a server says
    /// otherwise.
    pub proxy_protocol: Option<ProxyVersion>,
    /// Clients start with a PROXY protocol header (`accept_proxy`).
    pub accept_proxy: bool,
    /// Active health checks.
    pub check: HealthCheck,
    /// Seconds over which a server coming back up ramps to its full weight (0 = at once).
    pub slow_start: u64,
    /// Seconds open connections may run on once quill stops accepting (0 = no limit).
    pub shutdown_grace: u64,
    /// The Direct Server Return interface (`dsr_if IF`); read at start-up.
    pub dsr_if: Option<Word>,
    /// How the DSR plane forwards (`dsr_path`); read at start-up.
    pub dsr_path: DsrPath,
    /// The interfaces whose ingress carries offloaded UDP flows (`udp_offload`, comma
    /// separated); read at start-up.
    pub udp_offload: Option<Word>,
    /// The access list whose permitted addresses the DSR plane tarpits.
    pub tarpit_acl: Option<AclId>,
    /// Connect to backends from the client's address (IP_TRANSPARENT).
    pub transparent: bool,
    /// The kernel routing table in which quill keeps a route for the listening address
    /// while this node can serve it (`announce_table N`; BIRD/FRR announce it).
    pub announce_table: Option<u32>,
    /// Seconds quill serves on after withdrawing that route when it stops.
    pub announce_grace: u64,
}

/// Default `announce_grace`: a few BGP update rounds (or a BFD detection time, well
/// within a second, plus the routers' reprogramming).
pub const DEFAULT_ANNOUNCE_GRACE: u64 = 3;

/// Default `shutdown_grace`: long enough for requests in flight, short enough for a
/// service manager's stop timeout.
pub const DEFAULT_SHUTDOWN_GRACE: u64 = 10;

/// Default `udp_idle_timeout`: as long as Linux conntrack keeps an unreplied UDP flow.
pub const DEFAULT_UDP_IDLE_TIMEOUT: u64 = 30;

/// Default limit of a request head (`http_header_max`), as large as NGINX's buffers.
pub const DEFAULT_HEADER_MAX: usize = 16 * 1024;
/// Default `http_request_timeout` in seconds: the time a client has to send a whole
/// request head, the `timeout http-request 10s` of HAProxy's example configurations
/// (Apache's mod_reqtimeout allows 20 to 40, NGINX's `client_header_timeout` 60).
pub const DEFAULT_REQUEST_TIMEOUT: u64 = 10;
/// Default `h2_max_streams`: concurrent streams per client connection (what NGINX and
/// most servers advertise).
pub const DEFAULT_MAX_STREAMS: u32 = 100;
/// Default `upstream_keepalive`: idle connections per server (NGINX's examples use 32).
pub const DEFAULT_KEEPALIVE: u32 = 32;
/// Default `upstream_idle_timeout` in seconds (NGINX's `keepalive_timeout` upstream: 60).
pub const DEFAULT_IDLE_TIMEOUT: u64 = 60;
/// Default `upstream_max_requests`. A bound, so that no server connection lives forever,
/// but ten times NGINX's `keepalive_requests` (1000): each retirement costs a new
/// connection, with `upstream_tls` a handshake with the server (≈ 1.2 k instructions a
/// request at 1000, 3 % of an HTTPS request's user-space work); HAProxy and Envoy set no
/// limit.
pub const DEFAULT_MAX_REQUESTS: u64 = 10_000;

/// Connections a process can hold with its file-descriptor limit: two descriptors per
/// proxied connection, with some kept back for listeners, logs and the control socket.
pub fn default_conn_max() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    let fds = limit.current.unwrap_or(1 << 20).min(1 << 24) as usize;
    (fds.saturating_sub(64) / 2).max(16)
}

impl Settings {
    /// The commands set here that only `http` (-H) acts on, when it is off: start-up and
    /// reloads name them rather than ignore them without a word.
    pub fn idle_without_http(&self) -> Vec<&'static str> {
        if self.http {
            return Vec::new();
        }
        let d = Settings::default();
        [
            ("h2c", self.h2c),
            ("upstream_h2", self.upstream_h2),
            ("hsts", self.hsts.is_some()),
            ("access_log", self.access_log.is_some()),
            (
                "upstream_keepalive",
                self.upstream_keepalive != d.upstream_keepalive,
            ),
            (
                "upstream_idle_timeout",
                self.upstream_idle_timeout != d.upstream_idle_timeout,
            ),
            (
                "upstream_max_requests",
                self.upstream_max_requests != d.upstream_max_requests,
            ),
            ("h2_max_streams", self.h2_max_streams != d.h2_max_streams),
            ("http_header_max", self.http_header_max != d.http_header_max),
            (
                "http_request_timeout",
                self.http_request_timeout != d.http_request_timeout,
            ),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect()
    }
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            servers: Vec::new(),
            server_proxy: false,
            policy: Policy::default(),
            tracking: 0,
            blacklist: 30,
            timeout: 5,
            conn_max: default_conn_max(),
            clients_max: 2048,
            pending_max: 100,
            acls: Default::default(),
            client_acl: AclId::default(),
            // On by default, unlike Pen: a response written as a head and a body (two
            // writes) would otherwise wait for the client's delayed ACK (40 ms) at every
            // hop. HAProxy and NGINX set it too; the relay writes what one read produced in
            // one write, so it sends no more segments than the peer did.
            tcp_nodelay: true,
            fastclose: FastClose::Off,
            keepalive: false,
            idle_timeout: 0,
            idle_park: 1,
            poll_before_sleep: 0,
            defer_accept: DeferAccept::Auto,
            source: None,
            dummy: false,
            debug: 0,
            emergency: None,
            abuse: None,
            multi_accept: 100,
            // Pen's 500 drops SYNs under a burst of connects (clients then wait 1 s to
            // retry); the kernel caps this at net.core.somaxconn.
            backlog: 4096,
            workers: 0,
            udp_idle_timeout: DEFAULT_UDP_IDLE_TIMEOUT,
            udp_responses: 0,
            compat: Vec::new(),
            listen: None,
            control_acl: AclId::default(),
            metrics_listen: None,
            log: None,
            access_log: None,
            web_stats: None,
            abort_on_error: false,
            geoip: None,
            tls: TlsConf::default(),
            tls_built: tls::Built::default(),
            http: false,
            http_header_max: DEFAULT_HEADER_MAX,
            http_request_timeout: DEFAULT_REQUEST_TIMEOUT,
            hsts: None,
            h2c: false,
            h2_max_streams: DEFAULT_MAX_STREAMS,
            upstream_keepalive: DEFAULT_KEEPALIVE,
            upstream_idle_timeout: DEFAULT_IDLE_TIMEOUT,
            queue_timeout: 0,
            queue_max: 0,
            upstream_max_requests: DEFAULT_MAX_REQUESTS,
            upstream_h2: false,
            proxy_protocol: None,
            accept_proxy: false,
            check: HealthCheck::default(),
            slow_start: 0,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
            dsr_if: None,
            dsr_path: DsrPath::Auto,
            udp_offload: None,
            tarpit_acl: None,
            transparent: false,
            announce_table: None,
            announce_grace: DEFAULT_ANNOUNCE_GRACE,
        }
    }
}

/// The answer to a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Done, nothing to say.
    Done,
    /// A value the command asked for.
    Value(String),
}

/// Something the caller must do to the runtime state after the new settings are published.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Blacklist server `index` for `seconds` (0 = whitelist now).
    Blacklist { index: usize, seconds: u64 },
    /// The client table must be resized to the new `clients_max`.
    ResizeClients(usize),
    /// The listening socket must be reopened on this address.
    Relisten(ListenAddr),
    /// The connection log must be reopened (new file, or none).
    ReopenLog,
    /// The metrics listener must move to this address, or close (`None`).
    MetricsListen(Option<SocketAddr>),
    /// Stop (or resume) sending new connections to server `index`.
    Drain { index: usize, on: bool },
}

/// The outcome of a successful [`Settings::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub reply: Reply,
    pub actions: Vec<Action>,
}

impl Applied {
    fn done() -> Applied {
        Applied {
            reply: Reply::Done,
            actions: Vec::new(),
        }
    }

    fn value(v: impl ToString) -> Applied {
        Applied {
            reply: Reply::Value(v.to_string()),
            actions: Vec::new(),
        }
    }

    fn action(a: Action) -> Applied {
        Applied {
            reply: Reply::Done,
            actions: vec![a],
        }
    }
}

/// Why a command could not be applied. Nothing was changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApplyError {
    #[error("cannot resolve host '{host}': {reason}")]
    Resolve { host: String, reason: String },
    #[error("server {0} has no address; set 'address' before blacklisting it")]
    NoSuchServer(usize),
    #[error("'{0}' must be at least 1")]
    TooSmall(&'static str),
    #[error("country rules need a GeoIP database: give 'geoip_db FILE' first")]
    NoGeoIp,
    #[error("{0}")]
    GeoIp(String),
    #[error("invalid listening address: {0}")]
    Listen(String),
    #[error("'{0}' is not a configuration command")]
    NotASetting(String),
    #[error("{0}")]
    Tls(String),
}

/// The address of `metrics_listen [ADDR:]PORT`: a bare port means 127.0.0.1, because the
/// listener shows client addresses and can take control commands; exposing it on a
/// network is a choice the user spells out.
pub fn metrics_addr(s: &str) -> Result<SocketAddr, ApplyError> {
    let invalid = |e: String| ApplyError::Listen(format!("metrics_listen {s}: {e}"));
    let (host, port) = match split_host_port(s).map_err(|e| invalid(e.to_string()))? {
        (port, None) => ("127.0.0.1", port),
        ("", Some(port)) => ("0.0.0.0", port),
        (host, Some(port)) => (host, port),
    };
    let port = parse_port(port).map_err(|e| invalid(e.to_string()))?;
    let host = Host::new(host).map_err(|e| invalid(e.to_string()))?;
    Ok(SocketAddr::new(resolve(&host)?, port))
}

/// Resolves a host to one address (the first the resolver gives), at configuration time.
pub fn resolve(host: &Host) -> Result<IpAddr, ApplyError> {
    if let Some(ip) = host.ip() {
        return Ok(ip);
    }
    let err = |reason: String| ApplyError::Resolve {
        host: host.to_string(),
        reason,
    };
    let mut addrs = (host.as_str(), 0)
        .to_socket_addrs()
        .map_err(|e| err(e.to_string()))?;
    addrs
        .next()
        .map(|a| a.ip())
        .ok_or_else(|| err("no address found".to_string()))
}

fn upstream(hp: &HostPort) -> Result<Upstream, ApplyError> {
    let ip = resolve(&hp.host)?;
    Ok(Upstream {
        name: hp.clone(),
        addr: SocketAddr::new(ip, hp.port),
    })
}

impl Settings {
    /// Applies one command. On error nothing is changed.
    pub fn apply(&mut self, cmd: &Command) -> Result<Applied, ApplyError> {
        let p = &mut self.policy;
        Ok(match cmd {
            Command::Server { index, fields } => return self.apply_server(*index, fields),
            Command::RoundRobin(on) => set(&mut p.roundrobin, *on),
            Command::Hash(on) => set(&mut p.hash, *on),
            Command::HashOnly(on) => {
                p.hash_only = *on;
                let hash = *on || p.hash;
                set(&mut p.hash, hash)
            }
            Command::Stubborn(on) => set(&mut p.stubborn, *on),
            Command::Weight(on) => set(&mut p.weight, *on),
            Command::Prio(on) => set(&mut p.prio, *on),
            Command::Tracking(v) => query_or_set(&mut self.tracking, *v),
            Command::Blacklist(v) => query_or_set(&mut self.blacklist, *v),
            Command::Timeout(v) => query_or_set(&mut self.timeout, *v),
            // 0 would refuse every client (Pen ignores it: its `conn_max` only raises).
            Command::ConnMax(Some(0)) => return Err(ApplyError::TooSmall("conn_max")),
            Command::ConnMax(v) => query_or_set(&mut self.conn_max, *v),
            Command::ClientsMax(None) => Applied::value(self.clients_max),
            Command::ClientsMax(Some(n)) => {
                if *n == 0 {
                    return Err(ApplyError::TooSmall("clients_max"));
                }
                self.clients_max = *n;
                Applied {
                    reply: Reply::Value(n.to_string()),
                    actions: vec![Action::ResizeClients(*n)],
                }
            }
            Command::Acl { list, rule } => {
                if matches!(rule.matcher, crate::acl::AclMatch::Country(_)) && self.geoip.is_none()
                {
                    return Err(ApplyError::NoGeoIp);
                }
                self.acls[list.index()].push(*rule);
                Applied::done()
            }
            Command::GeoipDb(file) => {
                let db =
                    GeoIp::open(file.as_str()).map_err(|e| ApplyError::GeoIp(e.to_string()))?;
                let geo = GeoRef(Arc::new(db));
                for acl in &mut self.acls {
                    acl.set_geo(Some(geo.clone()));
                }
                set(&mut self.geoip, Some((file.clone(), geo)))
            }
            Command::NoAcl(list) => {
                self.acls[list.index()].clear();
                Applied::done()
            }
            // Pen prints the list in force after either form.
            Command::ClientAcl(list) => query_or_set(&mut self.client_acl, *list),
            Command::TcpNodelay(on) => set(&mut self.tcp_nodelay, *on),
            Command::TcpFastclose(mode) => set(&mut self.fastclose, *mode),
            Command::Keepalive(on) => set(&mut self.keepalive, *on),
            Command::IdleTimeout(v) => query_or_set(&mut self.idle_timeout, *v),
            Command::IdlePark(n) => set(&mut self.idle_park, *n),
            Command::PollBeforeSleep(n) => set(&mut self.poll_before_sleep, *n),
            Command::DeferAccept(d) => set(&mut self.defer_accept, *d),
            Command::PendingMax(n) => set(&mut self.pending_max, *n),
            Command::Source(ip) => set(&mut self.source, Some(*ip)),
            Command::NoSource => set(&mut self.source, None),
            Command::Dummy(on) => set(&mut self.dummy, *on),
            Command::Debug(v) => query_or_set(&mut self.debug, *v),
            Command::EventEngine(_) => Applied::done(),
            Command::Compat(word, _) => {
                self.compat
                    .retain(|c| !matches!(c, Command::Compat(w, _) if w == word));
                self.compat.push(cmd.clone());
                Applied::done()
            }
            Command::Emergency(hp) => {
                set(&mut self.emergency, hp.as_ref().map(upstream).transpose()?)
            }
            Command::Abuse(hp) => set(&mut self.abuse, hp.as_ref().map(upstream).transpose()?),
            Command::MultiAccept(n) => set(&mut self.multi_accept, *n),
            // As Pen: a backlog below 50 is raised to 50.
            Command::Backlog(n) => set(&mut self.backlog, (*n).max(50)),
            Command::Workers(n) => set(&mut self.workers, *n),
            Command::UdpIdleTimeout(v) => query_or_set(&mut self.udp_idle_timeout, *v),
            Command::UdpResponses(v) => query_or_set(&mut self.udp_responses, *v),
            Command::Listen(None) => Applied::value(
                self.listen
                    .as_ref()
                    .map(|l| l.to_string())
                    .unwrap_or_default(),
            ),
            Command::Listen(Some(word)) => {
                let addr = ListenAddr::parse(word.as_str())
                    .map_err(|e| ApplyError::Listen(e.to_string()))?;
                if self.listen.as_ref() == Some(&addr) {
                    return Ok(Applied::done());
                }
                self.listen = Some(addr.clone());
                Applied::action(Action::Relisten(addr))
            }
            Command::ControlAcl(list) => query_or_set(&mut self.control_acl, *list),
            Command::MetricsListen(None) => Applied::value(
                self.metrics_listen
                    .map(|a| a.to_string())
                    .unwrap_or_default(),
            ),
            Command::MetricsListen(Some(word)) => {
                let addr = metrics_addr(word.as_str())?;
                if self.metrics_listen == Some(addr) {
                    return Ok(Applied::done());
                }
                self.metrics_listen = Some(addr);
                Applied::action(Action::MetricsListen(Some(addr)))
            }
            Command::NoMetricsListen => {
                if self.metrics_listen.take().is_none() {
                    return Ok(Applied::done());
                }
                Applied::action(Action::MetricsListen(None))
            }
            Command::Log(None) => {
                Applied::value(self.log.as_ref().map(Word::to_string).unwrap_or_default())
            }
            Command::Log(Some(file)) => {
                self.log = Some(file.clone());
                Applied::action(Action::ReopenLog)
            }
            Command::NoLog => {
                self.log = None;
                Applied::action(Action::ReopenLog)
            }
            Command::AccessLog(file) => {
                self.access_log = file.clone();
                Applied::action(Action::ReopenLog)
            }
            Command::WebStats(None) => Applied::value(
                self.web_stats
                    .as_ref()
                    .map(Word::to_string)
                    .unwrap_or_default(),
            ),
            Command::WebStats(Some(file)) => set(&mut self.web_stats, Some(file.clone())),
            Command::NoWebStats => set(&mut self.web_stats, None),
            Command::AbortOnError(on) => set(&mut self.abort_on_error, *on),
            Command::SslClientRenegotiationInterval(_) => self.apply_tls(cmd)?,
            other if other.is_tls() => self.apply_tls(cmd)?,
            Command::Http(on) => {
                self.tls.http = *on;
                set(&mut self.http, *on)
            }
            Command::H2c(on) => set(&mut self.h2c, *on),
            Command::H2MaxStreams(n) => set(&mut self.h2_max_streams, *n),
            Command::UpstreamKeepalive(n) => set(&mut self.upstream_keepalive, *n),
            Command::UpstreamIdleTimeout(n) => set(&mut self.upstream_idle_timeout, *n),
            Command::QueueTimeout(n) => set(&mut self.queue_timeout, *n),
            Command::QueueMax(n) => set(&mut self.queue_max, *n),
            Command::UpstreamMaxRequests(n) => set(&mut self.upstream_max_requests, *n),
            Command::UpstreamH2(on) => set(&mut self.upstream_h2, *on),
            Command::HttpHeaderMax(v) => query_or_set(&mut self.http_header_max, *v),
            Command::HttpRequestTimeout(v) => query_or_set(&mut self.http_request_timeout, *v),
            Command::Hsts(h) => set(&mut self.hsts, *h),
            Command::ProxyProtocol(v) => set(&mut self.proxy_protocol, *v),
            Command::AcceptProxy(on) => set(&mut self.accept_proxy, *on),
            Command::Check(probe) => set(&mut self.check.probe, probe.clone()),
            Command::CheckInterval(d) => set(&mut self.check.interval, *d),
            Command::CheckTimeout(d) => set(&mut self.check.timeout, *d),
            Command::CheckRise(n) => set(&mut self.check.rise, *n),
            Command::CheckFall(n) => set(&mut self.check.fall, *n),
            Command::SlowStart(n) => set(&mut self.slow_start, *n),
            Command::ShutdownGrace(n) => set(&mut self.shutdown_grace, *n),
            Command::DsrIf(name) => set(&mut self.dsr_if, Some(name.clone())),
            Command::DsrPath(path) => set(&mut self.dsr_path, *path),
            Command::UdpOffload(names) => set(&mut self.udp_offload, names.clone()),
            Command::TarpitAcl(None) => Applied::value(
                self.tarpit_acl
                    .map(|l| l.to_string())
                    .unwrap_or_else(|| "-1".to_string()),
            ),
            Command::TarpitAcl(Some(list)) => set(&mut self.tarpit_acl, Some(*list)),
            Command::NoTarpitAcl => set(&mut self.tarpit_acl, None),
            Command::Transparent(on) => set(&mut self.transparent, *on),
            Command::AnnounceTable(table) => set(&mut self.announce_table, *table),
            Command::AnnounceGrace(n) => set(&mut self.announce_grace, *n),
            other => return Err(ApplyError::NotASetting(other.to_string())),
        })
    }

    /// Whether a PROXY protocol header may go to some upstream (globally or per server).
    pub fn may_send_proxy_header(&self) -> bool {
        self.proxy_protocol.is_some() || self.server_proxy
    }

    fn apply_tls(&mut self, cmd: &Command) -> Result<Applied, ApplyError> {
        self.tls
            .apply(cmd)
            .map_err(|e| ApplyError::Tls(e.to_string()))?;
        Ok(Applied::done())
    }

    /// Reads the files the TLS settings name and builds the rustls configurations, keeping
    /// the session state of `previous`. On error nothing changes. Called once the settings
    /// are complete: at start-up, on reload and `include`, and after a TLS command.
    pub fn build_tls(&mut self, previous: Option<&tls::Built>) -> Result<(), TlsError> {
        self.tls_built = tls::build(&self.tls, previous)?;
        Ok(())
    }

    fn apply_server(
        &mut self,
        index: usize,
        fields: &[ServerField],
    ) -> Result<Applied, ApplyError> {
        debug_assert!(index < MAX_SERVERS, "the parser bounds server numbers");
        let mut conf = self.servers.get(index).cloned().unwrap_or_default();
        let mut actions = Vec::new();
        for field in fields {
            match field {
                ServerField::Acl(a) => conf.acl = Some(*a),
                ServerField::Address(h) => {
                    conf.ip = Some(resolve(h)?);
                    conf.host = Some(h.clone());
                }
                ServerField::Port(p) => conf.port = *p,
                ServerField::Max(m) => conf.max = *m,
                ServerField::Hard(h) => conf.hard = *h,
                ServerField::Weight(w) => conf.weight = *w,
                ServerField::Prio(p) => conf.prio = *p,
                ServerField::ProxyProtocol(pp) => conf.proxy_protocol = *pp,
                ServerField::Blacklist(t) => {
                    if conf.ip.is_none() {
                        return Err(ApplyError::NoSuchServer(index));
                    }
                    actions.push(Action::Blacklist { index, seconds: *t });
                }
                ServerField::Drain(on) => {
                    if conf.ip.is_none() {
                        return Err(ApplyError::NoSuchServer(index));
                    }
                    actions.push(Action::Drain { index, on: *on });
                }
                ServerField::Check(c) => conf.check = c.clone(),
            }
        }
        if self.servers.len() <= index {
            self.servers.resize_with(index + 1, ServerConf::default);
        }
        self.servers[index] = conf;
        self.server_proxy = self
            .servers
            .iter()
            .any(|s| matches!(s.proxy_protocol, ServerProxy::On(_)));
        Ok(Applied {
            reply: Reply::Done,
            actions,
        })
    }

    /// The commands that rebuild this configuration from the defaults, in order.
    pub fn to_commands(&self) -> Vec<Command> {
        let d = Settings::default();
        let mut out = Vec::new();
        if let Some(listen) = self.listen.as_ref().and_then(|l| Word::new(&l.to_string())) {
            out.push(Command::Listen(Some(listen)));
        }
        let mut flag = |on: bool, def: bool, make: fn(bool) -> Command| {
            if on != def {
                out.push(make(on));
            }
        };
        flag(self.policy.roundrobin, false, Command::RoundRobin);
        flag(
            self.policy.hash && !self.policy.hash_only,
            false,
            Command::Hash,
        );
        flag(self.policy.hash_only, false, Command::HashOnly);
        flag(self.policy.stubborn, false, Command::Stubborn);
        flag(self.policy.weight, false, Command::Weight);
        flag(self.policy.prio, false, Command::Prio);
        flag(self.tcp_nodelay, true, Command::TcpNodelay);
        flag(self.keepalive, false, Command::Keepalive);
        flag(self.dummy, false, Command::Dummy);
        out.push(Command::Tracking(Some(self.tracking)));
        out.push(Command::Blacklist(Some(self.blacklist)));
        out.push(Command::Timeout(Some(self.timeout)));
        // The default depends on the machine's descriptor limit: only a chosen value is
        // worth carrying to another start.
        if self.conn_max != d.conn_max {
            out.push(Command::ConnMax(Some(self.conn_max)));
        }
        out.push(Command::ClientsMax(Some(self.clients_max)));
        out.push(Command::PendingMax(self.pending_max));
        out.push(Command::IdleTimeout(Some(self.idle_timeout)));
        out.push(Command::IdlePark(self.idle_park));
        if self.poll_before_sleep != d.poll_before_sleep {
            out.push(Command::PollBeforeSleep(self.poll_before_sleep));
        }
        if self.defer_accept != d.defer_accept {
            out.push(Command::DeferAccept(self.defer_accept));
        }
        if self.fastclose != d.fastclose {
            out.push(Command::TcpFastclose(self.fastclose));
        }
        if let Some(ip) = self.source {
            out.push(Command::Source(ip));
        }
        if self.debug != d.debug {
            out.push(Command::Debug(Some(self.debug)));
        }
        out.extend(self.compat.iter().cloned());
        if let Some((file, _)) = &self.geoip {
            out.push(Command::GeoipDb(file.clone()));
        }
        for (i, acl) in self.acls.iter().enumerate() {
            let Some(list) = u8::try_from(i).ok().and_then(AclId::new) else {
                continue;
            };
            for rule in acl.rules() {
                out.push(Command::Acl { list, rule: *rule });
            }
        }
        if self.client_acl != d.client_acl {
            out.push(Command::ClientAcl(Some(self.client_acl)));
        }
        if let Some(u) = &self.emergency {
            out.push(Command::Emergency(Some(u.name.clone())));
        }
        if let Some(u) = &self.abuse {
            out.push(Command::Abuse(Some(u.name.clone())));
        }
        if self.multi_accept != d.multi_accept {
            out.push(Command::MultiAccept(self.multi_accept));
        }
        if self.backlog != d.backlog {
            out.push(Command::Backlog(self.backlog));
        }
        if self.udp_idle_timeout != d.udp_idle_timeout {
            out.push(Command::UdpIdleTimeout(Some(self.udp_idle_timeout)));
        }
        if self.udp_responses != d.udp_responses {
            out.push(Command::UdpResponses(Some(self.udp_responses)));
        }
        if self.workers != d.workers {
            out.push(Command::Workers(self.workers));
        }
        if self.control_acl != d.control_acl {
            out.push(Command::ControlAcl(Some(self.control_acl)));
        }
        if let Some(addr) = self.metrics_listen {
            out.extend(Word::new(&addr.to_string()).map(|w| Command::MetricsListen(Some(w))));
        }
        if let Some(f) = &self.log {
            out.push(Command::Log(Some(f.clone())));
        }
        if let Some(f) = &self.access_log {
            out.push(Command::AccessLog(Some(f.clone())));
        }
        if let Some(f) = &self.web_stats {
            out.push(Command::WebStats(Some(f.clone())));
        }
        if self.abort_on_error {
            out.push(Command::AbortOnError(true));
        }
        out.extend(self.tls.to_commands());
        if self.http {
            out.push(Command::Http(true));
        }
        if self.http_header_max != d.http_header_max {
            out.push(Command::HttpHeaderMax(Some(self.http_header_max)));
        }
        if self.http_request_timeout != d.http_request_timeout {
            out.push(Command::HttpRequestTimeout(Some(self.http_request_timeout)));
        }
        if self.hsts.is_some() {
            out.push(Command::Hsts(self.hsts));
        }
        if self.h2c {
            out.push(Command::H2c(true));
        }
        if self.h2_max_streams != d.h2_max_streams {
            out.push(Command::H2MaxStreams(self.h2_max_streams));
        }
        if self.upstream_keepalive != d.upstream_keepalive {
            out.push(Command::UpstreamKeepalive(self.upstream_keepalive));
        }
        if self.upstream_idle_timeout != d.upstream_idle_timeout {
            out.push(Command::UpstreamIdleTimeout(self.upstream_idle_timeout));
        }
        if self.queue_timeout != d.queue_timeout {
            out.push(Command::QueueTimeout(self.queue_timeout));
        }
        if self.queue_max != d.queue_max {
            out.push(Command::QueueMax(self.queue_max));
        }
        if self.upstream_max_requests != d.upstream_max_requests {
            out.push(Command::UpstreamMaxRequests(self.upstream_max_requests));
        }
        if self.upstream_h2 {
            out.push(Command::UpstreamH2(true));
        }
        if self.proxy_protocol.is_some() {
            out.push(Command::ProxyProtocol(self.proxy_protocol));
        }
        if self.accept_proxy {
            out.push(Command::AcceptProxy(true));
        }
        if let Some(p) = &self.check.probe {
            out.push(Command::Check(Some(p.clone())));
        }
        if self.check.interval != d.check.interval {
            out.push(Command::CheckInterval(self.check.interval));
        }
        if self.check.timeout != d.check.timeout {
            out.push(Command::CheckTimeout(self.check.timeout));
        }
        if self.check.rise != d.check.rise {
            out.push(Command::CheckRise(self.check.rise));
        }
        if self.check.fall != d.check.fall {
            out.push(Command::CheckFall(self.check.fall));
        }
        if self.slow_start != d.slow_start {
            out.push(Command::SlowStart(self.slow_start));
        }
        if self.shutdown_grace != d.shutdown_grace {
            out.push(Command::ShutdownGrace(self.shutdown_grace));
        }
        if let Some(name) = &self.dsr_if {
            out.push(Command::DsrIf(name.clone()));
        }
        if self.dsr_path != d.dsr_path {
            out.push(Command::DsrPath(self.dsr_path));
        }
        if let Some(names) = &self.udp_offload {
            out.push(Command::UdpOffload(Some(names.clone())));
        }
        if self.announce_table.is_some() {
            out.push(Command::AnnounceTable(self.announce_table));
        }
        if self.announce_grace != d.announce_grace {
            out.push(Command::AnnounceGrace(self.announce_grace));
        }
        if let Some(list) = self.tarpit_acl {
            out.push(Command::TarpitAcl(Some(list)));
        }
        if self.transparent {
            out.push(Command::Transparent(true));
        }
        for (index, s) in self.servers.iter().enumerate() {
            let Some(host) = &s.host else { continue };
            let mut fields = vec![
                ServerField::Address(host.clone()),
                ServerField::Port(s.port),
                ServerField::Max(s.max),
                ServerField::Hard(s.hard),
                ServerField::Weight(s.weight),
                ServerField::Prio(s.prio),
            ];
            if let Some(a) = s.acl {
                fields.push(ServerField::Acl(a));
            }
            if s.proxy_protocol != ServerProxy::Global {
                fields.push(ServerField::ProxyProtocol(s.proxy_protocol));
            }
            if s.check != ServerCheck::Inherit {
                fields.push(ServerField::Check(s.check.clone()));
            }
            out.push(Command::Server { index, fields });
        }
        out
    }
}

fn set<T>(slot: &mut T, value: T) -> Applied {
    *slot = value;
    Applied::done()
}

/// Sets the value if one is given; either way the reply is the (new) value, as Pen's.
fn query_or_set<T: Copy + ToString>(slot: &mut T, value: Option<T>) -> Applied {
    if let Some(v) = value {
        *slot = v;
    }
    Applied::value(*slot)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn apply_all(lines: &[&str]) -> Settings {
        let mut s = Settings::default();
        for line in lines {
            let cmd: Command = match line.parse() {
                Ok(c) => c,
                Err(e) => panic!("{line}: {e}"),
            };
            if let Err(e) = s.apply(&cmd) {
                panic!("{line}: {e}");
            }
        }
        s
    }

    #[test]
    fn server_command_creates_and_updates_slots() {
        let s = apply_all(&[
            "server 2 address 127.0.0.1 port 80 max 5",
            "server 2 hard 9",
        ]);
        assert_eq!(s.servers.len(), 3);
        assert_eq!(s.servers[0].addr(), None, "gap slots are unused");
        assert_eq!(
            s.servers[2].addr(),
            Some("127.0.0.1:80".parse().unwrap_or_else(|_| unreachable!()))
        );
        assert_eq!((s.servers[2].max, s.servers[2].hard_limit()), (5, 9));
    }

    #[test]
    fn hard_limit_defaults_to_soft_limit() {
        let s = apply_all(&["server 0 address 127.0.0.1 port 80 max 5"]);
        assert_eq!(s.servers[0].hard_limit(), 5);
    }

    #[test]
    fn queries_do_not_change_anything() {
        let mut s = Settings::default();
        let before = s.clone();
        let r = s.apply(&Command::Blacklist(None));
        assert_eq!(r.map(|a| a.reply), Ok(Reply::Value("30".into())));
        assert_eq!(s, before);
        // Setting answers with the new value, as Pen does.
        let r = s.apply(&Command::Timeout(Some(9)));
        assert_eq!(r.map(|a| a.reply), Ok(Reply::Value("9".into())));
    }

    #[test]
    fn failed_server_command_changes_nothing() {
        let mut s = apply_all(&["server 0 address 127.0.0.1 port 80"]);
        let before = s.clone();
        let cmd = Command::Server {
            index: 0,
            fields: vec![
                ServerField::Port(81),
                ServerField::Address(
                    Host::new("no-such-host.invalid").unwrap_or_else(|_| unreachable!()),
                ),
            ],
        };
        assert!(s.apply(&cmd).is_err());
        assert_eq!(s, before);
    }

    #[test]
    fn blacklist_of_a_server_is_an_action() {
        let mut s = apply_all(&["server 0 address 127.0.0.1 port 80"]);
        let r = s.apply(&Command::Server {
            index: 0,
            fields: vec![ServerField::Blacklist(7)],
        });
        assert_eq!(
            r.map(|a| a.actions),
            Ok(vec![Action::Blacklist {
                index: 0,
                seconds: 7
            }])
        );
        assert!(s
            .apply(&Command::Server {
                index: 5,
                fields: vec![ServerField::Blacklist(7)]
            })
            .is_err());
    }

    #[test]
    fn to_commands_rebuilds_the_same_settings() {
        let s = apply_all(&[
            "roundrobin",
            "weight",
            "stubborn",
            "tracking 60",
            "acl 1 deny 10.0.0.0 255.0.0.0",
            "acl 2 permit ::1/128",
            "client_acl 1",
            "tcp_fastclose both",
            "no tcp_nodelay",
            "source 127.0.0.1",
            "emergency 127.0.0.1:9",
            "block",
            "http",
            "http_header_max 8192",
            "http_request_timeout 0",
            "hsts 31536000 include_subdomains",
            "upstream_h2",
            "proxy_protocol v2",
            "accept_proxy",
            "dsr_if eth1",
            "dsr_path packet",
            "acl 3 permit 10.77.0.200 255.255.255.248",
            "tarpit_acl 3",
            "transparent",
            "server 0 address 127.0.0.1 port 80 max 3 hard 4 weight 2 prio 1 acl 2 proxy_protocol off",
            "server 3 address ::1 port 81 check http /health 204",
            "server 4 address ::1 port 82 check off",
            "check tcp",
            "check_interval 500ms",
            "check_timeout 2",
            "check_rise 1",
            "check_fall 5",
            "slow_start 30",
            "shutdown_grace 0",
            "udp_responses 1",
        ]);
        let mut rebuilt = Settings::default();
        for cmd in s.to_commands() {
            let line = cmd.to_string();
            let again: Command = line.parse().unwrap_or_else(|e| panic!("{line}: {e}"));
            rebuilt
                .apply(&again)
                .unwrap_or_else(|e| panic!("{line}: {e}"));
        }
        assert_eq!(rebuilt, s);
    }

    #[test]
    fn upstream_h2_is_off_by_default_and_written_only_when_on() {
        let lines = |s: &Settings| -> Vec<String> {
            s.to_commands().iter().map(|c| c.to_string()).collect()
        };
        assert!(!Settings::default().upstream_h2);
        assert!(!lines(&Settings::default())
            .iter()
            .any(|l| l.contains("upstream_h2")));
        let on = apply_all(&["upstream_h2"]);
        assert!(on.upstream_h2);
        assert!(lines(&on).contains(&"upstream_h2".to_string()));
        assert!(!apply_all(&["upstream_h2", "no upstream_h2"]).upstream_h2);
    }

    #[test]
    fn defer_accept_follows_whether_clients_speak_first_unless_chosen() {
        let lines = |s: &Settings| -> Vec<String> {
            s.to_commands().iter().map(|c| c.to_string()).collect()
        };
        // A raw relay's server may speak first: accepted at once.
        assert_eq!(Settings::default().defer_accept_seconds(), 0);
        for first in ["http", "dummy", "accept_proxy"] {
            assert_eq!(
                apply_all(&[first]).defer_accept_seconds(),
                DeferAccept::AUTO_SECONDS,
                "{first}"
            );
        }
        assert!(!lines(&apply_all(&["http"]))
            .iter()
            .any(|l| l.contains("defer_accept")));
        let chosen = apply_all(&["defer_accept 3"]);
        assert_eq!(chosen.defer_accept_seconds(), 3);
        assert!(lines(&chosen).contains(&"defer_accept 3".to_string()));
        assert_eq!(
            apply_all(&["http", "defer_accept 0"]).defer_accept_seconds(),
            0
        );
        assert_eq!(
            apply_all(&["defer_accept 3", "defer_accept auto"]).defer_accept,
            DeferAccept::Auto
        );
    }

    #[test]
    fn tcp_nodelay_is_on_by_default_and_only_its_absence_is_written() {
        let on = Settings::default();
        assert!(on.tcp_nodelay);
        let lines = |s: &Settings| -> Vec<String> {
            s.to_commands().iter().map(|c| c.to_string()).collect()
        };
        assert!(!lines(&on).iter().any(|l| l.contains("tcp_nodelay")));
        let off = apply_all(&["no tcp_nodelay"]);
        assert!(!off.tcp_nodelay);
        assert!(lines(&off).contains(&"no tcp_nodelay".to_string()));
        assert!(apply_all(&["no tcp_nodelay", "tcp_nodelay"]).tcp_nodelay);
    }
}
