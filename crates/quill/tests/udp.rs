//! UDP load balancing (`-U`): flows, selection, failover, expiry, datagram integrity.
//!
//! The backends speak just enough DNS to answer an A query with their own address
//! (10.0.0.N), so a test sees who answered; anything else they echo. Clients are the
//! test's own sockets (one socket = one flow) and `dig`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::HashSet;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use support::dns::*;
use support::{ipv6_available, skip_on_pen, wait_until, Rng};

const WAIT: Duration = Duration::from_secs(3);
const SHORT: Duration = Duration::from_millis(500);

#[test]
fn tracking_keeps_a_client_and_a_second_address_goes_to_the_other() {
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let q = UdpQuill::start(&["{port}", &a.spec(), &b.spec()]);
    let first = q.client("127.0.0.1").ask(WAIT).expect("an answer");
    // New flows (new source ports) of the same client address go back to the same server.
    for _ in 0..5 {
        assert_eq!(q.client("127.0.0.1").ask(WAIT), Some(first));
    }
    let use_dig = have_dig();
    if use_dig {
        for _ in 0..2 {
            assert_eq!(
                dig(q.addr(), "127.0.0.1", 3),
                Some(first),
                "dig from 127.0.0.1"
            );
        }
    } else {
        eprintln!("SKIPPED the dig part: dig is not installed (Debian dnsutils)");
    }
    let other = if first == a.ip() { b.ip() } else { a.ip() };
    let second = if use_dig {
        dig(q.addr(), "127.0.0.2", 3)
    } else {
        q.client("127.0.0.2").ask(WAIT)
    };
    assert_eq!(
        second,
        Some(other),
        "a second client address lands on the other server"
    );
    for _ in 0..3 {
        assert_eq!(q.client("127.0.0.2").ask(WAIT), Some(other));
        assert_eq!(q.client("127.0.0.1").ask(WAIT), Some(first));
    }
}

