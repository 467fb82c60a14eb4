//! Prometheus metrics (`/metrics` of the metrics listener), read from the shared state on
//! each scrape: the data plane keeps counting in its own atomics and never learns that it
//! is observed. Nothing here changes anything.
//!
//! Every family is one row of [`FAMILIES`] (name, help, type, and how to read its value), so
//! a new counter in `State` or in a server's state is exported by adding one row.

use std::borrow::Cow;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use crate::balance::servers::{Answers, Condition};
use crate::balance::{clock, ServerState};
use crate::proxy::{poll_before_sleep, polling};
use crate::state::{DsrCounters, State};
use crate::tls::Certificate;

/// The content type of [`encode`]'s output (OpenMetrics text, which Prometheus asks for).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of [`to_text_format`]'s output: Prometheus's own text format, served
/// to clients that do not ask for OpenMetrics (curl, `promtool check metrics`), as the
/// Prometheus client libraries do.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header asks for OpenMetrics (Prometheus does, with a higher q than
/// the text format; a media range of q=0 refuses it).
pub fn wants_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|range| {
        let mut parts = range.split(';').map(str::trim);
        let media = parts.next().unwrap_or_default();
        media.eq_ignore_ascii_case("application/openmetrics-text")
            && !parts.any(|p| {
                p.strip_prefix("q=")
                    .and_then(|q| q.parse::<f32>().ok())
                    .is_some_and(|q| q <= 0.0)
            })
    })
}

/// Rewrites [`encode`]'s OpenMetrics text in the Prometheus text format 0.0.4: a counter
/// family is named with its `_total` suffix in `# HELP` and `# TYPE` (OpenMetrics names the
/// family without it), and `# UNIT` and `# EOF` lines, which 0.0.4 does not have, go.
/// Samples are the same in both formats.
pub fn to_text_format(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                out.push_str(prefix);
                out.push_str(name);
                if counters.contains(name) && !name.ends_with("_total") {
                    out.push_str("_total");
                }
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Whether a family only grows (a counter, exported as `NAME_total`) or goes up and down.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Counter,
    Gauge,
}

/// Reads one value of the whole process.
pub type Reader = fn(&State) -> u64;

/// Where a family's values come from.
#[derive(Debug, Clone, Copy)]
pub enum Source {
    /// One value for the whole process.
    Global(Reader),
    /// One value per value of `label` (e.g. the reasons a connection was refused).
    ByLabel {
        label: &'static str,
        values: &'static [(&'static str, Reader)],
    },
    /// One value per server in use, labelled `server` (its number) and `address`.
    PerServer(fn(&ServerState) -> u64),
    /// With `http` only: one value per server in use and answer status class, labelled
    /// `server`, `address` and `code` (`2xx`...).
    PerServerAnswers,
    /// With `http` only: as `PerServer`.
    PerServerHttp(fn(&ServerState) -> u64),
    /// One value for the process, from a part that may not run (e.g. the DSR plane): the
    /// family is left out when the reader gives `None`.
    IfRunning(fn(&State) -> Option<u64>),
    /// One value per certificate quill serves (TLS termination), labelled `file` (its PEM
    /// file) and `sni` (the name it is served for, empty for the default certificate).
    PerCertificate(fn(&Certificate) -> u64),
}

/// One metric family.
#[derive(Debug)]
pub struct Family {
    /// Name without the `quill_` prefix (and, for counters, without `_total`).
    pub name: &'static str,
    pub help: &'static str,
    pub unit: Option<Unit>,
    pub kind: Kind,
    pub source: Source,
}

fn load(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(Relaxed)
}

/// A DSR counter, when the DSR plane runs.
fn dsr(s: &State, read: fn(&DsrCounters) -> &std::sync::atomic::AtomicU64) -> Option<u64> {
    s.dsr.get().map(|c| load(read(c)))
}

