//! The command language: one line of text <-> one [`Command`].
//!
//! Every way of configuring quill (command-line flags, `-O`/`-o`, config files, the control
//! socket) ends up here, so there is exactly one grammar. Invariant, checked by a property
//! test: for every command `c`, `c.to_string().parse::<Command>() == Ok(c)`. That is what lets
//! `write FILE` print the running configuration as commands that rebuild it.
//!
//! Parsing is purely syntactic: numbers, addresses and keywords are checked here, while
//! anything that needs the current configuration (does server N exist, can a host name be
//! resolved) is checked by [`crate::settings::Settings::apply`].

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use crate::acl::{AclAction, AclId, AclMatch, AclRule};

/// Highest server number `server N ...` accepts (exclusive). Servers live in a fixed table
/// of runtime counters so that the data plane never reallocates it.
pub const MAX_SERVERS: usize = 1024;

/// Smallest `http_header_max` accepted: a request line and a few headers must fit.
pub const MIN_HEADER_MAX: usize = 256;
/// The most `poll_before_sleep` accepts: beyond a few milliseconds a loop would poll
/// through most pauses of any load, which is `proxy::polling`'s busy polling, not this.
pub const MAX_POLL_BEFORE_SLEEP_MICROS: u32 = 10_000;

/// One line of the command language.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Command {
    /// `server N field value ...`: change fields of server N (created if new).
    Server {
        index: usize,
        fields: Vec<ServerField>,
    },
    /// `roundrobin` / `no roundrobin`: select without looking up the client tracking table.
    RoundRobin(bool),
    /// `hash` / `no hash`: initial choice by a hash of the client address.
    Hash(bool),
    /// `hash_only` / `no hash_only` (extension, Pen's `-N`): hash without saving clients.
    HashOnly(bool),
    /// `stubborn` / `no stubborn`: never fail over from the initial choice.
    Stubborn(bool),
    /// `weight` / `no weight`: least connections relative to weight.
    Weight(bool),
    /// `prio` / `no prio`: lowest priority value that has capacity.
    Prio(bool),
    /// `tracking [N]`: seconds a client is remembered (0 = forever); no argument asks.
    Tracking(Option<u64>),
    /// `blacklist [N]`: seconds a failed server is avoided; no argument asks.
    Blacklist(Option<u64>),
    /// `timeout [N]`: connect timeout in seconds; no argument asks.
    Timeout(Option<u64>),
    /// `conn_max [N]`: maximum simultaneous client connections; no argument asks.
    ConnMax(Option<usize>),
    /// `clients_max [N]`: size of the client tracking table; no argument asks.
    ClientsMax(Option<usize>),
    /// `acl N permit|deny ADDR [MASK]` / `acl N permit|deny ADDR6[/LEN]`: append a rule.
    Acl {
        list: AclId,
        rule: AclRule,
    },
    /// `no acl N`: empty list N (it then permits everything).
    NoAcl(AclId),
    /// `client_acl [N]`: check connecting clients against list N (without N: print it).
    ClientAcl(Option<AclId>),
    /// `tcp_nodelay` / `no tcp_nodelay`.
    TcpNodelay(bool),
    /// `tcp_fastclose up|down|both|off`.
    TcpFastclose(FastClose),
    /// `keepalive` / `no keepalive`: SO_KEEPALIVE on upstream sockets (client sockets
    /// always have it, inherited from the listener, as in Pen).
    Keepalive(bool),
    /// `idle_timeout [N]`: close connections silent for N seconds (0 = never); without N,
    /// the reply is the value.
    IdleTimeout(Option<u64>),
    /// `defer_accept auto|N` (extension): how long the kernel holds a new TCP connection
    /// until its client's first bytes arrive (TCP_DEFER_ACCEPT), so that quill is woken
    /// once for both; `0` = never.
    DeferAccept(DeferAccept),
    /// `idle_park N` (extension): after N seconds of silence, an idle raw TCP connection
    /// is parked: it keeps only its session, out of the event loop's tasks and reactor,
    /// until a byte or a close arrives (0 = never park); an HTTP/1.x client served request
    /// by request drops hyper and its buffers between requests.
    IdlePark(u64),
    /// `poll_before_sleep N` (extension): microseconds an event loop that has just worked
    /// keeps polling for events before it sleeps (0 = sleep at once, the default; at most
    /// `MAX_POLL_BEFORE_SLEEP_MICROS`): lower latency for more CPU.
    PollBeforeSleep(u32),
    /// `pending_max N`: upstream connects allowed in progress at once.
    PendingMax(usize),
    /// `source IP`: local address for upstream connections.
    Source(IpAddr),
    /// `no source` (extension): let the kernel choose the upstream source address.
    NoSource,
    /// `dummy` / `no dummy`: answer HTTP requests ourselves instead of proxying.
    Dummy(bool),
    /// `debug [N]`: log verbosity; no argument asks.
    Debug(Option<u32>),
    /// `epoll`, `poll`, `select`, `kqueue`: Pen's event-engine choice; quill accepts and
    /// ignores it (its runtime always uses the best mechanism of the platform).
    EventEngine(EventEngine),
    /// `block`, `delayed_forward`, `ascii` and their `no` forms: obsolete or debug-only in
    /// Pen; accepted so that old scripts keep working.
    Compat(CompatWord, bool),
    /// `emergency HOST:PORT` / `no emergency` (extension, Pen's `-e`).
    Emergency(Option<HostPort>),
    /// `abuse HOST:PORT` / `no abuse` (extension, Pen's `-B`).
    Abuse(Option<HostPort>),
    /// `multi_accept N` (extension, Pen's `-m`): connections accepted per wake-up.
    MultiAccept(usize),
    /// `backlog N` (extension, Pen's `-q`): listen queue length.
    Backlog(u32),
    /// `workers N` (extension): event loops (threads); 0 = one per available core.
    Workers(usize),
    /// `udp_idle_timeout [N]` (extension): seconds after which a silent UDP flow (`-U`) is
    /// forgotten (default 30, at least 1); no argument asks.
    UdpIdleTimeout(Option<u64>),
    /// `udp_responses [N]` (extension, NGINX's `proxy_responses`): datagrams a server sends
    /// back for each client datagram; once all have come, the UDP flow ends (0, the
    /// default: never, as Pen); no argument asks.
    UdpResponses(Option<u32>),
    /// `listen [ADDR]`: ask for, or move, the listening socket.
    Listen(Option<Word>),
    /// `control_acl [N]`: check control-socket clients against list N (without N: print
    /// it).
    ControlAcl(Option<AclId>),
    /// `metrics_listen [[ADDR:]PORT]` (extension): serve Prometheus metrics, the JSON status
    /// and the web dashboard over HTTP there (a bare port means 127.0.0.1); no argument asks.
    MetricsListen(Option<Word>),
    /// `no metrics_listen` (extension): close the metrics listener.
    NoMetricsListen,
    /// `log [FILE]` / `no log`: the connection log.
    Log(Option<Word>),
    NoLog,
    /// `web_stats [FILE]` / `no web_stats`: the HTML status file written on SIGUSR1.
    WebStats(Option<Word>),
    NoWebStats,
    /// `abort_on_error` / `no abort_on_error`.
    AbortOnError(bool),
    /// `servers`: list the servers with their state and counters.
    Servers,
    /// `status [json]`: the status report, HTML (Pen's) or JSON (extension).
    Status(StatusFormat),
    /// `mode`: the selection flags.
    Mode,
    /// `recent [N]`: clients seen in the last N seconds (default 300).
    Recent(Option<u64>),
    /// `connection N`: one open connection.
    Connection(u64),
    /// `connections [N]` (extension): the open connections, oldest first (the oldest N),
    /// one `connection N` line each (Pen lists them on its status page).
    Connections(Option<u64>),
    /// `close N`: close an open connection.
    Close(u64),
    /// `control`: where the control socket listens.
    Control,
    /// `pid`: the process id.
    Pid,
    /// `include FILE`: apply the commands of a file.
    Include(Word),
    /// `write [FILE]`: save the running configuration as commands.
    Write(Option<Word>),
    /// `exit`: stop quill (only when started with `-X`).
    Exit,
    /// `geoip_db FILE`: the MaxMind DB that `acl N ... country CC` rules use.
    GeoipDb(Word),
    /// `ssl_cert FILE` / `no ssl_cert` (Pen's `-E`): terminate TLS with this PEM
    /// certificate chain (leaf first); `no ssl_cert` turns termination off.
    SslCert(Option<Word>),
    /// `ssl_key FILE` / `no ssl_key` (Pen's `-K`): the private key (RSA, ECDSA or Ed25519,
    /// PEM); without it the key is looked for in the certificate file.
    SslKey(Option<Word>),
    /// `ssl_ca FILE` / `no ssl_ca` (Pen's `-G`): CA certificates client certificates are
    /// verified against.
    SslCa(Option<Word>),
    /// `ssl_ca_dir DIR` / `no ssl_ca_dir` (Pen's `-A`): a directory of CA certificates.
    SslCaDir(Option<Word>),
    /// `ssl_verify_client` / `no ssl_verify_client` (Pen's `-R`): require a client
    /// certificate signed by `ssl_ca` / `ssl_ca_dir`.
    SslVerifyClient(bool),
    /// `ssl_protocol ssl23|tls1.2|tls1.3` (Pen's `-L`): the protocol versions offered.
    SslProtocol(SslProtocol),
    /// `ssl_option OPTION` / `no ssl_option OPTION` (Pen's): protocol options.
    SslOption(SslOption, bool),
    /// `ssl_ciphers LIST` / `no ssl_ciphers` (Pen's): OpenSSL-style cipher list.
    SslCiphers(Option<Word>),
    /// `ssl_sni_path DIR` / `no ssl_sni_path` (Pen's): per-name `DIR/NAME.crt|.key|.ca`.
    SslSniPath(Option<Word>),
    /// `ssl_ocsp_response FILE` / `no ssl_ocsp_response` (Pen's): a DER OCSP response to
    /// staple; repeating the command re-reads the file.
    SslOcspResponse(Option<Word>),
    /// `ssl_client_renegotiation_interval N` (Pen's): accepted; quill never allows
    /// renegotiation (rustls does not implement it), which is stricter than any interval.
    SslClientRenegotiationInterval(u64),
    /// `upstream_tls` / `no upstream_tls` (extension): speak TLS to every upstream server,
    /// verifying its certificate.
    UpstreamTls(bool),
    /// `upstream_ca FILE` / `no upstream_ca` (extension): trust these CA certificates for
    /// upstream servers instead of the built-in Mozilla root set.
    UpstreamCa(Option<Word>),
    /// `upstream_sni NAME` / `no upstream_sni` (extension): the name sent to upstream
    /// servers and checked in their certificates (default: the server's host as written).
    UpstreamSni(Option<Host>),
    /// `dsr_if IF`: Direct Server Return on interface IF (read at start-up).
    DsrIf(Word),
    /// `dsr_path auto|xdp|packet` (extension): how the DSR plane forwards frames: an XDP
    /// program in the driver's receive path, or quill's packet socket (read at start-up).
    DsrPath(DsrPath),
    /// `udp_offload IF[,IF...]` / `no udp_offload` (extension): in UDP mode, a TC program
    /// on these interfaces' ingress carries the datagrams of flows quill has placed, in
    /// the kernel (`proxy::offload`; read at start-up).
    UdpOffload(Option<Word>),
    /// `tarpit_acl [N]`: in DSR mode, answer ARP and TCP SYNs for the addresses a permit
    /// rule of list N matches; no argument asks.
    TarpitAcl(Option<AclId>),
    /// `no tarpit_acl` (extension): stop tarpitting.
    NoTarpitAcl,
    /// `transparent` / `no transparent`: connect to backends from the client's address.
    Transparent(bool),
    /// `check tcp` / `check http PATH [STATUS]` / `check grpc [SERVICE]` / `no check`
    /// (extension): the active health check of every server that does not choose its own
    /// (`server N check ...`).
    Check(Option<Probe>),
    /// `check_interval D` (extension): time between two checks of a server.
    CheckInterval(Millis),
    /// `check_timeout D` (extension): how long one check may take.
    CheckTimeout(Millis),
    /// `check_rise N` (extension): successes in a row that bring a down server back.
    CheckRise(u32),
    /// `check_fall N` (extension): failures in a row that take a server down.
    CheckFall(u32),
    /// `shutdown_grace N` (extension): seconds open connections may run on after quill
    /// stops accepting (TERM, `exit`, a binary upgrade); 0 = as long as they last.
    ShutdownGrace(u64),
    /// `announce_table N` / `no announce_table` (extension): keep a route for the listening
    /// address in kernel routing table N while this node can serve it, for BIRD or FRR to
    /// announce (BGP/ECMP scale-out); never 0 or the kernel's own tables 253-255.
    AnnounceTable(Option<u32>),
    /// `announce_grace N` (extension): seconds quill goes on serving after it withdrew the
    /// route when it stops, so that the routers move the flows first.
    AnnounceGrace(u64),
    /// `drain` / `drain 0` (extension): take this whole node out of the service (its
    /// `announce_table` route withdrawn, `health` failing) while it goes on serving what
    /// reaches it, or put it back. Runtime state, not part of the configuration.
    NodeDrain(bool),
    /// `health` (extension): whether this node can serve (for keepalived's track_script:
    /// quillctl exits 0 when it can, 1 when it cannot).
    Health,
    /// `slow_start N` (extension): seconds over which a server that comes back up ramps
    /// from a small share of its weight to all of it (0 = at once).
    SlowStart(u64),
    /// `http` / `no http` (Pen's `-H`): frame HTTP/1.x and add `X-Forwarded-For` and
    /// `X-Forwarded-Proto` to every request.
    Http(bool),
    /// `http_header_max [BYTES]` (extension): largest request head with `http` (431
    /// beyond); no argument asks.
    HttpHeaderMax(Option<usize>),
    /// `http_request_timeout [N]` (extension): seconds a client has to send a whole
    /// request head with `http` (408 beyond; 0 = no bound); no argument asks.
    HttpRequestTimeout(Option<u64>),
    /// `hsts MAX_AGE [include_subdomains] [preload]` / `no hsts` (extension): add
    /// `Strict-Transport-Security` to responses of TLS-terminated HTTP (needs `http`).
    Hsts(Option<Hsts>),
    /// `proxy_protocol v1|v2` / `no proxy_protocol` (extension): send a PROXY protocol
    /// header first on every backend connection.
    ProxyProtocol(Option<ProxyVersion>),
    /// `accept_proxy` / `no accept_proxy` (extension): clients begin with a PROXY protocol
    /// header (v1 or v2) naming the real client.
    AcceptProxy(bool),
    /// `alpn h2,http/1.1` / `no alpn` (extension): the protocols TLS listeners offer, in
    /// the server's order of preference. Without it: `h2,http/1.1` with `http`, else
    /// `http/1.1`. `h2` needs `http`.
    Alpn(Option<Vec<Alpn>>),
    /// `h2c` / `no h2c` (extension): with `http`, plain listeners also take HTTP/2 from
    /// clients that start with its preface (prior knowledge, RFC 9113 3.3).
    H2c(bool),
    /// `h2_max_streams N` (extension): concurrent streams an HTTP/2 client may open.
    H2MaxStreams(u32),
    /// `upstream_keepalive N` (extension): idle kept-alive connections per server, per
    /// event loop, that requests served per request (HTTP/2 clients) reuse; 0 = one
    /// connection per request.
    UpstreamKeepalive(u32),
    /// `upstream_idle_timeout N` (extension): seconds an idle pooled connection is kept.
    UpstreamIdleTimeout(u64),
    /// `queue_timeout N` (extension): seconds a client connection (or a request, with
    /// `http`) that finds every server it may use at its `max` waits for one to have room,
    /// before the emergency server or a refusal; 0 = no wait, as Pen.
    QueueTimeout(u64),
    /// `queue_max N` (extension): clients that may wait for room at once (`queue_timeout`);
    /// one more goes at once to the emergency server or is refused; 0 = no limit but
    /// `conn_max`.
    QueueMax(u64),
    /// `access_log FILE` / `no access_log` (extension): with `http`, one line per request
    /// (see `accesslog`), reopened on SIGHUP like `log`.
    AccessLog(Option<Word>),
    /// `upstream_max_requests N` (extension): requests over one pooled connection before
    /// it is closed (0 = no limit).
    UpstreamMaxRequests(u64),
    /// `upstream_h2` / `no upstream_h2` (extension): requests served per request go to
    /// servers over HTTP/2 (prior knowledge on plain connections, ALPN `h2` with
    /// `upstream_tls`), one multiplexed connection per server and event loop.
    UpstreamH2(bool),
}

