//! The metrics listener (`metrics_listen`): Prometheus metrics read by the reference parser
//! and checked against the traffic the test sent, the JSON endpoints, `POST /control` under
//! `control_acl` and its CSRF rules, moving and closing the listener at run time, abuse
//! (stalled, oversized and malformed requests), and the dashboard in a real browser
//! (headless Chromium driven by Playwright, `tests/browser/`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use support::browser::{browser_tools, CHROMIUM};
use support::ctl::*;
use support::http::*;
use support::*;

const DEADLINE: Duration = Duration::from_secs(10);

/// `/status.json`, parsed.
fn status(addr: SocketAddr) -> serde_json::Value {
    let r = get(addr, "/status.json");
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// The state `/status.json` reports for server `index`.
fn server_state(addr: SocketAddr, index: u64) -> String {
    status(addr)["servers"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["index"] == index))
        .map(|s| s["state"].as_str().unwrap_or_default().to_string())
        .unwrap_or_else(|| panic!("no server {index} in status.json"))
}

/// One echo exchange through quill from `src`: returns the backend's name and the bytes
/// (sent, received) that crossed the balancer for this connection.
fn exchange_through(q: &Quill, src: &str, payload: &[u8]) -> (String, usize, usize) {
    let (name, mut s) = q.name_from(src);
    s.write_all(payload).unwrap();
    let mut back = vec![0u8; payload.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, payload);
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "nothing after the echo");
    (name.clone(), payload.len(), name.len() + 1 + payload.len())
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    let found: Vec<_> = samples
        .iter()
        .filter(|s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one sample {name} {labels:?}, got {found:?}"
    );
    found[0].value
}

#[test]
fn prometheus_counters_match_the_traffic_sent() {
    let Some(python) = prometheus_parser() else {
        eprintln!(
            "SKIPPED: needs /usr/bin/python3 with prometheus_client \
             (apt-get install python3-prometheus-client)"
        );
        return;
    };
    let a = IdentityBackend::start("alpha");
    let b = IdentityBackend::start("beta");
    let (q, m) = start_with_metrics(&[
        "-r",
        "-O",
        "metrics_listen 127.0.0.1:{metrics}",
        "-O",
        "acl 1 deny 127.0.0.9",
        "-O",
        "client_acl 1",
        "{port}",
        &a.spec(),
        &b.spec(),
    ]);

    // Before any traffic: valid, and every counter at 0.
    let before = parse_metrics(python, &get_openmetrics(m).text());
    assert_eq!(value(&before, "quill_connections_accepted_total", &[]), 0.0);

    // 2N connections with payloads of different sizes, tallied per backend.
    let n = 6;
    let mut expect: HashMap<String, (usize, usize, usize)> = HashMap::new();
    for i in 0..2 * n {
        let payload = vec![b'x'; 100 + 37 * i];
        let (name, sent, received) = exchange_through(&q, "127.0.0.1", &payload);
        let e = expect.entry(name).or_default();
        e.0 += 1;
        e.1 += sent;
        e.2 += received;
    }
    assert_eq!(expect.len(), 2, "round robin used both servers: {expect:?}");
    // One client the ACL refuses.
    let mut denied = q.connect_from("127.0.0.9");
    expect_closed_without_data(&mut denied, DEADLINE);

    // Bytes are counted when a connection ends: wait until quill has closed them all.
    wait_until(DEADLINE, "every connection is closed", || {
        status(m)["connections"]["open"] == 0
    });
    let r = get_openmetrics(m);
    assert_eq!(r.status, 200);
    assert!(
        r.header("content-type")
            .is_some_and(|t| t.starts_with("application/openmetrics-text")),
        "{:?}",
        r.headers
    );
    let samples = parse_metrics(python, &r.text());
    let kind = |family: &str| {
        samples
            .iter()
            .find(|s| s.family == family)
            .map(|s| s.kind.clone())
            .unwrap_or_default()
    };
    assert_eq!(kind("quill_connections_accepted"), "counter");
    assert_eq!(kind("quill_server_connections_open"), "gauge");
    // Every accepted connection counts, the refused one too.
    assert_eq!(
        value(&samples, "quill_connections_accepted_total", &[]),
        (2 * n + 1) as f64
    );
    assert_eq!(
        value(
            &samples,
            "quill_connections_refused_total",
            &[("reason", "acl")]
        ),
        1.0
    );
    assert_eq!(value(&samples, "quill_connections_open", &[]), 0.0);
    assert_eq!(value(&samples, "quill_clients_tracked", &[]), 1.0);
    // A dozen connections keep no event loop busy enough to try busy polling.
    assert_eq!(kind("quill_event_loops_polling"), "gauge");
    assert_eq!(value(&samples, "quill_event_loops_polling", &[]), 0.0);
    for verdict in ["poll", "sleep"] {
        let labels = [("verdict", verdict)];
        assert_eq!(value(&samples, "quill_polling_trials_total", &labels), 0.0);
    }
    for (index, backend) in [("0", &a), ("1", &b)] {
        let (conns, sent, received) = expect[backend.name()];
        let labels = [("server", index), ("address", &backend.spec()[..])];
        assert_eq!(
            value(&samples, "quill_server_connections_total", &labels),
            conns as f64,
            "connections to {}",
            backend.name()
        );
        assert_eq!(
            value(&samples, "quill_server_sent_bytes_total", &labels),
            sent as f64,
            "bytes sent to {}",
            backend.name()
        );
        assert_eq!(
            value(&samples, "quill_server_received_bytes_total", &labels),
            received as f64,
            "bytes received from {}",
            backend.name()
        );
        assert_eq!(value(&samples, "quill_server_failures_total", &labels), 0.0);
        assert_eq!(
            value(&samples, "quill_server_connections_open", &labels),
            0.0
        );
        let state = |s: &str| {
            let mut l = labels.to_vec();
            l.push(("state", s));
            value(&samples, "quill_server_state", &l)
        };
        assert_eq!((state("up"), state("blacklisted")), (1.0, 0.0));
    }
}