/// The exported families besides `server_state` (which is a state set, see [`Metrics`]).
pub static FAMILIES: &[Family] = &[
    Family {
        name: "connections_accepted",
        help: "Client connections (UDP: new flows) accepted, including those then refused.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.accepted)),
    },
    Family {
        name: "connections_refused",
        help: "Client connections (UDP: flows) refused, by reason: the client ACL, conn_max, \
               no server (nor emergency server) reachable, or a missing or malformed PROXY \
               protocol header (accept_proxy).",
        unit: None,
        kind: Kind::Counter,
        source: Source::ByLabel {
            label: "reason",
            values: &[
                ("acl", |s| load(&s.counters.refused_acl)),
                ("conn_max", |s| load(&s.counters.refused_conn_max)),
                ("no_server", |s| load(&s.counters.no_server)),
                ("proxy_header", |s| load(&s.counters.bad_proxy_header)),
            ],
        },
    },
    Family {
        name: "udp_flows_evicted",
        help: "UDP flows ended to make room for new clients when conn_max flows were open \
               (flows waiting for no answer, the oldest first).",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.udp_evicted)),
    },
    Family {
        name: "udp_flows_answered",
        help: "UDP flows ended once their server had sent udp_responses datagrams for each \
               of their client's.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.udp_answered)),
    },
    Family {
        name: "udp_sockets_reused",
        help: "New UDP flows served by the socket of a flow that ended answered \
               (udp_responses), instead of a new one.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.udp_reused)),
    },
    Family {
        name: "udp_flows_offloaded",
        help: "UDP flows handed to the kernel path (udp_offload) once answered twice.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.udp_offloaded)),
    },
    Family {
        name: "udp_flows_placed",
        help: "New UDP flows the kernel path (udp_offload with udp_responses) placed on a \
               server itself, without waking quill.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.udp_placed)),
    },
    Family {
        name: "udp_flows_carried",
        help: "UDP flows the kernel path (udp_offload) carries now, without waking quill.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| load(&s.counters.udp_carried)),
    },
    Family {
        name: "tls_handshakes",
        help: "TLS handshakes with clients (when quill terminates TLS), by result: completed, \
               or failed (protocol or certificate refused, timeout, reset).",
        unit: None,
        kind: Kind::Counter,
        source: Source::ByLabel {
            label: "result",
            values: &[
                ("ok", |s| load(&s.counters.tls_handshakes)),
                ("failed", |s| load(&s.counters.tls_failures)),
            ],
        },
    },
    Family {
        name: "upstream_tls_handshake_failures",
        help: "TLS handshakes with servers (upstream_tls) that failed: certificate not \
               verified, wrong name, protocol, timeout. Each also counts as a failed connect.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.upstream_tls_failures)),
    },
    Family {
        name: "http_requests_refused",
        help: "HTTP requests (http, -H) answered by quill with 400, 408 or 431, their \
               connection then closed.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.http_refused)),
    },
    Family {
        name: "http_bad_answers",
        help: "Answers of HTTP/1.x servers (http, -H) that quill could not frame (two \
               Content-Length values, one that is no number, bytes that are no answer over a \
               reused connection), replaced by its 502 and the server connection closed.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.http_bad_answers)),
    },
    Family {
        name: "http_request_timeouts",
        help: "HTTP connections (http, -H) closed because a request head did not arrive \
               whole within http_request_timeout (408 after part of one, else no answer).",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.http_request_timeouts)),
    },
    Family {
        name: "h2_connections",
        help: "HTTP/2 client connections (http, -H: ALPN h2 or h2c), each served request by \
               request.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.h2_connections)),
    },
    Family {
        name: "h2_requests",
        help: "Requests (streams) of HTTP/2 clients.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.h2_requests)),
    },
    Family {
        name: "connections_open",
        help: "Client connections (UDP: flows) open now.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| s.active.load(Relaxed) as u64),
    },
    Family {
        name: "connections_max",
        help: "The connection limit in force (conn_max, -x): clients beyond it are refused \
               (connections_refused_total, reason conn_max).",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| s.settings().conn_max as u64),
    },
    Family {
        name: "listener_defer_accept",
        help: "How long the kernel holds a new client connection until its first bytes \
               arrive before quill accepts it (defer_accept; 0: accepted at once).",
        unit: Some(Unit::Seconds),
        kind: Kind::Gauge,
        source: Source::Global(|s| u64::from(s.settings().defer_accept_seconds())),
    },
    Family {
        name: "tls_certificate_expiry_timestamp",
        help: "When each certificate quill serves expires (its notAfter), in seconds since \
               the Unix epoch, as read at start-up or the last reload.",
        unit: Some(Unit::Seconds),
        kind: Kind::Gauge,
        source: Source::PerCertificate(|c| u64::try_from(c.not_after).unwrap_or(0)),
    },
    Family {
        name: "announced",
        help: "1 while quill's route for the service address is in the kernel table of \
               announce_table (BIRD or FRR announce it), 0 otherwise.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| u64::from(s.announced.load(Relaxed) != 0)),
    },
    Family {
        name: "connections_parked",
        help: "Of the open TCP connections, those parked while idle (idle_park): no task, \
               no reactor entry, only their session kept.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| s.parked.load(Relaxed) as u64),
    },
    Family {
        name: "upstream_connects_pending",
        help: "Connections to servers in progress now.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| s.pending.load(Relaxed) as u64),
    },
    Family {
        name: "queued",
        help: "Client connections (requests, with http) waiting now for a server at its max \
               to have room (queue_timeout).",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| load(&s.counters.queued)),
    },
    Family {
        name: "queue_timeouts",
        help: "Client connections (requests, with http) whose wait for a server with room \
               ran out (queue_timeout); each then went to the emergency server or was \
               refused (a refusal counts in connections_refused, reason no_server, too).",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.queue_timeouts)),
    },
    Family {
        name: "queue_full",
        help: "Client connections (requests, with http) that found every server they may \
               use full and queue_max clients waiting already: not let wait, each went to \
               the emergency server or was refused (a refusal counts in \
               connections_refused, reason no_server, too).",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.queue_full)),
    },
    Family {
        name: "queue_abandoned",
        help: "Client connections or requests (http: HTTP/1.x clients' and HTTP/2 \
               streams) whose client left while they waited in the queue for a server \
               with room (queue_timeout): never sent to a server.",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|s| load(&s.counters.queue_abandoned)),
    },
    Family {
        name: "clients_tracked",
        help: "Entries in the client tracking table.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|s| s.clients.len() as u64),
    },
    Family {
        name: "uptime",
        help: "Time since quill started.",
        unit: Some(Unit::Seconds),
        kind: Kind::Gauge,
        source: Source::Global(|s| s.started.elapsed().as_secs()),
    },
    Family {
        name: "log_lines_dropped",
        help: "Lines of the connection log, the access log and (in the foreground) stderr \
               dropped because their file was not taking them (4 MiB were waiting: a full \
               disk, a stalled pipe).",
        unit: None,
        kind: Kind::Counter,
        source: Source::Global(|_| crate::logfile::dropped()),
    },
    Family {
        name: "event_loops_polling",
        help: "Event loops busy-polling now instead of sleeping between events (a busy loop \
               polls only where its trials found that it pays; QUILL_BUSY_POLL in quill(1)).",
        unit: None,
        kind: Kind::Gauge,
        source: Source::Global(|_| load(&polling::STATS.polling)),
    },
    Family {
        name: "polling_trials",
        help: "Trials of busy polling against sleeping by busy event loops, by verdict: \
               polling kept, or sleeping.",
        unit: None,
        kind: Kind::Counter,
        source: Source::ByLabel {
            label: "verdict",
            values: &[
                ("poll", |_| load(&polling::STATS.trials_poll)),
                ("sleep", |_| load(&polling::STATS.trials_sleep)),
            ],
        },
    },
    Family {
        name: "poll_before_sleep_windows",
        help: "Windows in which an event loop that had just worked polled before sleeping \
               (poll_before_sleep), by outcome: an event came (a wake-up spared), or none \
               did and the loop slept.",
        unit: None,
        kind: Kind::Counter,
        source: Source::ByLabel {
            label: "outcome",
            values: &[
                ("caught", |_| load(&poll_before_sleep::STATS.caught)),
                ("missed", |_| load(&poll_before_sleep::STATS.missed)),
            ],
        },
    },
    Family {
        name: "server_connections_open",
        help: "Connections open to the server now.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::PerServer(|s| u64::from(s.conns.load(Relaxed))),
    },
    Family {
        name: "server_connections",
        help: "Connections made to the server.",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.total)),
    },
    Family {
        name: "server_requests",
        help: "Requests sent to the server one by one (http: HTTP/1.x clients' requests \
               over the pool, HTTP/2 clients' streams).",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.requests)),
    },
    Family {
        name: "server_requests_reused",
        help: "Of server_requests, those sent over a kept-alive connection an earlier \
               request had used (upstream_keepalive).",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.reused)),
    },
    Family {
        name: "server_http_responses",
        help: "Final answers of the server to HTTP requests (http, -H), by status class \
               (1xx: a 101 switching protocols; other: a status outside 100-599). quill's \
               own answers (502 for an answer it could not frame, 503, 504) are not counted.",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServerAnswers,
    },
    Family {
        name: "server_client_aborts",
        help: "Requests given to the server (http, -H) whose client left (closed or reset \
               its connection or HTTP/2 stream) before the answer had ended: before its \
               head (logged 499) or in its body (logged with the answer's status).",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServerHttp(|s| s.answers.abandoned()),
    },
    Family {
        name: "server_pool_connections",
        help: "Kept-alive connections to the server open now, busy or idle.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::PerServer(|s| u64::from(s.pool_open.load(Relaxed))),
    },
    Family {
        name: "server_pool_idle",
        help: "Kept-alive connections to the server idle in the pool now.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::PerServer(|s| u64::from(s.pool_idle.load(Relaxed))),
    },
    Family {
        name: "server_queued",
        help: "Client connections (requests, with http) waiting now for the server, at its \
               max, to have room (queue_timeout); one waiting for several full servers \
               counts at each.",
        unit: None,
        kind: Kind::Gauge,
        source: Source::PerServer(|s| u64::from(s.waiting())),
    },
    Family {
        name: "server_failures",
        help: "Failed attempts to connect to the server.",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.failures)),
    },
    Family {
        name: "server_checks_passed",
        help: "Active health checks of the server that passed.",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.checks_passed)),
    },
    Family {
        name: "server_checks_failed",
        help: "Active health checks of the server that failed.",
        unit: None,
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.checks_failed)),
    },
    Family {
        name: "server_sent",
        help: "Bytes relayed from clients to the server.",
        unit: Some(Unit::Bytes),
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.bytes_to)),
    },
    Family {
        name: "server_received",
        help: "Bytes relayed from the server to clients.",
        unit: Some(Unit::Bytes),
        kind: Kind::Counter,
        source: Source::PerServer(|s| load(&s.bytes_from)),
    },
    Family {
        name: "dsr_forwarded_frames",
        help: "DSR: frames forwarded to a server.",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.forwarded)),
    },
    Family {
        name: "dsr_no_server_frames",
        help: "DSR: frames for the virtual address dropped because no server was up.",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.no_backend)),
    },
    Family {
        name: "dsr_arp_replies",
        help: "DSR: ARP replies sent for the virtual address or a tarpitted address.",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.arp_replies)),
    },
    Family {
        name: "dsr_tarpit_synacks",
        help: "DSR: SYN+ACKs sent by the tarpit.",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.tarpit_synack)),
    },
    Family {
        name: "dsr_tarpit_dropped_frames",
        help: "DSR: other frames to tarpitted addresses, dropped.",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.tarpit_dropped)),
    },
    Family {
        name: "dsr_send_errors",
        help: "DSR: frames that could not be sent (buffer full, interface down).",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.send_errors)),
    },
    Family {
        name: "dsr_xdp_forwarded_frames",
        help: "DSR: frames the XDP program forwarded (counted in dsr_forwarded_frames too).",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.xdp_forwarded)),
    },
    Family {
        name: "dsr_xdp_mode",
        help: "DSR: how the XDP program forwards: 2 in the driver (native), 1 on the skb (generic), 0 not at all (the packet socket forwards).",
        unit: None,
        kind: Kind::Gauge,
        source: Source::IfRunning(|s| dsr(s, |c| &c.xdp_mode)),
    },
    Family {
        name: "dsr_servers_up",
        help: "DSR: servers the plane forwards to now (answering ARP, not blacklisted).",
        unit: None,
        kind: Kind::Gauge,
        source: Source::IfRunning(|s| dsr(s, |c| &c.backends_up)),
    },
    Family {
        name: "dsr_flows",
        help: "DSR: flows in the flow table (each keeps its server while the set of servers changes).",
        unit: None,
        kind: Kind::Gauge,
        source: Source::IfRunning(|s| dsr(s, |c| &c.flows)),
    },
    Family {
        name: "dsr_flows_unrecorded",
        help: "DSR: new flows the full flow table could not record (placed by consistent hashing alone).",
        unit: None,
        kind: Kind::Counter,
        source: Source::IfRunning(|s| dsr(s, |c| &c.flows_unrecorded)),
    },
];

