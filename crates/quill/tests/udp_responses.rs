//! `udp_responses N` (an extension, NGINX's `proxy_responses`): a UDP flow ends once its
//! server has sent N datagrams for each of the client's, and its socket serves the next
//! flow to that server. A DNS client that takes a new port for each query then leaves
//! no flow behind, and a client that keeps its port has each query balanced.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::Duration;

use support::dns::*;
use support::{skip_on_pen, wait_until};

const WAIT: Duration = Duration::from_secs(3);
const SHORT: Duration = Duration::from_millis(300);

/// quill with a control socket, one event loop (the spare sockets are the loop's own) and
/// `udp_responses`; `None` when the build refuses a control socket.
fn quill(responses: u32, rest: &[&str]) -> Option<(UdpQuill, u16)> {
    let responses = format!("udp_responses {responses}");
    let mut args = vec!["-O", &responses, "-O", "workers 1"];
    args.extend_from_slice(rest);
    with_control(&args)
}

fn no_flows_open(cport: u16) -> bool {
    control(cport, "connections").is_ok_and(|l| l.trim().is_empty())
}

#[test]
fn a_flow_ends_once_answered_and_its_socket_serves_the_next_client() {
    if skip_on_pen("udp_responses is a quill extension") {
        return;
    }
    let a = DnsBackend::start(1);
    let Some((q, cport)) = quill(1, &["{port}", &a.spec()]) else {
        return;
    };
    assert_eq!(control(cport, "udp_responses").unwrap().trim(), "1");

    assert_eq!(q.client("127.0.0.2").ask(WAIT), Some(a.ip()));
    let first_port = a.last_sender().expect("a datagram").port();
    // Not after `udp_idle_timeout` (30 s): at once.
    wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
    for n in 3..8 {
        let client = q.client(&format!("127.0.0.{n}"));
        assert_eq!(client.ask(WAIT), Some(a.ip()));
        assert_eq!(
            a.last_sender().map(|s| s.port()),
            Some(first_port),
            "the next flow is sent from the socket of the last"
        );
        wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
    }
    let digs = if have_dig() { 2 } else { 0 };
    if digs > 0 {
        // A real stub client: a new port for each run, no retry.
        for _ in 0..2 {
            assert_eq!(dig(q.addr(), "127.0.0.9", 3), Some(a.ip()));
            assert_eq!(a.last_sender().map(|s| s.port()), Some(first_port));
            wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
        }
    } else {
        eprintln!("SKIPPED the dig part: dig is not installed (Debian dnsutils)");
    }
    assert_eq!(q.flows_to(a.addr()), 1, "one socket served every flow");
    let status = control(cport, "status json").unwrap();
    assert!(
        status.contains(&format!("\"udp_answered\":{}", 6 + digs))
            && status.contains(&format!("\"udp_reused\":{}", 5 + digs)),
        "{status}"
    );
}

#[test]
fn each_query_of_a_client_that_keeps_its_port_is_balanced() {
    if skip_on_pen("udp_responses is a quill extension") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let Some((q, cport)) = quill(1, &["-r", "{port}", &a.spec(), &b.spec()]) else {
        return;
    };
    let client = q.client("127.0.0.2");
    let mut picks = Vec::new();
    for _ in 0..6 {
        picks.push(client.ask(WAIT).expect("an answer"));
        wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
    }
    for w in picks.windows(2) {
        assert_ne!(w[0], w[1], "round robin alternates per query: {picks:?}");
    }
}

/// A server's answer beyond those counted comes to a socket whose flow has ended: that
/// socket is closed, not handed to the next client, who sees only its own answer.
#[test]
fn an_answer_that_comes_after_its_flow_ended_reaches_no_other_client() {
    if skip_on_pen("udp_responses is a quill extension") {
        return;
    }
    let a = DnsBackend::start(1);
    let Some((q, cport)) = quill(1, &["{port}", &a.spec()]) else {
        return;
    };
    a.set_answer_twice(Duration::from_millis(100));
    let one = q.client("127.0.0.2");
    assert_eq!(one.ask(WAIT), Some(a.ip()));
    let stray_to = a.last_sender().expect("a datagram");
    wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
    wait_until(WAIT, "the server sends its copy", || a.answered() == 2);
    a.set_answer_twice(Duration::ZERO);

    let two = q.client("127.0.0.3");
    let asked = two.sock.local_addr().unwrap();
    assert_eq!(two.ask(WAIT), Some(a.ip()));
    assert_ne!(
        a.last_sender(),
        Some(stray_to),
        "{asked}'s flow got a new socket, not the one the copy came to"
    );
    assert_eq!(two.receive(SHORT), None, "nothing else reaches {asked}");
    assert_eq!(one.receive(SHORT), None, "the copy is dropped");
}