#[test]
fn a_failed_server_shows_as_blacklisted_with_its_failures() {
    let Some(python) = prometheus_parser() else {
        eprintln!("SKIPPED: needs /usr/bin/python3 with prometheus_client");
        return;
    };
    let a = IdentityBackend::start("alpha");
    let b = IdentityBackend::start("beta");
    b.stop();
    let (q, m) = start_with_metrics(&[
        "-r",
        "-O",
        "metrics_listen {metrics}",
        "{port}",
        &a.spec(),
        &b.spec(),
    ]);
    // Round robin tries beta on one of the first two connections: refused, blacklisted,
    // and the client is sent on to alpha.
    for _ in 0..2 {
        let (name, _, _) = exchange_through(&q, "127.0.0.1", b"ping");
        assert_eq!(name, "alpha");
    }
    let samples = parse_metrics(python, &get_openmetrics(m).text());
    let beta = [("server", "1"), ("address", &b.spec()[..])];
    assert_eq!(value(&samples, "quill_server_failures_total", &beta), 1.0);
    let mut l = beta.to_vec();
    l.push(("state", "blacklisted"));
    assert_eq!(value(&samples, "quill_server_state", &l), 1.0);
    assert_eq!(server_state(m, 1), "blacklisted");
}

#[test]
fn json_endpoints_and_dashboard_assets() {
    let a = IdentityBackend::start("alpha");
    let (q, m) = start_with_metrics(&["-O", "metrics_listen {metrics}", "{port}", &a.spec()]);
    let _ = exchange_through(&q, "127.0.0.3", b"hello");

    let s = status(m);
    assert_eq!(s["servers"][0]["address"], "127.0.0.1");
    assert_eq!(s["servers"][0]["port"], a.port());
    assert_eq!(s["servers"][0]["state"], "up");
    assert_eq!(s["connections"]["accepted"], 1);

    let clients = get(m, "/clients.json").json();
    assert_eq!(clients["clients"][0]["address"], "127.0.0.3");
    assert_eq!(clients["clients"][0]["server"], 0);

    wait_until(DEADLINE, "the history has two samples", || {
        get(m, "/history.json").json()["samples"]
            .as_array()
            .is_some_and(|s| s.len() >= 2)
    });

    let page = get(m, "/");
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(page.text().contains("<script src=\"/dashboard.js\""));
    assert_eq!(page.header("x-frame-options"), Some("DENY"));
    assert!(page
        .header("content-security-policy")
        .is_some_and(|c| c.contains("frame-ancestors 'none'")));
    for (path, kind) in [
        ("/dashboard.js", "text/javascript"),
        ("/dashboard.css", "text/css"),
    ] {
        let r = get(m, path);
        assert_eq!(r.status, 200, "{path}");
        assert!(r
            .header("content-type")
            .is_some_and(|t| t.starts_with(kind)));
        assert!(!r.body.is_empty());
    }
    let head = request_from("127.0.0.1", m, "HEAD", "/metrics", &[], b"").unwrap();
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_eq!(get(m, "/nowhere").status, 404);
    let put = request_from("127.0.0.1", m, "PUT", "/metrics", &[], b"x").unwrap();
    assert_eq!(put.status, 405);
    assert_eq!(put.header("allow"), Some("GET, HEAD"));
}

