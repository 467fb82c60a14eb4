//! Status reports: Pen's `servers` and `mode` lines, the HTML status page, and the JSON
//! status (an extension for machines). All are built from one settings snapshot and the
//! runtime counters; nothing here changes anything.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;

use serde_json::json;

use super::Context;
use crate::balance::clock;
use crate::proxy::registry::{ConnInfo, Registry, Upstream};
use crate::settings::Settings;
use crate::state::State;

/// Pen's `servers` format: one line per configured server.
pub fn servers(state: &State) -> String {
    let settings = state.settings();
    let now = clock::now_ms();
    let mut out = String::new();
    for (i, s, ip, rt) in state.servers_in_use(&settings) {
        let _ = writeln!(
            out,
            "{i} addr {ip} port {} conn {} max {} hard {} weight {} prio {} sx {} rx {} state {} health {}",
            s.port,
            rt.conns.load(Relaxed),
            s.max,
            s.hard,
            s.weight,
            s.prio,
            rt.bytes_to.load(Relaxed),
            rt.bytes_from.load(Relaxed),
            rt.state_word(now),
            rt.health().word(),
        );
    }
    out
}

/// One open connection, as `connection N` shows it.
pub fn connection(c: &ConnInfo, now: u64) -> String {
    let upstream = match c.upstream() {
        Upstream::None => "none".to_string(),
        Upstream::Server(i) => format!("server {i}"),
        Upstream::Emergency => "emergency".to_string(),
        Upstream::Abuse => "abuse".to_string(),
    };
    let age = now.saturating_sub(c.started) / 1000;
    format!(
        "connection {} client {} upstream {upstream} age {age}",
        c.id,
        c.real_client()
    )
}

/// The status page lists at most this many connections (`connections` lists them all).
const PAGE_CONNECTIONS: usize = 1_000;

/// Every open connection, oldest first, a [`connection`] line each: the numbers `close N`
/// takes. With a `limit`, the oldest that many and a line saying how many more are open.
pub fn connections(registry: &Registry, limit: Option<usize>) -> String {
    let mut all = registry.all();
    all.sort_unstable_by_key(|c| c.id);
    let now = clock::now_ms();
    let mut out = String::new();
    let shown = limit.unwrap_or(usize::MAX).min(all.len());
    for c in &all[..shown] {
        out.push_str(&connection(c, now));
        out.push('\n');
    }
    if shown < all.len() {
        let _ = writeln!(out, "and {} more", all.len() - shown);
    }
    out
}

/// Pen's `mode` line.
pub fn mode(settings: &Settings) -> String {
    let p = settings.policy;
    let word = |on: bool, w: &str| if on { w.to_string() } else { format!("no {w}") };
    [
        word(p.hash, "hash"),
        word(p.roundrobin, "roundrobin"),
        word(p.stubborn, "stubborn"),
        word(p.weight, "weight"),
        word(p.prio, "prio"),
    ]
    .join(" ")
}

/// Clients seen in the last `seconds`, most recent first.
pub fn recent(state: &State, seconds: u64) -> String {
    let now = clock::now_ms();
    let mut clients: Vec<_> = state
        .clients
        .snapshot()
        .into_iter()
        .filter(|(_, e)| now.saturating_sub(e.last_seen) <= seconds.saturating_mul(1000))
        .collect();
    clients.sort_by_key(|(_, e)| std::cmp::Reverse(e.last_seen));
    let mut out = String::new();
    for (ip, e) in clients {
        let _ = writeln!(
            out,
            "{ip} server {} connections {} last {} s ago",
            e.server,
            e.connections,
            now.saturating_sub(e.last_seen) / 1000
        );
    }
    out
}