/// A protocol name TLS listeners may offer (ALPN, RFC 7301).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    H2,
    Http11,
}

impl Alpn {
    pub fn word(self) -> &'static str {
        match self {
            Alpn::H2 => "h2",
            Alpn::Http11 => "http/1.1",
        }
    }
}

/// A PROXY protocol version (HAProxy's specification).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyVersion {
    /// The text form: `PROXY TCP4 src dst sport dport\r\n`.
    V1,
    /// The binary form.
    V2,
}

impl ProxyVersion {
    fn word(self) -> &'static str {
        match self {
            ProxyVersion::V1 => "v1",
            ProxyVersion::V2 => "v2",
        }
    }
}

/// `server N proxy_protocol ...`: the server's own choice, or the global one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServerProxy {
    /// `global`: follow `proxy_protocol` (the default).
    #[default]
    Global,
    /// `off`: never, whatever `proxy_protocol` says.
    Off,
    /// `v1` / `v2`.
    On(ProxyVersion),
}

/// The `Strict-Transport-Security` policy of `hsts`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hsts {
    /// Seconds browsers remember to use only HTTPS.
    pub max_age: u64,
    pub include_subdomains: bool,
    pub preload: bool,
}

impl Hsts {
    /// The header field's value, e.g. `max-age=31536000; includeSubDomains`, formatted where
    /// it is written (every response of a TLS client carries it: no `String` each time).
    pub fn header_value(&self) -> impl fmt::Display + '_ {
        HstsValue(self)
    }
}

/// [`Hsts::header_value`].
struct HstsValue<'a>(&'a Hsts);

impl fmt::Display for HstsValue<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "max-age={}", self.0.max_age)?;
        if self.0.include_subdomains {
            f.write_str("; includeSubDomains")?;
        }
        if self.0.preload {
            f.write_str("; preload")?;
        }
        Ok(())
    }
}

impl fmt::Display for Hsts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.max_age)?;
        if self.include_subdomains {
            f.write_str(" include_subdomains")?;
        }
        if self.preload {
            f.write_str(" preload")?;
        }
        Ok(())
    }
}

/// What an active health check does.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Probe {
    /// Connect, then close.
    Tcp,
    /// `GET PATH HTTP/1.1`; the answer must have `status` (or any 2xx/3xx when `None`).
    Http { path: Word, status: Option<u16> },
    /// gRPC's `grpc.health.v1.Health/Check` over HTTP/2 for `service` (the server as a
    /// whole when `None`); the answer must be `SERVING`.
    Grpc { service: Option<Word> },
}

/// A server's own choice of health check (`server N check ...`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum ServerCheck {
    /// `check default`: the global `check` setting.
    #[default]
    Inherit,
    /// `check off`: never checked, even with a global check.
    Off,
    /// `check tcp` / `check http PATH [STATUS]` / `check grpc [SERVICE]`.
    Probe(Probe),
}

/// A duration written in seconds (`2`, as Pen's timers) or milliseconds (`500ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Millis(pub u64);

impl Millis {
    pub fn duration(self) -> std::time::Duration {
        std::time::Duration::from_millis(self.0)
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 % 1000 == 0 {
            write!(f, "{}", self.0 / 1000)
        } else {
            write!(f, "{}ms", self.0)
        }
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Probe::Tcp => f.write_str("tcp"),
            Probe::Http { path, status: None } => write!(f, "http {path}"),
            Probe::Http {
                path,
                status: Some(s),
            } => write!(f, "http {path} {s}"),
            Probe::Grpc { service: None } => f.write_str("grpc"),
            Probe::Grpc {
                service: Some(name),
            } => write!(f, "grpc {name}"),
        }
    }
}

impl fmt::Display for ServerCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerCheck::Inherit => f.write_str("default"),
            ServerCheck::Off => f.write_str("off"),
            ServerCheck::Probe(p) => p.fmt(f),
        }
    }
}

/// A single whitespace-free word: a file name or an address kept as written.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Word(String);