#[test]
fn post_control_honours_control_acl_and_refuses_cross_site_requests() {
    let a = IdentityBackend::start("alpha");
    let b = IdentityBackend::start("beta");
    let (q, m) = start_with_metrics(&[
        "-r",
        "-O",
        "metrics_listen {metrics}",
        "-O",
        "acl 2 permit 127.0.0.1",
        "-O",
        "acl 2 deny 0.0.0.0 0.0.0.0",
        "-O",
        "control_acl 2",
        "{port}",
        &a.spec(),
        &b.spec(),
    ]);

    // What the page asks to decide whether to show buttons.
    let viewer = |src: &str| {
        request_from(src, m, "GET", "/control", &[], b"")
            .unwrap()
            .json()["permitted"]
            .clone()
    };
    assert_eq!(viewer("127.0.0.1"), true);
    assert_eq!(viewer("127.0.0.2"), false);

    // Denied from an address the ACL does not permit; nothing changes.
    let r = post_control("127.0.0.2", m, "server 0 blacklist 60");
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains("control_acl"));
    assert_eq!(server_state(m, 0), "up");

    // Without the custom header (what a cross-site form can send): refused.
    let r = request_from(
        "127.0.0.1",
        m,
        "POST",
        "/control",
        &["Content-Type: text/plain"],
        b"server 0 blacklist 60",
    )
    .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    // With a foreign Origin: refused.
    let r = request_from(
        "127.0.0.1",
        m,
        "POST",
        "/control",
        &["X-Quill-Control: 1", "Origin: http://evil.example"],
        b"server 0 blacklist 60",
    )
    .unwrap();
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(server_state(m, 0), "up");

    // Commands beyond per-server blacklisting stay on the control socket.
    for line in [
        "exit",
        "server 0 address 127.0.0.9",
        "roundrobin",
        "write /tmp/x",
    ] {
        let r = post_control("127.0.0.1", m, line);
        assert_eq!(r.status, 403, "{line}: {}", r.text());
    }
    assert_eq!(
        post_control("127.0.0.1", m, "server 7 blacklist 5").status,
        404
    );
    assert_eq!(post_control("127.0.0.1", m, "no such command").status, 400);

    // Permitted: blacklisting takes effect at once, and new connections avoid the server.
    let r = request_from(
        "127.0.0.1",
        m,
        "POST",
        "/control",
        &["X-Quill-Control: 1", &format!("Origin: http://{m}")],
        b"server 0 blacklist 60",
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(server_state(m, 0), "blacklisted");
    for _ in 0..4 {
        assert_eq!(exchange_through(&q, "127.0.0.1", b"x").0, "beta");
    }
    // And whitelisting brings it back.
    assert_eq!(
        post_control("127.0.0.1", m, "server 0 blacklist 0").status,
        200
    );
    assert_eq!(server_state(m, 0), "up");
    let names: Vec<String> = (0..4)
        .map(|_| exchange_through(&q, "127.0.0.1", b"x").0)
        .collect();
    assert!(names.iter().any(|n| n == "alpha"), "{names:?}");

    // Drain and undrain, the dashboard's other pair of buttons.
    assert_eq!(post_control("127.0.0.1", m, "server 1 drain").status, 200);
    assert_eq!(server_state(m, 1), "draining");
    for _ in 0..4 {
        assert_eq!(exchange_through(&q, "127.0.0.1", b"x").0, "alpha");
    }
    assert_eq!(post_control("127.0.0.1", m, "server 1 drain 0").status, 200);
    assert_eq!(server_state(m, 1), "up");
    // Refused from elsewhere, like blacklisting.
    assert_eq!(post_control("127.0.0.2", m, "server 1 drain").status, 403);
    assert_eq!(server_state(m, 1), "up");
}

