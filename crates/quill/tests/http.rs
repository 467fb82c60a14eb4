//! `http` (-H): X-Forwarded-For / X-Forwarded-Proto on every request, HTTP/1.x framing
//! (keep-alive, pipelining, chunked bodies, 100-continue, Upgrade), refusals (400, 431),
//! against the real binary with an HTTP echo backend (support/http.rs) and curl.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::process::Command;
use std::time::Duration;

use support::http_echo::{read_final_response, read_response, sha256_hex, EchoServer};
use support::*;

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    // xorshift: cheap, deterministic, not compressible.
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn start(extra: &[&str], backend: &EchoServer) -> Quill {
    let spec = backend.spec();
    let mut args: Vec<&str> = vec!["-H"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["127.0.0.1:{port}", &spec]);
    Quill::start(&args)
}

#[test]
fn every_request_of_a_keep_alive_connection_names_the_client() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let mut s = q.connect_from("127.0.0.5");
    for i in 0..5 {
        write!(s, "GET /r{i} HTTP/1.1\r\nHost: example\r\n\r\n").unwrap();
        let resp = read_response(&mut s).expect("a response");
        assert_eq!(resp.status, 200);
        let seen = resp.seen();
        assert_eq!(seen.request_line(), format!("GET /r{i} HTTP/1.1"));
        assert_eq!(
            seen.fields("x-forwarded-for"),
            ["127.0.0.5"],
            "{}",
            seen.head
        );
        assert_eq!(seen.fields("x-forwarded-proto"), ["http"], "{}", seen.head);
        assert_eq!(seen.fields("host"), ["example"]);
    }
    assert_eq!(
        backend.connections(),
        1,
        "one keep-alive backend connection"
    );
}

#[test]
fn existing_x_forwarded_for_is_appended_to_and_proto_is_not_spoofable() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let mut s = q.connect_from("127.0.0.6");
    s.write_all(
        b"GET / HTTP/1.1\r\nX-Forwarded-For: 203.0.113.7\r\nX-Forwarded-Proto: https\r\n\r\n",
    )
    .unwrap();
    let seen = read_response(&mut s).unwrap().seen();
    assert_eq!(seen.fields("x-forwarded-for"), ["203.0.113.7, 127.0.0.6"]);
    assert_eq!(
        seen.fields("x-forwarded-proto"),
        ["http"],
        "a plain-HTTP client must not be able to claim https"
    );
}

#[test]
fn pipelined_requests_with_bodies_arrive_in_order_and_byte_exact() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let mut s = q.connect_from("127.0.0.7");
    let small = random_bytes(1000, 1);
    let chunks = [
        random_bytes(3000, 2),
        random_bytes(1, 3),
        random_bytes(70_000, 4),
    ];
    let mut all = Vec::new();
    all.extend_from_slice(b"GET /a HTTP/1.1\r\n\r\n");
    all.extend_from_slice(
        format!(
            "POST /b HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            small.len()
        )
        .as_bytes(),
    );
    all.extend_from_slice(&small);
    all.extend_from_slice(b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n");
    for c in &chunks {
        all.extend_from_slice(format!("{:x};note=x\r\n", c.len()).as_bytes());
        all.extend_from_slice(c);
        all.extend_from_slice(b"\r\n");
    }
    all.extend_from_slice(b"0\r\nChecksum: none\r\n\r\n");
    all.extend_from_slice(b"HEAD /d HTTP/1.1\r\n\r\nGET /e HTTP/1.1\r\nConnection: close\r\n\r\n");
    // Everything in one write: the requests are pipelined.
    s.write_all(&all).unwrap();
    let chunked_body = chunks.concat();
    let expected = [
        ("GET /a HTTP/1.1", 0, sha256_hex(b"")),
        ("POST /b HTTP/1.1", small.len(), sha256_hex(&small)),
        (
            "POST /c HTTP/1.1",
            chunked_body.len(),
            sha256_hex(&chunked_body),
        ),
    ];
    for (line, len, sha) in &expected {
        let seen = read_response(&mut s).expect("a response").seen();
        assert_eq!(seen.request_line(), *line);
        assert_eq!((seen.body_len, &seen.body_sha256), (*len, sha), "{line}");
        assert_eq!(seen.fields("x-forwarded-for"), ["127.0.0.7"], "{line}");
    }
    // The answer to HEAD has a Content-Length but no body: quill must not wait for one.
    let (rest, _) = expect_closed(&mut s, Duration::from_secs(10));
    let rest = String::from_utf8_lossy(&rest);
    let d = rest
        .find("X-Request-Line: HEAD /d HTTP/1.1")
        .expect("HEAD answered");
    let e = rest.find("GET /e HTTP/1.1").expect("GET /e answered");
    assert!(d < e, "answers out of order: {rest:?}");
    assert!(rest.contains("X-Forwarded-For: 127.0.0.7"), "{rest:?}");
}