/// `poll_before_sleep`: a UDP loop that sent queries on to a server polls for the window's
/// length, and takes the answers without going to sleep.
#[test]
fn poll_before_sleep_catches_answers_to_the_queries_sent_on() {
    if skip_on_pen("poll_before_sleep is quill's own") {
        return;
    }
    let a = DnsBackend::start(1);
    let m = SocketAddr::from(([127, 0, 0, 1], support::free_port()));
    let metrics = format!("metrics_listen {m}");
    let q = UdpQuill::start(&[
        "-O",
        "poll_before_sleep 10000",
        "-O",
        &metrics,
        "{port}",
        &a.spec(),
    ]);
    let caught = || {
        let line = "quill_poll_before_sleep_windows_total{outcome=\"caught\"} ";
        let text = support::http::get(m, "/metrics").text();
        text.lines()
            .find_map(|l| l.strip_prefix(line)?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {line} in:\n{text}"))
    };
    assert_eq!(caught(), 0);
    wait_until(
        Duration::from_secs(10),
        "an answer caught within a window",
        || {
            assert_eq!(q.client("127.0.0.1").ask(WAIT), Some(a.ip()));
            caught() > 0
        },
    );
}

#[test]
fn round_robin_alternates_per_flow_and_a_flow_stays_put() {
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let q = UdpQuill::start(&["-r", "{port}", &a.spec(), &b.spec()]);
    let picks: Vec<_> = (0..6)
        .map(|_| q.client("127.0.0.1").ask(WAIT).expect("an answer"))
        .collect();
    for w in picks.windows(2) {
        assert_ne!(w[0], w[1], "round robin alternates: {picks:?}");
    }
    // Datagrams of one flow all go to the flow's server.
    let c = q.client("127.0.0.3");
    let first = c.ask(WAIT).expect("an answer");
    for _ in 0..5 {
        assert_eq!(c.ask(WAIT), Some(first));
    }
    if have_dig() {
        let d1 = dig(q.addr(), "127.0.0.4", 3).expect("dig answer");
        let d2 = dig(q.addr(), "127.0.0.4", 3).expect("dig answer");
        assert_ne!(d1, d2, "each dig is a new flow, and -r alternates");
    }
}

#[test]
fn hash_is_stable_per_client_address() {
    if skip_on_pen("Pen 0.34 -U -h sends every client to one server") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let q = UdpQuill::start(&["-h", "{port}", &a.spec(), &b.spec()]);
    let mut seen = HashSet::new();
    for n in 2..12 {
        let src = format!("127.0.1.{n}");
        let x = q.client(&src).ask(WAIT).expect("an answer");
        assert_eq!(q.client(&src).ask(WAIT), Some(x));
        seen.insert(x);
    }
    assert_eq!(seen.len(), 2, "ten clients spread over both servers");
}

#[test]
fn failover_blacklist_all_then_whitelist_over_the_control_socket() {
    if skip_on_pen("Pen 0.34 does not fail over UDP flows") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let Some((q, cport)) = with_control(&[
        "-d",
        "-r",
        "-b",
        "60",
        "-t",
        "1",
        "{port}",
        &a.spec(),
        &b.spec(),
    ]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    assert_eq!(
        c.ask(WAIT),
        Some(a.ip()),
        "round robin starts with server 0"
    );

    // One server down: its ICMP port unreachable blacklists it, and the flow's next
    // datagram goes to the other server.
    a.stop();
    assert_eq!(
        c.ask_retrying(Duration::from_millis(200), Duration::from_secs(5)),
        Some(b.ip()),
        "after server 0 went away"
    );
    for src in ["127.0.0.3", "127.0.0.4"] {
        assert_eq!(
            q.client(src).ask(WAIT),
            Some(b.ip()),
            "new flows avoid server 0"
        );
    }

    // Both down: both blacklisted, no answer at all.
    b.stop();
    assert_eq!(
        c.ask_retrying(Duration::from_millis(200), Duration::from_millis(1500)),
        None
    );
    wait_until(
        Duration::from_secs(5),
        "quill logs that server 1 is blacklisted",
        || q.stderr().contains("server 1"),
    );
    // Both back, still blacklisted: with nothing else left, a new client's flow tries a
    // blacklisted server anyway (each at most once a second), and its answer puts that
    // server back in use (before, nothing was answered for the whole 60 s).
    a.restart();
    b.restart();
    assert!(
        q.client("127.0.0.5")
            .ask_retrying(Duration::from_millis(300), Duration::from_secs(5))
            .is_some(),
        "a server back was tried despite its blacklist"
    );
    wait_until(Duration::from_secs(5), "its return logged", || {
        q.stderr().contains("answers again: no longer blacklisted")
    });

    // Whitelisting by hand brings the other back at once.
    command(cport, "server 1 blacklist 0");
    assert!(q.client("127.0.0.6").ask(WAIT).is_some());
    command(cport, "server 0 blacklist 0");
    let picks: HashSet<_> = (0..4)
        .filter_map(|_| q.client("127.0.0.7").ask(WAIT))
        .collect();
    assert_eq!(picks.len(), 2, "both servers serve again: {picks:?}");
}

/// With a control socket, UDP flows are numbered as TCP connections are (Pen keeps both in
/// one table): `connections` lists them, `connection N` shows one, and `close N` ends one,
/// as an expiry would: the client's next datagram starts a new flow, and selection sends
/// it where it sends any new flow.
#[test]
fn connections_lists_the_flows_and_close_ends_one() {
    if skip_on_pen("quill's connection numbers") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let c = DnsBackend::start(3);
    let Some((q, cport)) = with_control(&["-r", "{port}", &a.spec(), &b.spec(), &c.spec()]) else {
        return;
    };
    let one = q.client("127.0.0.2");
    let two = q.client("127.0.0.3");
    assert_eq!(one.ask(WAIT), Some(a.ip()));
    assert_eq!(two.ask(WAIT), Some(b.ip()));
    let listed = control(cport, "connections").expect("control socket");
    let first = format!(
        "connection 1 client {} upstream server 0 age ",
        one.local_addr()
    );
    let second = format!(
        "connection 2 client {} upstream server 1 age ",
        two.local_addr()
    );
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed:?}");
    assert!(lines[0].starts_with(&first), "{listed:?}");
    assert!(lines[1].starts_with(&second), "{listed:?}");
    let shown = control(cport, "connection 2").expect("control socket");
    assert!(shown.starts_with(&second), "{shown:?}");

    // The flow ends: the registry and the server's count of connections let it go.
    assert_eq!(control(cport, "close 1").expect("control socket"), "");
    wait_until(
        Duration::from_secs(5),
        "the closed flow leaves the list",
        || {
            control(cport, "connections")
                .is_ok_and(|l| l.lines().count() == 1 && l.starts_with("connection 2 "))
        },
    );
    let refused = control(cport, "close 1").expect("control socket");
    assert!(refused.contains("no connection 1"), "{refused:?}");
    // Its client's next datagram is a new flow (number 3), which round robin gives to the
    // next server; the other flow is untouched.
    assert_eq!(
        one.ask(WAIT),
        Some(c.ip()),
        "a new flow, on the next server"
    );
    assert_eq!(two.ask(WAIT), Some(b.ip()), "the other flow stays put");
    let listed = control(cport, "connections").expect("control socket");
    let third = format!(
        "connection 3 client {} upstream server 2 age ",
        one.local_addr()
    );
    assert!(
        listed.starts_with(&second) && listed.lines().nth(1).is_some_and(|l| l.starts_with(&third)),
        "{listed:?}"
    );
    // A flow that expires leaves the list too (the new timeout applies to new flows).
    command(cport, "udp_idle_timeout 1");
    let three = q.client("127.0.0.4");
    assert!(three.ask(WAIT).is_some());
    let listed = control(cport, "connections").expect("control socket");
    assert!(listed.contains("\nconnection 4 client "), "{listed:?}");
    wait_until(
        Duration::from_secs(10),
        "the expired flow leaves the list",
        || control(cport, "connections").is_ok_and(|l| !l.contains("connection 4 ")),
    );
    let listed = control(cport, "connections").expect("control socket");
    assert_eq!(listed.lines().count(), 2, "{listed:?}");
}

/// A server with nothing listening answers the first datagram of a flow with ICMP port
/// unreachable: quill reads that error at once, blacklists the server, and sends the same
/// datagram on to the next server. So a client that never retries (`dig +tries=1`, each
/// run from a new source port) is answered every time, the first time included.
#[test]
fn a_refusing_server_is_blacklisted_at_once_and_no_query_is_lost() {
    if skip_on_pen("Pen 0.34 does not fail over UDP flows") {
        return;
    }
    let live = DnsBackend::start(2);
    // A port that nothing listens on.
    let dead = refused_udp_spec();
    let spec = live.spec();
    let q = UdpQuill::start(&["-d", "-r", "-b", "60", "-t", "5", "{port}", &dead, &spec]);
    // Our own client first: a new flow, one datagram, no retry.
    for src in ["127.0.0.2", "127.0.0.3", "127.0.0.4"] {
        assert_eq!(
            q.client(src).ask(WAIT),
            Some(live.ip()),
            "a new flow from {src}, asked once: {}",
            q.stderr()
        );
    }
    // Log lines are written by a thread of quill's: they come soon, not at once.
    wait_until(Duration::from_secs(5), "the failure logged", || {
        let e = q.stderr();
        e.contains(&format!("server 0 ({dead}) failed")) && e.contains("blacklisted")
    });
    if !have_dig() {
        eprintln!("SKIPPED: dig is not installed (.ci/run installs dnsutils)");
        return;
    }
    // And dig, a client nobody here wrote, without retries, 10 times over.
    let q = UdpQuill::start(&["-r", "-b", "60", "-t", "5", "{port}", &dead, &spec]);
    for i in 0..10 {
        assert_eq!(
            dig(q.addr(), "127.0.0.1", 2),
            Some(live.ip()),
            "dig +tries=1, query {i}: {}",
            q.stderr()
        );
    }
}

/// Pen's issue #31 (UDP balancing was uneven): with round robin, 10,000 datagrams from
/// 1,000 client ports spread over four servers within ±5 % of a quarter each.
#[test]
fn round_robin_spreads_a_thousand_flows_evenly() {
    let backends: Vec<DnsBackend> = (1..=4).map(DnsBackend::start).collect();
    let specs: Vec<String> = backends.iter().map(DnsBackend::spec).collect();
    let mut args = vec!["-r", "{port}"];
    args.extend(specs.iter().map(String::as_str));
    let q = UdpQuill::start(&args);
    for _ in 0..1000 {
        let c = q.client("127.0.0.2");
        for _ in 0..10 {
            assert!(c.ask(WAIT).is_some(), "a query went unanswered");
        }
    }
    let counts: Vec<usize> = backends.iter().map(DnsBackend::received).collect();
    assert_eq!(counts.iter().sum::<usize>(), 10_000, "{counts:?}");
    for (i, n) in counts.iter().enumerate() {
        assert!(
            (2375..=2625).contains(n),
            "server {i} got {n} of 10,000 datagrams: {counts:?}"
        );
    }
}

#[test]
fn a_server_that_never_answers_is_blacklisted_after_the_timeout() {
    if skip_on_pen("Pen 0.34 does not fail over UDP flows") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    a.set_silent(true);
    let q = UdpQuill::start(&["-r", "-t", "1", "-b", "60", "{port}", &a.spec(), &b.spec()]);
    let c = q.client("127.0.0.2");
    // Server 0 reads and never answers; within the answer timeout (plus a retry) the
    // flow moves to server 1.
    let start = Instant::now();
    assert_eq!(
        c.ask_retrying(Duration::from_millis(300), Duration::from_secs(6)),
        Some(b.ip())
    );
    assert!(a.received() >= 1, "server 0 was tried first");
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "not before the timeout"
    );
    let named = format!("server 0 ({}) failed for udp client", a.addr());
    wait_until(Duration::from_secs(5), "the failure logged", || {
        q.stderr().contains(&named)
    });
    // Now blacklisted: every new flow goes to server 1.
    for n in 3..7 {
        assert_eq!(q.client(&format!("127.0.0.{n}")).ask(WAIT), Some(b.ip()));
    }
}

