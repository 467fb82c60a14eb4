//! Server selection: client tracking, round robin, hash, weight, priority,
//! soft and hard connection limits, stubbornness.
//!
//! Distinct clients are played by distinct loopback source addresses
//! (127.0.0.x), since Pen-style tracking is per client IP address.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::Write;
use std::time::Duration;

use support::*;

#[test]
fn tracking_keeps_a_client_on_its_server() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (first, _held) = q.name_from("127.0.0.1");
    for i in 0..6 {
        let (name, _) = q.name_from("127.0.0.1");
        assert_eq!(
            name,
            first,
            "connection #{} of 127.0.0.1 changed server",
            i + 2
        );
    }
}

#[test]
fn tracking_sends_a_new_client_to_the_next_server() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (first, _) = q.name_from("127.0.0.1");
    let (second, _) = q.name_from("127.0.0.2");
    assert_ne!(
        second, first,
        "a new client should take the next server in turn"
    );
    for _ in 0..4 {
        assert_eq!(
            q.name_from("127.0.0.2").0,
            second,
            "127.0.0.2 changed server"
        );
        assert_eq!(
            q.name_from("127.0.0.1").0,
            first,
            "127.0.0.1 changed server"
        );
    }
}

#[test]
fn round_robin_alternates_between_servers_for_the_same_client() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let names: Vec<String> = (0..8).map(|_| q.name_from("127.0.0.1").0).collect();
    for i in 1..names.len() {
        assert_ne!(
            names[i],
            names[i - 1],
            "round robin repeated a server: {names:?}"
        );
    }
    for i in 2..names.len() {
        assert_eq!(
            names[i],
            names[i - 2],
            "round robin is not a strict alternation: {names:?}"
        );
    }
}

#[test]
fn hash_keeps_every_client_address_on_one_server() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-h", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    for x in 1..=8 {
        let src = format!("127.0.0.{x}");
        let first = q.name_from(&src).0;
        for _ in 0..3 {
            assert_eq!(
                q.name_from(&src).0,
                first,
                "client {src} changed server under -h"
            );
        }
    }
}

#[test]
fn hash_maps_a_client_address_to_the_same_server_in_every_instance() {
    // The hash depends only on the client's address, so two balancers with the
    // same server list agree on where each client goes.
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let c = IdentityBackend::start("c");
    let (sa, sb, sc) = (a.spec(), b.spec(), c.spec());
    let args = ["-h", "127.0.0.1:{port}", &sa, &sb, &sc];
    let q1 = Quill::start(&args);
    let q2 = Quill::start(&args);

    // Visit the clients in opposite orders so that any round-robin state would
    // produce different answers.
    let srcs: Vec<String> = (1..=9).map(|x| format!("127.0.0.{x}")).collect();
    let from_q1: Vec<String> = srcs.iter().map(|s| q1.name_from(s).0).collect();
    let mut from_q2: Vec<String> = srcs.iter().rev().map(|s| q2.name_from(s).0).collect();
    from_q2.reverse();
    assert_eq!(
        from_q1, from_q2,
        "two -h balancers disagree on client placement for {srcs:?}"
    );
}

#[test]
fn weights_split_connections_in_proportion() {
    let light = IdentityBackend::start("light");
    let heavy = IdentityBackend::start("heavy");
    let q = Quill::start(&[
        "-W",
        "-r",
        "-x",
        "1000",
        "127.0.0.1:{port}",
        &light.spec_with("0:0:1"),
        &heavy.spec_with("0:0:3"),
    ]);

    let mut held = Vec::with_capacity(400);
    let mut names = Vec::with_capacity(400);
    for i in 0..400 {
        let (name, s) = q.name_from(&format!("127.0.0.{}", 1 + i % 50));
        names.push(name);
        held.push(s);
    }
    let t = tally(&names);
    let l = t.get("light").copied().unwrap_or(0);
    let h = t.get("heavy").copied().unwrap_or(0);
    assert_eq!(l + h, 400, "unexpected servers: {t:?}");
    assert!(
        (85..=115).contains(&l),
        "weight 1 server got {l} of 400 (want ~100): {t:?}"
    );
    assert!(
        (285..=315).contains(&h),
        "weight 3 server got {h} of 400 (want ~300): {t:?}"
    );
}

