//! The state every event loop shares: the published settings snapshot and, beside it, the
//! runtime tables and counters that outlive any reload.
//!
//! Data planes call `settings()` once per connection and never write settings; the control
//! side goes through [`State::execute`], which applies a command to a copy and publishes the
//! copy atomically, so a reader sees either the old or the new configuration, never a mix.

use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{
    AtomicBool, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, SeqCst},
};
use std::sync::{Arc, Mutex};

use arc_swap::{ArcSwap, ArcSwapOption};

use crate::connlog::ConnLog;
use crate::proxy::registry::Registry;

use crate::balance::{clock, ClientTable, ServerState, ServerTable};
use crate::command::Command;
use crate::settings::{Action, ApplyError, Reply, ServerConf, Settings};

/// A reading of [`State::asked`]: whether quill stops, and how many reloads and drains
/// asked connections to move on so far (compare two readings to see one in between).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Asked(u64);

impl Asked {
    /// The stop flag's bit; the bits below count recycles (wrapping long before 2^63).
    const STOPPING: u64 = 1 << 63;

    /// quill stops.
    pub fn stopping(self) -> bool {
        self.0 & Self::STOPPING != 0
    }

    /// A reload or a drain happened between `earlier` and this reading.
    pub fn recycled_since(self, earlier: Asked) -> bool {
        (self.0 & !Self::STOPPING) != (earlier.0 & !Self::STOPPING)
    }
}

/// Process-wide counters (summed over all event loops).
#[derive(Debug, Default)]
pub struct Counters {
    /// Client connections accepted (UDP: new flows), including those then refused.
    pub accepted: AtomicU64,
    /// Client connections closed at once because `conn_max` was reached: UDP flows only
    /// (a TCP client beyond it waits in the listen queue, or for a place when two event
    /// loops accepted it at once).
    pub refused_conn_max: AtomicU64,
    /// Client connections denied by the client ACL (and not sent to an abuse server).
    pub refused_acl: AtomicU64,
    /// Client connections closed because no server (nor emergency server) was reachable.
    pub no_server: AtomicU64,
    /// Client connections (or requests) waiting now for a full server to have room
    /// (`queue_timeout`).
    pub queued: AtomicU64,
    /// Of those, the ones whose wait ran out (then the emergency server, or a refusal).
    pub queue_timeouts: AtomicU64,
    /// Clients that found every server full and the queue at `queue_max`: not let wait.
    pub queue_full: AtomicU64,
    /// Clients (requests, with `http`) that left while they waited in the queue.
    pub queue_abandoned: AtomicU64,
    /// TLS handshakes completed with clients.
    pub tls_handshakes: AtomicU64,
    /// TLS handshakes with clients that failed (protocol, certificate, timeout, reset).
    pub tls_failures: AtomicU64,
    /// TLS handshakes with upstream servers that failed (certificate, protocol, timeout).
    pub upstream_tls_failures: AtomicU64,
    /// Client connections closed for a missing or malformed PROXY protocol header
    /// (`accept_proxy`).
    pub bad_proxy_header: AtomicU64,
    /// HTTP requests refused with 400, 408 or 431 (`http`).
    pub http_refused: AtomicU64,
    /// Answers of HTTP/1.x servers that quill could not frame, replaced by its 502
    /// (`http`: two lengths, a length that is no number, bytes that are no answer over a
    /// reused connection), whichever HTTP the client speaks.
    pub http_bad_answers: AtomicU64,
    /// HTTP connections closed because a request head did not come whole within
    /// `http_request_timeout` (answered 408 after part of one, else closed silently).
    pub http_request_timeouts: AtomicU64,
    /// UDP flows ended to make room for new clients' when `conn_max` flows were open
    /// (each waiting for no answer, the oldest first).
    pub udp_evicted: AtomicU64,
    /// UDP flows ended with every answer in (`udp_responses`), and new flows served by
    /// such a flow's socket.
    pub udp_answered: AtomicU64,
    pub udp_reused: AtomicU64,
    /// UDP flows handed to the kernel path (`udp_offload`), and those it carries now.
    pub udp_offloaded: AtomicU64,
    pub udp_carried: AtomicU64,
    /// New UDP flows the kernel path placed itself (`udp_offload` with `udp_responses`).
    pub udp_placed: AtomicU64,
    /// HTTP/2 client connections served (`http` with ALPN `h2`, or `h2c`).
    pub h2_connections: AtomicU64,
    /// Requests of HTTP/2 clients, each sent to a server of its own choosing.
    pub h2_requests: AtomicU64,
}

