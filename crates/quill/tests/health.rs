//! Active health checks, slow start and drain against the real binary: a killed backend is
//! taken out by its check (not by a failed client connect) after exactly `check_fall`
//! failures and comes back after `check_rise` successes; an HTTP check sends a real
//! request and a wrong status marks the server down; a drained server gets no new
//! connections while a long transfer on it runs to its end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener};
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use support::ctl::*;
use support::*;

const DEADLINE: Duration = Duration::from_secs(20);

fn names(q: &Quill, n: usize) -> Vec<String> {
    (0..n)
        .map(|_| {
            let (name, s) = q.name_from("127.0.0.1");
            drop(s);
            name
        })
        .collect()
}

#[test]
fn tcp_check_takes_a_killed_backend_out_and_brings_it_back() {
    if skip_on_pen("active health checks are a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&[
        "-r",
        "-O",
        "check tcp",
        "-O",
        "check_interval 50ms",
        "-O",
        "check_fall 3",
        "-O",
        "check_rise 2",
        "127.0.0.1:{port}",
        &a.spec(),
        &b.spec(),
    ]);
    wait_health(&ctl, 0, "up");
    wait_health(&ctl, 1, "up");
    let servers = ctl_ok(&ctl, "servers");
    assert!(servers.contains("state up health up"), "{servers}");

    a.stop();
    let down = wait_health(&ctl, 0, "down");
    // Taken out by exactly `fall` failed checks in a row, i.e. within interval x fall of
    // the first failure (the log says how many), and by the check, not by a client's
    // failed connect.
    wait_until(Duration::from_secs(5), "the change logged", || {
        q.stderr().contains("is down: 3 health check(s) failed")
    });
    assert!(down["checks_failed"].as_u64().unwrap() >= 3, "{down}");
    assert_eq!(down["state"], "down");
    assert_eq!(down["failures"], 0, "no client connect was tried: {down}");
    assert!(ctl_ok(&ctl, "servers")
        .lines()
        .next()
        .unwrap()
        .ends_with("state down health down"));
    assert!(names(&q, 6).iter().all(|n| n == "b"));
    assert_eq!(server_status(&ctl, 0)["failures"], 0);

    a.restart();
    let up = wait_health(&ctl, 0, "up");
    // Back after exactly `rise` successes (and the change is logged).
    wait_until(Duration::from_secs(5), "the change logged", || {
        q.stderr().contains("is up: 2 health check(s) passed")
    });
    assert!(
        up["checks_passed"].as_u64().unwrap() >= down["checks_passed"].as_u64().unwrap() + 2,
        "{up}"
    );
    let got = names(&q, 6);
    assert!(
        got.contains(&"a".to_string()) && got.contains(&"b".to_string()),
        "{got:?}"
    );
}

/// A small HTTP server answering every request with `status`, remembering the requests.
struct HttpBackend {
    port: u16,
    status: Arc<AtomicU16>,
    requests: Arc<Mutex<Vec<String>>>,
    served: Arc<AtomicUsize>,
}