/// quill in front of `backend` with a TCP control socket and a metrics listener: the
/// process, the metrics address and the control address.
fn start_with_control_and_metrics(backend: &IdentityBackend) -> (Quill, SocketAddr, String) {
    let spec = backend.spec();
    let mut args = vec!["-C", "127.0.0.1:{ctl}"];
    args.extend(run_as_args());
    args.extend(["-O", "metrics_listen {metrics}", "{port}", &spec]);
    let (q, m) = start_with_metrics(&args);
    let ctl = q.arg_after("-C").expect("-C in the arguments").to_owned();
    (q, m, ctl)
}

/// `quill_poll_before_sleep_windows_total{outcome=...}` from `/metrics`.
fn poll_windows(m: SocketAddr, outcome: &str) -> u64 {
    let line = format!("quill_poll_before_sleep_windows_total{{outcome=\"{outcome}\"}} ");
    let text = get(m, "/metrics").text();
    text.lines()
        .find_map(|l| l.strip_prefix(&line)?.parse().ok())
        .unwrap_or_else(|| panic!("no {line} in:\n{text}"))
}

#[test]
fn poll_before_sleep_polls_after_work_only_while_set() {
    if skip_on_pen("poll_before_sleep is quill's own") {
        return;
    }
    let a = IdentityBackend::start("alpha");
    let (q, m, ctl) = start_with_control_and_metrics(&a);
    let echo = |s: &mut TcpStream| {
        s.write_all(b"ping").unwrap();
        let mut back = [0u8; 4];
        s.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"ping");
    };
    let (_, mut s) = q.name_from("127.0.0.1");

    // Off by default: the loops sleep at once and never poll.
    for _ in 0..20 {
        echo(&mut s);
    }
    assert_eq!(
        (poll_windows(m, "caught"), poll_windows(m, "missed")),
        (0, 0)
    );
    let d = TempDir::new("poll-before-sleep");
    let written = || {
        let file = d.path().join("quill.cfg");
        ctl_ok(&ctl, &format!("write {}", file.display()));
        std::fs::read_to_string(file).unwrap()
    };
    assert!(!written().contains("poll_before_sleep"));

    // 10 ms windows: the loop that sent a request to the backend (a thread of this
    // process, answering at once) is still polling when the answer comes; the windows
    // after the answer run out with nothing to do.
    ctl_ok(&ctl, "poll_before_sleep 10000");
    wait_until(DEADLINE, "an answer caught within a window", || {
        echo(&mut s);
        poll_windows(m, "caught") > 0
    });
    wait_until(DEADLINE, "a window that ran out", || {
        poll_windows(m, "missed") > 0
    });
    assert!(written().contains("poll_before_sleep 10000\n"));
    assert!(ctl_err(&ctl, "poll_before_sleep 10001").contains("at most 10000"));

    // Back to 0: nothing more is counted.
    ctl_ok(&ctl, "poll_before_sleep 0");
    let before = (poll_windows(m, "caught"), poll_windows(m, "missed"));
    for _ in 0..20 {
        echo(&mut s);
    }
    assert_eq!(
        (poll_windows(m, "caught"), poll_windows(m, "missed")),
        before
    );
}