/// What the DSR plane (`dsr_if`) did, for status reports and tests (monotonic counters).
#[derive(Debug, Default)]
pub struct DsrCounters {
    /// Frames forwarded to a backend (by either path).
    pub forwarded: AtomicU64,
    /// Of those, frames the XDP program forwarded.
    pub xdp_forwarded: AtomicU64,
    /// Frames for the VIP dropped because no backend was up.
    pub no_backend: AtomicU64,
    /// ARP replies sent for the VIP or a tarpitted address.
    pub arp_replies: AtomicU64,
    /// SYN+ACKs sent by the tarpit.
    pub tarpit_synack: AtomicU64,
    /// Other frames to tarpitted addresses, dropped.
    pub tarpit_dropped: AtomicU64,
    /// Sends that failed (buffer full, interface down...).
    pub send_errors: AtomicU64,
    /// Flows in the flow table now (a gauge, updated every tick).
    pub flows: AtomicU64,
    /// New flows the full flow table could not record (served by Maglev's choice alone).
    pub flows_unrecorded: AtomicU64,
    /// How the XDP program is attached: 2 native, 1 generic, 0 none (the packet socket
    /// forwards).
    pub xdp_mode: AtomicU64,
    /// Backends the plane can forward to now (answering ARP, not blacklisted): what
    /// `announce::can_serve` asks in DSR mode. Set after the plane's first tick.
    pub backends_up: AtomicU64,
    /// The plane has made its first decision about the backends.
    pub started: AtomicBool,
}

/// Shared state of one quill process.
#[derive(Debug)]
pub struct State {
    settings: ArcSwap<Settings>,
    /// Serialises `execute` so that two commands never apply to the same old copy.
    writer: Mutex<()>,
    pub servers: ServerTable,
    pub emergency: ServerState,
    pub abuse: ServerState,
    pub clients: ClientTable,
    /// Index of the most recently chosen server (round robin).
    pub cursor: AtomicUsize,
    /// Client connections currently open.
    pub active: AtomicUsize,
    /// Of those, connections parked while idle (`idle_park`).
    pub parked: AtomicUsize,
    /// Upstream connects in progress.
    pub pending: AtomicUsize,
    /// Accept loops paused at `pending_max` or `conn_max`, waiting on `accept_resumes`.
    pub accept_paused: AtomicUsize,
    /// Signalled when a connect finishes or a client connection ends while an accept loop
    /// is paused.
    pub accept_resumes: tokio::sync::Notify,
    pub counters: Counters,
    /// Open connections by number; kept only when a control socket can ask for them.
    pub registry: Option<Arc<Registry>>,
    /// The connection log, when one is configured.
    pub log: ArcSwapOption<ConnLog>,
    /// The access log of request-level proxying, when one is configured.
    pub access_log: ArcSwapOption<crate::accesslog::AccessLog>,
    /// Process start, for uptime in status reports.
    pub started: std::time::Instant,
    /// The DSR plane's counters, once it runs (`dsr_if`), for the metrics.
    pub dsr: std::sync::OnceLock<Arc<DsrCounters>>,
    /// Who places new UDP flows with `udp_offload` as last decided (`proxy::offload::placement`):
    /// `None` before the first decision or without `udp_offload`, else "kernel" or why quill.
    pub udp_placement: ArcSwapOption<String>,
    /// Bumped each time new settings are published (the health checks re-plan on it).
    pub generation: tokio::sync::watch::Sender<u64>,
    /// Set once when quill stops: HTTP/2 connections send GOAWAY and finish their streams.
    pub stopping: tokio::sync::watch::Sender<bool>,
    /// Bumped by a reload (SIGHUP) and when the node starts draining (`drain`): the client
    /// connections of request-level proxying are asked to move on to new connections
    /// (HTTP/2 GOAWAY, HTTP/1.x `Connection: close` on the next response), which see the
    /// new certificates and limits, or, draining, reach another node.
    pub recycled: tokio::sync::watch::Sender<u64>,
    /// `stopping` and the count of `recycled` bumps in one word ([`Asked`]), for the
    /// connections that look per request (one load) instead of watching the channels.
    /// Written only by [`State::stop`] and [`State::recycle`], before the channels.
    asked: AtomicU64,
    /// The routing table quill's route for the service address is in now
    /// (`announce_table`), 0 when none is.
    pub announced: std::sync::atomic::AtomicU32,
    /// `drain`: the whole node is out of the service (route withdrawn, `health` failing)
    /// while it serves on.
    pub node_draining: std::sync::atomic::AtomicBool,
    /// `poll_before_sleep` of the published settings, for the event loops' runtime hooks
    /// (`proxy::poll_before_sleep`), which run at every sleep and read one word.
    poll_before_sleep: std::sync::atomic::AtomicU32,
}