#[test]
fn large_bodies_are_byte_exact() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let mut s = q.connect();
    let body = random_bytes(8 << 20, 7);
    write!(
        s,
        "PUT /big HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    s.write_all(&body).unwrap();
    let seen = read_response(&mut s).unwrap().seen();
    assert_eq!(
        (seen.body_len, seen.body_sha256),
        (body.len(), sha256_hex(&body))
    );
    // Chunked, with chunk sizes that do not line up with any buffer.
    s.write_all(b"PUT /big2 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        .unwrap();
    let mut sent = 0;
    let mut size = 1;
    while sent < body.len() {
        let n = size.min(body.len() - sent);
        write!(s, "{n:x}\r\n").unwrap();
        s.write_all(&body[sent..sent + n]).unwrap();
        s.write_all(b"\r\n").unwrap();
        sent += n;
        size = size * 3 + 7;
    }
    s.write_all(b"0\r\n\r\n").unwrap();
    let seen = read_response(&mut s).unwrap().seen();
    assert_eq!(
        (seen.body_len, seen.body_sha256),
        (body.len(), sha256_hex(&body))
    );
}

#[test]
fn expect_100_continue() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let mut s = q.connect();
    s.write_all(b"POST /up HTTP/1.1\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    // The client waits for the interim answer before sending the body.
    let interim = read_response(&mut s).expect("100 Continue");
    assert_eq!(interim.status, 100);
    s.write_all(b"hello").unwrap();
    let seen = read_response(&mut s).unwrap().seen();
    assert_eq!(
        (seen.body_len, seen.body_sha256.clone()),
        (5, sha256_hex(b"hello"))
    );
    assert_eq!(seen.fields("x-forwarded-for"), ["127.0.0.1"]);
}

#[test]
fn upgrade_switches_to_a_plain_relay() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let mut s = q.connect_from("127.0.0.8");
    s.write_all(
        b"GET /chat HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n\r\n",
    )
    .unwrap();
    let resp = read_response(&mut s).unwrap();
    assert_eq!(resp.status, 101);
    // After the switch, bytes pass untouched, even ones that look like HTTP.
    let frames: &[&[u8]] = &[
        b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58",
        b"GET /not-http HTTP/1.1\r\n\r\n",
        &random_bytes(100_000, 9),
    ];
    for frame in frames {
        s.write_all(frame).unwrap();
        let mut back = vec![0; frame.len()];
        s.read_exact(&mut back).unwrap();
        assert_eq!(&back, frame);
    }
    s.shutdown(Shutdown::Write).unwrap();
    let (rest, _) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(rest.is_empty());
}

#[test]
fn garbage_gets_400_and_a_close() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    for garbage in [
        &b"HELLO THERE\r\n\r\n"[..],
        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n",
    ] {
        let mut s = q.connect();
        s.write_all(garbage).unwrap();
        let (data, _) = expect_closed(&mut s, Duration::from_secs(10));
        let text = String::from_utf8_lossy(&data);
        assert!(
            text.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{garbage:?} -> {text:?}"
        );
    }
    assert_eq!(backend.requests(), 0, "nothing reached the server");
    // A good request first is answered, then the bad one is refused.
    let mut s = q.connect();
    s.write_all(b"GET /ok HTTP/1.1\r\n\r\nNOT HTTP\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut s).unwrap().status, 200);
    let (data, _) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(String::from_utf8_lossy(&data).starts_with("HTTP/1.1 400 "));
}