#[test]
fn metrics_listen_moves_closes_and_is_written_back() {
    let a = IdentityBackend::start("alpha");
    let (q, m, ctl) = start_with_control_and_metrics(&a);
    assert_eq!(ctl_ok(&ctl, "metrics_listen").trim(), m.to_string());

    // A port that is taken: an error, and the listener stays where it was.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap();
    let err = ctl_err(&ctl, &format!("metrics_listen {busy}"));
    assert!(err.contains("in use"), "{err}");
    assert_eq!(get(m, "/status.json").status, 200);

    // Move it.
    let port = free_port();
    assert_eq!(
        ctl_ok(&ctl, &format!("metrics_listen 127.0.0.1:{port}")).trim(),
        ""
    );
    let moved = SocketAddr::from(([127, 0, 0, 1], port));
    assert_eq!(get(moved, "/status.json").status, 200);
    wait_until(DEADLINE, "the old metrics port is closed", || {
        TcpStream::connect(m).is_err()
    });

    // `write` keeps it.
    let file = q.dir().join("written.cfg");
    ctl_ok(&ctl, &format!("write {}", file.display()));
    let written = std::fs::read_to_string(&file).unwrap();
    assert!(
        written
            .lines()
            .any(|l| l == format!("metrics_listen 127.0.0.1:{port}")),
        "{written}"
    );

    // Close it.
    assert_eq!(ctl_ok(&ctl, "no metrics_listen").trim(), "");
    assert_eq!(ctl_ok(&ctl, "metrics_listen").trim(), "");
    wait_until(DEADLINE, "the metrics port is closed", || {
        TcpStream::connect(moved).is_err()
    });
}

#[test]
fn bad_addresses_are_refused_at_start() {
    for bad in [
        "metrics_listen 0",
        "metrics_listen 127.0.0.1:99999",
        "metrics_listen [::1",
    ] {
        let (code, stderr) = Quill::start_expect_exit(&["-O", bad, "{port}", "127.0.0.1:9"]);
        assert_eq!(code, Some(2), "{bad}: {stderr}");
        assert!(stderr.contains("metrics_listen"), "{bad}: {stderr}");
    }
}

#[test]
fn slow_oversized_and_malformed_requests_cost_nothing_lasting() {
    let a = IdentityBackend::start("alpha");
    let (_q, m) = start_with_metrics(&["-O", "metrics_listen {metrics}", "{port}", &a.spec()]);

    // Clients that send half a request and stall do not stop others being served.
    let stalled: Vec<TcpStream> = (0..20)
        .map(|_| {
            let mut s = TcpStream::connect(m).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                .unwrap();
            s
        })
        .collect();
    assert_eq!(get(m, "/metrics").status, 200);

    // A head larger than the limit: an error status, and the connection ends.
    let mut s = TcpStream::connect(m).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let big = format!(
        "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
        "a".repeat(64 * 1024)
    );
    let _ = s.write_all(big.as_bytes());
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.is_empty() || reply.starts_with("HTTP/1.1 431"),
        "{reply}"
    );

    // A control body larger than one command line: 413.
    let r = request_from(
        "127.0.0.1",
        m,
        "POST",
        "/control",
        &["X-Quill-Control: 1"],
        &vec![b'a'; 64 * 1024],
    )
    .unwrap();
    assert_eq!(r.status, 413, "{}", r.text());

    // Garbage: a 400, no crash.
    let mut s = TcpStream::connect(m).unwrap();
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    s.write_all(b"\x00\x01\x02 not http\r\n\r\n").unwrap();
    let mut reply = Vec::new();
    let _ = s.read_to_end(&mut reply);
    assert!(
        reply.is_empty() || reply.starts_with(b"HTTP/1.1 400"),
        "{}",
        String::from_utf8_lossy(&reply)
    );

    drop(stalled);
    assert_eq!(get(m, "/status.json").status, 200);
}

// ---------------------------------------------------------------------------
// The dashboard in a real browser
// ---------------------------------------------------------------------------

