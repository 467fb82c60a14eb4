//! Failover, blacklisting, the emergency server, the abuse server and access
//! control lists.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::time::{Duration, Instant};

use support::*;

/// quill in round robin over `servers` (`-r`), a connect timeout of 1 s and `blacklist`
/// seconds of blacklisting.
fn round_robin(servers: &[&str], blacklist: &str) -> Quill {
    let mut args = vec!["-b", blacklist, "-r", "-t", "1", "127.0.0.1:{port}"];
    args.extend_from_slice(servers);
    Quill::start(&args)
}

#[test]
fn failover_to_a_live_server_is_invisible_to_the_client() {
    if skip_on_pen("Pen 0.34 closes the client whose server failed to connect") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = round_robin(&[&a.spec(), &b.spec()], "2");
    a.stop();

    for i in 0..6 {
        let (name, _) = q.name_from("127.0.0.1");
        assert_eq!(
            name,
            "b",
            "connection #{} was not served by the live server",
            i + 1
        );
    }
}

#[test]
fn failover_from_an_unresponsive_server_is_invisible_to_the_client() {
    let a = UnresponsiveBackend::start();
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-r", "-t", "1", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    for i in 0..4 {
        let start = Instant::now();
        let (name, _) = q.name_from("127.0.0.1");
        assert_eq!(
            name,
            "b",
            "connection #{} was not served by the live server",
            i + 1
        );
        // At most one connect timeout (1 s) is spent on the dead server.
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "connection #{} took {:?}",
            i + 1,
            start.elapsed()
        );
    }
}

#[test]
fn a_refused_server_is_not_tried_before_its_blacklist_time() {
    if skip_on_pen("Pen 0.34 does not blacklist a server that refuses connections") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = round_robin(&[&a.spec(), &b.spec()], "30");
    a.stop();
    for _ in 0..2 {
        assert_eq!(q.name_from("127.0.0.1").0, "b");
    }
    a.restart();

    for i in 0..6 {
        let (name, _) = q.name_from("127.0.0.1");
        assert_eq!(
            name,
            "b",
            "connection #{} went to a blacklisted server",
            i + 1
        );
    }
    assert_eq!(
        a.accepted(),
        0,
        "the blacklisted server was contacted within its 30 s blacklist"
    );
}