#[test]
fn prio_sends_every_connection_to_the_best_priority_server() {
    let first = IdentityBackend::start("prio1");
    let second = IdentityBackend::start("prio2");
    let q = Quill::start(&[
        "-r",
        "-O",
        "prio",
        "127.0.0.1:{port}",
        &second.spec_with("0:0:1:2"),
        &first.spec_with("0:0:1:1"),
    ]);

    let mut held = Vec::new();
    for i in 0..6 {
        let (name, s) = q.name_from("127.0.0.1");
        assert_eq!(
            name,
            "prio1",
            "connection #{} did not go to the prio 1 server",
            i + 1
        );
        held.push(s);
    }
}

#[test]
fn prio_overflows_to_the_next_priority_when_the_best_server_is_full() {
    let first = IdentityBackend::start("prio1");
    let second = IdentityBackend::start("prio2");
    let q = Quill::start(&[
        "-r",
        "-O",
        "prio",
        "127.0.0.1:{port}",
        &first.spec_with("3:3:1:1"),
        &second.spec_with("0:0:1:2"),
    ]);

    let mut held = Vec::new();
    for i in 0..3 {
        let (name, s) = q.name_from(&format!("127.0.0.{}", 11 + i));
        assert_eq!(
            name,
            "prio1",
            "connection #{} did not go to the prio 1 server",
            i + 1
        );
        held.push(s);
    }
    let (name, _s) = q.name_from("127.0.0.14");
    assert_eq!(
        name, "prio2",
        "the 4th concurrent connection should overflow to prio 2"
    );
}

#[test]
fn soft_limit_caps_new_clients_on_a_server() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-r", "127.0.0.1:{port}", &a.spec_with("2:4"), &b.spec()]);

    let mut held = Vec::new();
    let mut names = Vec::new();
    for i in 0..6 {
        let (name, s) = q.name_from(&format!("127.0.0.{}", 11 + i));
        names.push(name);
        held.push(s);
    }
    let t = tally(&names);
    assert_eq!(
        t.get("a").copied().unwrap_or(0),
        2,
        "server a (max 2) should hold exactly 2: {names:?}"
    );
    assert_eq!(
        t.get("b").copied().unwrap_or(0),
        4,
        "the others should go to b: {names:?}"
    );
}

#[test]
fn hard_limit_lets_a_known_client_return_beyond_the_soft_limit() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    // No -r: clients are tracked.  Server a: soft limit 2, hard limit 4.
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec_with("2:4"), &b.spec()]);

    let mut held = Vec::new();
    // Find a client that round robin sends to a (one of the first two new ones).
    let mut known = None;
    for x in 21..24 {
        let src = format!("127.0.0.{x}");
        let (name, s) = q.name_from(&src);
        held.push(s);
        if name == "a" {
            known = Some(src);
            break;
        }
    }
    let known = known.expect("no new client was ever sent to server a");
    assert_eq!(a.open(), 1);

    // Second connection of the known client: a reaches its soft limit (2).
    let (name, s) = q.name_from(&known);
    assert_eq!(name, "a", "tracked client {known} left its server");
    held.push(s);

    // A new client no longer gets a: it is at its soft limit.
    let (name, s) = q.name_from("127.0.0.30");
    assert_eq!(
        name, "b",
        "a new client was sent to a server at its soft limit"
    );
    held.push(s);

    // The known client still gets a, up to the hard limit (4).
    for n in 3..=4 {
        let (name, s) = q.name_from(&known);
        assert_eq!(
            name,
            "a",
            "known client refused its server at {} connections (hard limit 4)",
            n - 1
        );
        held.push(s);
    }
    a.wait_open(4, Duration::from_secs(5));

    // Beyond the hard limit it must not get a.
    let mut s = q.connect_from(&known);
    let name = backend_name(&mut s);
    assert_ne!(
        name.as_deref(),
        Some("a"),
        "server a exceeded its hard limit of 4"
    );
    assert!(
        a.open() <= 4,
        "server a has {} connections, hard limit 4",
        a.open()
    );
}