#[test]
fn emergency_server_when_every_server_is_down() {
    if skip_on_pen("Pen 0.34 does not notice a refused UDP server") {
        return;
    }
    let e = DnsBackend::start(9);
    let refused = refused_udp_spec();
    let q = UdpQuill::start(&["-e", &e.spec(), "-b", "60", "{port}", &refused]);
    let c = q.client("127.0.0.2");
    assert_eq!(
        c.ask_retrying(Duration::from_millis(200), Duration::from_secs(5)),
        Some(e.ip())
    );
}

#[test]
fn client_acl_drops_or_sends_to_the_abuse_server() {
    let a = DnsBackend::start(1);
    let abuse = DnsBackend::start(7);
    let q = UdpQuill::start(&[
        "-O",
        "acl 1 deny 127.0.0.9",
        "-O",
        "client_acl 1",
        "{port}",
        &a.spec(),
    ]);
    assert_eq!(q.client("127.0.0.8").ask(WAIT), Some(a.ip()));
    let before = a.received();
    assert_eq!(q.client("127.0.0.9").ask(SHORT), None, "denied and dropped");
    assert_eq!(
        a.received(),
        before,
        "the denied datagram never reached the server"
    );
    drop(q);
    let q = UdpQuill::start(&[
        "-O",
        "acl 1 deny 127.0.0.9",
        "-O",
        "client_acl 1",
        "-B",
        &abuse.spec(),
        "{port}",
        &a.spec(),
    ]);
    assert_eq!(q.client("127.0.0.9").ask(WAIT), Some(abuse.ip()));
    assert_eq!(q.client("127.0.0.8").ask(WAIT), Some(a.ip()));
}