#[test]
fn dashboard_in_a_browser_blacklists_a_server_and_traffic_moves() {
    let dir = match browser_tools() {
        Ok(d) => d,
        Err(why) => {
            eprintln!("SKIPPED: the browser test needs node, chromium and playwright-core: {why}");
            return;
        }
    };
    let a = IdentityBackend::start("alpha");
    let b = IdentityBackend::start("beta");
    let (q, m) = start_with_metrics(&[
        "-r",
        "-O",
        "metrics_listen {metrics}",
        "{port}",
        &a.spec(),
        &b.spec(),
    ]);

    // Traffic while the page is open: a steady stream of short connections from a few
    // clients, counted per backend.
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let target = q.addr();
    let load = {
        let stop = Arc::clone(&stop);
        let served = Arc::clone(&served);
        thread::spawn(move || {
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let src = format!("127.0.0.{}", 10 + i % 5);
                i += 1;
                if let Ok(mut s) = client_from(&src, target) {
                    if backend_name(&mut s).is_some() {
                        let _ = s.write_all(b"hello dashboard\n");
                        let mut buf = [0u8; 16];
                        let _ = s.read_exact(&mut buf);
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                }
                // Pacing of the load generator (a steady rate for the chart), not
                // synchronisation: nothing waits on it.
                thread::sleep(Duration::from_millis(20));
            }
        })
    };
    wait_until(DEADLINE, "both backends have traffic", || {
        a.accepted() > 0 && b.accepted() > 0
    });

    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .map(|t| t.join("test-output"))
        .unwrap_or_else(|| PathBuf::from("target/test-output"));
    std::fs::create_dir_all(&out_dir).unwrap();
    let screenshot = out_dir.join("dashboard.png");
    let _ = std::fs::remove_file(&screenshot);
    let profile = TempDir::new("chromium-profile");

    // The page blacklists server 0 ("alpha"); the script waits until the page shows it
    // blacklisted, then asks the test (on stdout) to check the traffic, and waits for
    // the test's go-ahead (a line on stdin) before the final screenshot.
    let mut child = Command::new("node")
        .arg(dir.join("dashboard.test.mjs"))
        .env("DASHBOARD_URL", format!("http://{m}/"))
        .env("CHROMIUM", CHROMIUM)
        .env("PROFILE_DIR", profile.path())
        .env("SCREENSHOT", &screenshot)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("node");
    let mut stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            eprintln!("browser: {line}");
            let _ = tx.send(line);
        }
    });
    let wait_line = |want: &str| loop {
        match rx.recv_timeout(Duration::from_secs(90)) {
            Ok(l) if l == want => return,
            Ok(l) if l.starts_with("FAIL") => panic!("browser test: {l}"),
            Ok(_) => continue,
            Err(e) => panic!("browser test: no '{want}' ({e})"),
        }
    };
    wait_line("BLACKLISTED 0");

    // The server really is blacklisted, and the traffic moves to the other one.
    assert_eq!(server_state(m, 0), "blacklisted");
    let alpha_then = a.accepted();
    let served_then = served.load(Ordering::Relaxed);
    wait_until(
        Duration::from_secs(20),
        "20 more connections served",
        || served.load(Ordering::Relaxed) >= served_then + 20,
    );
    assert_eq!(a.accepted(), alpha_then, "no new connection reached alpha");
    writeln!(stdin, "CONTINUE").unwrap();
    drop(stdin);
    wait_line("DONE");
    let status = child.wait().unwrap();
    stop.store(true, Ordering::Relaxed);
    load.join().unwrap();
    assert!(status.success(), "the browser script failed: {status}");
    let png = std::fs::read(&screenshot).unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    eprintln!("screenshot: {}", screenshot.display());
}

#[test]
fn after_a_binary_upgrade_the_new_process_serves_the_metrics() {
    let a = IdentityBackend::start("alpha");
    let spec = a.spec();
    let dir = TempDir::new("metrics-upgrade");
    let ctl = dir.path().join("ctl.sock").to_string_lossy().into_owned();
    let listen = format!("127.0.0.1:{}", free_port());
    let m = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let metrics = format!("metrics_listen {m}");
    let mut args = vec!["-C", &ctl];
    args.extend(run_as_args());
    args.extend(["-O", &metrics, &listen, &spec]);
    let mut old = Quill::start_on(&args, Target::Tcp(listen.parse().unwrap())).unwrap();
    assert_eq!(status(m)["pid"], old.pid());

    let mut new_args = vec!["--takeover"];
    new_args.extend(args.iter().copied());
    let new = Quill::start_on(&new_args, Target::Tcp(old.addr())).unwrap();
    // The old process closes its metrics listener when it hands over; the new one binds
    // the same address as soon as it is free.
    wait_until(
        DEADLINE,
        "the new process answers on the metrics port",
        || {
            request_from("127.0.0.1", m, "GET", "/status.json", &[], b"")
                .is_ok_and(|r| r.status == 200 && r.json()["pid"] == new.pid())
        },
    );
    assert_eq!(old.wait_exit(DEADLINE), Some(Some(0)), "{}", old.stderr());
    assert_eq!(status(m)["pid"], new.pid());
    assert!(!new.stderr().contains("ERROR"), "{}", new.stderr());
}