#[test]
fn with_two_responses_a_flow_passes_both_then_ends() {
    if skip_on_pen("udp_responses is a quill extension") {
        return;
    }
    let a = DnsBackend::start(1);
    let Some((q, cport)) = quill(2, &["{port}", &a.spec()]) else {
        return;
    };
    a.set_answer_twice(Duration::from_millis(50));
    let client = q.client("127.0.0.2");
    assert_eq!(client.ask(WAIT), Some(a.ip()));
    assert!(
        client.receive(WAIT).is_some(),
        "the second answer reaches the client"
    );
    wait_until(WAIT, "the flow ends after its second answer", || {
        no_flows_open(cport)
    });
}

/// Without `udp_responses` (Pen's behaviour) an answered flow stays until it is idle: the
/// client's next query goes on the same flow.
#[test]
fn by_default_an_answered_flow_stays_open() {
    if skip_on_pen("quill's connection numbers") {
        return;
    }
    let a = DnsBackend::start(1);
    let Some((q, cport)) = with_control(&["{port}", &a.spec()]) else {
        return;
    };
    assert_eq!(control(cport, "udp_responses").unwrap().trim(), "0");
    let client = q.client("127.0.0.2");
    for _ in 0..3 {
        assert_eq!(client.ask(WAIT), Some(a.ip()));
    }
    let listed = control(cport, "connections").unwrap();
    assert_eq!(listed.lines().count(), 1, "{listed}");
    assert!(listed.starts_with("connection 1 "), "{listed}");
}

/// Spare sockets are kept while flows keep taking them, and closed once none did for a
/// few seconds: those of a server that left the configuration while its neighbour's are in
/// use, and every one once the clients stop.
#[test]
fn spare_sockets_no_flow_takes_are_closed() {
    if skip_on_pen("udp_responses is a quill extension") {
        return;
    }
    const TRIMMED: Duration = Duration::from_secs(20);
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let c = DnsBackend::start(3);
    let Some((q, cport)) = quill(1, &["-r", "{port}", &a.spec(), &b.spec()]) else {
        return;
    };
    let ask = |n: &mut u32| {
        *n += 1;
        let client = q.client(&format!("127.0.1.{}", *n % 200 + 1));
        let answer = client.ask(WAIT).expect("an answer");
        wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
        answer
    };
    let mut n = 0;
    let picks = [ask(&mut n), ask(&mut n)];
    assert!(
        picks.contains(&a.ip()) && picks.contains(&b.ip()),
        "{picks:?}"
    );
    assert_eq!(
        q.flows_to(a.addr()),
        1,
        "a's socket is kept for the next flow"
    );

    // Server 0 is now c: a's spare socket is never taken again, b's is, at each query.
    let addr = c.addr();
    let moved = format!("server 0 address {} port {}", addr.ip(), addr.port());
    assert_eq!(control(cport, &moved).unwrap().trim(), "");
    wait_until(TRIMMED, "a's spare socket closed", || {
        ask(&mut n);
        q.flows_to(a.addr()) == 0
    });
    assert_eq!(q.flows_to(b.addr()), 1, "b's socket serves b's flows");
    assert_eq!(q.flows_to(c.addr()), 1, "c's socket serves c's flows");

    // The clients stop: no socket stays open for them.
    wait_until(TRIMMED, "every spare socket closed", || {
        q.flows_to(b.addr()) + q.flows_to(c.addr()) == 0
    });
}

/// Spare sockets hold descriptors outside `conn_max`: a loop out of descriptors for a new
/// flow's socket closes them and serves the flow.
#[test]
fn out_of_descriptors_a_new_flow_takes_those_of_the_spare_sockets() {
    if skip_on_pen("udp_responses is a quill extension") {
        return;
    }
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let c = DnsBackend::start(3);
    let Some((q, cport)) = quill(1, &["-r", "{port}", &a.spec(), &b.spec()]) else {
        return;
    };
    for n in 2..4 {
        q.client(&format!("127.0.0.{n}"))
            .ask(WAIT)
            .expect("an answer");
        wait_until(WAIT, "the answered flow ends", || no_flows_open(cport));
    }
    assert_eq!(q.flows_to(a.addr()) + q.flows_to(b.addr()), 2, "two spares");
    let addr = c.addr();
    let moved = format!("server 0 address {} port {}", addr.ip(), addr.port());
    assert_eq!(control(cport, &moved).unwrap().trim(), "");

    // No descriptor left: a flow to c needs a new socket. (Nor is one left for a control
    // connection, so the answers alone tell what happened.)
    support::set_fd_limit(q.pid(), support::lowest_free_fd(q.pid()) as u64);
    let mut answers = Vec::new();
    for n in 4..6 {
        answers.push(q.client(&format!("127.0.0.{n}")).ask(WAIT));
    }
    assert!(answers.contains(&Some(c.ip())), "{answers:?}");
    assert_eq!(q.flows_to(a.addr()), 0, "a's spare socket closed");
}