#[test]
fn conn_max_bounds_the_flows_waiting_for_answers() {
    if skip_on_pen("Pen 0.34 does not count UDP flows against -x") {
        return;
    }
    let a = DnsBackend::start(1);
    // One event loop: each makes room among its own flows.
    let q = UdpQuill::start(&[
        "-x",
        "2",
        "-t",
        "60",
        "-O",
        "workers 1",
        "{port}",
        &a.spec(),
    ]);
    // Two flows whose queries the server has not answered yet fill the table.
    a.set_silent(true);
    let c1 = q.client("127.0.0.2");
    let c2 = q.client("127.0.0.3");
    assert_eq!(c1.ask(SHORT), None);
    assert_eq!(c2.ask(SHORT), None);
    a.set_silent(false);
    let c3 = q.client("127.0.0.4");
    assert_eq!(c3.ask(SHORT), None, "a third flow is over conn_max");
    assert_eq!(a.received(), 2, "its datagram never reached the server");
    // Answered, the two flows wait for nothing: a new client's flow takes the place of
    // the one silent longest.
    assert!(c1.ask(WAIT).is_some());
    assert!(c2.ask(WAIT).is_some());
    assert!(
        c3.ask(WAIT).is_some(),
        "a flow waiting for nothing makes room"
    );
    wait_until(Duration::from_secs(5), "two flows are open", || {
        q.flows_to(a.addr()) == 2
    });
}

/// A DNS client takes a new source port for each query (glibc does, resolvers do): each
/// query is a flow, answered at once, that would sit out `udp_idle_timeout` (30 s) and
/// turn new clients away once `conn_max` of them are open.
#[test]
fn a_full_table_makes_room_for_clients_that_take_a_new_port_each_query() {
    if skip_on_pen("Pen 0.34 does not count UDP flows against -x") {
        return;
    }
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&["-x", "20", "-O", "workers 1", "{port}", &a.spec()]);
    let answered = (0..200)
        .filter(|_| q.client("127.0.0.2").ask(WAIT).is_some())
        .count();
    assert_eq!(answered, 200);
    assert!(q.flows_to(a.addr()) <= 20, "{} flows", q.flows_to(a.addr()));
}

/// A server that answers other clients but not one datagram (a query it chose to drop,
/// unbound's `deny`) is not taken out of use by that client's flow timing out: else one
/// client could blacklist every server.
#[test]
fn a_datagram_the_server_leaves_unanswered_while_it_answers_others_blacklists_nothing() {
    if skip_on_pen("Pen 0.34 does not fail over UDP flows") {
        return;
    }
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&["-dd", "-t", "1", "-b", "60", "{port}", &a.spec()]);
    a.set_silent(true);
    let dropped = q.client("127.0.0.2");
    assert_eq!(dropped.ask(SHORT), None);
    a.set_silent(false);
    assert_eq!(q.client("127.0.0.3").ask(WAIT), Some(a.ip()));
    wait_until(
        Duration::from_secs(5),
        "the unanswered flow times out",
        || q.stderr().contains("its server answers others"),
    );
    assert!(!q.stderr().contains("blacklisted"), "{}", q.stderr());
    assert_eq!(q.client("127.0.0.4").ask(WAIT), Some(a.ip()));
    assert_eq!(
        dropped.ask(WAIT),
        Some(a.ip()),
        "its next query is answered"
    );
}