#[test]
fn an_exposed_listener_without_a_control_acl_is_warned_about() {
    let a = IdentityBackend::start("alpha");
    let (q, m) = start_with_metrics(&[
        "-O",
        "metrics_listen 0.0.0.0:{metrics}",
        "{port}",
        &a.spec(),
    ]);
    assert_eq!(get(m, "/status.json").status, 200);
    wait_until(DEADLINE, "quill warns about the open control", || {
        q.stderr().contains("control_acl 0 is empty")
    });

    let (q, m) = start_with_metrics(&[
        "-O",
        "acl 3 permit 10.0.0.0 255.0.0.0",
        "-O",
        "control_acl 3",
        "-O",
        "metrics_listen 0.0.0.0:{metrics}",
        "{port}",
        &a.spec(),
    ]);
    assert_eq!(get(m, "/status.json").status, 200);
    assert!(!q.stderr().contains("is empty"), "{}", q.stderr());
    // 127.0.0.1 is not in list 3: read-only.
    assert_eq!(get(m, "/control").json()["permitted"], false);
    assert_eq!(
        post_control("127.0.0.1", m, "server 0 blacklist 5").status,
        403
    );
}

/// A client that leaves before its answer has ended (curl giving up after two seconds:
/// `-m`) abandoned its request: counted for the server it waited on, and logged 499 when
/// no answer's head had reached it, or with the answer's status and the bytes it got when
/// it left in the body; HTTP/1.1 over the pool, HTTP/2, one server connection per client.
/// An HTTP/1.1 client's close goes on to the server, which may answer all the same: that
/// answer passes (and is logged), and the request was abandoned still.
#[test]
fn requests_whose_clients_leave_are_counted_and_logged() {
    if tool("curl", &["--version"]).is_none() {
        return;
    }
    let server = StatusServer::start();
    let spec = server.addr.to_string();
    for (how, quill_args, curl_args, version, late) in [
        (
            "HTTP/1.1, pooled",
            &[][..],
            &["--http1.1"][..],
            "HTTP/1.1",
            200,
        ),
        (
            "HTTP/2",
            &["-O", "h2c"][..],
            &["--http2-prior-knowledge"][..],
            "HTTP/2.0",
            499,
        ),
        (
            "one server connection per client",
            &["-O", "upstream_keepalive 0"][..],
            &["--http1.1"][..],
            "HTTP/1.1",
            200,
        ),
    ] {
        let mut args = vec![
            "-H",
            "-O",
            "metrics_listen 127.0.0.1:{metrics}",
            "-O",
            "access_log {dir}/access.log",
        ];
        args.extend_from_slice(quill_args);
        args.extend(["{port}", &spec]);
        let (q, m) = start_with_metrics(&args);
        for path in ["200", "hold-head", "hold-body", "late"] {
            let url = format!("http://127.0.0.1:{}/{path}", q.port);
            let out = Command::new("curl")
                .args(["-s", "-o", "/dev/null", "-m", "2", &url])
                .args(curl_args)
                .output()
                .unwrap();
            // 28: curl gave up waiting.
            let expected = if path == "200" { 0 } else { 28 };
            assert_eq!(out.status.code(), Some(expected), "{how}: /{path}");
        }
        let aborts =
            format!("quill_server_client_aborts_total{{server=\"0\",address=\"{spec}\"}} 3");
        wait_until(DEADLINE, format!("{how}: {aborts}"), || {
            get(m, "/metrics").text().lines().any(|l| l == aborts)
        });
        assert_eq!(status(m)["servers"][0]["client_aborts"].as_u64(), Some(3));
        let log = q.dir().join("access.log");
        wait_until(DEADLINE, format!("{how}: four lines logged"), || {
            std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() == 4)
        });
        let text = std::fs::read_to_string(&log).unwrap();
        let logged: Vec<String> = text
            .lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                [f[4], f[5], f[6], f[8], f[10]].join(" ")
            })
            .collect();
        assert_eq!(
            logged,
            [
                format!("/200 {version} 200 0 {spec}"),
                format!("/hold-head {version} 499 0 {spec}"),
                format!("/hold-body {version} 200 10 {spec}"),
                format!("/late {version} {late} 0 {spec}"),
            ],
            "{how}:\n{text}"
        );
    }
}