impl Word {
    /// `s` if it is one non-empty word without control characters.
    pub fn new(s: &str) -> Option<Word> {
        (!s.is_empty() && !s.chars().any(|c| c.is_whitespace() || c.is_control()))
            .then(|| Word(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Word {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The two forms of `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusFormat {
    Html,
    Json,
}

/// `ssl_protocol` values (Pen's `-L`). Pen's `ssl3`, `tls1` and `tls1.1` are refused:
/// quill never offers a protocol below TLS 1.2.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslProtocol {
    /// `ssl23`: the best version both sides have (TLS 1.3 or 1.2).
    #[default]
    Any,
    /// `tls1.2`: TLS 1.2 only.
    Tls12,
    /// `tls1.3`: TLS 1.3 only.
    Tls13,
}

impl SslProtocol {
    pub fn word(self) -> &'static str {
        match self {
            SslProtocol::Any => "ssl23",
            SslProtocol::Tls12 => "tls1.2",
            SslProtocol::Tls13 => "tls1.3",
        }
    }
}

/// `ssl_option` words (Pen's). Versions below TLS 1.2 are never offered, so their `no_`
/// options are always in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SslOption {
    NoSslv2,
    NoSslv3,
    NoTlsv1,
    NoTlsv11,
    NoTlsv12,
    CipherServerPreference,
}

impl SslOption {
    pub fn word(self) -> &'static str {
        match self {
            SslOption::NoSslv2 => "no_sslv2",
            SslOption::NoSslv3 => "no_sslv3",
            SslOption::NoTlsv1 => "no_tlsv1",
            SslOption::NoTlsv11 => "no_tlsv1.1",
            SslOption::NoTlsv12 => "no_tlsv1.2",
            SslOption::CipherServerPreference => "cipher_server_preference",
        }
    }

    fn parse(w: &str) -> Option<SslOption> {
        [
            SslOption::NoSslv2,
            SslOption::NoSslv3,
            SslOption::NoTlsv1,
            SslOption::NoTlsv11,
            SslOption::NoTlsv12,
            SslOption::CipherServerPreference,
        ]
        .into_iter()
        .find(|o| o.word() == w)
    }
}

impl Command {
    /// Whether the command changes the TLS configuration, which is then rebuilt (and its
    /// files re-read) before the change is published.
    pub fn is_tls(&self) -> bool {
        matches!(
            self,
            Command::SslCert(_)
                | Command::SslKey(_)
                | Command::SslCa(_)
                | Command::SslCaDir(_)
                | Command::SslVerifyClient(_)
                | Command::SslProtocol(_)
                | Command::SslOption(..)
                | Command::SslCiphers(_)
                | Command::SslSniPath(_)
                | Command::SslOcspResponse(_)
                | Command::UpstreamTls(_)
                | Command::UpstreamCa(_)
                | Command::UpstreamSni(_)
                | Command::Alpn(_)
        )
    }

    /// Whether the command changes (or asks for) configuration, as opposed to an operation
    /// on the running process (`servers`, `close N`, `write`, ...). Only configuration
    /// commands may appear in configuration files.
    pub fn is_setting(&self) -> bool {
        !matches!(
            self,
            Command::Servers
                | Command::Status(_)
                | Command::Mode
                | Command::Recent(_)
                | Command::Connection(_)
                | Command::Connections(_)
                | Command::Close(_)
                | Command::Control
                | Command::Pid
                | Command::Health
                | Command::NodeDrain(_)
                | Command::Include(_)
                | Command::Write(_)
                | Command::Exit
        )
    }
}

/// One `field value` pair of `server N ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerField {
    /// `acl A`: only clients permitted by list A may use this server.
    Acl(AclId),
    /// `address A`: host name or IP address (resolved when applied).
    Address(Host),
    /// `port P`.
    Port(u16),
    /// `max M`: soft limit of simultaneous connections (0 = unlimited).
    Max(u32),
    /// `hard H`: limit for returning clients (0 = same as `max`).
    Hard(u32),
    /// `weight W`.
    Weight(u32),
    /// `prio P`: lower is preferred.
    Prio(u32),
    /// `blacklist T`: avoid the server for T seconds; 0 whitelists it.
    Blacklist(u64),
    /// `drain` / `drain 1` (extension): no new connections, open ones finish; `drain 0`
    /// takes the server back.
    Drain(bool),
    /// `check tcp|http PATH [STATUS]|off|default` (extension): this server's health check.
    Check(ServerCheck),
    /// `proxy_protocol v1|v2|off|global` (extension): this server's PROXY protocol.
    ProxyProtocol(ServerProxy),
}

/// A host as written by the user: an IP literal or a DNS name, checked for syntax only.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Host(String);

impl Host {
    /// Checks that `s` is an IP literal or a plausible DNS name.
    pub fn new(s: &str) -> Result<Host, ParseError> {
        let bad = || ParseError::InvalidHost(s.to_string());
        if s.is_empty() || s.len() > 253 {
            return Err(bad());
        }
        if s.parse::<IpAddr>().is_ok() {
            return Ok(Host(s.to_string()));
        }
        // `[::1]`, as a server spec writes an IPv6 address: the address.
        if let Some(v6) = s.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            if let Ok(ip) = v6.parse::<std::net::Ipv6Addr>() {
                return Ok(Host(ip.to_string()));
            }
        }
        // Something that looks like dotted decimal but is no IPv4 address (300.1.1.1) is a
        // typo, not a host name: refuse it rather than send it to the resolver.
        if s.bytes().all(|b| b.is_ascii_digit() || b == b'.') || s.contains(':') {
            return Err(bad());
        }
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
                && !l.starts_with('-')
        };
        if s.trim_end_matches('.').split('.').all(label_ok) {
            Ok(Host(s.to_string()))
        } else {
            Err(bad())
        }
    }

    /// The host as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The IP address, when the host is a literal.
    pub fn ip(&self) -> Option<IpAddr> {
        self.0.parse().ok()
    }
}

impl From<IpAddr> for Host {
    fn from(ip: IpAddr) -> Host {
        Host(ip.to_string())
    }
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `host:port`, with IPv6 literals in brackets (`[::1]:80`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub host: Host,
    pub port: u16,
}

impl HostPort {
    /// Parses `host:port` / `[v6]:port`; without a port, `default_port` is used if given.
    pub fn parse(s: &str, default_port: Option<u16>) -> Result<HostPort, ParseError> {
        let (host, port) = split_host_port(s)?;
        let port = match (port, default_port) {
            (Some(p), _) => parse_port(p)?,
            (None, Some(p)) => p,
            (None, None) => return Err(ParseError::MissingPort(s.to_string())),
        };
        Ok(HostPort {
            host: Host::new(host)?,
            port,
        })
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.host.ip() {
            Some(IpAddr::V6(_)) => write!(f, "[{}]:{}", self.host, self.port),
            _ => write!(f, "{}:{}", self.host, self.port),
        }
    }
}

/// Splits `host[:port]`, `[v6][:port]` or a bare IPv6 literal into host and optional port.
pub fn split_host_port(s: &str) -> Result<(&str, Option<&str>), ParseError> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| ParseError::InvalidHost(s.to_string()))?;
        return match after {
            "" => Ok((host, None)),
            _ => match after.strip_prefix(':') {
                Some(port) => Ok((host, Some(port))),
                None => Err(ParseError::InvalidHost(s.to_string())),
            },
        };
    }
    if s.parse::<Ipv6Addr>().is_ok() {
        return Ok((s, None));
    }
    match s.rsplit_once(':') {
        Some((host, port)) => Ok((host, Some(port))),
        None => Ok((s, None)),
    }
}

/// Parses a TCP/UDP port number (1..=65535), or a service name from /etc/services.
pub fn parse_port(s: &str) -> Result<u16, ParseError> {
    if s.bytes().all(|b| b.is_ascii_digit()) && !s.is_empty() {
        return match s.parse::<u32>() {
            Ok(p @ 1..=65535) => Ok(p as u16),
            _ => Err(ParseError::InvalidPort(s.to_string())),
        };
    }
    crate::net::services::lookup(s).ok_or_else(|| ParseError::InvalidPort(s.to_string()))
}

/// Pen's `tcp_fastclose` modes: which side's close also closes the other side at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FastClose {
    /// Half-close is passed on; the connection ends when both sides are done.
    #[default]
    Off,
    /// Close both when the server (upstream) closes.
    Up,
    /// Close both when the client (downstream) closes.
    Down,
    /// Close both when either closes.
    Both,
}

impl FastClose {
    fn word(self) -> &'static str {
        match self {
            FastClose::Off => "off",
            FastClose::Up => "up",
            FastClose::Down => "down",
            FastClose::Both => "both",
        }
    }
}

/// `defer_accept`: whether, and how long, new TCP connections wait in the kernel for their
/// client's first bytes before quill accepts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeferAccept {
    /// [`DeferAccept::AUTO_SECONDS`] where every client speaks first (`http`, `dummy`, TLS
    /// terminated by quill, `accept_proxy`), never for a raw TCP relay: a server may speak
    /// first there (SMTP, FTP, MySQL), and its silent clients would wait out the delay.
    #[default]
    Auto,
    /// This many seconds (0: accept at once).
    Seconds(u32),
}

impl DeferAccept {
    /// What `auto` holds a connection for where clients speak first. A client's first bytes
    /// follow its handshake within a round trip; one whose bytes come later is accepted
    /// after this (one SYN-ACK retransmitted) and served as any other.
    pub const AUTO_SECONDS: u32 = 1;
    /// The largest delay accepted: the kernel counts it in SYN-ACK retransmissions, and a
    /// client that silent is better timed out by quill than held unseen.
    pub const MAX_SECONDS: u32 = 600;

    /// The seconds to ask of the kernel, given whether this listener's clients speak first.
    pub fn seconds(self, clients_speak_first: bool) -> u32 {
        match self {
            DeferAccept::Auto if clients_speak_first => Self::AUTO_SECONDS,
            DeferAccept::Auto => 0,
            DeferAccept::Seconds(n) => n,
        }
    }
}

/// How the DSR plane forwards frames (`dsr_path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DsrPath {
    /// XDP where the program loads and attaches, else the packet socket (said in the log).
    #[default]
    Auto,
    /// XDP, or quill does not start.
    Xdp,
    /// The packet socket (AF_PACKET) only.
    Packet,
}

impl DsrPath {
    pub fn word(self) -> &'static str {
        match self {
            DsrPath::Auto => "auto",
            DsrPath::Xdp => "xdp",
            DsrPath::Packet => "packet",
        }
    }
}

/// Pen's event-engine words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventEngine {
    Epoll,
    Poll,
    Select,
    Kqueue,
}

impl EventEngine {
    fn word(self) -> &'static str {
        match self {
            EventEngine::Epoll => "epoll",
            EventEngine::Poll => "poll",
            EventEngine::Select => "select",
            EventEngine::Kqueue => "kqueue",
        }
    }
}

/// Pen words kept only so that old scripts parse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompatWord {
    Block,
    DelayedForward,
    Ascii,
    /// `ssl_compat` (Pen's `-Z`, OpenSSL's bug workarounds): rustls needs none.
    SslCompat,
}

impl CompatWord {
    fn word(self) -> &'static str {
        match self {
            CompatWord::Block => "block",
            CompatWord::DelayedForward => "delayed_forward",
            CompatWord::Ascii => "ascii",
            CompatWord::SslCompat => "ssl_compat",
        }
    }
}

/// Why a line is not a valid command. Each variant names the offending word.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseError {
    #[error("empty command")]
    Empty,
    #[error("unknown command '{0}'")]
    Unknown(String),
    #[error("'{command}' needs {what}")]
    Missing {
        command: &'static str,
        what: &'static str,
    },
    #[error("'{command}': unexpected '{word}'")]
    Unexpected { command: &'static str, word: String },
    #[error("'{command}': '{value}' is not a valid {what}")]
    Invalid {
        command: &'static str,
        what: &'static str,
        value: String,
    },
    #[error("'{0}' is not a valid host name or address")]
    InvalidHost(String),
    #[error("'{0}' is not a valid port (1-65535 or a service name)")]
    InvalidPort(String),
    #[error("'{0}' has no port and none can be implied")]
    MissingPort(String),
    #[error("server number {0} is out of range (0-{max})", max = MAX_SERVERS - 1)]
    ServerIndex(usize),
    #[error("access list number '{0}' is out of range (0-9)")]
    AclIndex(String),
}

/// Reads whitespace-separated words with the context needed for good errors.
struct Words<'a> {
    command: &'static str,
    iter: std::str::SplitWhitespace<'a>,
}