#[test]
fn stubborn_closes_the_client_when_its_server_is_down() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-s", "-t", "1", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (name, _) = q.name_from("127.0.0.1");
    let (chosen, other) = if name == "a" { (&a, &b) } else { (&b, &a) };
    chosen.stop();

    let mut s = q.connect_from("127.0.0.1");
    expect_closed_without_data(&mut s, Duration::from_secs(5));
    assert_eq!(
        other.accepted(),
        0,
        "a stubborn balancer failed over to {}",
        other.name()
    );
}

#[test]
fn stubborn_closes_the_client_when_its_server_does_not_answer() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-s", "-t", "1", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (name, _) = q.name_from("127.0.0.1");
    let (chosen, other) = if name == "a" { (&a, &b) } else { (&b, &a) };
    chosen.stop();
    let _hung = UnresponsiveBackend::start_on(chosen.addr());

    let mut s = q.connect_from("127.0.0.1");
    // Closed once the 1 s connect timeout expires.
    expect_closed_without_data(&mut s, Duration::from_secs(5));
    assert_eq!(
        other.accepted(),
        0,
        "a stubborn balancer failed over to {}",
        other.name()
    );
}

#[test]
fn without_stubborn_a_tracked_client_fails_over_when_its_server_is_down() {
    if skip_on_pen("Pen 0.34 closes the client when its server refuses the connection") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-t", "1", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (name, _) = q.name_from("127.0.0.1");
    let (chosen, other) = if name == "a" { (&a, &b) } else { (&b, &a) };
    chosen.stop();

    let (name, _) = q.name_from("127.0.0.1");
    assert_eq!(
        name,
        other.name(),
        "the client was not failed over to the live server"
    );
}

#[test]
fn without_stubborn_a_tracked_client_fails_over_when_its_server_does_not_answer() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-t", "1", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (name, _) = q.name_from("127.0.0.1");
    let (chosen, other) = if name == "a" { (&a, &b) } else { (&b, &a) };
    chosen.stop();
    let _hung = UnresponsiveBackend::start_on(chosen.addr());

    let (name, _) = q.name_from("127.0.0.1");
    assert_eq!(
        name,
        other.name(),
        "the client was not failed over to the live server"
    );
}

/// `status json`'s count of clients waiting for room (`queue_timeout`), and of waits
/// that ran out.
fn queue_counts(ctl: &str) -> (u64, u64) {
    let status = support::ctl::status_json(ctl);
    let c = &status["connections"];
    (
        c["queued"].as_u64().expect("queued"),
        c["queue_timeouts"].as_u64().expect("queue_timeouts"),
    )
}

#[test]
fn a_client_finding_its_servers_full_waits_for_room_within_queue_timeout() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-O",
        "queue_timeout 10",
        "127.0.0.1:{port}",
        &a.spec_with("1"),
    ]);
    let (name, first) = q.name_from("127.0.0.21");
    assert_eq!(name, "a");
    // Server a is at its max: the next client waits instead of being closed...
    let addr = q.addr();
    let second = std::thread::spawn(move || {
        let mut s = client_from("127.0.0.22", addr).expect("connect");
        backend_name(&mut s)
    });
    wait_until(Duration::from_secs(5), "the second client queued", || {
        queue_counts(&ctl) == (1, 0)
    });
    assert_eq!(a.open(), 1, "server a went past its max");
    // ...and gets the server as soon as the first client leaves it.
    drop(first);
    assert_eq!(second.join().unwrap().as_deref(), Some("a"));
    assert_eq!(queue_counts(&ctl), (0, 0));

    // A wait that runs out ends as Pen ends a client with no server: closed.
    support::ctl::ctl_ok(&ctl, "queue_timeout 1");
    let (_, holder) = q.name_from("127.0.0.23");
    let mut third = q.connect_from("127.0.0.24");
    wait_until(Duration::from_secs(5), "the third client queued", || {
        queue_counts(&ctl).0 == 1
    });
    expect_closed_without_data(&mut third, Duration::from_secs(5));
    assert_eq!(queue_counts(&ctl), (0, 1));

    // Without queue_timeout (Pen's way, the default) such a client is closed at once.
    support::ctl::ctl_ok(&ctl, "queue_timeout 0");
    let mut fourth = q.connect_from("127.0.0.25");
    expect_closed_without_data(&mut fourth, Duration::from_secs(5));
    assert_eq!(queue_counts(&ctl), (0, 1));
    drop(holder);
}