/// A keep-alive HTTP/1.1 server that answers `GET /NNN` with status NNN and an empty body,
/// and closes without an answer on `GET /close`. On `GET /hold-head` it answers nothing,
/// and on `GET /hold-body` only a head and 10 of 1,000 bytes, until quill closes the
/// connection (or 20 s pass); on `GET /late` it answers 200 once quill has closed (or
/// shut) its side.
struct StatusServer {
    addr: SocketAddr,
}

impl StatusServer {
    fn start() -> StatusServer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                thread::spawn(move || StatusServer::serve(conn));
            }
        });
        StatusServer { addr }
    }

    fn serve(mut conn: TcpStream) {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while conn.read(&mut byte).is_ok_and(|n| n == 1) {
            head.push(byte[0]);
            if !head.ends_with(b"\r\n\r\n") {
                continue;
            }
            let text = String::from_utf8_lossy(&head).into_owned();
            head.clear();
            let path = text.split(' ').nth(1).unwrap_or_default();
            if path == "/late" {
                conn.set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                let _ = conn.read_to_end(&mut Vec::new());
                let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
                return;
            }
            if path.starts_with("/hold-") {
                if path == "/hold-body" {
                    let head = "HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n";
                    let _ = conn.write_all(format!("{head}0123456789").as_bytes());
                }
                conn.set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                let _ = conn.read_to_end(&mut Vec::new());
                return;
            }
            let Ok(code) = path.trim_start_matches('/').parse::<u16>() else {
                return; // `/close`: no answer.
            };
            let answer = format!("HTTP/1.1 {code} Status\r\nContent-Length: 0\r\n\r\n");
            if conn.write_all(answer.as_bytes()).is_err() {
                return;
            }
        }
    }
}

/// Each server's final answers are counted by status class, however its requests came:
/// HTTP/1.1 clients over the pool, HTTP/2 clients, one server connection per client. The
/// 502 quill gives in place of an answer that never came is quill's, not the server's.
#[test]
fn http_answers_are_counted_per_server_by_status_class() {
    let server = StatusServer::start();
    let spec = server.addr.to_string();
    let paths = ["200", "204", "302", "404", "503", "600", "close"];
    for (how, quill_args, curl_args) in [
        ("HTTP/1.1, pooled", &[][..], &["--http1.1"][..]),
        (
            "HTTP/2",
            &["-O", "h2c"][..],
            &["--http2-prior-knowledge"][..],
        ),
        (
            "one server connection per client",
            &["-O", "upstream_keepalive 0"][..],
            &["--http1.1"][..],
        ),
    ] {
        let mut args = vec!["-H", "-O", "metrics_listen 127.0.0.1:{metrics}"];
        args.extend_from_slice(quill_args);
        args.extend(["{port}", &spec]);
        let (q, m) = start_with_metrics(&args);
        let mut statuses = Vec::new();
        for path in paths {
            // A connection each: curl 7.88 does not reuse an h2c connection it knew
            // beforehand (its second request on it gets nothing, whatever the server).
            let url = format!("http://127.0.0.1:{}/{path}", q.port);
            let mut curl = vec!["-s", "-o", "/dev/null", "-w", "%{http_code}", &url];
            curl.extend_from_slice(curl_args);
            let Some(out) = tool("curl", &curl) else {
                return;
            };
            statuses.push(out);
        }
        assert_eq!(statuses.join(" "), "200 204 302 404 503 600 502", "{how}");

        let text = get(m, "/metrics").text();
        let answers = |code: &str| {
            let line = format!(
                "quill_server_http_responses_total{{server=\"0\",address=\"{spec}\",code=\"{code}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(&line)?.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {line} in:\n{text}"))
        };
        let counted: Vec<u64> = ["1xx", "2xx", "3xx", "4xx", "5xx", "other"]
            .into_iter()
            .map(answers)
            .collect();
        assert_eq!(counted, [0, 2, 1, 1, 1, 1], "{how}");
        let json = &status(m)["servers"][0]["responses"];
        assert_eq!(
            (json["2xx"].as_u64(), json["other"].as_u64()),
            (Some(2), Some(1))
        );
    }
}