impl State {
    /// Shared state starting from `settings`; `registry` keeps a table of open connections.
    pub fn new(settings: Settings, registry: bool) -> Arc<State> {
        let servers = ServerTable::default();
        servers.mirror_limits(&settings);
        let poll_before_sleep = settings.poll_before_sleep;
        Arc::new(State {
            clients: ClientTable::new(settings.clients_max),
            settings: ArcSwap::from_pointee(settings),
            writer: Mutex::new(()),
            servers,
            emergency: ServerState::default(),
            abuse: ServerState::default(),
            cursor: AtomicUsize::new(usize::MAX),
            active: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            accept_paused: AtomicUsize::new(0),
            accept_resumes: tokio::sync::Notify::new(),
            counters: Counters::default(),
            registry: registry.then(Arc::default),
            log: ArcSwapOption::empty(),
            access_log: ArcSwapOption::empty(),
            started: std::time::Instant::now(),
            dsr: std::sync::OnceLock::new(),
            udp_placement: ArcSwapOption::empty(),
            generation: tokio::sync::watch::Sender::new(0),
            stopping: tokio::sync::watch::Sender::new(false),
            recycled: tokio::sync::watch::Sender::new(0),
            asked: AtomicU64::new(0),
            announced: std::sync::atomic::AtomicU32::new(0),
            node_draining: std::sync::atomic::AtomicBool::new(false),
            poll_before_sleep: std::sync::atomic::AtomicU32::new(poll_before_sleep),
        })
    }

    /// quill stops: HTTP/2 connections send GOAWAY, HTTP/1.x ones close between requests.
    pub fn stop(&self) {
        self.asked.fetch_or(Asked::STOPPING, SeqCst);
        self.stopping.send_replace(true);
    }