/// The collector behind `/metrics`: every family of [`FAMILIES`], the servers' state set
/// and the build info, read from `state` at each scrape.
#[derive(Debug)]
pub struct Metrics {
    state: Arc<State>,
}

/// A registry holding the collector for `state`, with the `quill_` prefix.
pub fn registry(state: Arc<State>) -> Registry {
    let mut registry = Registry::with_prefix("quill");
    registry.register_collector(Box::new(Metrics { state }));
    registry
}

/// The metrics in OpenMetrics text format.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

type Labels = Vec<(&'static str, Cow<'static, str>)>;

/// Writes one sample of a family.
fn write_value(encoder: MetricEncoder<'_>, kind: Kind, v: u64) -> Result<(), std::fmt::Error> {
    match kind {
        Kind::Counter => ConstCounter::new(v).encode(encoder),
        Kind::Gauge => ConstGauge::new(v).encode(encoder),
    }
}

fn metric_type(kind: Kind) -> MetricType {
    match kind {
        Kind::Counter => MetricType::Counter,
        Kind::Gauge => MetricType::Gauge,
    }
}

impl Collector for Metrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let state = &self.state;
        let settings = state.settings();
        let now = clock::now_ms();
        // The labels of every server in use, built once per scrape.
        let servers: Vec<(Labels, &ServerState)> = state
            .servers_in_use(&settings)
            .map(|(i, conf, ip, rt)| {
                let address = std::net::SocketAddr::new(ip, conf.port).to_string();
                let labels = vec![
                    ("server", Cow::Owned(i.to_string())),
                    ("address", Cow::Owned(address)),
                ];
                (labels, rt)
            })
            .collect();

        let info = ConstGauge::new(1u64);
        let version = [("version", env!("CARGO_PKG_VERSION"))];
        let mut family = encoder.encode_descriptor(
            "build_info",
            "The version of quill running (always 1).",
            None,
            MetricType::Gauge,
        )?;
        info.encode(family.encode_family(&version)?)?;

        let mut family = encoder.encode_descriptor(
            "server_state",
            "1 for the condition the server is in now, 0 for the others.",
            None,
            MetricType::Gauge,
        )?;
        for (labels, rt) in &servers {
            let current = rt.condition(now);
            for condition in Condition::ALL {
                let mut with_state = labels.clone();
                with_state.push(("state", Cow::Borrowed(condition.word())));
                let v = u64::from(*condition == current);
                ConstGauge::new(v).encode(family.encode_family(&with_state)?)?;
            }
        }

        for f in FAMILIES {
            // A part that does not run has no family at all (not a misleading 0).
            let running = match f.source {
                Source::IfRunning(read) => match read(state) {
                    Some(v) => Some(v),
                    None => continue,
                },
                Source::PerServerAnswers | Source::PerServerHttp(_) if !settings.http => continue,
                _ => None,
            };
            let mut family =
                encoder.encode_descriptor(f.name, f.help, f.unit.as_ref(), metric_type(f.kind))?;
            match f.source {
                Source::Global(read) => write_value(family, f.kind, read(state))?,
                Source::IfRunning(_) => write_value(family, f.kind, running.unwrap_or(0))?,
                Source::ByLabel { label, values } => {
                    for (value, read) in values {
                        let labels = [(label, *value)];
                        write_value(family.encode_family(&labels)?, f.kind, read(state))?;
                    }
                }
                Source::PerServer(read) | Source::PerServerHttp(read) => {
                    for (labels, rt) in &servers {
                        write_value(family.encode_family(labels)?, f.kind, read(rt))?;
                    }
                }
                Source::PerServerAnswers => {
                    for (labels, rt) in &servers {
                        for (class, code) in Answers::CLASSES.iter().enumerate() {
                            let mut with_code = labels.clone();
                            with_code.push(("code", Cow::Borrowed(*code)));
                            let v = rt.answers.get(class);
                            write_value(family.encode_family(&with_code)?, f.kind, v)?;
                        }
                    }
                }
                Source::PerCertificate(read) => {
                    let served = settings.tls_built.server.as_deref();
                    for c in served.map_or(&[][..], |t| t.certificates()) {
                        let labels = [
                            ("file", c.file.to_string_lossy()),
                            ("sni", Cow::Borrowed(c.sni.as_str())),
                        ];
                        write_value(family.encode_family(&labels)?, f.kind, read(c))?;
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::Command;
    use crate::settings::Settings;

    #[test]
    fn the_text_format_names_counters_with_total_and_drops_unit_and_eof() {
        let om = "# HELP quill_a Things.\n# TYPE quill_a counter\nquill_a_total 3\n\
                  # HELP quill_up_seconds Age.\n# TYPE quill_up_seconds gauge\n\
                  # UNIT quill_up_seconds seconds\nquill_up_seconds 7\n# EOF\n";
        assert_eq!(
            to_text_format(om),
            "# HELP quill_a_total Things.\n# TYPE quill_a_total counter\nquill_a_total 3\n\
             # HELP quill_up_seconds Age.\n# TYPE quill_up_seconds gauge\nquill_up_seconds 7\n"
        );
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                          version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(prometheus));
        assert!(wants_openmetrics("Application/OpenMetrics-Text"));
        assert!(!wants_openmetrics("*/*"));
        assert!(!wants_openmetrics("text/plain"));
        assert!(!wants_openmetrics(
            "application/openmetrics-text;q=0, text/plain"
        ));
    }

    #[test]
    fn families_have_unique_valid_names() {
        let mut seen = std::collections::HashSet::new();
        for f in FAMILIES {
            assert!(
                f.name.starts_with(|c: char| c.is_ascii_lowercase())
                    && f.name
                        .bytes()
                        .all(|b| { b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' }),
                "{}",
                f.name
            );
            assert!(
                !f.name.ends_with("_total"),
                "the encoder adds _total: {}",
                f.name
            );
            assert!(seen.insert(f.name), "duplicate family {}", f.name);
        }
    }

    #[test]
    fn scrape_reads_the_counters() {
        let state = State::new(Settings::default(), false);
        for line in [
            "server 0 address 127.0.0.1 port 9001",
            "server 1 address ::1 port 9002",
        ] {
            let cmd: Command = line.parse().unwrap();
            state.execute(&cmd).unwrap();
        }
        state.counters.accepted.store(7, Relaxed);
        state.counters.refused_acl.store(2, Relaxed);
        state.counters.tls_handshakes.store(5, Relaxed);
        state.counters.tls_failures.store(3, Relaxed);
        state.counters.upstream_tls_failures.store(1, Relaxed);
        state.counters.bad_proxy_header.store(3, Relaxed);
        state.counters.http_refused.store(4, Relaxed);
        state.counters.http_request_timeouts.store(6, Relaxed);
        state.counters.http_bad_answers.store(8, Relaxed);
        if let Some(s) = state.servers.get(1) {
            s.bytes_to.store(1234, Relaxed);
            s.blacklist(clock::now_ms(), 60);
        }
        let registry = registry(Arc::clone(&state));
        let text = encode(&registry).unwrap();
        assert!(!text.contains("quill_dsr_"), "no DSR families without DSR");
        for line in [
            "quill_connections_accepted_total 7",
            "quill_connections_refused_total{reason=\"acl\"} 2",
            "quill_tls_handshakes_total{result=\"ok\"} 5",
            "quill_tls_handshakes_total{result=\"failed\"} 3",
            "quill_upstream_tls_handshake_failures_total 1",
            "quill_connections_refused_total{reason=\"proxy_header\"} 3",
            "quill_http_requests_refused_total 4",
            "quill_http_request_timeouts_total 6",
            "quill_http_bad_answers_total 8",
            "quill_server_sent_bytes_total{server=\"1\",address=\"[::1]:9002\"} 1234",
            "quill_server_state{server=\"1\",address=\"[::1]:9002\",state=\"blacklisted\"} 1",
            "quill_server_state{server=\"0\",address=\"127.0.0.1:9001\",state=\"up\"} 1",
            "# EOF",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