impl<'a> Words<'a> {
    fn next(&mut self, what: &'static str) -> Result<&'a str, ParseError> {
        self.iter.next().ok_or(ParseError::Missing {
            command: self.command,
            what,
        })
    }

    fn number<T: FromStr>(&mut self, what: &'static str) -> Result<T, ParseError> {
        let w = self.next(what)?;
        parse_number(self.command, what, w)
    }

    fn optional_number<T: FromStr>(&mut self, what: &'static str) -> Result<Option<T>, ParseError> {
        match self.iter.next() {
            None => Ok(None),
            Some(w) => parse_number(self.command, what, w).map(Some),
        }
    }

    fn word(&mut self, what: &'static str) -> Result<Word, ParseError> {
        let w = self.next(what)?;
        Word::new(w).ok_or(ParseError::Invalid {
            command: self.command,
            what,
            value: w.to_string(),
        })
    }

    fn optional_word(&mut self, what: &'static str) -> Result<Option<Word>, ParseError> {
        match self.iter.next() {
            None => Ok(None),
            Some(w) => Word::new(w).map(Some).ok_or(ParseError::Invalid {
                command: self.command,
                what,
                value: w.to_string(),
            }),
        }
    }

    /// A duration: `N` seconds or `Nms` milliseconds, more than zero.
    fn millis(&mut self) -> Result<Millis, ParseError> {
        let w = self.next("a duration (seconds, or milliseconds as 500ms)")?;
        let ms = match w.strip_suffix("ms") {
            Some(n) => parse_number::<u64>(self.command, "duration", n),
            None => parse_number::<u64>(self.command, "duration", w).and_then(|s| {
                s.checked_mul(1000).ok_or(ParseError::Invalid {
                    command: self.command,
                    what: "duration",
                    value: w.to_string(),
                })
            }),
        }
        .map_err(|_| ParseError::Invalid {
            command: self.command,
            what: "duration (seconds, or milliseconds as 500ms)",
            value: w.to_string(),
        })?;
        if ms == 0 {
            return Err(ParseError::Invalid {
                command: self.command,
                what: "duration (more than 0)",
                value: w.to_string(),
            });
        }
        Ok(Millis(ms))
    }

    /// A count of at least 1.
    fn count(&mut self) -> Result<u32, ParseError> {
        let n: u32 = self.number("count")?;
        if n == 0 {
            return Err(ParseError::Invalid {
                command: self.command,
                what: "count (at least 1)",
                value: "0".into(),
            });
        }
        Ok(n)
    }

    fn acl_id(&mut self) -> Result<AclId, ParseError> {
        let w = self.next("an access list number (0-9)")?;
        AclId::from_str(w).map_err(|_| ParseError::AclIndex(w.to_string()))
    }

    fn optional_acl_id(&mut self) -> Result<Option<AclId>, ParseError> {
        match self.iter.next() {
            None => Ok(None),
            Some(w) => AclId::from_str(w)
                .map(Some)
                .map_err(|_| ParseError::AclIndex(w.to_string())),
        }
    }

    fn end(mut self) -> Result<(), ParseError> {
        match self.iter.next() {
            None => Ok(()),
            Some(w) => Err(ParseError::Unexpected {
                command: self.command,
                word: w.to_string(),
            }),
        }
    }
}

/// `n`, unless it is over `max`.
fn at_most(command: &'static str, what: &'static str, n: u32, max: u32) -> Result<u32, ParseError> {
    if n > max {
        return Err(ParseError::Invalid {
            command,
            what,
            value: format!("{n} (at most {max})"),
        });
    }
    Ok(n)
}

fn parse_number<T: FromStr>(
    command: &'static str,
    what: &'static str,
    w: &str,
) -> Result<T, ParseError> {
    // Only plain decimal digits: "+5", "0x10" or "-1" are mistakes worth reporting.
    if w.is_empty() || !w.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ParseError::Invalid {
            command,
            what,
            value: w.to_string(),
        });
    }
    w.parse().map_err(|_| ParseError::Invalid {
        command,
        what,
        value: w.to_string(),
    })
}

/// Every command word the parser knows (`no` is a prefix of some of them, not a command).
/// Public so that lists kept elsewhere, such as the shell completions in
/// contrib/completions/, can be checked against it; a unit test checks that each word has
/// a parse rule.
pub const NAMES: &[&str] = &[
    "server",
    "roundrobin",
    "hash",
    "hash_only",
    "stubborn",
    "weight",
    "prio",
    "tracking",
    "blacklist",
    "timeout",
    "conn_max",
    "clients_max",
    "acl",
    "client_acl",
    "tcp_nodelay",
    "tcp_fastclose",
    "keepalive",
    "idle_timeout",
    "idle_park",
    "poll_before_sleep",
    "defer_accept",
    "pending_max",
    "source",
    "dummy",
    "debug",
    "epoll",
    "poll",
    "select",
    "kqueue",
    "block",
    "delayed_forward",
    "ascii",
    "emergency",
    "abuse",
    "multi_accept",
    "backlog",
    "workers",
    "udp_idle_timeout",
    "udp_responses",
    "listen",
    "control_acl",
    "metrics_listen",
    "log",
    "web_stats",
    "abort_on_error",
    "servers",
    "status",
    "mode",
    "recent",
    "connection",
    "connections",
    "close",
    "control",
    "pid",
    "include",
    "write",
    "exit",
    "geoip_db",
    "ssl_cert",
    "ssl_key",
    "ssl_ca",
    "ssl_ca_dir",
    "ssl_verify_client",
    "ssl_protocol",
    "ssl_option",
    "ssl_ciphers",
    "ssl_sni_path",
    "ssl_ocsp_response",
    "ssl_client_renegotiation_interval",
    "ssl_compat",
    "upstream_tls",
    "upstream_ca",
    "upstream_sni",
    "check",
    "check_interval",
    "check_timeout",
    "check_rise",
    "check_fall",
    "slow_start",
    "shutdown_grace",
    "announce_table",
    "announce_grace",
    "health",
    "drain",
    "dsr_if",
    "dsr_path",
    "udp_offload",
    "tarpit_acl",
    "transparent",
    "http",
    "http_header_max",
    "http_request_timeout",
    "hsts",
    "proxy_protocol",
    "accept_proxy",
    "alpn",
    "h2c",
    "h2_max_streams",
    "upstream_keepalive",
    "upstream_idle_timeout",
    "upstream_max_requests",
    "queue_timeout",
    "queue_max",
    "upstream_h2",
    "access_log",
];

/// The static name of a command word, for error messages.
fn command_name(word: &str) -> Option<&'static str> {
    NAMES.iter().copied().find(|n| *n == word)
}

impl FromStr for Command {
    type Err = ParseError;

    fn from_str(line: &str) -> Result<Command, ParseError> {
        let mut iter = line.split_whitespace();
        let first = iter.next().ok_or(ParseError::Empty)?;
        let (negated, word) = if first == "no" {
            (
                true,
                iter.next().ok_or(ParseError::Missing {
                    command: "no",
                    what: "a command",
                })?,
            )
        } else {
            (false, first)
        };
        let command = command_name(word).ok_or_else(|| ParseError::Unknown(word.to_string()))?;
        let mut w = Words { command, iter };
        let cmd = if negated {
            parse_negated(command, &mut w)?
        } else {
            parse_positive(command, &mut w)?
        };
        w.end()?;
        Ok(cmd)
    }
}

fn parse_negated(command: &'static str, w: &mut Words<'_>) -> Result<Command, ParseError> {
    Ok(match command {
        "roundrobin" => Command::RoundRobin(false),
        "hash" => Command::Hash(false),
        "hash_only" => Command::HashOnly(false),
        "stubborn" => Command::Stubborn(false),
        "weight" => Command::Weight(false),
        "prio" => Command::Prio(false),
        "tcp_nodelay" => Command::TcpNodelay(false),
        "keepalive" => Command::Keepalive(false),
        "dummy" => Command::Dummy(false),
        "source" => Command::NoSource,
        "emergency" => Command::Emergency(None),
        "abuse" => Command::Abuse(None),
        "block" => Command::Compat(CompatWord::Block, false),
        "delayed_forward" => Command::Compat(CompatWord::DelayedForward, false),
        "ascii" => Command::Compat(CompatWord::Ascii, false),
        "acl" => Command::NoAcl(w.acl_id()?),
        "log" => Command::NoLog,
        "web_stats" => Command::NoWebStats,
        "metrics_listen" => Command::NoMetricsListen,
        "abort_on_error" => Command::AbortOnError(false),
        "ssl_cert" => Command::SslCert(None),
        "ssl_key" => Command::SslKey(None),
        "ssl_ca" => Command::SslCa(None),
        "ssl_ca_dir" => Command::SslCaDir(None),
        "ssl_verify_client" => Command::SslVerifyClient(false),
        "ssl_option" => Command::SslOption(ssl_option(w)?, false),
        "ssl_ciphers" => Command::SslCiphers(None),
        "ssl_sni_path" => Command::SslSniPath(None),
        "ssl_ocsp_response" => Command::SslOcspResponse(None),
        "ssl_compat" => Command::Compat(CompatWord::SslCompat, false),
        "upstream_tls" => Command::UpstreamTls(false),
        "upstream_ca" => Command::UpstreamCa(None),
        "upstream_sni" => Command::UpstreamSni(None),
        "check" => Command::Check(None),
        "tarpit_acl" => Command::NoTarpitAcl,
        "udp_offload" => Command::UdpOffload(None),
        "announce_table" => Command::AnnounceTable(None),
        "transparent" => Command::Transparent(false),
        "http" => Command::Http(false),
        "hsts" => Command::Hsts(None),
        "proxy_protocol" => Command::ProxyProtocol(None),
        "accept_proxy" => Command::AcceptProxy(false),
        "alpn" => Command::Alpn(None),
        "h2c" => Command::H2c(false),
        "upstream_h2" => Command::UpstreamH2(false),
        "access_log" => Command::AccessLog(None),
        _ => return Err(ParseError::Unknown(format!("no {command}"))),
    })
}