impl HttpBackend {
    fn start(status: u16) -> HttpBackend {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let status = Arc::new(AtomicU16::new(status));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let served = Arc::new(AtomicUsize::new(0));
        let (st, rq, sv) = (status.clone(), requests.clone(), served.clone());
        thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { continue };
                let (st, rq, sv) = (st.clone(), rq.clone(), sv.clone());
                thread::spawn(move || {
                    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
                    let mut r = BufReader::new(s.try_clone().unwrap());
                    let mut head = String::new();
                    loop {
                        let mut line = String::new();
                        if r.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                            break;
                        }
                        head.push_str(&line);
                    }
                    if head.is_empty() {
                        return;
                    }
                    rq.lock().unwrap().push(head);
                    let code = st.load(Ordering::SeqCst);
                    let _ = write!(
                        s,
                        "HTTP/1.1 {code} Whatever\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                    );
                    sv.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        HttpBackend {
            port,
            status,
            requests,
            served,
        }
    }
}

#[test]
fn http_check_sends_a_real_request_and_a_wrong_status_marks_down() {
    if skip_on_pen("active health checks are a quill extension") {
        return;
    }
    let good = HttpBackend::start(200);
    let bad = HttpBackend::start(404);
    let (_q, ctl) = start_with_tcp_control(&[
        "-r",
        "-O",
        "check http /healthz?full=1",
        "-O",
        "check_interval 50ms",
        "-O",
        "check_fall 2",
        "-O",
        "check_rise 1",
        "127.0.0.1:{port}",
        &format!("127.0.0.1:{}", good.port),
        &format!("127.0.0.1:{}", bad.port),
    ]);
    let up = wait_health(&ctl, 0, "up");
    assert_eq!(up["health_check"], "http /healthz?full=1");
    let down = wait_health(&ctl, 1, "down");
    assert_eq!(
        down["checks_passed"], 0,
        "404 is not a passing status: {down}"
    );
    let req = good.requests.lock().unwrap()[0].clone();
    assert!(
        req.starts_with("GET /healthz?full=1 HTTP/1.1\r\n"),
        "request line: {req:?}"
    );
    assert!(
        req.contains(&format!("\r\nHost: 127.0.0.1:{}\r\n", good.port)),
        "Host header: {req:?}"
    );

    // The server's own check, changed at run time, restarts its checker: 404 is what
    // this one is told to expect, so it comes back up.
    ctl_ok(&ctl, "server 1 check http /healthz 404");
    let up = wait_health(&ctl, 1, "up");
    assert_eq!(up["health_check"], "http /healthz 404");
    // And an exact status that the server does not give takes the other one down.
    ctl_ok(&ctl, "server 0 check http / 204");
    wait_health(&ctl, 0, "down");
    // `check off` for a server: no longer checked, counted as up again.
    ctl_ok(&ctl, "server 0 check off");
    let s0 = wait_health(&ctl, 0, "unchecked");
    assert_eq!(s0["state"], "up");
    let served = good.served.load(Ordering::SeqCst);
    assert!(served > 0);
    // `write` keeps the checks.
    let dir = TempDir::new("health-write");
    let file = dir.path().join("w.cfg");
    ctl_ok(&ctl, &format!("write {}", file.display()));
    let text = std::fs::read_to_string(&file).unwrap();
    for line in [
        "check http /healthz?full=1",
        "check_interval 50ms",
        "check_fall 2",
        "check_rise 1",
        "check off",
        "check http /healthz 404",
    ] {
        assert!(text.contains(line), "{line:?} missing from:\n{text}");
    }
    drop(bad.status);
}

#[test]
fn drain_lets_a_long_transfer_finish_while_new_connections_go_elsewhere() {
    if skip_on_pen("drain is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    // Client tracking on (Pen's default): a tracked client of a drained server moves too.
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let (first, mut long) = q.name_from("127.0.0.2");
    let drained = if first == "a" { 0 } else { 1 };
    let other = if first == "a" { "b" } else { "a" };
    long.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let mut rng = Rng::new(7);
    let mut sent = Vec::new();
    let mut echo = |s: &mut std::net::TcpStream, n: usize| {
        let mut chunk = vec![0u8; n];
        rng.fill(&mut chunk);
        s.write_all(&chunk).unwrap();
        let mut back = vec![0u8; n];
        s.read_exact(&mut back).unwrap();
        assert_eq!(back, chunk);
        sent.extend_from_slice(&chunk);
    };
    echo(&mut long, 256 * 1024);

    ctl_ok(&ctl, &format!("server {drained} drain"));
    let s = server_status(&ctl, drained);
    assert_eq!(
        (s["state"].as_str(), s["draining"].as_bool()),
        (Some("draining"), Some(true))
    );
    assert_eq!(s["connections"], 1);
    // New connections, from the tracked client and from others, go to the other server.
    for src in ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.2"] {
        let (name, _s) = q.name_from(src);
        assert_eq!(name, other, "from {src}");
    }
    // The transfer on the drained server goes on to its end.
    for _ in 0..8 {
        echo(&mut long, 128 * 1024);
    }
    long.shutdown(Shutdown::Write).unwrap();
    let (rest, _) = expect_closed(&mut long, Duration::from_secs(10));
    assert!(rest.is_empty());
    wait_until(
        DEADLINE,
        "the drained server has no connection left",
        || server_status(&ctl, drained)["connections"] == 0,
    );
    assert!(sent.len() > 1024 * 1024);
    let servers = ctl_ok(&ctl, "servers");
    assert!(servers.contains("state draining"), "{servers}");

    // Undrain: the server takes connections again (client 127.0.0.9 is new: round robin
    // over both would eventually use it; tracked 127.0.0.2 moved, so use fresh clients).
    ctl_ok(&ctl, &format!("server {drained} drain 0"));
    assert_eq!(server_status(&ctl, drained)["state"], "up");
    let got: Vec<String> = (5..12)
        .map(|i| q.name_from(&format!("127.0.0.{i}")).0)
        .collect();
    assert!(got.contains(&first), "{got:?}");
    // Draining a server that does not exist is an error that changes nothing.
    let e = ctl_err(&ctl, "server 9 drain");
    assert!(e.contains("server 9"), "{e}");
}

#[test]
fn passive_blacklisting_keeps_working_beside_health_checks() {
    if skip_on_pen("active health checks are a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    // Checks so rare that only the first one runs during the test.
    let (q, ctl) = start_with_tcp_control(&[
        "-r",
        "-b",
        "60",
        "-O",
        "check tcp",
        "-O",
        "check_interval 3600",
        "127.0.0.1:{port}",
        &a.spec(),
        &b.spec(),
    ]);
    wait_health(&ctl, 0, "up");
    a.stop();
    // Clients find out first: the failed connect blacklists server 0, the client is sent
    // on to server 1, and the health verdict (not yet re-checked) stays up.
    let got = names(&q, 4);
    assert!(got.iter().all(|n| n == "b"), "{got:?}");
    let s0 = server_status(&ctl, 0);
    assert_eq!(s0["failures"], 1, "{s0}");
    assert_eq!(s0["blacklisted"], true, "{s0}");
    assert_eq!(s0["health"], "up", "{s0}");
    assert_eq!(s0["state"], "blacklisted", "{s0}");
}