    /// A reload or a drain: client connections of request-level proxying move on to new
    /// connections.
    pub fn recycle(&self) {
        self.asked.fetch_add(1, SeqCst);
        self.recycled.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// What quill asks of connections now.
    pub fn asked(&self) -> Asked {
        Asked(self.asked.load(Acquire))
    }

    /// `poll_before_sleep` in µs as last published.
    pub fn poll_before_sleep(&self) -> u32 {
        self.poll_before_sleep.load(Relaxed)
    }

    /// The current settings snapshot.
    pub fn settings(&self) -> Arc<Settings> {
        self.settings.load_full()
    }

    /// The servers of `settings` in use (those with an address), with their runtime state.
    pub fn servers_in_use<'a>(
        &'a self,
        settings: &'a Settings,
    ) -> impl Iterator<Item = (usize, &'a ServerConf, IpAddr, &'a ServerState)> + 'a {
        settings
            .servers
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((i, s, s.ip?, self.servers.get(i)?)))
    }

    /// Applies one command: on success the new settings are published and the actions on
    /// the shared tables carried out; on error nothing changes. Actions that need the
    /// process (reopening sockets or files) are returned for the caller to carry out.
    pub fn execute(&self, cmd: &Command) -> Result<(Reply, Vec<Action>), ApplyError> {
        let _guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.settings.load();
        let mut next = Settings::clone(&current);
        let applied = next.apply(cmd)?;
        // `http` changes what TLS listeners offer (ALPN `h2`).
        if cmd.is_tls() || matches!(cmd, Command::Http(_)) {
            // Re-read the files even when nothing changed: repeating `ssl_ocsp_response`
            // (or `ssl_cert`) is how a renewed file is picked up.
            next.build_tls(Some(&current.tls_built))
                .map_err(|e| ApplyError::Tls(e.to_string()))?;
        }
        self.publish(next);
        let rest = applied
            .actions
            .into_iter()
            .filter_map(|a| self.perform(a))
            .collect();
        Ok((applied.reply, rest))
    }

    /// Makes `settings` the snapshot new connections and requests read; the servers'
    /// limits are mirrored into their states first, and when the servers changed, clients
    /// waiting for room look again once it is out (a `max` raised or a server added may
    /// give them some; any other command, a query included, leaves them their turn).
    fn publish(&self, settings: Settings) {
        let servers_changed = self.settings.load().servers != settings.servers;
        let more_room = settings.conn_max > self.settings.load().conn_max
            || settings.pending_max > self.settings.load().pending_max;
        self.servers.mirror_limits(&settings);
        self.poll_before_sleep
            .store(settings.poll_before_sleep, Relaxed);
        self.settings.store(Arc::new(settings));
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
        if servers_changed {
            self.servers.changed.notify_waiters();
        }
        if more_room {
            // Accepts paused at the old limit, and connections waiting for a place.
            self.accept_resumes.notify_waiters();
        }
    }

    /// Replaces the whole configuration (a reload), carrying out `actions` like `execute`.
    pub fn replace(&self, settings: Settings, actions: Vec<Action>) -> Vec<Action> {
        let _guard = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        if settings.clients_max != self.settings.load().clients_max {
            self.clients.resize(settings.clients_max);
        }
        self.publish(settings);
        actions
            .into_iter()
            .filter_map(|a| self.perform(a))
            .collect()
    }

    /// Carries out an action on the shared tables; returns it when it is the process's to
    /// carry out instead.
    pub fn perform(&self, action: Action) -> Option<Action> {
        match action {
            Action::Blacklist { index, seconds } => {
                if let Some(s) = self.servers.get(index) {
                    let was_in_use = s.blacklist_by_hand(clock::now_ms(), seconds);
                    if seconds == 0 {
                        if !was_in_use {
                            tracing::warn!("server {index} no longer blacklisted");
                        }
                        self.servers.changed.notify_waiters();
                    } else {
                        let open = s.conns.load(Relaxed);
                        tracing::warn!("server {index} blacklisted for {seconds} s: no new connections ({open} open)");
                    }
                }
                None
            }
            Action::Drain { index, on } => {
                if let Some(s) = self.servers.get(index) {
                    if s.draining.swap(on, Relaxed) != on {
                        if on {
                            let open = s.conns.load(Relaxed);
                            tracing::warn!(
                                "server {index} draining: no new connections ({open} open)"
                            );
                        } else {
                            tracing::warn!("server {index} no longer draining");
                            self.servers.changed.notify_waiters();
                        }
                    }
                }
                None
            }
            Action::ResizeClients(n) => {
                self.clients.resize(n);
                None
            }
            other => Some(other),
        }
    }

    /// Marks a server as failed (`what` says how, naming it): counted and blacklisted for
    /// the configured time. The failure that takes a server out of use is a warning (an
    /// operator sees it at the default level); those while it is out already, which only
    /// move its return, are debug lines, so that a dead server under load does not flood
    /// the log.
    pub fn server_failed(&self, index: usize, blacklist_secs: u64, what: fmt::Arguments<'_>) {
        let Some(s) = self.servers.get(index) else {
            return;
        };
        s.failures.fetch_add(1, Relaxed);
        if s.blacklist(clock::now_ms(), blacklist_secs) && blacklist_secs > 0 {
            tracing::warn!("{what}; blacklisted for {blacklist_secs} s");
        } else {
            tracing::debug!("{what}; blacklisted for {blacklist_secs} s");
        }
    }
}
