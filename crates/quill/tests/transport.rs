//! Moving bytes: IPv4/IPv6 in either direction, Unix socket listeners, large
//! transfers, half-close, idle timeout and tcp_fastclose.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::thread;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::*;

fn skip_without_ipv6() -> bool {
    if ipv6_available() {
        false
    } else {
        eprintln!("SKIPPED: ::1 is not available on this host");
        true
    }
}

#[test]
fn ipv6_listener_forwards_to_an_ipv4_server() {
    if skip_without_ipv6()
        || skip_on_pen("Pen 0.34 does not understand the bracketed [::1]:port form")
    {
        return;
    }
    let a = IdentityBackend::start("v4-server");
    let q = Quill::start(&["[::1]:{port}", &a.spec()]);
    assert!(q.addr().is_ipv6());
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("v4-server"));
}

#[test]
fn ipv6_listener_accepts_pens_unbracketed_form() {
    if skip_without_ipv6() {
        return;
    }
    let a = IdentityBackend::start("v4-server");
    let q = Quill::start(&["::1:{port}", &a.spec()]);
    assert!(q.addr().is_ipv6());
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("v4-server"));
}

#[test]
fn ipv6_listener_accepts_the_colon_colon_colon_port_form() {
    if skip_without_ipv6() {
        return;
    }
    let a = IdentityBackend::start("v4-server");
    let q = Quill::start(&[":::{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("v4-server"));
}

#[test]
fn ipv4_listener_forwards_to_an_ipv6_server() {
    if skip_without_ipv6() {
        return;
    }
    let a = IdentityBackend::start_on("v6-server", "[::1]:0");
    assert_eq!(a.spec(), format!("[::1]:{}", a.port()));
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("v6-server"));
    s.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");
}

#[test]
fn unix_socket_listener_forwards_to_a_tcp_server() {
    let a = IdentityBackend::start("tcp-server");
    let q = Quill::start(&["{sock}", &a.spec()]);
    let Target::Unix(path) = q.target().clone() else {
        unreachable!()
    };
    let mut s = UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert_eq!(backend_name(&mut s).as_deref(), Some("tcp-server"));
    s.write_all(b"over unix\n").unwrap();
    assert_eq!(read_line(&mut s).unwrap().as_deref(), Some("over unix"));
}

/// Sends `total` pseudo-random bytes through `s` while a second thread reads
/// the backend's answer until EOF; returns (sha256 sent, sha256 received,
/// bytes received, backend name).  The client shuts its write side down after
/// the last byte.  With `wait_for_echo` it does so only once the whole echo
/// has arrived (for balancers without half-close support, i.e. Pen).
fn round_trip(
    s: TcpStream,
    total: usize,
    seed: u64,
    wait_for_echo: bool,
) -> ([u8; 32], [u8; 32], usize, String) {
    let mut reader = s.try_clone().unwrap();
    let mut writer = s;
    let (got_all_tx, got_all_rx) = std::sync::mpsc::channel::<()>();
    let rx = thread::spawn(move || {
        let name = backend_name(&mut reader).unwrap_or_default();
        let mut h = Sha256::new();
        let mut n = 0usize;
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(k) => {
                    h.update(&buf[..k]);
                    n += k;
                    if n >= total {
                        let _ = got_all_tx.send(());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("reading the echo failed after {n} bytes: {e}"),
            }
        }
        (h.finalize().into(), n, name)
    });
    // One random block, each copy stamped with its index, keeps generation cheap.
    let mut block = vec![0u8; 1 << 20];
    Rng::new(seed).fill(&mut block);
    let mut h = Sha256::new();
    let mut sent = 0usize;
    let mut i = 0u64;
    while sent < total {
        block[..8].copy_from_slice(&i.to_le_bytes());
        let k = block.len().min(total - sent);
        writer
            .write_all(&block[..k])
            .unwrap_or_else(|e| panic!("sending failed after {sent} bytes: {e}"));
        h.update(&block[..k]);
        sent += k;
        i += 1;
    }
    if wait_for_echo {
        let _ = got_all_rx.recv_timeout(Duration::from_secs(60));
    }
    writer.shutdown(Shutdown::Write).unwrap();
    let (got, n, name) = rx.join().expect("reader thread");
    (h.finalize().into(), got, n, name)
}

#[test]
fn a_hundred_mebibytes_each_way_arrive_intact() {
    let a = IdentityBackend::start("echo");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let s = q.connect();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    let total = 100 << 20;
    let start = Instant::now();
    let (sent, got, n, name) = round_trip(s, total, 0x5eed, is_pen());
    eprintln!("100 MiB each way in {:?}", start.elapsed());
    assert_eq!(name, "echo");
    assert_eq!(n, total, "echoed byte count differs from what was sent");
    assert_eq!(sent, got, "SHA-256 of the echo differs from what was sent");
}

#[test]
fn half_close_still_delivers_the_whole_answer() {
    if skip_on_pen("Pen 0.34 closes both sides when the client half-closes") {
        return;
    }
    // The backend answers only after the client has shut down its write side,
    // so the answer must travel after the client's FIN.
    let a = IdentityBackend::start_deferred("deferred");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let s = q.connect();
    let (sent, got, n, name) = round_trip(s, 1 << 20, 0x4a1f, false);
    assert_eq!(name, "deferred");
    assert_eq!(
        n,
        1 << 20,
        "the answer sent after the client's half-close was cut short"
    );
    assert_eq!(sent, got, "the answer after half-close is corrupted");
}

#[test]
fn after_the_client_half_closes_the_server_close_reaches_it() {
    if skip_on_pen("Pen 0.34 closes both sides when the client half-closes") {
        return;
    }
    // After its FIN the client still gets the data in flight, then EOF when
    // the server closes in turn; nothing is left open at the server.
    let a = IdentityBackend::start("echo");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
    s.write_all(b"last words\n").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert_eq!(rest, b"last words\n");
    a.wait_open(0, Duration::from_secs(5));
}

#[test]
fn idle_timeout_closes_a_silent_connection() {
    let a = IdentityBackend::start("a");
    let q = Quill::start(&["-O", "idle_timeout 1", "127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("a"));
    let start = Instant::now();
    let (data, _) = expect_closed(&mut s, Duration::from_secs(5));
    assert!(
        data.is_empty(),
        "unexpected data {:?}",
        String::from_utf8_lossy(&data)
    );
    assert!(
        start.elapsed() >= Duration::from_millis(500),
        "closed after {:?}, well before the 1 s idle timeout",
        start.elapsed()
    );
    a.wait_open(0, Duration::from_secs(5));
}

#[test]
fn idle_timeout_spares_a_busy_connection() {
    let a = IdentityBackend::start("a");
    let q = Quill::start(&["-O", "idle_timeout 2", "127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("a"));
    // Traffic every 200 ms for 3 s (longer than the 2 s timeout).
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_secs(3) {
        let msg = format!("tick {i}\n");
        s.write_all(msg.as_bytes())
            .unwrap_or_else(|e| panic!("busy connection closed after {:?}: {e}", start.elapsed()));
        let echo = read_line(&mut s).unwrap();
        assert_eq!(
            echo.as_deref(),
            Some(msg.trim_end()),
            "busy connection closed after {:?}",
            start.elapsed()
        );
        i += 1;
        // Pacing the traffic, not synchronisation.
        thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn tcp_fastclose_both_closes_the_connection_when_the_client_half_closes() {
    // Without fastclose the deferred backend's answer would arrive after the
    // client's FIN (see half_close_still_delivers_the_whole_answer).
    let a = IdentityBackend::start_deferred("deferred");
    let q = Quill::start(&["-O", "tcp_fastclose both", "127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("deferred"));
    s.write_all(b"never answered\n").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let (data, _) = expect_closed(&mut s, Duration::from_secs(5));
    assert!(
        data.is_empty(),
        "with tcp_fastclose the server's late answer {:?} should not arrive",
        String::from_utf8_lossy(&data)
    );
    a.wait_open(0, Duration::from_secs(5));
}

#[test]
fn x_forwarded_for_is_added_to_http_requests() {
    let a = IdentityBackend::start("echo");
    let spec = a.spec();
    // The echo backend is no HTTP server: it takes Pen's byte relay (`upstream_keepalive 0`,
    // quill's request-level proxying would answer 502 to its echo).
    let mut args = vec!["-H", "127.0.0.1:{port}", &spec];
    if !is_pen() {
        args.splice(1..1, ["-O", "upstream_keepalive 0"]);
    }
    let Some(q) = Quill::start_unless_unsupported(&args) else {
        return;
    };
    let mut s = q.connect_from("127.0.0.5");
    s.write_all(b"GET /index.html HTTP/1.1\r\nHost: example\r\n\r\n")
        .unwrap();
    assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
    // The echo is the request as the server received it.
    let mut forwarded = Vec::new();
    let mut b = [0u8; 1];
    while !forwarded.ends_with(b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(1) => forwarded.push(b[0]),
            other => panic!(
                "request echo ended early ({other:?}): {:?}",
                String::from_utf8_lossy(&forwarded)
            ),
        }
    }
    let text = String::from_utf8_lossy(&forwarded);
    assert!(
        text.starts_with("GET /index.html HTTP/1.1\r\n"),
        "request line changed: {text:?}"
    );
    let xff: Vec<&str> = text
        .lines()
        .filter(|l| l.to_ascii_lowercase().starts_with("x-forwarded-for:"))
        .collect();
    assert_eq!(
        xff.len(),
        1,
        "expected one X-Forwarded-For header: {text:?}"
    );
    assert_eq!(
        xff[0].split_once(':').map(|(_, v)| v.trim()),
        Some("127.0.0.5"),
        "X-Forwarded-For does not name the client"
    );
    assert!(
        text.contains("Host: example\r\n"),
        "Host header lost: {text:?}"
    );
}

#[test]
fn server_half_close_still_lets_the_client_send() {
    if skip_on_pen("Pen 0.34 closes both sides when one side half-closes") {
        return;
    }
    // The server says its name and shuts down its write side at once.
    let a = IdentityBackend::start_listening_only("listener");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("listener"));
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty(), "data after the server's FIN: {rest:?}");
    // The client can still talk to the server.
    let payload = vec![7u8; 256 * 1024];
    s.write_all(&payload)
        .expect("sending after the server's half-close");
    s.shutdown(Shutdown::Write).unwrap();
    wait_until(
        Duration::from_secs(5),
        "the server received everything",
        || a.received() == payload.len(),
    );
    a.wait_open(0, Duration::from_secs(5));
}

#[test]
fn data_sent_before_the_server_answers_survives_a_failover() {
    // The best-priority server never answers, so the client's first bytes
    // wait in the balancer during the 1 s connect timeout, then go to the
    // other server.
    let dead = UnresponsiveBackend::start();
    let b = IdentityBackend::start("b");
    let q = Quill::start(&[
        "-O",
        "prio",
        "-t",
        "1",
        "127.0.0.1:{port}",
        &format!("{}:0:0:1:1", dead.spec()),
        &b.spec_with("0:0:1:2"),
    ]);
    let start = Instant::now();
    let mut s = q.connect();
    s.write_all(b"early bird\n").unwrap();
    assert_eq!(backend_name(&mut s).as_deref(), Some("b"));
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "answered after {:?}: the unresponsive server was not tried first",
        start.elapsed()
    );
    assert_eq!(read_line(&mut s).unwrap().as_deref(), Some("early bird"));
}

/// Resident memory of a process in KiB (None without /proc).
fn rss_kib(pid: u32) -> Option<usize> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[test]
fn a_client_that_does_not_read_is_held_back_not_buffered() {
    // The client sends to an echo server but never reads the echo: the
    // balancer must apply backpressure instead of buffering without limit.
    let a = IdentityBackend::start("echo");
    let q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let Some(rss_before) = rss_kib(q.pid()) else {
        eprintln!("SKIPPED: /proc/PID/status is not available");
        return;
    };
    let mut s = q.connect();
    s.set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let chunk = vec![0x55u8; 256 * 1024];
    let limit: usize = 512 << 20;
    let mut sent = 0usize;
    while sent < limit {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                break
            }
            Err(e) => panic!("write failed after {sent} bytes: {e}"),
        }
    }
    let rss_after = rss_kib(q.pid()).unwrap_or(0);
    eprintln!(
        "blocked after {} MiB; quill RSS {} -> {} MiB",
        sent >> 20,
        rss_before >> 10,
        rss_after >> 10
    );
    assert!(
        sent < limit,
        "{} MiB were accepted from a client that reads nothing",
        sent >> 20
    );
    assert!(
        rss_after.saturating_sub(rss_before) < 64 << 10,
        "quill's memory grew by {} MiB holding data for a client that does not read",
        rss_after.saturating_sub(rss_before) >> 10
    );
    // And nothing was lost: reading now drains the echo completely.
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
    let mut echoed = 0usize;
    let mut buf = vec![0u8; 256 * 1024];
    while echoed < sent {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => echoed += n,
            Err(e) => panic!("draining the echo failed after {echoed} bytes: {e}"),
        }
    }
    assert_eq!(echoed, sent, "echoed bytes differ from bytes sent");
}

// `defer_accept`: a raw relay cannot know that its clients speak first (SMTP, FTP and
// MySQL servers greet), so by default it accepts every connection at once; asked to, it
// lets the kernel hold each one until the client's first bytes.

#[test]
fn a_raw_relay_accepts_a_silent_client_at_once_so_its_server_can_greet_it() {
    let a = IdentityBackend::start("greeter");
    let q = Quill::start(&["-r", "127.0.0.1:{port}", &a.spec()]);
    let started = Instant::now();
    let mut s = q.connect();
    // The kernel would hold a deferred connection for at least a second (its first
    // SYN-ACK retransmission); the greeting comes well before that.
    assert_eq!(backend_name(&mut s).as_deref(), Some("greeter"));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "greeted after {:?}",
        started.elapsed()
    );
}

#[test]
fn with_defer_accept_a_silent_client_is_not_accepted_until_it_speaks() {
    if skip_on_pen("defer_accept is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("held");
    let q = Quill::start(&["-r", "-O", "defer_accept 5", "127.0.0.1:{port}", &a.spec()]);
    let mut s = q.connect();
    // quill never saw the connection, so it connected nowhere.
    assert!(
        !poll_until(Duration::from_millis(500), || a.accepted() > 0),
        "a silent client was accepted and relayed"
    );
    s.write_all(b"ping").unwrap();
    a.wait_accepted(1, Duration::from_secs(2));
    assert_eq!(backend_name(&mut s).as_deref(), Some("held"));
    let mut echo = [0u8; 4];
    s.read_exact(&mut echo).unwrap();
    assert_eq!(&echo, b"ping", "the first bytes were relayed");
}