/// An operator sees a server taken out of use at the default log level, as a warning that
/// names it; the connections that go elsewhere meanwhile add nothing to the log.
#[test]
fn a_blacklisted_server_is_a_warning_in_the_log() {
    if skip_on_pen("Pen 0.34 does not blacklist a server that refuses connections") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = round_robin(&[&a.spec(), &b.spec()], "30");
    a.stop();
    for _ in 0..6 {
        assert_eq!(q.name_from("127.0.0.1").0, "b");
    }
    let warnings = || {
        q.stderr()
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("blacklisted for 30 s"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    wait_until(Duration::from_secs(5), "the blacklisting's warning", || {
        !warnings().is_empty()
    });
    let lines = warnings();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains(&a.spec()), "{lines:?}");
}

#[test]
fn an_unresponsive_server_is_not_tried_before_its_blacklist_time() {
    let a = UnresponsiveBackend::start();
    let b = IdentityBackend::start("b");
    let q = round_robin(&[&a.spec(), &b.spec()], "30");

    // The first attempt on a times out after 1 s; a is blacklisted then.
    for _ in 0..2 {
        assert_eq!(q.name_from("127.0.0.1").0, "b");
    }
    // From now on no connection waits for a.
    for i in 0..6 {
        let start = Instant::now();
        let (name, _) = q.name_from("127.0.0.1");
        assert_eq!(name, "b");
        assert!(
            start.elapsed() < Duration::from_millis(800),
            "connection #{} took {:?}: the blacklisted server was tried again",
            i + 1,
            start.elapsed()
        );
    }
}

#[test]
fn a_refused_server_serves_again_after_the_blacklist_time() {
    if skip_on_pen("Pen 0.34 does not blacklist a server that refuses connections") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = round_robin(&[&a.spec(), &b.spec()], "2");
    a.stop();
    for _ in 0..2 {
        assert_eq!(q.name_from("127.0.0.1").0, "b");
    }
    a.restart();
    expect_server_back(&q, "a");
}

#[test]
fn an_unresponsive_server_serves_again_after_the_blacklist_time() {
    let a = UnresponsiveBackend::start();
    let b = IdentityBackend::start("b");
    let q = round_robin(&[&a.spec(), &b.spec()], "2");
    for _ in 0..2 {
        assert_eq!(q.name_from("127.0.0.1").0, "b");
    }
    let _a = a.revive("a");
    expect_server_back(&q, "a");
}

/// Polls (10 s) until a connection through `q` is served by `name`.
fn expect_server_back(q: &Quill, name: &str) {
    let start = Instant::now();
    let mut seen = Vec::new();
    let back = poll_until(Duration::from_secs(10), || {
        let mut s = q.connect_from("127.0.0.1");
        let got = backend_name(&mut s);
        seen.push(got.clone());
        got.as_deref() == Some(name)
    });
    assert!(
        back,
        "server {name} did not serve again within 10 s (blacklist 2 s); answers: {seen:?}"
    );
    eprintln!("{name} served again after {:?}", start.elapsed());
}

#[test]
fn emergency_server_serves_when_all_servers_are_down() {
    if skip_on_pen("Pen 0.34 closes (or stalls) clients when all servers refuse, without using -e")
    {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let e = IdentityBackend::start("emergency");
    let emergency = e.spec();
    let q = Quill::start(&[
        "-t",
        "1",
        "-e",
        &emergency,
        "127.0.0.1:{port}",
        &a.spec(),
        &b.spec(),
    ]);
    a.stop();
    b.stop();

    for (i, src) in ["127.0.0.1", "127.0.0.2", "127.0.0.1"].iter().enumerate() {
        let (name, _) = q.name_from(src);
        assert_eq!(
            name,
            "emergency",
            "connection #{} was not served by the emergency server",
            i + 1
        );
    }
}

#[test]
fn emergency_server_serves_when_all_servers_are_unresponsive() {
    let a = UnresponsiveBackend::start();
    let e = IdentityBackend::start("emergency");
    let emergency = e.spec();
    let q = Quill::start(&["-t", "1", "-e", &emergency, "127.0.0.1:{port}", &a.spec()]);

    for (i, src) in ["127.0.0.1", "127.0.0.2", "127.0.0.1"].iter().enumerate() {
        let (name, _) = q.name_from(src);
        assert_eq!(
            name,
            "emergency",
            "connection #{} was not served by the emergency server",
            i + 1
        );
    }
}

#[test]
fn emergency_server_is_unused_while_a_server_is_up() {
    let a = IdentityBackend::start("a");
    let e = IdentityBackend::start("emergency");
    let emergency = e.spec();
    let q = Quill::start(&["-r", "-e", &emergency, "127.0.0.1:{port}", &a.spec()]);
    for _ in 0..4 {
        assert_eq!(q.name_from("127.0.0.1").0, "a");
    }
    assert_eq!(e.accepted(), 0);
}

#[test]
fn without_emergency_server_a_client_is_closed_when_all_servers_are_down() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-t", "1", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    a.stop();
    b.stop();

    for src in ["127.0.0.1", "127.0.0.2"] {
        let mut s = q.connect_from(src);
        // Connect timeout 1 s (refusals are immediate anyway) plus a margin.
        expect_closed_without_data(&mut s, Duration::from_secs(3));
    }
}

/// A lone server that refused while it restarted is tried again by clients even though it
/// is blacklisted (no other server is left to try; one client a second): a server back
/// after a few seconds serves within a second instead of after its blacklist time, with
/// every client turned away meanwhile (before: 30 s of refusals after a 3-s broker restart, where HAProxy and
/// NGINX reconnected every client within a second). Being served, it is in use again.
#[test]
fn a_lone_server_back_from_a_restart_serves_at_once_despite_its_blacklist() {
    if skip_on_pen("Pen 0.34 does not blacklist a server that refuses connections") {
        return;
    }
    let a = IdentityBackend::start("a");
    let q = Quill::start(&["-b", "60", "-t", "1", "-d", "127.0.0.1:{port}", &a.spec()]);
    a.stop();
    let mut s = q.connect_from("127.0.0.1");
    expect_closed_without_data(&mut s, Duration::from_secs(3));
    wait_until(Duration::from_secs(5), "the blacklisting logged", || {
        q.stderr().contains("blacklisted for 60 s")
    });
    a.restart();
    // A blacklisted server is tried at most once a second: within a few, not 60 s.
    let back = poll_until(Duration::from_secs(5), || {
        let mut s = q.connect_from("127.0.0.1");
        backend_name(&mut s).is_some()
    });
    assert!(
        back,
        "the blacklisted server back from its restart served no one"
    );
    wait_until(Duration::from_secs(5), "its return logged", || {
        q.stderr().contains("answers again: no longer blacklisted")
    });
    for _ in 0..3 {
        assert_eq!(q.name_from("127.0.0.1").0, "a");
    }
}

/// What the operator blacklisted stays out even when nothing else is left: only a failed
/// connect's blacklist is tried past.
#[test]
fn a_server_blacklisted_by_hand_is_not_tried_when_nothing_else_is_left() {
    if skip_on_pen("status json is quill's") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = support::ctl::start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    support::ctl::ctl_ok(&ctl, "server 0 blacklist 60");
    let mut s = q.connect_from("127.0.0.1");
    expect_closed_without_data(&mut s, Duration::from_secs(3));
    assert_eq!(a.accepted(), 0, "the operator's blacklist was passed");
}

#[test]
fn denied_client_goes_to_the_abuse_server() {
    let a = IdentityBackend::start("a");
    let abuse = IdentityBackend::start("abuse");
    let abuse_spec = abuse.spec();
    let q = Quill::start(&[
        "-B",
        &abuse_spec,
        "-O",
        "acl 1 deny 127.0.0.2",
        "-O",
        "client_acl 1",
        "127.0.0.1:{port}",
        &a.spec(),
    ]);

    assert_eq!(
        q.name_from("127.0.0.2").0,
        "abuse",
        "denied client not sent to the abuse server"
    );
    assert_eq!(
        q.name_from("127.0.0.1").0,
        "a",
        "permitted client not sent to the server"
    );
    assert_eq!(q.name_from("127.0.0.2").0, "abuse");
}

#[test]
fn denied_client_is_closed_without_an_abuse_server() {
    let a = IdentityBackend::start("a");
    let q = Quill::start(&[
        "-O",
        "acl 1 deny 127.0.0.2",
        "-O",
        "client_acl 1",
        "127.0.0.1:{port}",
        &a.spec(),
    ]);

    let mut s = q.connect_from("127.0.0.2");
    expect_closed_without_data(&mut s, Duration::from_secs(5));
    assert_eq!(a.accepted(), 0, "a denied client reached the server");
    assert_eq!(
        q.name_from("127.0.0.1").0,
        "a",
        "permitted client not served"
    );
}

#[test]
fn permit_list_admits_listed_clients_only() {
    let a = IdentityBackend::start("a");
    let q = Quill::start(&[
        "-O",
        "acl 2 permit 127.0.0.1",
        "-O",
        "client_acl 2",
        "127.0.0.1:{port}",
        &a.spec(),
    ]);

    assert_eq!(q.name_from("127.0.0.1").0, "a", "listed client not served");
    let mut s = q.connect_from("127.0.0.3");
    expect_closed_without_data(&mut s, Duration::from_secs(5));
    assert_eq!(a.accepted(), 1, "an unlisted client reached the server");
}

#[test]
fn acl_mask_matches_a_whole_network() {
    let a = IdentityBackend::start("a");
    let q = Quill::start(&[
        "-O",
        "acl 4 deny 127.0.1.0 255.255.255.0",
        "-O",
        "client_acl 4",
        "127.0.0.1:{port}",
        &a.spec(),
    ]);

    for src in ["127.0.1.1", "127.0.1.200"] {
        let mut s = q.connect_from(src);
        expect_closed_without_data(&mut s, Duration::from_secs(5));
    }
    assert_eq!(
        q.name_from("127.0.2.1").0,
        "a",
        "client outside the denied network not served"
    );
}

#[test]
fn server_acl_keeps_denied_clients_off_that_server() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&[
        "-r",
        "-O",
        "acl 3 deny 127.0.0.4",
        "-O",
        "server 0 acl 3",
        "127.0.0.1:{port}",
        &a.spec(),
        &b.spec(),
    ]);

    for i in 0..6 {
        let mut s = q.connect_from("127.0.0.4");
        let name = backend_name(&mut s);
        assert_ne!(
            name.as_deref(),
            Some("a"),
            "connection #{} of a denied client reached server 0",
            i + 1
        );
    }
    let names: Vec<String> = (0..4).map(|_| q.name_from("127.0.0.1").0).collect();
    assert!(
        names.iter().any(|n| n == "a"),
        "server 0 no longer serves permitted clients: {names:?}"
    );
}

#[test]
fn ipv6_acl_denies_an_ipv6_client() {
    if !ipv6_available() {
        eprintln!("SKIPPED: ::1 is not available on this host");
        return;
    }
    let a = IdentityBackend::start("a");
    let q = Quill::start(&[
        "-O",
        "acl 5 deny ::1",
        "-O",
        "client_acl 5",
        "::1:{port}",
        &a.spec(),
    ]);
    let mut s = q.connect();
    expect_closed_without_data(&mut s, Duration::from_secs(5));
    assert_eq!(a.accepted(), 0, "a denied IPv6 client reached the server");
}

#[test]
fn ipv6_acl_with_a_prefix_length_permits_its_network() {
    if !ipv6_available() {
        eprintln!("SKIPPED: ::1 is not available on this host");
        return;
    }
    let a = IdentityBackend::start("a");
    let q = Quill::start(&[
        "-O",
        "acl 6 permit ::/64",
        "-O",
        "client_acl 6",
        "::1:{port}",
        &a.spec(),
    ]);
    assert_eq!(
        q.name_from("::1").0,
        "a",
        "a client inside ::/64 was not served"
    );
}