fn parse_positive(command: &'static str, w: &mut Words<'_>) -> Result<Command, ParseError> {
    Ok(match command {
        "server" => parse_server(w)?,
        "roundrobin" => Command::RoundRobin(true),
        "hash" => Command::Hash(true),
        "hash_only" => Command::HashOnly(true),
        "stubborn" => Command::Stubborn(true),
        "weight" => Command::Weight(true),
        "prio" => Command::Prio(true),
        "tracking" => Command::Tracking(w.optional_number("number of seconds")?),
        "blacklist" => Command::Blacklist(w.optional_number("number of seconds")?),
        "timeout" => {
            let t = w.optional_number::<u64>("number of seconds")?;
            if t == Some(0) {
                return Err(ParseError::Invalid {
                    command,
                    what: "timeout (at least 1 second)",
                    value: "0".into(),
                });
            }
            Command::Timeout(t)
        }
        "conn_max" => Command::ConnMax(w.optional_number("number of connections")?),
        "clients_max" => Command::ClientsMax(w.optional_number("number of clients")?),
        "acl" => parse_acl(w)?,
        "client_acl" => Command::ClientAcl(w.optional_acl_id()?),
        "tcp_nodelay" => Command::TcpNodelay(true),
        "tcp_fastclose" => Command::TcpFastclose(match w.next("up, down, both or off")? {
            "up" => FastClose::Up,
            "down" => FastClose::Down,
            "both" => FastClose::Both,
            "off" => FastClose::Off,
            other => {
                return Err(ParseError::Invalid {
                    command,
                    what: "mode (up, down, both, off)",
                    value: other.into(),
                })
            }
        }),
        "keepalive" => Command::Keepalive(true),
        "idle_timeout" => Command::IdleTimeout(w.optional_number("number of seconds")?),
        "idle_park" => Command::IdlePark(w.number("number of seconds")?),
        "poll_before_sleep" => {
            let what = "number of microseconds";
            let max = MAX_POLL_BEFORE_SLEEP_MICROS;
            Command::PollBeforeSleep(at_most(command, what, w.number(what)?, max)?)
        }
        "defer_accept" => Command::DeferAccept(match w.next("auto or a number of seconds")? {
            "auto" => DeferAccept::Auto,
            n => {
                let what = "number of seconds";
                let n = parse_number(command, what, n)?;
                DeferAccept::Seconds(at_most(command, what, n, DeferAccept::MAX_SECONDS)?)
            }
        }),
        "pending_max" => {
            let n: usize = w.number("number of connections")?;
            if n == 0 {
                return Err(ParseError::Invalid {
                    command,
                    what: "limit (at least 1)",
                    value: "0".into(),
                });
            }
            Command::PendingMax(n)
        }
        "source" => {
            let s = w.next("an IP address")?;
            Command::Source(s.parse().map_err(|_| ParseError::Invalid {
                command,
                what: "IP address",
                value: s.into(),
            })?)
        }
        "dummy" => Command::Dummy(true),
        "debug" => Command::Debug(w.optional_number("debug level")?),
        "epoll" => Command::EventEngine(EventEngine::Epoll),
        "poll" => Command::EventEngine(EventEngine::Poll),
        "select" => Command::EventEngine(EventEngine::Select),
        "kqueue" => Command::EventEngine(EventEngine::Kqueue),
        "block" => Command::Compat(CompatWord::Block, true),
        "delayed_forward" => Command::Compat(CompatWord::DelayedForward, true),
        "ascii" => Command::Compat(CompatWord::Ascii, true),
        "emergency" => Command::Emergency(Some(HostPort::parse(w.next("host:port")?, None)?)),
        "abuse" => Command::Abuse(Some(HostPort::parse(w.next("host:port")?, None)?)),
        "multi_accept" => {
            let n: usize = w.number("number of connections")?;
            if n == 0 {
                return Err(ParseError::Invalid {
                    command,
                    what: "count (at least 1)",
                    value: "0".into(),
                });
            }
            Command::MultiAccept(n)
        }
        "backlog" => Command::Backlog(w.number("queue length")?),
        "workers" => Command::Workers(w.number("number of workers")?),
        "udp_idle_timeout" => {
            let t = w.optional_number::<u64>("number of seconds")?;
            if t == Some(0) {
                return Err(ParseError::Invalid {
                    command,
                    what: "idle time (at least 1 second)",
                    value: "0".into(),
                });
            }
            Command::UdpIdleTimeout(t)
        }
        "udp_responses" => Command::UdpResponses(w.optional_number("number of datagrams")?),
        "listen" => Command::Listen(w.optional_word("an address")?),
        "control_acl" => Command::ControlAcl(w.optional_acl_id()?),
        "metrics_listen" => Command::MetricsListen(w.optional_word("[address:]port")?),
        "log" => Command::Log(w.optional_word("a file name")?),
        "web_stats" => Command::WebStats(w.optional_word("a file name")?),
        "abort_on_error" => Command::AbortOnError(true),
        "servers" => Command::Servers,
        "status" => Command::Status(match w.iter.next() {
            None | Some("html") => StatusFormat::Html,
            Some("json") => StatusFormat::Json,
            Some(other) => {
                return Err(ParseError::Invalid {
                    command,
                    what: "format (html or json)",
                    value: other.into(),
                })
            }
        }),
        "mode" => Command::Mode,
        "recent" => Command::Recent(w.optional_number("number of seconds")?),
        "connection" => Command::Connection(w.number("a connection number")?),
        "connections" => Command::Connections(w.optional_number("number of connections")?),
        "close" => Command::Close(w.number("a connection number")?),
        "control" => Command::Control,
        "pid" => Command::Pid,
        "include" => Command::Include(w.word("a file name")?),
        "write" => Command::Write(w.optional_word("a file name")?),
        "exit" => Command::Exit,
        "geoip_db" => Command::GeoipDb(w.word("a file name")?),
        "ssl_cert" => Command::SslCert(Some(w.word("a certificate file")?)),
        "ssl_key" => Command::SslKey(Some(w.word("a key file")?)),
        "ssl_ca" => Command::SslCa(Some(w.word("a CA certificate file")?)),
        "ssl_ca_dir" => Command::SslCaDir(Some(w.word("a directory")?)),
        "ssl_verify_client" => Command::SslVerifyClient(true),
        "ssl_protocol" => Command::SslProtocol(match w.next("ssl23, tls1.2 or tls1.3")? {
            "ssl23" => SslProtocol::Any,
            "tls1.2" => SslProtocol::Tls12,
            "tls1.3" => SslProtocol::Tls13,
            other => {
                return Err(ParseError::Invalid {
                    command,
                    what: "protocol (ssl23, tls1.2 or tls1.3; quill never offers SSL 3 or \
                           TLS below 1.2)",
                    value: other.into(),
                })
            }
        }),
        "ssl_option" => Command::SslOption(ssl_option(w)?, true),
        "ssl_ciphers" => Command::SslCiphers(Some(w.word("a cipher list")?)),
        "ssl_sni_path" => Command::SslSniPath(Some(w.word("a directory")?)),
        "ssl_ocsp_response" => Command::SslOcspResponse(Some(w.word("a file name")?)),
        "ssl_client_renegotiation_interval" => {
            Command::SslClientRenegotiationInterval(w.number("number of seconds")?)
        }
        "ssl_compat" => Command::Compat(CompatWord::SslCompat, true),
        "upstream_tls" => Command::UpstreamTls(true),
        "upstream_ca" => Command::UpstreamCa(Some(w.word("a CA certificate file")?)),
        "upstream_sni" => Command::UpstreamSni(Some(Host::new(w.next("a server name")?)?)),
        "check" => {
            let kind = w.next("tcp, http PATH [STATUS] or grpc [SERVICE]")?;
            Command::Check(Some(parse_probe(w, kind)?))
        }
        "check_interval" => Command::CheckInterval(w.millis()?),
        "check_timeout" => Command::CheckTimeout(w.millis()?),
        "check_rise" => Command::CheckRise(w.count()?),
        "check_fall" => Command::CheckFall(w.count()?),
        "slow_start" => Command::SlowStart(w.number("number of seconds")?),
        "shutdown_grace" => Command::ShutdownGrace(w.number("number of seconds")?),
        "announce_table" => {
            let table: u32 = w.number("routing table number")?;
            if table == 0 || (253..=255).contains(&table) {
                return Err(ParseError::Invalid {
                    command: "announce_table",
                    what:
                        "routing table number (1-252 or above 255: 0 and 253-255 are the kernel's)",
                    value: table.to_string(),
                });
            }
            Command::AnnounceTable(Some(table))
        }
        "announce_grace" => Command::AnnounceGrace(w.number("number of seconds")?),
        "health" => Command::Health,
        "drain" => match w.optional_number::<u8>("0 or 1")? {
            None | Some(1) => Command::NodeDrain(true),
            Some(0) => Command::NodeDrain(false),
            Some(n) => {
                return Err(ParseError::Invalid {
                    command: "drain",
                    what: "0 or 1",
                    value: n.to_string(),
                })
            }
        },
        "dsr_if" => {
            let name = w.word("an interface name")?;
            if !is_interface_name(name.as_str()) {
                return Err(ParseError::Invalid {
                    command,
                    what: "interface name",
                    value: name.to_string(),
                });
            }
            Command::DsrIf(name)
        }
        "udp_offload" => {
            let names = w.word("interface names (IF[,IF...])")?;
            if !names.as_str().split(',').all(is_interface_name) {
                return Err(ParseError::Invalid {
                    command,
                    what: "interface names (IF[,IF...])",
                    value: names.to_string(),
                });
            }
            Command::UdpOffload(Some(names))
        }
        "dsr_path" => Command::DsrPath(match w.next("auto, xdp or packet")? {
            "auto" => DsrPath::Auto,
            "xdp" => DsrPath::Xdp,
            "packet" => DsrPath::Packet,
            other => {
                return Err(ParseError::Invalid {
                    command,
                    what: "DSR path (auto, xdp, packet)",
                    value: other.into(),
                })
            }
        }),
        "tarpit_acl" => Command::TarpitAcl(match w.iter.next() {
            None => None,
            Some(n) => Some(AclId::from_str(n).map_err(|_| ParseError::AclIndex(n.to_string()))?),
        }),
        "transparent" => Command::Transparent(true),
        "http" => Command::Http(true),
        "http_header_max" => {
            let n = w.optional_number::<usize>("number of bytes")?;
            if n.is_some_and(|n| n < MIN_HEADER_MAX) {
                return Err(ParseError::Invalid {
                    command,
                    what: "size (at least 256 bytes)",
                    value: n.unwrap_or_default().to_string(),
                });
            }
            Command::HttpHeaderMax(n)
        }
        "http_request_timeout" => {
            Command::HttpRequestTimeout(w.optional_number("number of seconds")?)
        }
        "alpn" => {
            let list = w.next("a protocol list (h2,http/1.1)")?;
            let mut protocols = Vec::new();
            for name in list.split(',') {
                let p = match name {
                    "h2" => Alpn::H2,
                    "http/1.1" => Alpn::Http11,
                    _ => {
                        return Err(ParseError::Invalid {
                            command,
                            what: "protocol (h2 or http/1.1)",
                            value: name.to_string(),
                        })
                    }
                };
                if !protocols.contains(&p) {
                    protocols.push(p);
                }
            }
            Command::Alpn(Some(protocols))
        }
        "h2c" => Command::H2c(true),
        "upstream_h2" => Command::UpstreamH2(true),
        "access_log" => Command::AccessLog(Some(w.word("a file name")?)),
        "h2_max_streams" => {
            let n: u32 = w.number("number of streams")?;
            if n == 0 {
                return Err(ParseError::Invalid {
                    command,
                    what: "number of streams (at least 1)",
                    value: n.to_string(),
                });
            }
            Command::H2MaxStreams(n)
        }
        "upstream_keepalive" => Command::UpstreamKeepalive(w.number("number of connections")?),
        "upstream_idle_timeout" => Command::UpstreamIdleTimeout(w.number("number of seconds")?),
        "queue_timeout" => Command::QueueTimeout(w.number("number of seconds")?),
        "queue_max" => Command::QueueMax(w.number("number of clients")?),
        "upstream_max_requests" => Command::UpstreamMaxRequests(w.number("number of requests")?),
        "hsts" => {
            let max_age = w.number("max-age in seconds")?;
            let (mut include_subdomains, mut preload) = (false, false);
            for word in w.iter.by_ref() {
                match word {
                    "include_subdomains" => include_subdomains = true,
                    "preload" => preload = true,
                    other => {
                        return Err(ParseError::Invalid {
                            command,
                            what: "option (include_subdomains, preload)",
                            value: other.into(),
                        })
                    }
                }
            }
            Command::Hsts(Some(Hsts {
                max_age,
                include_subdomains,
                preload,
            }))
        }
        "proxy_protocol" => Command::ProxyProtocol(Some(proxy_version(w.next("v1 or v2")?)?)),
        "accept_proxy" => Command::AcceptProxy(true),
        _ => return Err(ParseError::Unknown(command.to_string())),
    })
}

fn ssl_option(w: &mut Words<'_>) -> Result<SslOption, ParseError> {
    let word = w.next("an option")?;
    SslOption::parse(word).ok_or_else(|| ParseError::Invalid {
        command: "ssl_option",
        what: "option (no_sslv2, no_sslv3, no_tlsv1, no_tlsv1.1, no_tlsv1.2, \
               cipher_server_preference)",
        value: word.to_string(),
    })
}

fn proxy_version(word: &str) -> Result<ProxyVersion, ParseError> {
    match word {
        "v1" => Ok(ProxyVersion::V1),
        "v2" => Ok(ProxyVersion::V2),
        other => Err(ParseError::Invalid {
            command: "proxy_protocol",
            what: "version (v1 or v2)",
            value: other.into(),
        }),
    }
}