#[test]
fn oversized_heads_get_431_and_the_limit_is_a_setting() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let big = format!("GET / HTTP/1.1\r\nCookie: {}\r\n\r\n", "c".repeat(20_000));
    let mut s = q.connect();
    s.write_all(big.as_bytes()).unwrap();
    let (data, _) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(
        String::from_utf8_lossy(&data).starts_with("HTTP/1.1 431 "),
        "{:?}",
        String::from_utf8_lossy(&data)
    );
    drop(q);
    let q = start(&["-O", "http_header_max 65536"], &backend);
    let mut s = q.connect();
    s.write_all(big.as_bytes()).unwrap();
    let resp = read_response(&mut s).unwrap();
    assert_eq!(resp.status, 200);
    assert_eq!(resp.seen().fields("cookie")[0].len(), 20_000);
}

#[test]
fn hsts_is_never_added_to_plain_http() {
    // HSTS on plain HTTP is ignored by browsers and wrong (RFC 6797 7.2): with TLS it is
    // covered by the TLS tests; here the policy must not leak into plain responses.
    let backend = EchoServer::start();
    let q = start(&["-O", "hsts 31536000"], &backend);
    let mut s = q.connect();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let resp = read_final_response(&mut s).unwrap();
    assert_eq!(resp.field("strict-transport-security"), None);
}

#[test]
fn curl_through_quill() {
    let backend = EchoServer::start();
    let q = start(&[], &backend);
    let url = format!("http://127.0.0.1:{}/x", q.port);
    let out = Command::new("curl")
        .args([
            "-sS",
            "--interface",
            "127.0.0.9",
            "-H",
            "X-Forwarded-For: 10.9.8.7",
        ])
        .args(["--data-binary", "@-", &url, &url])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run curl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    // Two requests on one keep-alive connection, both with the header.
    assert_eq!(
        text.matches("X-Forwarded-For: 10.9.8.7, 127.0.0.9\r\n")
            .count(),
        2,
        "{text}"
    );
}

#[test]
fn half_close_idle_timeout_and_the_connection_log_work_with_http() {
    let backend = EchoServer::start();
    let spec = backend.spec();
    let q = Quill::start(&[
        "-H",
        "-O",
        "idle_timeout 1",
        "-l",
        "{dir}/conn.log",
        "127.0.0.1:{port}",
        &spec,
    ]);
    // Half-close: the request, then EOF; the answer still arrives, then the close.
    let mut s = q.connect_from("127.0.0.4");
    s.write_all(b"GET /half HTTP/1.1\r\n\r\n").unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let seen = read_response(&mut s)
        .expect("the answer after a half-close")
        .seen();
    assert_eq!(seen.request_line(), "GET /half HTTP/1.1");
    let (rest, _) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(rest.is_empty());
    // Idle: a keep-alive connection that goes quiet is closed.
    let mut s = q.connect();
    s.write_all(b"GET /idle HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut s).unwrap().status, 200);
    let (rest, _) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(rest.is_empty());
    // The log names the client and the first request line, as without -H.
    let log = q.dir().join("conn.log");
    wait_until(Duration::from_secs(10), "two log lines", || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() >= 2)
    });
    let text = std::fs::read_to_string(&log).unwrap();
    let first = text.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("127.0.0.4 ") && first.ends_with(" GET /half HTTP/1.1"),
        "{text}"
    );
}