/// A client that keeps its port keeps its flow for as long as it sends: draining or
/// blacklisting its server moves the flow at its next datagram (when it waits for no
/// answer), as it moves a new TCP connection.
#[test]
fn drain_and_blacklist_move_a_clients_flow_to_a_server_in_use() {
    if skip_on_pen("Pen 0.34 has no drain") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let Some((q, cport)) = with_control(&["-r", "{port}", &a.spec(), &b.spec()]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    let d = q.client("127.0.0.3");
    assert_eq!(c.ask(WAIT), Some(a.ip()));
    assert_eq!(d.ask(WAIT), Some(b.ip()));
    command(cport, "server 0 drain");
    assert_eq!(c.ask(WAIT), Some(b.ip()), "moved off the drained server");
    assert_eq!(d.ask(WAIT), Some(b.ip()));
    command(cport, "server 0 drain 0");
    command(cport, "server 1 blacklist 60");
    assert_eq!(
        c.ask(WAIT),
        Some(a.ip()),
        "moved off the blacklisted server"
    );
    assert_eq!(
        d.ask(WAIT),
        Some(a.ip()),
        "moved off the blacklisted server"
    );
    // Both taken out by hand: the operator's log says so.
    wait_until(Duration::from_secs(5), "both logged", || {
        let log = q.stderr();
        log.contains("server 0 draining") && log.contains("server 1 blacklisted for 60 s")
    });
}

/// With no server in use to move to, a flow stays where it is: draining the only server
/// turns new clients away, not the ones it serves (as for TCP connections).
#[test]
fn a_flow_with_nowhere_to_move_stays_on_its_drained_server() {
    if skip_on_pen("Pen 0.34 has no drain") {
        return;
    }
    let a = DnsBackend::start(1);
    let Some((q, cport)) = with_control(&["{port}", &a.spec()]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    assert_eq!(c.ask(WAIT), Some(a.ip()));
    command(cport, "server 0 drain");
    assert_eq!(c.ask(WAIT), Some(a.ip()), "its flow stays");
    assert_eq!(
        q.client("127.0.0.3").ask(SHORT),
        None,
        "a new client has no server"
    );
    assert_eq!(c.ask(WAIT), Some(a.ip()), "its flow stays");
}

/// A client that only sends (syslog) always waits for an answer that never comes; its
/// flow moves off a drained server all the same, and the flow it left stops holding the
/// server within seconds, not after the day-long `-t` such senders are given.
#[test]
fn a_client_that_only_sends_moves_off_a_drained_server() {
    if skip_on_pen("Pen 0.34 has no drain") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    a.set_silent(true);
    b.set_silent(true);
    let Some((q, cport)) = with_control(&["-r", "-t", "86400", "{port}", &a.spec(), &b.spec()])
    else {
        return;
    };
    let c = q.client("127.0.0.2");
    for _ in 0..3 {
        c.sock.send(b"<14>one-way message").unwrap();
    }
    wait_until(WAIT, "three messages on server 0", || a.received() == 3);
    command(cport, "server 0 drain");
    for _ in 0..3 {
        c.sock.send(b"<14>one-way message").unwrap();
    }
    wait_until(WAIT, "three messages on server 1", || b.received() == 3);
    assert_eq!(a.received(), 3, "nothing more went to the drained server");
    wait_until(
        Duration::from_secs(6),
        "the drained server's flow ended",
        || q.flows_to(a.addr()) == 0,
    );
    assert_eq!(q.flows_to(b.addr()), 1);
}

/// A flow that moves while its server still owes an answer keeps listening for that answer
/// for a while: a slow server's last answer still reaches its client.
#[test]
fn an_answer_still_due_from_a_drained_server_reaches_its_client() {
    if skip_on_pen("Pen 0.34 has no drain") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    a.set_delay(Duration::from_millis(700));
    let Some((q, cport)) = with_control(&["-r", "{port}", &a.spec(), &b.spec()]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    c.sock.send(&query(40_001, "who.example")).unwrap();
    wait_until(WAIT, "the query on server 0", || a.received() == 1);
    command(cport, "server 0 drain");
    assert_eq!(c.ask(WAIT), Some(b.ip()), "the next query moved");
    let deadline = Instant::now() + WAIT;
    let late = std::iter::from_fn(|| c.receive(deadline.saturating_duration_since(Instant::now())))
        .find_map(|reply| answer(&reply, 40_001));
    assert_eq!(
        late,
        Some(a.ip()),
        "the drained server's answer came through"
    );
}

/// A flow that moved while its server still owed an answer stays listed under its own
/// number until it ends, and `close N` ends it too: that answer is then never passed on.
#[test]
fn close_ends_a_flow_that_waits_for_an_answer_after_moving() {
    if skip_on_pen("Pen 0.34 has no drain") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    a.set_delay(Duration::from_millis(1500));
    let Some((q, cport)) = with_control(&["-r", "{port}", &a.spec(), &b.spec()]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    c.sock.send(&query(40_002, "who.example")).unwrap();
    wait_until(WAIT, "the query on server 0", || a.received() == 1);
    command(cport, "server 0 drain");
    assert_eq!(c.ask(WAIT), Some(b.ip()), "the next query moved");
    let listed = control(cport, "connections").expect("control socket");
    let client = c.local_addr();
    assert!(
        listed.starts_with(&format!(
            "connection 1 client {client} upstream server 0 age "
        )) && listed.contains(&format!(
            "\nconnection 2 client {client} upstream server 1 age "
        )),
        "{listed:?}"
    );
    assert_eq!(control(cport, "close 1").expect("control socket"), "");
    let deadline = Instant::now() + Duration::from_secs(3);
    let late = std::iter::from_fn(|| c.receive(deadline.saturating_duration_since(Instant::now())))
        .find_map(|reply| answer(&reply, 40_002));
    assert_eq!(late, None, "the closed flow passed its late answer on");
    let listed = control(cport, "connections").expect("control socket");
    assert!(
        listed.starts_with("connection 2 ") && listed.lines().count() == 1,
        "{listed:?}"
    );
}

#[test]
fn a_servers_max_bounds_its_flows_from_every_event_loop() {
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let limited = format!("{}:2", a.spec());
    let q = UdpQuill::start(&["-r", "{port}", &limited, &b.spec()]);
    // Forty new flows at once, from as many addresses (spread over the event loops by
    // the kernel): server a takes two of them, whichever loops they arrived on.
    let clients: Vec<_> = (10..50)
        .map(|i| q.client(&format!("127.0.0.{i}")))
        .collect();
    let barrier = std::sync::Barrier::new(clients.len());
    let answers: Vec<_> = std::thread::scope(|scope| {
        let asks: Vec<_> = clients
            .iter()
            .map(|c| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    c.ask(WAIT)
                })
            })
            .collect();
        asks.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(answers.iter().all(Option::is_some), "{answers:?}");
    let on_a = answers.iter().filter(|&&ip| ip == Some(a.ip())).count();
    assert!(on_a <= 2, "{on_a} flows on server a, max 2");
}

#[test]
fn ten_thousand_flows_expire_and_memory_returns() {
    if skip_on_pen("Pen 0.34 keeps UDP flows in a fixed table") {
        return;
    }
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&[
        "-d",
        "-x",
        "15000",
        "-O",
        "udp_idle_timeout 4",
        "{port}",
        &a.spec(),
    ]);
    // Warm up (buffers, runtime), then take the baseline once that flow is gone.
    assert!(q.client("127.0.0.2").ask(WAIT).is_some());
    assert_eq!(q.flows_to(a.addr()), 1);
    wait_until(Duration::from_secs(10), "the warm-up flow expires", || {
        q.flows_to(a.addr()) == 0
    });
    let base_fds = q.fd_count();
    let base_rss = q.rss_kib();
    let mut peak_rss = 0;
    // Two rounds: the first shows the flows expire and their descriptors close; the
    // second, that the memory they held is reused rather than leaked.
    for round in 0..2u8 {
        let start = Instant::now();
        let sent = flood(&q, &a, 10 + round * 10);
        let took = start.elapsed();
        let flows = q.flows_to(a.addr());
        // The first flows expire 4 s after the flood began: on a loaded machine the flood
        // and the count (a read of /proc/net/udp's 10,000 lines) can take 2 s or more.
        let counted_within_idle_timeout = start.elapsed() < Duration::from_millis(3800);
        let fds = q.fd_count();
        let rss = q.rss_kib();
        eprintln!("round {round}: {sent} flows in {took:?}: {flows} open, fds {base_fds} -> {fds}, RSS {base_rss} KiB -> {rss} KiB");
        assert!(sent >= 9_900, "only {sent} flows could be started");
        if counted_within_idle_timeout {
            assert!(
                flows >= sent * 9 / 10,
                "one upstream socket per live flow: {flows}"
            );
        }
        wait_until(Duration::from_secs(15), "the flows expire", || {
            q.flows_to(a.addr()) == 0
        });
        wait_until(
            Duration::from_secs(5),
            format_args!("their descriptors are closed (back to {base_fds})"),
            || q.fd_count() <= base_fds,
        );
        let after = q.rss_kib();
        eprintln!("round {round}: after expiry RSS {after} KiB");
        if round == 0 {
            peak_rss = rss.max(after);
        } else {
            assert!(
                rss.max(after) <= peak_rss + peak_rss / 10,
                "a second round of flows reuses the memory of the first: \
                 baseline {base_rss} KiB, first peak {peak_rss} KiB, second {rss} KiB"
            );
        }
    }
    assert!(q.client("127.0.0.3").ask(WAIT).is_some(), "still serving");
}

/// Sends one query from each of 10,000 distinct flows (10 addresses from 127.0.2.`first`,
/// 1,000 ports each), 64 at a time so that no burst overflows the listening socket's
/// receive buffer; returns how many were sent.
fn flood(q: &UdpQuill, backend: &DnsBackend, first: u8) -> usize {
    let to = q.addr();
    let payload = query(7, "flood.example");
    let mut sent = 0usize;
    let base = backend.received();
    for host in first..first + 10 {
        for port in (42_000u16..43_000).step_by(64) {
            for p in port..(port + 64).min(43_000) {
                let src = SocketAddr::from(([127, 0, 2, host], p));
                let Ok(s) = UdpSocket::bind(src) else {
                    continue;
                };
                if s.send_to(&payload, to).is_ok() {
                    sent += 1;
                }
            }
            let want = base + sent;
            wait_until(
                WAIT,
                format_args!("the server got {sent} datagrams"),
                || backend.received() >= want,
            );
        }
    }
    sent
}

#[test]
fn datagrams_pass_whole_from_empty_to_65507_bytes() {
    if skip_on_pen("Pen 0.34 truncates UDP datagrams to 32,768 bytes and drops empty ones") {
        return;
    }
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&["{port}", &a.spec()]);
    let c = q.client("127.0.0.2");
    let mut rng = Rng::new(42);
    for len in [65_507usize, 0, 1, 11, 12, 1_472, 9_000, 65_507] {
        let mut data = vec![0u8; len];
        rng.fill(&mut data);
        if len >= 3 {
            data[2] |= 0x80; // never a DNS query: the backend echoes it
        }
        let back = c.exchange(&data, WAIT);
        assert_eq!(back.as_ref().map(Vec::len), Some(len), "{len} bytes");
        assert!(back == Some(data), "{len} bytes came back changed");
    }
}

#[test]
fn malformed_and_short_datagrams_are_relayed_as_bytes() {
    if skip_on_pen("Pen 0.34 drops empty UDP datagrams") {
        return;
    }
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&["{port}", &a.spec()]);
    let c = q.client("127.0.0.2");
    let mut bad: Vec<Vec<u8>> = vec![
        vec![],
        vec![0],
        vec![0xff; 5],
        query(1, "x.example")[..11].to_vec(),
        {
            let mut v = query(2, "x.example");
            v[4] = 0xff; // absurd question count
            v[2] |= 0x80;
            v
        },
        {
            let mut v = query(3, "x.example");
            v.truncate(v.len() - 3);
            v[12] = 200; // label longer than the message
            v
        },
    ];
    let mut rng = Rng::new(7);
    for len in [2usize, 13, 100, 512, 4096] {
        let mut v = vec![0u8; len];
        rng.fill(&mut v);
        if len > 2 {
            v[2] |= 0x80;
        }
        bad.push(v);
    }
    for d in &bad {
        let back = c.exchange(d, WAIT);
        assert_eq!(back.as_deref(), Some(&d[..]), "relayed unchanged: {d:?}");
    }
    // Garbage from many flows at once, then a real query still works.
    for n in 0..50u8 {
        let s = q.client("127.0.0.3");
        let _ = s.sock.send(&[n; 3]);
    }
    assert_eq!(c.ask(WAIT), Some(a.ip()));
    let mut q = q;
    q.assert_running();
}