fn parse_server(w: &mut Words<'_>) -> Result<Command, ParseError> {
    let index: usize = w.number("a server number")?;
    if index >= MAX_SERVERS {
        return Err(ParseError::ServerIndex(index));
    }
    let mut fields = Vec::new();
    while let Some(name) = w.iter.next() {
        let field = match name {
            "acl" => ServerField::Acl(w.acl_id()?),
            "address" => ServerField::Address(Host::new(w.next("an address")?)?),
            "port" => ServerField::Port(parse_port(w.next("a port")?)?),
            "max" => ServerField::Max(w.number("connection limit")?),
            "hard" => ServerField::Hard(w.number("connection limit")?),
            "weight" => ServerField::Weight(w.number("weight")?),
            "prio" => ServerField::Prio(w.number("priority")?),
            "blacklist" => ServerField::Blacklist(w.number("number of seconds")?),
            "drain" => {
                // The value is optional: look at the next word without taking a field name.
                let mut ahead = w.iter.clone();
                match ahead.next() {
                    Some("0") => {
                        w.iter = ahead;
                        ServerField::Drain(false)
                    }
                    Some("1") => {
                        w.iter = ahead;
                        ServerField::Drain(true)
                    }
                    _ => ServerField::Drain(true),
                }
            }
            "check" => ServerField::Check(
                match w.next("tcp, http PATH [STATUS], grpc [SERVICE], off or default")? {
                    "off" => ServerCheck::Off,
                    "default" => ServerCheck::Inherit,
                    kind => ServerCheck::Probe(parse_probe(w, kind)?),
                },
            ),
            "proxy_protocol" => {
                ServerField::ProxyProtocol(match w.next("v1, v2, off or global")? {
                    "off" => ServerProxy::Off,
                    "global" => ServerProxy::Global,
                    v => ServerProxy::On(proxy_version(v)?),
                })
            }
            other => {
                return Err(ParseError::Invalid {
                    command: "server",
                    what: "field",
                    value: other.into(),
                })
            }
        };
        fields.push(field);
    }
    if fields.is_empty() {
        return Err(ParseError::Missing {
            command: "server",
            what: "a field (acl, address, port, max, hard, weight, prio, blacklist, drain, check, proxy_protocol)",
        });
    }
    Ok(Command::Server { index, fields })
}

/// The fields of a `server` command; a word after `check grpc` that is one of them starts
/// the next field rather than naming a service.
const SERVER_FIELDS: [&str; 11] = [
    "acl",
    "address",
    "port",
    "max",
    "hard",
    "weight",
    "prio",
    "blacklist",
    "drain",
    "check",
    "proxy_protocol",
];

/// `tcp`, `http PATH [STATUS]` or `grpc [SERVICE]`, after the word `kind`. The status is
/// optional: it is taken when the next word is a number (field names and commands never
/// are); so is the service: taken unless the next word is a server field's name.
fn parse_probe(w: &mut Words<'_>, kind: &str) -> Result<Probe, ParseError> {
    let command = w.command;
    match kind {
        "tcp" => Ok(Probe::Tcp),
        "http" => {
            let path = w.word("a path")?;
            if !path.as_str().starts_with('/') {
                return Err(ParseError::Invalid {
                    command,
                    what: "path (starting with /)",
                    value: path.to_string(),
                });
            }
            let mut ahead = w.iter.clone();
            let status = match ahead.next() {
                Some(word) if word.bytes().all(|b| b.is_ascii_digit()) => {
                    w.iter = ahead;
                    match word.parse::<u16>() {
                        Ok(s @ 100..=599) => Some(s),
                        _ => {
                            return Err(ParseError::Invalid {
                                command,
                                what: "HTTP status (100-599)",
                                value: word.to_string(),
                            })
                        }
                    }
                }
                _ => None,
            };
            Ok(Probe::Http { path, status })
        }
        "grpc" => {
            let mut ahead = w.iter.clone();
            let service = match ahead.next() {
                Some(word) if !SERVER_FIELDS.contains(&word) => {
                    w.iter = ahead;
                    Some(Word::new(word).ok_or_else(|| ParseError::Invalid {
                        command,
                        what: "gRPC service name",
                        value: word.to_string(),
                    })?)
                }
                _ => None,
            };
            Ok(Probe::Grpc { service })
        }
        other => Err(ParseError::Invalid {
            command,
            what: "check (tcp, http or grpc)",
            value: other.to_string(),
        }),
    }
}

fn parse_acl(w: &mut Words<'_>) -> Result<Command, ParseError> {
    let list = w.acl_id()?;
    let action = match w.next("permit or deny")? {
        "permit" => AclAction::Permit,
        "deny" => AclAction::Deny,
        other => {
            return Err(ParseError::Invalid {
                command: "acl",
                what: "action (permit or deny)",
                value: other.into(),
            })
        }
    };
    let addr = w.next("an address")?;
    let invalid = |what, v: &str| ParseError::Invalid {
        command: "acl",
        what,
        value: v.to_string(),
    };
    let matcher = if addr == "country" {
        let cc = w.next("a two-letter country code")?;
        let bytes = cc.as_bytes();
        if bytes.len() != 2 || !bytes.iter().all(u8::is_ascii_alphabetic) {
            return Err(invalid("country code", cc));
        }
        AclMatch::Country([bytes[0].to_ascii_uppercase(), bytes[1].to_ascii_uppercase()])
    } else if addr.contains(':') {
        let (ip, len) = match addr.split_once('/') {
            Some((ip, len)) => (ip, parse_number::<u8>("acl", "prefix length", len)?),
            None => (addr, 128),
        };
        if len > 128 {
            return Err(invalid("prefix length (0-128)", addr));
        }
        let ip: Ipv6Addr = ip.parse().map_err(|_| invalid("IPv6 address", addr))?;
        AclMatch::V6 {
            addr: ip,
            prefix: len,
        }
    } else {
        let ip: Ipv4Addr = addr.parse().map_err(|_| invalid("IPv4 address", addr))?;
        let mask = match w.iter.next() {
            Some(m) => m.parse::<Ipv4Addr>().map_err(|_| invalid("IPv4 mask", m))?,
            None => Ipv4Addr::BROADCAST,
        };
        AclMatch::V4 { addr: ip, mask }
    };
    Ok(Command::Acl {
        list,
        rule: AclRule { action, matcher },
    })
}

fn on_off(f: &mut fmt::Formatter<'_>, on: bool, word: &str) -> fmt::Result {
    if on {
        f.write_str(word)
    } else {
        write!(f, "no {word}")
    }
}

fn with_optional<T: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    word: &str,
    v: &Option<T>,
) -> fmt::Result {
    match v {
        Some(v) => write!(f, "{word} {v}"),
        None => f.write_str(word),
    }
}

/// `word VALUE` when set, `no word` when not.
/// Whether `name` can be a Linux interface name: 1-15 bytes, no '/' (they are sysfs file
/// names).
fn is_interface_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 15 && !name.contains('/')
}

fn optional_or_no<T: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    word: &str,
    v: &Option<T>,
) -> fmt::Result {
    match v {
        Some(v) => write!(f, "{word} {v}"),
        None => write!(f, "no {word}"),
    }
}