/// `status json`'s count of clients that left while they waited for room.
fn queue_abandoned(ctl: &str) -> u64 {
    let status = support::ctl::status_json(ctl);
    status["connections"]["queue_abandoned"]
        .as_u64()
        .expect("queue_abandoned")
}

/// A server with `max 1` and a long `queue_timeout`, held by a first client (returned).
fn full_server_with_queue(holder: &str) -> (IdentityBackend, Quill, String, std::net::TcpStream) {
    let a = IdentityBackend::start("a");
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-O",
        "queue_timeout 30",
        "127.0.0.1:{port}",
        &a.spec_with("1"),
    ]);
    let (name, first) = q.name_from(holder);
    assert_eq!(name, "a");
    (a, q, ctl, first)
}

/// A client from `from` that connects and is seen waiting: `waiting` clients in the queue,
/// none timed out.
fn queued_from(q: &Quill, ctl: &str, from: &str, waiting: u64) -> std::net::TcpStream {
    let client = q.connect_from(from);
    wait_until(Duration::from_secs(5), format!("{from} queued"), || {
        queue_counts(ctl) == (waiting, 0)
    });
    client
}

#[test]
fn a_queued_client_that_leaves_gives_up_its_place_at_once() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (a, q, ctl, first) = full_server_with_queue("127.0.0.41");
    let second = queued_from(&q, &ctl, "127.0.0.42", 1);
    // It closes without having sent a byte: seen at once, not when room comes or the
    // 30 s run out.
    drop(second);
    wait_until(
        Duration::from_secs(5),
        "the second client left the queue",
        || queue_counts(&ctl) == (0, 0),
    );
    assert_eq!(queue_abandoned(&ctl), 1);
    // The place the first client leaves goes to no client that is gone: the next one
    // gets it, and the server saw no connection in between.
    drop(first);
    let (name, _third) = q.name_from("127.0.0.43");
    assert_eq!(name, "a");
    assert_eq!(
        a.accepted(),
        2,
        "a connection was made for a client that had left"
    );
    assert_eq!(queue_abandoned(&ctl), 1);
}

/// `close N` on a client waiting in the queue ends it there: quill's doing, not a client
/// that left (`queue_abandoned` stays 0).
#[test]
fn close_n_ends_a_queued_client_without_counting_it_abandoned() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (a, q, ctl, first) = full_server_with_queue("127.0.0.71");
    let mut second = queued_from(&q, &ctl, "127.0.0.72", 1);
    let listed = support::ctl::ctl_ok(&ctl, "connections");
    let number = listed
        .lines()
        .find(|l| l.contains(&format!("client {} ", second.local_addr().unwrap())))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("the queued client is not listed: {listed}"))
        .to_string();
    assert_eq!(support::ctl::ctl_ok(&ctl, &format!("close {number}")), "");
    expect_closed_without_data(&mut second, Duration::from_secs(5));
    wait_until(Duration::from_secs(5), "the queue emptied", || {
        queue_counts(&ctl) == (0, 0)
    });
    assert_eq!(
        queue_abandoned(&ctl),
        0,
        "quill's close counted as the client's"
    );
    drop(first);
    let (name, _next) = q.name_from("127.0.0.73");
    assert_eq!(name, "a");
    assert_eq!(a.accepted(), 2);
}