#[test]
fn replies_leave_from_the_address_the_client_sent_to() {
    if skip_on_pen("Pen 0.34 replies from the address the routing table picks") {
        return;
    }
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&["{port}", &a.spec()]);
    // quill listens on 0.0.0.0; the client talks to 127.0.0.5 and its connected socket
    // accepts only a reply from 127.0.0.5.
    let to = SocketAddr::from(([127, 0, 0, 5], q.port));
    let c = UdpClient::new("127.0.0.1", to);
    assert_eq!(c.ask(WAIT), Some(a.ip()));
    let c = UdpClient::new("127.0.0.2", SocketAddr::from(([127, 0, 0, 6], q.port)));
    assert_eq!(c.ask(WAIT), Some(a.ip()));
}

#[test]
fn ipv4_and_ipv6_in_every_combination() {
    if skip_on_pen("Pen 0.34 -U does not listen on IPv6") {
        return;
    }
    if !ipv6_available() {
        eprintln!("SKIPPED: no IPv6 loopback");
        return;
    }
    let v4 = DnsBackend::start_on(4, "127.0.0.1:0");
    let v6 = DnsBackend::start_on(6, "[::1]:0");
    for (listen, backend, clients) in [
        ("[::1]:{port}", &v4, &["::1"][..]),
        ("127.0.0.1:{port}", &v6, &["127.0.0.1"][..]),
        ("[::1]:{port}", &v6, &["::1"][..]),
        (":::{port}", &v4, &["::1", "127.0.0.1"][..]),
        (":::{port}", &v6, &["::1", "127.0.0.1"][..]),
    ] {
        let q = UdpQuill::start(&["-dd", listen, &backend.spec()]);
        for src in clients {
            let to = match src.contains(':') {
                true => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, q.port)),
                false => SocketAddr::from(([127, 0, 0, 1], q.port)),
            };
            let c = UdpClient::new(src, to);
            assert_eq!(
                c.ask(WAIT),
                Some(backend.ip()),
                "listen {listen}, server {}, client {src}; quill's log:\n{}",
                backend.spec(),
                q.stderr()
            );
            let big = vec![0x5a; 60_000];
            assert_eq!(c.exchange(&big, WAIT).map(|b| b.len()), Some(60_000));
        }
    }
}