impl fmt::Display for ServerField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServerField::Acl(a) => write!(f, "acl {a}"),
            ServerField::Address(h) => write!(f, "address {h}"),
            ServerField::Port(p) => write!(f, "port {p}"),
            ServerField::Max(m) => write!(f, "max {m}"),
            ServerField::Hard(h) => write!(f, "hard {h}"),
            ServerField::Weight(w) => write!(f, "weight {w}"),
            ServerField::Prio(p) => write!(f, "prio {p}"),
            ServerField::Blacklist(t) => write!(f, "blacklist {t}"),
            ServerField::Drain(true) => f.write_str("drain"),
            ServerField::Drain(false) => f.write_str("drain 0"),
            ServerField::Check(c) => write!(f, "check {c}"),
            ServerField::ProxyProtocol(ServerProxy::Global) => f.write_str("proxy_protocol global"),
            ServerField::ProxyProtocol(ServerProxy::Off) => f.write_str("proxy_protocol off"),
            ServerField::ProxyProtocol(ServerProxy::On(v)) => {
                write!(f, "proxy_protocol {}", v.word())
            }
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Command::Server { index, fields } => {
                write!(f, "server {index}")?;
                for field in fields {
                    write!(f, " {field}")?;
                }
                Ok(())
            }
            Command::RoundRobin(on) => on_off(f, *on, "roundrobin"),
            Command::Hash(on) => on_off(f, *on, "hash"),
            Command::HashOnly(on) => on_off(f, *on, "hash_only"),
            Command::Stubborn(on) => on_off(f, *on, "stubborn"),
            Command::Weight(on) => on_off(f, *on, "weight"),
            Command::Prio(on) => on_off(f, *on, "prio"),
            Command::Tracking(v) => with_optional(f, "tracking", v),
            Command::Blacklist(v) => with_optional(f, "blacklist", v),
            Command::Timeout(v) => with_optional(f, "timeout", v),
            Command::ConnMax(v) => with_optional(f, "conn_max", v),
            Command::ClientsMax(v) => with_optional(f, "clients_max", v),
            Command::Acl { list, rule } => write!(f, "acl {list} {rule}"),
            Command::NoAcl(list) => write!(f, "no acl {list}"),
            Command::ClientAcl(list) => with_optional(f, "client_acl", list),
            Command::TcpNodelay(on) => on_off(f, *on, "tcp_nodelay"),
            Command::TcpFastclose(mode) => write!(f, "tcp_fastclose {}", mode.word()),
            Command::Keepalive(on) => on_off(f, *on, "keepalive"),
            Command::IdleTimeout(v) => with_optional(f, "idle_timeout", v),
            Command::IdlePark(n) => write!(f, "idle_park {n}"),
            Command::PollBeforeSleep(n) => write!(f, "poll_before_sleep {n}"),
            Command::DeferAccept(DeferAccept::Auto) => write!(f, "defer_accept auto"),
            Command::DeferAccept(DeferAccept::Seconds(n)) => write!(f, "defer_accept {n}"),
            Command::PendingMax(n) => write!(f, "pending_max {n}"),
            Command::Source(ip) => write!(f, "source {ip}"),
            Command::NoSource => f.write_str("no source"),
            Command::Dummy(on) => on_off(f, *on, "dummy"),
            Command::Debug(v) => with_optional(f, "debug", v),
            Command::EventEngine(e) => f.write_str(e.word()),
            Command::Compat(w, on) => on_off(f, *on, w.word()),
            Command::Emergency(Some(hp)) => write!(f, "emergency {hp}"),
            Command::Emergency(None) => f.write_str("no emergency"),
            Command::Abuse(Some(hp)) => write!(f, "abuse {hp}"),
            Command::Abuse(None) => f.write_str("no abuse"),
            Command::MultiAccept(n) => write!(f, "multi_accept {n}"),
            Command::Backlog(n) => write!(f, "backlog {n}"),
            Command::Workers(n) => write!(f, "workers {n}"),
            Command::UdpIdleTimeout(v) => with_optional(f, "udp_idle_timeout", v),
            Command::UdpResponses(v) => with_optional(f, "udp_responses", v),
            Command::Listen(a) => with_optional(f, "listen", a),
            Command::ControlAcl(list) => with_optional(f, "control_acl", list),
            Command::MetricsListen(a) => with_optional(f, "metrics_listen", a),
            Command::NoMetricsListen => f.write_str("no metrics_listen"),
            Command::Log(file) => with_optional(f, "log", file),
            Command::NoLog => f.write_str("no log"),
            Command::WebStats(file) => with_optional(f, "web_stats", file),
            Command::NoWebStats => f.write_str("no web_stats"),
            Command::AbortOnError(on) => on_off(f, *on, "abort_on_error"),
            Command::Servers => f.write_str("servers"),
            Command::Status(StatusFormat::Html) => f.write_str("status"),
            Command::Status(StatusFormat::Json) => f.write_str("status json"),
            Command::Mode => f.write_str("mode"),
            Command::Recent(n) => with_optional(f, "recent", n),
            Command::Connection(n) => write!(f, "connection {n}"),
            Command::Connections(n) => with_optional(f, "connections", n),
            Command::Close(n) => write!(f, "close {n}"),
            Command::Control => f.write_str("control"),
            Command::Pid => f.write_str("pid"),
            Command::Include(file) => write!(f, "include {file}"),
            Command::Write(file) => with_optional(f, "write", file),
            Command::Exit => f.write_str("exit"),
            Command::GeoipDb(file) => write!(f, "geoip_db {file}"),
            Command::SslCert(v) => optional_or_no(f, "ssl_cert", v),
            Command::SslKey(v) => optional_or_no(f, "ssl_key", v),
            Command::SslCa(v) => optional_or_no(f, "ssl_ca", v),
            Command::SslCaDir(v) => optional_or_no(f, "ssl_ca_dir", v),
            Command::SslVerifyClient(on) => on_off(f, *on, "ssl_verify_client"),
            Command::SslProtocol(p) => write!(f, "ssl_protocol {}", p.word()),
            Command::SslOption(o, true) => write!(f, "ssl_option {}", o.word()),
            Command::SslOption(o, false) => write!(f, "no ssl_option {}", o.word()),
            Command::SslCiphers(v) => optional_or_no(f, "ssl_ciphers", v),
            Command::SslSniPath(v) => optional_or_no(f, "ssl_sni_path", v),
            Command::SslOcspResponse(v) => optional_or_no(f, "ssl_ocsp_response", v),
            Command::SslClientRenegotiationInterval(n) => {
                write!(f, "ssl_client_renegotiation_interval {n}")
            }
            Command::UpstreamTls(on) => on_off(f, *on, "upstream_tls"),
            Command::UpstreamCa(v) => optional_or_no(f, "upstream_ca", v),
            Command::UpstreamSni(v) => optional_or_no(f, "upstream_sni", v),
            Command::Check(Some(p)) => write!(f, "check {p}"),
            Command::Check(None) => f.write_str("no check"),
            Command::CheckInterval(d) => write!(f, "check_interval {d}"),
            Command::CheckTimeout(d) => write!(f, "check_timeout {d}"),
            Command::CheckRise(n) => write!(f, "check_rise {n}"),
            Command::CheckFall(n) => write!(f, "check_fall {n}"),
            Command::SlowStart(n) => write!(f, "slow_start {n}"),
            Command::ShutdownGrace(n) => write!(f, "shutdown_grace {n}"),
            Command::AnnounceTable(Some(n)) => write!(f, "announce_table {n}"),
            Command::AnnounceTable(None) => f.write_str("no announce_table"),
            Command::AnnounceGrace(n) => write!(f, "announce_grace {n}"),
            Command::Health => f.write_str("health"),
            Command::NodeDrain(true) => f.write_str("drain"),
            Command::NodeDrain(false) => f.write_str("drain 0"),
            Command::DsrIf(name) => write!(f, "dsr_if {name}"),
            Command::DsrPath(path) => write!(f, "dsr_path {}", path.word()),
            Command::UdpOffload(v) => optional_or_no(f, "udp_offload", v),
            Command::TarpitAcl(list) => with_optional(f, "tarpit_acl", list),
            Command::NoTarpitAcl => f.write_str("no tarpit_acl"),
            Command::Transparent(on) => on_off(f, *on, "transparent"),
            Command::Http(on) => on_off(f, *on, "http"),
            Command::HttpHeaderMax(n) => with_optional(f, "http_header_max", n),
            Command::Alpn(None) => f.write_str("no alpn"),
            Command::Alpn(Some(list)) => {
                f.write_str("alpn ")?;
                for (i, p) in list.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    f.write_str(p.word())?;
                }
                Ok(())
            }
            Command::H2c(on) => on_off(f, *on, "h2c"),
            Command::AccessLog(Some(file)) => write!(f, "access_log {file}"),
            Command::AccessLog(None) => f.write_str("no access_log"),
            Command::H2MaxStreams(n) => write!(f, "h2_max_streams {n}"),
            Command::UpstreamKeepalive(n) => write!(f, "upstream_keepalive {n}"),
            Command::UpstreamIdleTimeout(n) => write!(f, "upstream_idle_timeout {n}"),
            Command::QueueTimeout(n) => write!(f, "queue_timeout {n}"),
            Command::QueueMax(n) => write!(f, "queue_max {n}"),
            Command::UpstreamMaxRequests(n) => write!(f, "upstream_max_requests {n}"),
            Command::UpstreamH2(on) => on_off(f, *on, "upstream_h2"),
            Command::HttpRequestTimeout(n) => with_optional(f, "http_request_timeout", n),
            Command::Hsts(Some(h)) => write!(f, "hsts {h}"),
            Command::Hsts(None) => f.write_str("no hsts"),
            Command::ProxyProtocol(Some(v)) => write!(f, "proxy_protocol {}", v.word()),
            Command::ProxyProtocol(None) => f.write_str("no proxy_protocol"),
            Command::AcceptProxy(on) => on_off(f, *on, "accept_proxy"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Command, ParseError> {
        s.parse()
    }

    #[test]
    fn hsts_header_value_names_each_directive_asked_for() {
        let mut h = Hsts {
            max_age: 600,
            include_subdomains: false,
            preload: false,
        };
        assert_eq!(h.header_value().to_string(), "max-age=600");
        h.include_subdomains = true;
        h.preload = true;
        assert_eq!(
            h.header_value().to_string(),
            "max-age=600; includeSubDomains; preload"
        );
    }

    /// `SERVER_FIELDS` (which ends a `check grpc` service name) and the message for a
    /// `server` command without fields name exactly the fields `parse_server` knows.
    #[test]
    fn server_fields_list_is_the_parsers() {
        let is_unknown_field = |r: &Result<Command, ParseError>| {
            matches!(r, Err(ParseError::Invalid { what: "field", .. }))
        };
        for field in SERVER_FIELDS {
            let r = parse(&format!("server 0 {field}"));
            assert!(!is_unknown_field(&r), "{field}: {r:?}");
        }
        assert!(is_unknown_field(&parse("server 0 service")));
        let Err(ParseError::Missing { what, .. }) = parse("server 0") else {
            panic!("a server command without fields parsed");
        };
        assert_eq!(what, format!("a field ({})", SERVER_FIELDS.join(", ")));
    }

    /// As a server spec writes it (`[::1]:80`): the control socket takes `[::1]` too.
    #[test]
    fn an_ipv6_address_in_brackets_is_the_address() {
        assert_eq!(
            parse("server 1 address [::1]").unwrap().to_string(),
            "server 1 address ::1"
        );
    }

    #[test]
    fn server_fields_parse_in_order() {
        let c = parse(
            "server 2 address 10.0.0.1 port 80 max 10 hard 20 weight 3 prio 1 acl 4 blacklist 0",
        );
        assert_eq!(
            c,
            Ok(Command::Server {
                index: 2,
                fields: vec![
                    ServerField::Address(Host("10.0.0.1".into())),
                    ServerField::Port(80),
                    ServerField::Max(10),
                    ServerField::Hard(20),
                    ServerField::Weight(3),
                    ServerField::Prio(1),
                    ServerField::Acl(AclId::new(4).unwrap_or_default()),
                    ServerField::Blacklist(0),
                ]
            })
        );
    }

    #[test]
    fn acl_defaults_mask_and_prefix() {
        let Ok(Command::Acl { rule, .. }) = parse("acl 1 deny 10.1.2.3") else {
            panic!("no acl")
        };
        assert_eq!(
            rule.matcher,
            AclMatch::V4 {
                addr: Ipv4Addr::new(10, 1, 2, 3),
                mask: Ipv4Addr::BROADCAST
            }
        );
        let Ok(Command::Acl { rule, .. }) = parse("acl 1 permit ::1") else {
            panic!("no acl")
        };
        assert_eq!(
            rule.matcher,
            AclMatch::V6 {
                addr: Ipv6Addr::LOCALHOST,
                prefix: 128
            }
        );
    }

    #[test]
    fn errors_name_the_offending_word() {
        assert_eq!(
            parse("frobnicate 3"),
            Err(ParseError::Unknown("frobnicate".into()))
        );
        assert!(parse("server 0 max abc")
            .unwrap_err()
            .to_string()
            .contains("abc"));
        assert!(parse("acl 10 deny 1.2.3.4")
            .unwrap_err()
            .to_string()
            .contains("10"));
        assert!(parse("timeout 5 6").unwrap_err().to_string().contains('6'));
        assert!(parse("tracking -1").unwrap_err().to_string().contains("-1"));
        assert_eq!(parse("   "), Err(ParseError::Empty));
        assert!(parse("server 0 address 300.1.1.1").is_err());
        assert!(parse("server 0 address [::1").is_err());
        assert!(parse("server 0 address [10.0.0.1]").is_err());
        assert!(parse("no timeout").is_err());
        assert!(parse("defer_accept 601")
            .unwrap_err()
            .to_string()
            .contains("601"));
        assert!(parse("defer_accept soon").is_err());
    }

    #[test]
    fn every_name_has_a_parse_rule() {
        let mut seen = std::collections::HashSet::new();
        for name in NAMES {
            assert!(seen.insert(name), "'{name}' is listed twice in NAMES");
            // Without arguments a command parses or names a missing or invalid argument;
            // only a word without a rule falls through to Unknown.
            let mut w = Words {
                command: name,
                iter: "".split_whitespace(),
            };
            let result = parse_positive(name, &mut w);
            assert!(
                !matches!(result, Err(ParseError::Unknown(_))),
                "'{name}' is in NAMES but parse_positive has no rule for it"
            );
        }
    }

    #[test]
    fn host_port_forms() {
        assert_eq!(split_host_port("[::1]:80"), Ok(("::1", Some("80"))));
        assert_eq!(split_host_port("::1"), Ok(("::1", None)));
        assert_eq!(split_host_port(":::8080"), Ok(("::", Some("8080"))));
        assert_eq!(split_host_port("a.b:9"), Ok(("a.b", Some("9"))));
        assert_eq!(
            HostPort::parse("[::1]:80", None).map(|h| h.to_string()),
            Ok("[::1]:80".into())
        );
        assert!(HostPort::parse("h:0", None).is_err());
        assert!(HostPort::parse("h:65536", None).is_err());
    }
}

#[cfg(test)]
mod roundtrip {
    //! Property: printing a command and parsing it back gives the same command.
    use super::*;
    use proptest::prelude::*;

    fn acl_id() -> impl Strategy<Value = AclId> {
        (0u8..10).prop_map(|n| AclId::new(n).unwrap_or_default())
    }

    fn host() -> impl Strategy<Value = Host> {
        prop_oneof![
            any::<[u8; 4]>().prop_map(|b| Host::from(IpAddr::from(b))),
            any::<[u16; 8]>().prop_map(|s| Host::from(IpAddr::from(Ipv6Addr::from(s)))),
            "[a-z][a-z0-9-]{0,10}(\\.[a-z][a-z0-9]{0,5}){0,3}".prop_map(Host),
        ]
    }

    fn word() -> impl Strategy<Value = Word> {
        "[a-zA-Z0-9/._:\\[\\]-]{1,30}"
            .prop_map(|w| Word::new(&w).unwrap_or_else(|| Word("x".into())))
    }

    fn host_port() -> impl Strategy<Value = HostPort> {
        (host(), 1u16..).prop_map(|(host, port)| HostPort { host, port })
    }