/// Clients seen in the last `seconds`, most recent first, at most `limit` (the dashboard's
/// list). Reads at most `limit` entries of each shard of the client table.
pub fn recent_json(state: &State, seconds: u64, limit: usize) -> serde_json::Value {
    let now = clock::now_ms();
    let mut clients: Vec<_> = state
        .clients
        .most_recent(limit)
        .into_iter()
        .filter(|(_, e)| now.saturating_sub(e.last_seen) <= seconds.saturating_mul(1000))
        .collect();
    clients.sort_by_key(|(_, e)| std::cmp::Reverse(e.last_seen));
    clients.truncate(limit);
    let list: Vec<_> = clients
        .into_iter()
        .map(|(ip, e)| {
            json!({
                "address": ip.to_string(),
                "server": e.server,
                "connections": e.connections,
                "last_seen_seconds_ago": now.saturating_sub(e.last_seen) / 1000,
            })
        })
        .collect();
    json!({ "tracked": state.clients.len(), "clients": list })
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The HTML status page (`status`, and the `web_stats` file).
pub fn html(ctx: &Context) -> String {
    let state = &ctx.state;
    let settings = state.settings();
    let now = clock::now_ms();
    let mut out = String::from("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>quill status</title></head><body>\n");
    let listen = settings
        .listen
        .as_ref()
        .map(|l| l.to_string())
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "<h1>quill {}</h1>\n<p>Listening on {}; pid {}; up {} s; {} connections open, {} accepted; mode: {}</p>",
        env!("CARGO_PKG_VERSION"),
        escape(&listen),
        std::process::id(),
        state.started.elapsed().as_secs(),
        state.active.load(Relaxed),
        state.counters.accepted.load(Relaxed),
        mode(&settings),
    );
    out.push_str("<table border=\"1\">\n<tr><th>server</th><th>address</th><th>port</th><th>state</th><th>conn</th><th>max</th><th>hard</th><th>weight</th><th>prio</th><th>total</th><th>failures</th><th>sent</th><th>received</th></tr>\n");
    for (i, s, ip, rt) in state.servers_in_use(&settings) {
        let up = match rt.state_word(now) {
            "blacklisted" => format!("blacklisted {} s", rt.blacklist_left(now)),
            word => word.to_string(),
        };
        let _ = writeln!(
            out,
            "<tr><td>{i}</td><td>{ip}</td><td>{}</td><td>{up}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            s.port,
            rt.conns.load(Relaxed),
            s.max,
            s.hard,
            s.weight,
            s.prio,
            rt.total.load(Relaxed),
            rt.failures.load(Relaxed),
            rt.bytes_to.load(Relaxed),
            rt.bytes_from.load(Relaxed),
        );
    }
    out.push_str("</table>\n");
    if let Some(registry) = &state.registry {
        out.push_str("<h2>Connections</h2>\n<pre>\n");
        out.push_str(&escape(&connections(registry, Some(PAGE_CONNECTIONS))));
        out.push_str("</pre>\n");
    }
    out.push_str("<h2>Recent clients</h2>\n<pre>\n");
    out.push_str(&escape(&recent(state, 300)));
    out.push_str("</pre>\n</body></html>\n");
    out
}