#[test]
fn a_flow_survives_while_active_and_expires_when_silent() {
    if skip_on_pen("Pen 0.34 has no UDP idle time") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let q = UdpQuill::start(&[
        "-dd",
        "-r",
        "-O",
        "udp_idle_timeout 1",
        "{port}",
        &a.spec(),
        &b.spec(),
    ]);
    let c = q.client("127.0.0.2");
    let first = c.ask(WAIT).expect("answer");
    let server = if first == a.ip() { a.addr() } else { b.addr() };
    assert_eq!(q.flows_to(server), 1);
    // Activity keeps the flow (and its server) for longer than the idle time.
    let until = Instant::now() + Duration::from_millis(1500);
    while Instant::now() < until {
        assert_eq!(c.ask(WAIT), Some(first));
        std::thread::sleep(Duration::from_millis(100)); // pacing of the client, not sync
    }
    // Silence ends it: its socket is closed.
    assert_eq!(q.flows_to(server), 1, "the flow lives on while active");
    wait_until(Duration::from_secs(5), "the silent flow expires", || {
        q.stderr().contains("udp flow expired") && q.flows_to(server) == 0
    });
    // The next datagram is a new flow, and round robin moves on.
    assert_ne!(c.ask(WAIT), Some(first));
}

#[test]
fn sigterm_stops_the_daemon_promptly() {
    let a = DnsBackend::start(1);
    let mut q = UdpQuill::start(&["{port}", &a.spec()]);
    for n in 2..6 {
        assert!(q.client(&format!("127.0.0.{n}")).ask(WAIT).is_some());
    }
    q.signal("TERM");
    let st = q
        .wait_exit(Duration::from_secs(5))
        .expect("quill exits after SIGTERM");
    assert!(st.success() || st.code().is_none(), "exit status {st}");
}