    fn acl_rule() -> impl Strategy<Value = AclRule> {
        let action = prop_oneof![Just(AclAction::Permit), Just(AclAction::Deny)];
        let matcher = prop_oneof![
            (any::<[u8; 4]>(), any::<[u8; 4]>()).prop_map(|(a, m)| AclMatch::V4 {
                addr: a.into(),
                mask: m.into()
            }),
            (any::<[u16; 8]>(), 0u8..=128).prop_map(|(a, p)| AclMatch::V6 {
                addr: a.into(),
                prefix: p
            }),
            "[A-Z]{2}".prop_map(|c| {
                let b = c.as_bytes();
                AclMatch::Country([b[0], b[1]])
            }),
        ];
        (action, matcher).prop_map(|(action, matcher)| AclRule { action, matcher })
    }

    fn server_field() -> impl Strategy<Value = ServerField> {
        prop_oneof![
            acl_id().prop_map(ServerField::Acl),
            host().prop_map(ServerField::Address),
            (1u16..).prop_map(ServerField::Port),
            any::<u32>().prop_map(ServerField::Max),
            any::<u32>().prop_map(ServerField::Hard),
            any::<u32>().prop_map(ServerField::Weight),
            any::<u32>().prop_map(ServerField::Prio),
            any::<u64>().prop_map(ServerField::Blacklist),
            any::<bool>().prop_map(ServerField::Drain),
            prop_oneof![
                Just(ServerCheck::Inherit),
                Just(ServerCheck::Off),
                probe().prop_map(ServerCheck::Probe),
            ]
            .prop_map(ServerField::Check),
            prop_oneof![
                Just(ServerProxy::Global),
                Just(ServerProxy::Off),
                Just(ServerProxy::On(ProxyVersion::V1)),
                Just(ServerProxy::On(ProxyVersion::V2)),
            ]
            .prop_map(ServerField::ProxyProtocol),
        ]
    }

    fn probe() -> impl Strategy<Value = Probe> {
        prop_oneof![
            Just(Probe::Tcp),
            (
                "/[a-zA-Z0-9/._?=&%-]{0,30}",
                proptest::option::of(100u16..600)
            )
                .prop_map(|(p, status)| Probe::Http {
                    path: Word::new(&p).unwrap_or_else(|| Word("/".into())),
                    status
                }),
            proptest::option::of("[a-z][a-zA-Z0-9._]{0,30}").prop_map(|name| Probe::Grpc {
                service: name
                    .and_then(|n| Word::new(&n))
                    .filter(|w| { !super::SERVER_FIELDS.contains(&w.as_str()) })
            }),
        ]
    }

    fn command() -> impl Strategy<Value = Command> {
        prop_oneof![
            (0..MAX_SERVERS, prop::collection::vec(server_field(), 1..6))
                .prop_map(|(index, fields)| Command::Server { index, fields }),
            any::<bool>().prop_map(Command::RoundRobin),
            any::<bool>().prop_map(Command::Hash),
            any::<bool>().prop_map(Command::HashOnly),
            any::<bool>().prop_map(Command::Stubborn),
            any::<bool>().prop_map(Command::Weight),
            any::<bool>().prop_map(Command::Prio),
            any::<Option<u64>>().prop_map(Command::Tracking),
            any::<Option<u64>>().prop_map(Command::Blacklist),
            proptest::option::of(1u64..).prop_map(Command::Timeout),
            any::<Option<usize>>().prop_map(Command::ConnMax),
            any::<Option<usize>>().prop_map(Command::ClientsMax),
            (acl_id(), acl_rule()).prop_map(|(list, rule)| Command::Acl { list, rule }),
            acl_id().prop_map(Command::NoAcl),
            proptest::option::of(acl_id()).prop_map(Command::ClientAcl),
            any::<bool>().prop_map(Command::TcpNodelay),
            prop_oneof![
                Just(FastClose::Off),
                Just(FastClose::Up),
                Just(FastClose::Down),
                Just(FastClose::Both)
            ]
            .prop_map(Command::TcpFastclose),
            any::<bool>().prop_map(Command::Keepalive),
            proptest::option::of(any::<u64>()).prop_map(Command::IdleTimeout),
            any::<u64>().prop_map(Command::IdlePark),
            (0..=MAX_POLL_BEFORE_SLEEP_MICROS).prop_map(Command::PollBeforeSleep),
            prop_oneof![
                Just(DeferAccept::Auto),
                (0..=DeferAccept::MAX_SECONDS).prop_map(DeferAccept::Seconds)
            ]
            .prop_map(Command::DeferAccept),
            (1usize..).prop_map(Command::PendingMax),
            any::<IpAddr>().prop_map(Command::Source),
            Just(Command::NoSource),
            any::<bool>().prop_map(Command::Dummy),
            any::<Option<u32>>().prop_map(Command::Debug),
            prop_oneof![
                Just(EventEngine::Epoll),
                Just(EventEngine::Poll),
                Just(EventEngine::Select),
                Just(EventEngine::Kqueue)
            ]
            .prop_map(Command::EventEngine),
            (
                prop_oneof![
                    Just(CompatWord::Block),
                    Just(CompatWord::DelayedForward),
                    Just(CompatWord::Ascii),
                    Just(CompatWord::SslCompat)
                ],
                any::<bool>()
            )
                .prop_map(|(w, on)| Command::Compat(w, on)),
            proptest::option::of(host_port()).prop_map(Command::Emergency),
            proptest::option::of(host_port()).prop_map(Command::Abuse),
            (1usize..).prop_map(Command::MultiAccept),
            any::<u32>().prop_map(Command::Backlog),
            any::<usize>().prop_map(Command::Workers),
            proptest::option::of(1u64..).prop_map(Command::UdpIdleTimeout),
            any::<Option<u32>>().prop_map(Command::UdpResponses),
            proptest::option::of(word()).prop_map(Command::Listen),
            proptest::option::of(acl_id()).prop_map(Command::ControlAcl),
            proptest::option::of(word()).prop_map(Command::MetricsListen),
            Just(Command::NoMetricsListen),
            proptest::option::of(word()).prop_map(Command::Log),
            Just(Command::NoLog),
            proptest::option::of(word()).prop_map(Command::WebStats),
            Just(Command::NoWebStats),
            any::<bool>().prop_map(Command::AbortOnError),
            Just(Command::Servers),
            prop_oneof![Just(StatusFormat::Html), Just(StatusFormat::Json)]
                .prop_map(Command::Status),
            Just(Command::Mode),
            any::<Option<u64>>().prop_map(Command::Recent),
            any::<u64>().prop_map(Command::Connection),
            any::<Option<u64>>().prop_map(Command::Connections),
            any::<u64>().prop_map(Command::Close),
            Just(Command::Control),
            Just(Command::Pid),
            word().prop_map(Command::Include),
            proptest::option::of(word()).prop_map(Command::Write),
            Just(Command::Exit),
            word().prop_map(Command::GeoipDb),
            proptest::option::of(probe()).prop_map(Command::Check),
            (1u64..u64::MAX / 1000).prop_map(|m| Command::CheckInterval(Millis(m))),
            (1u64..u64::MAX / 1000).prop_map(|m| Command::CheckTimeout(Millis(m))),
            (1u32..).prop_map(Command::CheckRise),
            (1u32..).prop_map(Command::CheckFall),
            any::<u64>().prop_map(Command::SlowStart),
            any::<u64>().prop_map(Command::ShutdownGrace),
            proptest::option::of(prop_oneof![1u32..253, 256u32..=u32::MAX])
                .prop_map(Command::AnnounceTable),
            any::<u64>().prop_map(Command::AnnounceGrace),
            Just(Command::Health),
            any::<bool>().prop_map(Command::NodeDrain),
            "[a-z][a-z0-9.-]{0,14}".prop_map(|w| Command::DsrIf(Word(w))),
            proptest::option::of("[a-z][a-z0-9.-]{0,14}(,[a-z][a-z0-9.-]{0,14}){0,2}")
                .prop_map(|w| Command::UdpOffload(w.map(Word))),
            prop_oneof![
                Just(DsrPath::Auto),
                Just(DsrPath::Xdp),
                Just(DsrPath::Packet)
            ]
            .prop_map(Command::DsrPath),
            proptest::option::of(acl_id()).prop_map(Command::TarpitAcl),
            Just(Command::NoTarpitAcl),
            any::<bool>().prop_map(Command::Transparent),
            any::<bool>().prop_map(Command::Http),
            proptest::option::of(256usize..).prop_map(Command::HttpHeaderMax),
            proptest::option::of(any::<u64>()).prop_map(Command::HttpRequestTimeout),
            proptest::option::of((any::<u64>(), any::<bool>(), any::<bool>()).prop_map(
                |(max_age, include_subdomains, preload)| Hsts {
                    max_age,
                    include_subdomains,
                    preload
                }
            ))
            .prop_map(Command::Hsts),
            proptest::option::of(prop_oneof![Just(ProxyVersion::V1), Just(ProxyVersion::V2)])
                .prop_map(Command::ProxyProtocol),
            any::<bool>().prop_map(Command::AcceptProxy),
            proptest::option::of(prop_oneof![
                Just(vec![Alpn::H2]),
                Just(vec![Alpn::Http11]),
                Just(vec![Alpn::H2, Alpn::Http11]),
                Just(vec![Alpn::Http11, Alpn::H2]),
            ])
            .prop_map(Command::Alpn),
            any::<bool>().prop_map(Command::H2c),
            proptest::option::of(word()).prop_map(Command::AccessLog),
            (1u32..).prop_map(Command::H2MaxStreams),
            any::<u32>().prop_map(Command::UpstreamKeepalive),
            any::<u64>().prop_map(Command::UpstreamIdleTimeout),
            any::<u64>().prop_map(Command::QueueTimeout),
            any::<u64>().prop_map(Command::QueueMax),
            any::<u64>().prop_map(Command::UpstreamMaxRequests),
            any::<bool>().prop_map(Command::UpstreamH2),
            tls_command(),
        ]
    }

    fn tls_command() -> impl Strategy<Value = Command> {
        let option = prop_oneof![
            Just(SslOption::NoSslv2),
            Just(SslOption::NoSslv3),
            Just(SslOption::NoTlsv1),
            Just(SslOption::NoTlsv11),
            Just(SslOption::NoTlsv12),
            Just(SslOption::CipherServerPreference),
        ];
        prop_oneof![
            proptest::option::of(word()).prop_map(Command::SslCert),
            proptest::option::of(word()).prop_map(Command::SslKey),
            proptest::option::of(word()).prop_map(Command::SslCa),
            proptest::option::of(word()).prop_map(Command::SslCaDir),
            any::<bool>().prop_map(Command::SslVerifyClient),
            prop_oneof![
                Just(SslProtocol::Any),
                Just(SslProtocol::Tls12),
                Just(SslProtocol::Tls13)
            ]
            .prop_map(Command::SslProtocol),
            (option, any::<bool>()).prop_map(|(o, on)| Command::SslOption(o, on)),
            proptest::option::of(word()).prop_map(Command::SslCiphers),
            proptest::option::of(word()).prop_map(Command::SslSniPath),
            proptest::option::of(word()).prop_map(Command::SslOcspResponse),
            any::<u64>().prop_map(Command::SslClientRenegotiationInterval),
            any::<bool>().prop_map(Command::UpstreamTls),
            proptest::option::of(word()).prop_map(Command::UpstreamCa),
            proptest::option::of(host()).prop_map(Command::UpstreamSni),
        ]
    }

    proptest! {
        #[test]
        fn print_then_parse_is_identity(cmd in command()) {
            let line = cmd.to_string();
            prop_assert_eq!(line.parse::<Command>(), Ok(cmd), "line: {}", line);
        }

        #[test]
        fn arbitrary_lines_never_panic(line in "\\PC{0,80}") {
            let _ = line.parse::<Command>();
        }
    }
}