#[test]
fn a_queued_client_that_sent_its_request_and_half_closed_is_still_served() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (a, q, ctl, first) = full_server_with_queue("127.0.0.51");
    // As `nc -N`: the request, then the write side shut, while it waits.
    let mut second = queued_from(&q, &ctl, "127.0.0.52", 1);
    second.write_all(b"request\n").expect("write");
    second
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    // A client that closes without a word, queued behind it, is taken as gone: by then
    // the second client's end has come too, and it still waits.
    let third = queued_from(&q, &ctl, "127.0.0.53", 2);
    drop(third);
    wait_until(
        Duration::from_secs(5),
        "the third client left the queue",
        || queue_abandoned(&ctl) == 1,
    );
    assert_eq!(
        queue_counts(&ctl),
        (1, 0),
        "the half-closed client was dropped"
    );
    // Room comes: the second client gets its answer (the name, its request echoed).
    drop(first);
    assert_eq!(backend_name(&mut second).as_deref(), Some("a"));
    let (echoed, _) = expect_closed(&mut second, Duration::from_secs(5));
    assert_eq!(echoed, b"request\n");
    assert_eq!(a.accepted(), 2);
    assert_eq!(queue_counts(&ctl), (0, 0));
}

#[test]
fn a_queued_client_that_is_reset_gives_up_its_place_at_once() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (a, q, ctl, first) = full_server_with_queue("127.0.0.61");
    // SO_LINGER 0: the close is a reset.
    let reset = |s: std::net::TcpStream| {
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .expect("SO_LINGER");
        drop(s);
    };
    // One that had sent nothing, then one that had sent bytes (only an error gives it
    // away: its bytes keep its socket readable).
    let silent = queued_from(&q, &ctl, "127.0.0.62", 1);
    reset(silent);
    wait_until(
        Duration::from_secs(5),
        "the silent client left the queue",
        || queue_counts(&ctl) == (0, 0) && queue_abandoned(&ctl) == 1,
    );
    let mut talker = q.connect_from("127.0.0.63");
    talker.write_all(b"request\n").expect("write");
    wait_until(Duration::from_secs(5), "the talking client queued", || {
        queue_counts(&ctl) == (1, 0)
    });
    reset(talker);
    wait_until(
        Duration::from_secs(5),
        "the talking client left the queue",
        || queue_counts(&ctl) == (0, 0) && queue_abandoned(&ctl) == 2,
    );
    // The next client gets the place the first one leaves; none was made in between.
    drop(first);
    let (name, _next) = q.name_from("127.0.0.64");
    assert_eq!(name, "a");
    assert_eq!(
        a.accepted(),
        2,
        "a connection was made for a client that had left"
    );
}

/// Server `index`'s open connections and waiting clients, from `status json`.
fn server_queue(ctl: &str, index: usize) -> (u64, u64) {
    let status = support::ctl::status_json(ctl);
    let s = &status["servers"][index];
    (
        s["connections"].as_u64().expect("connections"),
        s["queued"].as_u64().expect("queued"),
    )
}