#[test]
fn udp_idle_timeout_is_a_command() {
    if skip_on_pen("udp_idle_timeout is a quill extension") {
        return;
    }
    let (code, err) = support::Quill::start_expect_exit(&[
        "-U",
        "-O",
        "udp_idle_timeout 0",
        "{port}",
        "127.0.0.1:1",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("udp_idle_timeout"), "{err}");
}

#[test]
fn a_burst_keeps_every_datagram_boundary_and_its_order() {
    let a = DnsBackend::start(1);
    let q = UdpQuill::start(&["{port}", &a.spec()]);
    let c = q.client("127.0.0.2");
    assert!(c.ask(WAIT).is_some());
    // Equal sizes (which quill may send as one segmented write) and mixed sizes, sent
    // back to back so that they arrive in one batch.
    let mut sent: Vec<Vec<u8>> = Vec::new();
    for round in 0..4u8 {
        for i in 0..16u8 {
            let len = if round % 2 == 0 {
                100
            } else {
                3 + usize::from(i) * 37
            };
            let mut d = vec![round.wrapping_mul(16).wrapping_add(i); len];
            d[2] |= 0x80; // not a DNS query: echoed
            sent.push(d);
        }
        sent.last_mut().unwrap().truncate(40);
    }
    for d in &sent {
        c.sock.send(d).unwrap();
    }
    let mut got = Vec::new();
    while got.len() < sent.len() {
        match c.receive(WAIT) {
            Some(d) => got.push(d),
            None => break,
        }
    }
    assert_eq!(got.len(), sent.len(), "every datagram came back");
    assert!(got == sent, "same datagrams, same boundaries, same order");
}