/// The JSON status (`status json`, an extension).
pub fn json(ctx: &Context) -> String {
    let state = &ctx.state;
    let settings = state.settings();
    let now = clock::now_ms();
    let servers: Vec<_> = state.servers_in_use(&settings)
        .map(|(i, s, ip, rt)| {
            json!({
                "index": i,
                "host": s.host.as_ref().map(|h| h.to_string()),
                "address": ip.to_string(),
                "port": s.port,
                "state": rt.state_word(now),
                "blacklisted": rt.is_blacklisted(now),
                "blacklist_seconds_left": rt.blacklist_left(now),
                "draining": rt.draining.load(Relaxed),
                "health": rt.health().word(),
                "health_check": settings.probe_of(i).map(ToString::to_string),
                "checks_passed": rt.checks_passed.load(Relaxed),
                "checks_failed": rt.checks_failed.load(Relaxed),
                "weight_now": rt.effective_weight(s.weight, now, settings.slow_start.saturating_mul(1000)),
                "connections": rt.conns.load(Relaxed),
                // Clients waiting for it to have room (`queue_timeout`); one waiting for
                // several full servers counts at each.
                "queued": rt.waiting(),
                "max": s.max,
                "hard": s.hard,
                "weight": s.weight,
                "prio": s.prio,
                "acl": s.acl.map(|a| a.index()),
                "total_connections": rt.total.load(Relaxed),
                "failures": rt.failures.load(Relaxed),
                "bytes_to_server": rt.bytes_to.load(Relaxed),
                "bytes_from_server": rt.bytes_from.load(Relaxed),
                // Request-level proxying (`http`): requests sent one by one, how many
                // reused a kept-alive connection, and the pool's connections to it.
                "requests": rt.requests.load(Relaxed),
                "requests_reused": rt.reused.load(Relaxed),
                // Its final answers by status class: `{"2xx": 10, ...}`.
                "responses": crate::balance::servers::Answers::CLASSES
                    .iter()
                    .enumerate()
                    .map(|(class, code)| (code.to_string(), json!(rt.answers.get(class))))
                    .collect::<serde_json::Map<_, _>>(),
                // Requests whose client left before their answer had ended.
                "client_aborts": rt.answers.abandoned(),
                "pool_open": rt.pool_open.load(Relaxed),
                "pool_idle": rt.pool_idle.load(Relaxed),
            })
        })
        .collect();
    let p = settings.policy;
    let doc = json!({
        "version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "uptime_seconds": state.started.elapsed().as_secs(),
        "listen": settings.listen.as_ref().map(|l| l.to_string()),
        "control": ctx.control_addr,
        // What `defer_accept` comes to for the listeners (`auto` resolved): 0 = none.
        "defer_accept_seconds": settings.defer_accept_seconds(),
        "mode": { "hash": p.hash, "roundrobin": p.roundrobin, "stubborn": p.stubborn, "weight": p.weight, "prio": p.prio },
        "connections": {
            "open": state.active.load(Relaxed),
            "parked": state.parked.load(Relaxed),
            "accepted": state.counters.accepted.load(Relaxed),
            "refused_conn_max": state.counters.refused_conn_max.load(Relaxed),
            "udp_evicted": state.counters.udp_evicted.load(Relaxed),
            "udp_answered": state.counters.udp_answered.load(Relaxed),
            "udp_reused": state.counters.udp_reused.load(Relaxed),
            "udp_offloaded": state.counters.udp_offloaded.load(Relaxed),
            "udp_carried": state.counters.udp_carried.load(Relaxed),
            "udp_placed": state.counters.udp_placed.load(Relaxed),
            "udp_placement": state.udp_placement.load_full().as_deref(),
            "refused_acl": state.counters.refused_acl.load(Relaxed),
            "no_server": state.counters.no_server.load(Relaxed),
            "queued": state.counters.queued.load(Relaxed),
            "queue_timeouts": state.counters.queue_timeouts.load(Relaxed),
            "queue_full": state.counters.queue_full.load(Relaxed),
            "queue_abandoned": state.counters.queue_abandoned.load(Relaxed),
            "refused_proxy_header": state.counters.bad_proxy_header.load(Relaxed),
            "http_refused": state.counters.http_refused.load(Relaxed),
            "http_request_timeouts": state.counters.http_request_timeouts.load(Relaxed),
            "http_bad_answers": state.counters.http_bad_answers.load(Relaxed),
            "h2": state.counters.h2_connections.load(Relaxed),
            "h2_requests": state.counters.h2_requests.load(Relaxed),
            "max": settings.conn_max,
        },
        "clients": { "tracked": state.clients.len(), "max": settings.clients_max },
        "servers": servers,
        "emergency": settings.emergency.as_ref().map(|e| json!({ "address": e.name.to_string(), "connections": state.emergency.conns.load(Relaxed) })),
        "abuse": settings.abuse.as_ref().map(|e| json!({ "address": e.name.to_string(), "connections": state.abuse.conns.load(Relaxed) })),
        "can_serve": crate::announce::can_serve(&settings, state).is_ok(),
        "node_draining": state.node_draining.load(Relaxed),
        "announce": settings.announce_table.map(|table| json!({
            "table": table,
            "announced": state.announced.load(Relaxed) == table,
            "address": crate::announce::service_address(&settings).ok().map(|a| a.to_string()),
        })),
        "dsr": state.dsr.get().map(|c| json!({
            "interface": settings.dsr_if.as_ref().map(|i| i.to_string()),
            "path": match c.xdp_mode.load(Relaxed) {
                2 => "xdp-native",
                1 => "xdp-generic",
                _ => "packet",
            },
            "servers_up": c.backends_up.load(Relaxed),
            "forwarded": c.forwarded.load(Relaxed),
            "xdp_forwarded": c.xdp_forwarded.load(Relaxed),
            "no_server": c.no_backend.load(Relaxed),
            "flows": c.flows.load(Relaxed),
            "flows_unrecorded": c.flows_unrecorded.load(Relaxed),
            "arp_replies": c.arp_replies.load(Relaxed),
            "tarpit_synacks": c.tarpit_synack.load(Relaxed),
            "send_errors": c.send_errors.load(Relaxed),
        })),
    });
    doc.to_string()
}