#[test]
fn waiting_clients_take_room_as_soon_as_a_change_makes_it() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (a, b) = (IdentityBackend::start("a"), IdentityBackend::start("b"));
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-O",
        "queue_timeout 30",
        "127.0.0.1:{port}",
        &a.spec_with("1"),
        &b.spec_with("1"),
    ]);
    support::ctl::ctl_ok(&ctl, "server 1 blacklist 60");
    let addr = q.addr();
    let waiting_client = move |src: &'static str| {
        std::thread::spawn(move || {
            // Each waits far less than queue_timeout: only the change can serve it in time.
            let mut s = client_from(src, addr).expect("connect");
            let name = backend_name(&mut s);
            (name, s)
        })
    };
    let (_, first) = q.name_from("127.0.0.31");

    // A raised max lets the waiting client in at once, while the first one stays.
    let second = waiting_client("127.0.0.32");
    wait_until(Duration::from_secs(5), "the second client queued", || {
        server_queue(&ctl, 0) == (1, 1)
    });
    support::ctl::ctl_ok(&ctl, "server 0 max 2");
    let (name, second) = second.join().unwrap();
    assert_eq!(name.as_deref(), Some("a"));

    // A server whose blacklist is lifted takes a client that waited for a full one.
    let third = waiting_client("127.0.0.33");
    wait_until(Duration::from_secs(5), "the third client queued", || {
        server_queue(&ctl, 0) == (2, 1)
    });
    support::ctl::ctl_ok(&ctl, "server 1 blacklist 0");
    let (name, third) = third.join().unwrap();
    assert_eq!(name.as_deref(), Some("b"));

    // So does one whose blacklist runs out: nothing rings then, the client looks again.
    drop(third);
    wait_until(Duration::from_secs(5), "server b free", || {
        server_queue(&ctl, 1).0 == 0
    });
    support::ctl::ctl_ok(&ctl, "server 1 blacklist 2");
    let fourth = waiting_client("127.0.0.34");
    let (name, _fourth) = fourth.join().unwrap();
    assert_eq!(name.as_deref(), Some("b"));
    assert_eq!(queue_counts(&ctl), (0, 0));
    drop((first, second));
}

#[test]
fn beyond_queue_max_a_client_finding_its_servers_full_is_not_let_wait() {
    if skip_on_pen("queue_max is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-O",
        "queue_timeout 30",
        "-O",
        "queue_max 1",
        "127.0.0.1:{port}",
        &a.spec_with("1"),
    ]);
    let (_, first) = q.name_from("127.0.0.51");
    let addr = q.addr();
    let second = std::thread::spawn(move || {
        let mut s = client_from("127.0.0.52", addr).expect("connect");
        backend_name(&mut s)
    });
    wait_until(Duration::from_secs(5), "the second client queued", || {
        queue_counts(&ctl) == (1, 0)
    });
    // The queue is full: the third client is closed at once, as without queue_timeout.
    let mut third = q.connect_from("127.0.0.53");
    let took = expect_closed_without_data(&mut third, Duration::from_secs(5));
    assert!(took < Duration::from_secs(5), "{took:?}");
    let status = support::ctl::status_json(&ctl);
    assert_eq!(status["connections"]["queue_full"], 1, "{status}");
    // The one waiting still gets its turn.
    drop(first);
    assert_eq!(second.join().unwrap().as_deref(), Some("a"));
    assert_eq!(queue_counts(&ctl), (0, 0));
}

#[test]
fn a_lowered_max_holds_while_clients_wait() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-O",
        "queue_timeout 30",
        "127.0.0.1:{port}",
        &a.spec_with("2"),
    ]);
    let (_, first) = q.name_from("127.0.0.41");
    let (_, second) = q.name_from("127.0.0.42");
    let addr = q.addr();
    let third = std::thread::spawn(move || {
        let mut s = client_from("127.0.0.43", addr).expect("connect");
        backend_name(&mut s)
    });
    wait_until(Duration::from_secs(5), "the third client queued", || {
        server_queue(&ctl, 0) == (2, 1)
    });
    support::ctl::ctl_ok(&ctl, "server 0 max 1");
    // The first client's place leaves the server at its new max: it is freed, not handed
    // to the waiting client.
    drop(first);
    wait_until(
        Duration::from_secs(5),
        "the first client's place freed",
        || server_queue(&ctl, 0) != (2, 1),
    );
    assert_eq!(
        server_queue(&ctl, 0),
        (1, 1),
        "the waiting client went past max 1"
    );
    assert_eq!(a.open(), 1);
    // The second one's place is room under max 1: the waiting client gets it.
    drop(second);
    assert_eq!(third.join().unwrap().as_deref(), Some("a"));
    assert_eq!(queue_counts(&ctl), (0, 0));
}