#[test]
fn slow_or_silent_clients_never_reach_a_backend_and_time_out() {
    if skip_on_pen("Pen connects to a server as soon as a client connects") {
        return;
    }
    let backend = EchoServer::start();
    let spec = backend.spec();
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "http_request_timeout 1",
        "127.0.0.1:{port}",
        &spec,
    ]);
    // A slowloris client: part of a head, then nothing.
    let mut slow = q.connect_from("127.0.0.11");
    slow.write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-a: b\r\n")
        .unwrap();
    // A client that sends nothing at all.
    let mut silent = q.connect_from("127.0.0.12");
    // Meanwhile a normal client is served, and it is the only one the backend sees.
    let mut good = q.connect_from("127.0.0.13");
    good.write_all(b"GET /good HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut good).unwrap().status, 200);
    assert_eq!(backend.connections(), 1, "only the normal client");
    // The slow head is answered 408 and closed (well before the default of 10 s); the
    // silent client is closed without a word.
    let (data, _) = expect_closed(&mut slow, Duration::from_secs(6));
    let text = String::from_utf8_lossy(&data);
    assert!(
        text.starts_with("HTTP/1.1 408 Request Timeout\r\n")
            && text.contains("\r\nConnection: close\r\n"),
        "{text:?}"
    );
    expect_closed_without_data(&mut silent, Duration::from_secs(6));
    assert_eq!(backend.connections(), 1, "no backend connection for either");

    // The same bound applies to every later head of a keep-alive connection: a client
    // that sends one good request and then trickles the next gets 408 ...
    let mut trickle = q.connect_from("127.0.0.14");
    trickle.write_all(b"GET /1 HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut trickle).unwrap().status, 200);
    trickle.write_all(b"GET /2 HTTP/1.1\r\n").unwrap();
    let (data, _) = expect_closed(&mut trickle, Duration::from_secs(6));
    assert!(
        String::from_utf8_lossy(&data).starts_with("HTTP/1.1 408 "),
        "{:?}",
        String::from_utf8_lossy(&data)
    );
    // ... and one that goes quiet after an answer is closed, as an idle keep-alive
    // connection, without a word.
    let mut idle = q.connect_from("127.0.0.15");
    idle.write_all(b"GET /1 HTTP/1.1\r\n\r\n").unwrap();
    assert_eq!(read_response(&mut idle).unwrap().status, 200);
    expect_closed_without_data(&mut idle, Duration::from_secs(6));
    // A client that keeps its requests coming is served throughout.
    let mut busy = q.connect_from("127.0.0.16");
    for i in 0..5 {
        write!(busy, "GET /b{i} HTTP/1.1\r\n\r\n").unwrap();
        assert_eq!(read_response(&mut busy).unwrap().status, 200);
    }
    // At most one server connection per client that sent a whole request (fewer when
    // the kept-alive ones are shared, `upstream_keepalive`).
    assert!(backend.connections() <= 4, "{}", backend.connections());
    // Counted once the connections are over (after a 408 quill reads what the client
    // still sends for a while, until it closes): the slow, silent, trickling and idle
    // clients (and the good one, idle since its answer), two of them answered 408.
    drop((slow, silent, trickle, idle));
    wait_until(Duration::from_secs(10), "the timeouts counted", || {
        let status = support::ctl::status_json(&ctl);
        status["connections"]["http_request_timeouts"]
            .as_u64()
            .is_some_and(|n| n >= 4)
            && status["connections"]["http_refused"] == 2
    });

    // The setting is asked, changed and written like any other.
    assert_eq!(
        support::ctl::ctl_ok(&ctl, "http_request_timeout").trim(),
        "1"
    );
    let written = support::ctl::written_config(&ctl, q.dir(), "timeout");
    assert!(written.contains("\nhttp_request_timeout 1\n"), "{written}");
    support::ctl::ctl_ok(&ctl, "http_request_timeout 0");
    let written = support::ctl::written_config(&ctl, q.dir(), "none");
    assert!(written.contains("\nhttp_request_timeout 0\n"), "{written}");
    support::ctl::ctl_ok(&ctl, "http_request_timeout 10");
    let written = support::ctl::written_config(&ctl, q.dir(), "default");
    assert!(!written.contains("http_request_timeout"), "{written}");
}

/// How `-H` relays an HTTP/1.x client.
#[derive(Clone, Copy)]
enum Pump {
    /// `upstream_keepalive 0`: one server connection per client connection, as Pen.
    Connection,
    /// The default pool: request by request, each over a pooled server connection.
    Request,
}

/// quill `-H` with the byte pump used as `pump` says, and a control socket.
fn start_pump(pump: Pump, extra: &[&str], backend: &EchoServer) -> (Quill, String) {
    let spec = backend.spec();
    let mut args: Vec<&str> = vec!["-H"];
    if let Pump::Connection = pump {
        args.extend_from_slice(&["-O", "upstream_keepalive 0"]);
    }
    args.extend_from_slice(extra);
    args.extend_from_slice(&["127.0.0.1:{port}", &spec]);
    support::ctl::start_with_tcp_control(&args)
}

/// A drain (or a reload) moves the byte pump's keep-alive clients on, as it does those
/// served request by request: the next answer says `Connection: close` (instead of the
/// server's keep-alive), and quill closes the connection after it.
#[test]
fn byte_pump_clients_are_moved_on_by_a_drain() {
    moved_on_by_a_drain(Pump::Connection);
}

#[test]
fn clients_served_request_by_request_are_moved_on_by_a_drain() {
    moved_on_by_a_drain(Pump::Request);
}

fn moved_on_by_a_drain(pump: Pump) {
    if skip_on_pen("drain is a quill extension") {
        return;
    }
    let backend = EchoServer::start();
    let (q, ctl) = start_pump(pump, &[], &backend);
    let mut s = q.connect();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /before HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let before = read_response(&mut s).expect("an answer before the drain");
    assert_eq!(before.field("connection"), None, "{}", before.head);
    drain_moves_on(&mut s, &ctl);
}

/// `drain` on the control socket `ctl`: the client's next answer over `s` (asked with
/// `Connection: keep-alive`) says `Connection: close`, and quill closes the connection
/// after it. The node is undrained again.
fn drain_moves_on(s: &mut std::net::TcpStream, ctl: &str) {
    support::ctl::ctl_ok(ctl, "drain");
    s.write_all(b"GET /after HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        .unwrap();
    let after = read_response(s).expect("an answer after the drain");
    assert_eq!(after.status, 200);
    assert_eq!(after.seen().request_line(), "GET /after HTTP/1.1");
    assert_eq!(
        after.field("connection").as_deref(),
        Some("close"),
        "{}",
        after.head
    );
    expect_closed(s, Duration::from_secs(10));
    support::ctl::ctl_ok(ctl, "drain 0");
}

/// Stopping, quill closes a keep-alive client that is between requests (within a second of
/// its last answer), and lets a request in flight finish with `Connection: close`: quill is
/// gone long before `shutdown_grace`.
#[test]
fn stopping_closes_idle_byte_pump_clients_and_finishes_answers_in_flight() {
    stopping_closes_idle_clients(Pump::Connection);
}

#[test]
fn stopping_closes_idle_clients_served_request_by_request_and_finishes_answers_in_flight() {
    stopping_closes_idle_clients(Pump::Request);
}

fn stopping_closes_idle_clients(pump: Pump) {
    if skip_on_pen("shutdown_grace is a quill extension") {
        return;
    }
    let backend = EchoServer::start();
    // Nothing but the stop closes the idle client within the test's 10 s.
    let extra = ["-O", "shutdown_grace 60", "-O", "http_request_timeout 60"];
    let (mut q, _ctl) = start_pump(pump, &extra, &backend);
    // A request whose body is half sent when quill is told to stop (sent first, so that
    // its server connection is not one the other request left in the pool).
    let mut busy = q.connect();
    busy.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    busy.write_all(b"POST /busy HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhalf-")
        .unwrap();
    wait_until(
        Duration::from_secs(10),
        "the request reaches the backend",
        || backend.connections() == 1,
    );
    let mut idle = q.connect();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    idle.write_all(b"GET /idle HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    read_response(&mut idle).expect("an answer");
    q.signal("TERM");
    expect_closed(&mut idle, Duration::from_secs(10));
    busy.write_all(b"done!").unwrap();
    let resp = read_response(&mut busy).expect("the answer in flight");
    assert_eq!(resp.status, 200);
    assert_eq!(resp.seen().body_len, 10);
    assert_eq!(
        resp.field("connection").as_deref(),
        Some("close"),
        "{}",
        resp.head
    );
    expect_closed(&mut busy, Duration::from_secs(10));
    drop((idle, busy));
    assert!(
        q.wait_exit(Duration::from_secs(10)).is_some(),
        "quill still runs, waiting out shutdown_grace"
    );
}

/// Stopping, a keep-alive client that has just read an answer saying nothing of a close
/// may be sending its next request already (a client at full speed, `wrk`, always is):
/// that request is served, its answer saying `Connection: close`, and the connection
/// closes after it. Closed under it, the request was lost without a word (`wrk` counted a
/// read error on every connection at a stop or a binary upgrade; HAProxy answers it).
#[test]
fn stopping_answers_the_request_a_keep_alive_client_sends_right_after_its_answer() {
    stopping_answers_the_next_request(Pump::Request);
}

#[test]
fn stopping_the_byte_pump_answers_the_request_a_keep_alive_client_sends_right_after_its_answer() {
    stopping_answers_the_next_request(Pump::Connection);
}

fn stopping_answers_the_next_request(pump: Pump) {
    if skip_on_pen("shutdown_grace is a quill extension") {
        return;
    }
    let backend = EchoServer::start();
    let extra = ["-O", "shutdown_grace 60"];
    let (mut q, _ctl) = start_pump(pump, &extra, &backend);
    let mut s = q.connect();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let first = read_response(&mut s).expect("an answer");
    assert_eq!(first.field("connection"), None, "{}", first.head);
    q.stop_accepting();
    s.write_all(b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let second = read_response(&mut s).expect("the request sent after the stop is answered");
    assert_eq!(second.status, 200);
    q.expect_last_answer(s, &second);
}

/// A pipeline whose last request asks to close: the earlier answers say nothing of a
/// close (a client that took one for its connection's last would send the rest of its
/// pipeline again, POSTs too), the last says `Connection: close`, and the connection ends
/// after it. With one server connection per client's every head of the pipeline is read
/// before the first answer comes, so the close must not leak into the earlier answers.
#[test]
fn byte_pump_pipelines_close_after_the_answer_to_the_request_that_asks() {
    pipeline_closes_after_the_answer_to_the_request_that_asks(Pump::Connection);
}

#[test]
fn request_by_request_pipelines_close_after_the_answer_to_the_request_that_asks() {
    pipeline_closes_after_the_answer_to_the_request_that_asks(Pump::Request);
}

fn pipeline_closes_after_the_answer_to_the_request_that_asks(pump: Pump) {
    if matches!(pump, Pump::Connection) && skip_on_pen("upstream_keepalive is quill's") {
        return;
    }
    let backend = EchoServer::start();
    let (q, _ctl) = start_pump(pump, &[], &backend);
    let mut s = q.connect();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // One write: the requests are pipelined.
    s.write_all(
        b"GET /1 HTTP/1.1\r\nHost: x\r\n\r\n\
          POST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi\
          GET /3 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    for line in ["GET /1 HTTP/1.1", "POST /2 HTTP/1.1"] {
        let resp = read_response(&mut s).expect("an earlier answer");
        assert_eq!(resp.seen().request_line(), line);
        assert_eq!(resp.field("connection"), None, "{}", resp.head);
    }
    let last = read_response(&mut s).expect("the last answer");
    assert_eq!(last.seen().request_line(), "GET /3 HTTP/1.1");
    assert_eq!(
        last.field("connection").as_deref(),
        Some("close"),
        "{}",
        last.head
    );
    expect_closed_without_data(&mut s, Duration::from_secs(10));
}

/// With `http` every client speaks first, so `defer_accept auto` lets the kernel hold a new
/// connection until its first bytes: quill does not even see a client that stays silent,
/// and is woken once for a connection and its request. `defer_accept 0`, given at run
/// time, has the next connections accepted at once.
#[test]
fn an_http_listener_takes_a_connection_with_its_first_bytes_unless_told_otherwise() {
    if skip_on_pen("defer_accept is a quill extension") {
        return;
    }
    let backend = EchoServer::start();
    let spec = backend.spec();
    let mut args = vec!["-H", "-C", "127.0.0.1:{ctl}"];
    args.extend(support::ctl::run_as_args());
    args.extend([
        "-O",
        "metrics_listen 127.0.0.1:{metrics}",
        "127.0.0.1:{port}",
        &spec,
    ]);
    let (q, metrics) = support::http::start_with_metrics(&args);
    let accepted = || support::http::metric(metrics, "quill_connections_accepted_total");
    let deferred = || support::http::metric(metrics, "quill_listener_defer_accept_seconds");
    assert_eq!(deferred(), 1, "`auto` with `-H` defers for a second");
    let mut s = q.connect();
    assert!(
        !poll_until(Duration::from_millis(500), || accepted() > 0),
        "a client that has sent nothing was accepted"
    );
    s.write_all(b"GET /first HTTP/1.1\r\nHost: example.test\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut s).expect("a response");
    assert_eq!(resp.status, 200);
    assert_eq!(accepted(), 1);

    let ctl = q.arg_after("-C").expect("-C in the arguments").to_owned();
    support::ctl::ctl_ok(&ctl, "defer_accept 0");
    assert_eq!(deferred(), 0);
    let status = support::ctl::ctl_ok(&ctl, "status json");
    assert!(
        status.contains("\"defer_accept_seconds\":0"),
        "status json tells the value in force: {status}"
    );
    let _silent = q.connect();
    wait_until(
        Duration::from_secs(2),
        "a silent client accepted at once after `defer_accept 0`",
        || accepted() == 2,
    );
}

/// An echo server with `max 1` behind quill (`-H`, `queue_timeout 30` and `extra`), with a
/// control socket, and a first client whose request holds the server's one place while
/// its body comes.
fn a_server_held_by_one_request(extra: &[&str]) -> (EchoServer, Quill, String, TcpStream) {
    let backend = EchoServer::start();
    let spec = format!("{}:1", backend.spec());
    let mut args = vec!["-H", "-O", "queue_timeout 30"];
    args.extend_from_slice(extra);
    args.extend(["127.0.0.1:{port}", &spec]);
    let (q, ctl) = support::ctl::start_with_tcp_control(&args);
    let mut first = q.connect_from("127.0.0.5");
    first
        .write_all(b"POST /first HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\n12345")
        .unwrap();
    wait_until(
        Duration::from_secs(5),
        "the first request at the server",
        || backend.connections() == 1,
    );
    (backend, q, ctl, first)
}

/// With `queue_timeout`, a request that finds its server at `max` (requests in flight,
/// served request by request) waits for the one in flight to end instead of getting 503.
#[test]
fn a_request_waits_for_a_full_server_within_queue_timeout() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (_backend, q, ctl, mut first) = a_server_held_by_one_request(&[]);
    let queued = || support::ctl::status_json(&ctl)["connections"]["queued"].as_u64();
    let mut second = q.connect_from("127.0.0.6");
    second
        .write_all(b"GET /second HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    wait_until(Duration::from_secs(5), "the second request queued", || {
        queued() == Some(1)
    });
    // The first ends; the second goes to the server then.
    first.write_all(b"67890").unwrap();
    let one = read_response(&mut first).expect("the first answer");
    assert_eq!((one.status, one.seen().body_len), (200, 10));
    let two = read_response(&mut second).expect("the second answer");
    assert_eq!(two.status, 200, "{}", two.head);
    assert_eq!(two.seen().request_line(), "GET /second HTTP/1.1");
    assert_eq!(queued(), Some(0));

    // Without it, Pen's way: refused at once (503) while the server is full.
    support::ctl::ctl_ok(&ctl, "queue_timeout 0");
    first
        .write_all(b"POST /third HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n1")
        .unwrap();
    let at_server = || support::ctl::status_json(&ctl)["servers"][0]["connections"].as_u64();
    wait_until(
        Duration::from_secs(5),
        "the third request at the server",
        || at_server() == Some(1),
    );
    let mut fourth = q.connect_from("127.0.0.7");
    fourth
        .write_all(b"GET /fourth HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut fourth).expect("an answer").status, 503);
    first.write_all(b"2").unwrap();
    assert_eq!(
        read_response(&mut first).expect("the third answer").status,
        200
    );
    wait_until(Duration::from_secs(5), "every place given back", || {
        at_server() == Some(0)
    });
}

/// A request whose client leaves while it waits in the queue is never sent: the server's
/// place goes to the next client (NGINX's 499, HAProxy's `abortonclose`), and the queue
/// counts it. So for an HTTP/1.1 client that closes, and for an HTTP/2 client (curl giving
/// up after a second) whose stream ends.
#[test]
fn a_request_whose_client_leaves_the_queue_is_never_sent() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let (backend, q, ctl, mut first) = a_server_held_by_one_request(&["-O", "h2c"]);
    let status = || support::ctl::status_json(&ctl)["connections"].clone();
    let queued = || status()["queued"].as_u64();
    let mut gone = q.connect_from("127.0.0.6");
    gone.write_all(b"GET /gone HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    wait_until(Duration::from_secs(5), "the request queued", || {
        queued() == Some(1)
    });
    drop(gone);
    wait_until(Duration::from_secs(5), "the client's leaving seen", || {
        queued() == Some(0)
    });
    assert_eq!(status()["queue_abandoned"].as_u64(), Some(1));
    if tool("curl", &["--version"]).is_some() {
        let url = format!("http://127.0.0.1:{}/gone-h2", q.port);
        let out = Command::new("curl")
            .args(["-s", "-m", "1", "--http2-prior-knowledge", &url])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(28), "curl gave up waiting");
        wait_until(Duration::from_secs(5), "the stream's end seen", || {
            status()["queue_abandoned"].as_u64() == Some(2)
        });
        assert_eq!(queued(), Some(0));
    }
    // The first ends, and the next client's request is the server's second.
    first.write_all(b"67890").unwrap();
    let one = read_response(&mut first).expect("the first answer");
    assert_eq!(one.status, 200);
    let mut next = q.connect_from("127.0.0.7");
    next.write_all(b"GET /next HTTP/1.1\r\nHost: a\r\n\r\n")
        .unwrap();
    let answer = read_response(&mut next).expect("the next answer");
    assert_eq!(answer.seen().request_line(), "GET /next HTTP/1.1");
    assert_eq!(
        backend.requests(),
        2,
        "a request of a client that left was sent"
    );
}

/// A keep-alive HTTP/1.1 server that takes 20 ms over each bodiless request and records
/// the most requests it ever had in hand at once.
struct SlowServer {
    addr: std::net::SocketAddr,
    most: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl SlowServer {
    fn start() -> SlowServer {
        use std::io::BufRead;
        use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let most = Arc::new(AtomicUsize::new(0));
        let now = Arc::new(AtomicUsize::new(0));
        let (most2, now2) = (Arc::clone(&most), Arc::clone(&now));
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (most, now) = (Arc::clone(&most2), Arc::clone(&now2));
                std::thread::spawn(move || {
                    let mut w = conn.try_clone().unwrap();
                    let mut r = std::io::BufReader::new(conn);
                    loop {
                        let mut line = String::new();
                        // The head, to its empty line.
                        loop {
                            line.clear();
                            match r.read_line(&mut line) {
                                Ok(0) | Err(_) => return,
                                Ok(_) if line == "\r\n" => break,
                                Ok(_) => {}
                            }
                        }
                        most.fetch_max(now.fetch_add(1, SeqCst) + 1, SeqCst);
                        std::thread::sleep(Duration::from_millis(20)); // the work, not sync
                        now.fetch_sub(1, SeqCst);
                        if w.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        SlowServer { addr, most }
    }
}

/// A server's `max` holds across event loops: a request's place is taken in the step that
/// checks it, so two loops choosing at once do not both get the last one.
#[test]
fn a_full_server_never_has_more_requests_than_its_max() {
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let backend = SlowServer::start();
    let spec = format!("127.0.0.1:{}:1", backend.addr.port());
    let q = Quill::start(&["-H", "-O", "queue_timeout 30", "127.0.0.1:{port}", &spec]);
    // Eight keep-alive clients, spread over quill's event loops by their ports.
    let clients: Vec<_> = (0..8)
        .map(|n| {
            let mut s = q.connect_from(&format!("127.0.0.{}", 10 + n));
            std::thread::spawn(move || {
                (0..10)
                    .map(|_| {
                        s.write_all(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n").unwrap();
                        read_response(&mut s).map(|r| r.status)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap(), vec![Some(200); 10]);
    }
    assert_eq!(
        backend.most.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the server had more requests at once than its max"
    );
}
