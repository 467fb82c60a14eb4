//! `upstream_h2`: requests of HTTP/1.1 clients go to Debian's NGINX over HTTP/2, with prior
//! knowledge in plain (`listen PORT http2`) and by ALPN over TLS (`listen PORT ssl http2`).
//! NGINX answers `/who` with "CONNECTION PROTOCOL XFF" (`$connection` numbers its
//! connections, `$server_protocol` says which HTTP it was spoken): that is how the tests see
//! how many server connections the requests shared, and over what.
//!
//! Skipped with a message where NGINX or curl is not installed; `.ci/run` installs them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use support::daemon::{nginx_at, Daemon};
use support::pki::certificates;
use support::*;

const WHO: &str = "  location /who { default_type text/plain; \
     return 200 \"$connection $server_protocol $http_x_forwarded_for\\n\"; }\n\
     location /files/ { dav_methods PUT; create_full_put_path on; }";

/// NGINX on `port` answering `/who` and storing `PUT`s under `/files/`; `listen` holds the
/// options of its `listen` line, `tls` the certificate and key when it terminates TLS.
fn nginx_on(port: u16, listen: &str, tls: Option<(&Path, &Path)>) -> Option<Daemon> {
    let mut server = WHO.to_string();
    if let Some((cert, key)) = tls {
        server.push_str(&format!(
            "\n  ssl_certificate {};\n  ssl_certificate_key {};",
            cert.display(),
            key.display()
        ));
    }
    nginx_at(
        port,
        listen,
        " keepalive_requests 1000000;\n client_max_body_size 64m;\n \
         log_format up '$connection $server_protocol $request_method $status $request_length';",
        &format!("{server}\n  access_log access.log up;"),
        &[],
    )
}

/// quill in `http` mode with `upstream_h2` (and `options`, each a `-O` command) in front of
/// one server on 127.0.0.1:`port`.
fn quill_h2(port: u16, options: &[&str]) -> Quill {
    let server = format!("127.0.0.1:{port}");
    let mut args = vec!["-H", "-O", "upstream_h2"];
    for o in options {
        args.extend(["-O", o]);
    }
    args.extend(["{port}", &server]);
    Quill::start(&args)
}

/// An HTTP/1.1 request on a connection of its own: status and body.
fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: example.test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

/// `n` requests for `/who` from as many client connections at once.
fn many_at_once(addr: std::net::SocketAddr, n: usize) -> Vec<(u16, String)> {
    let threads: Vec<_> = (0..n)
        .map(|_| std::thread::spawn(move || get(addr, "/who")))
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// The connection numbers in `/who` answers, after checking each was HTTP/2 with the
/// client in X-Forwarded-For.
fn h2_connections(answers: &[(u16, String)]) -> BTreeSet<u64> {
    answers
        .iter()
        .map(|(status, body)| {
            assert_eq!(*status, 200, "{body}");
            let fields: Vec<&str> = body.split_whitespace().collect();
            assert_eq!(fields.get(1), Some(&"HTTP/2.0"), "{body}");
            assert_eq!(fields.get(2), Some(&"127.0.0.1"), "X-Forwarded-For: {body}");
            fields[0].parse().unwrap()
        })
        .collect()
}

#[test]
fn two_hundred_http11_clients_reach_an_h2c_server_over_one_connection_per_loop() {
    let port = free_port();
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "upstream_h2",
        "-O",
        "workers 2",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let answers = many_at_once(q.addr(), 200);
    let used = h2_connections(&answers);
    // 200 at once stay under NGINX's 128 streams per loop's connection (100 each): one
    // each, or two where a burst filled one.
    assert!(
        !used.is_empty() && used.len() <= 4,
        "200 client connections used {} server connections: {used:?}",
        used.len()
    );
    let status = support::ctl::status_json(&ctl);
    let server = &status["servers"][0];
    assert_eq!(server["requests"], 200, "{server}");
    let reused = server["requests_reused"].as_u64().unwrap();
    assert!(reused >= 200 - used.len() as u64, "{server}");
    assert!(server["pool_open"].as_u64().unwrap() <= 4, "{server}");
}

#[test]
fn a_one_mib_body_goes_up_and_down_over_h2c() {
    let port = free_port();
    let Some(nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let q = quill_h2(port, &[]);
    let dir = TempDir::new("uph2");
    let file = dir.path().join("upload");
    let data = patterned(1 << 20);
    std::fs::write(&file, &data).unwrap();
    let url = format!("http://127.0.0.1:{}/files/blob", q.port);
    let Some(out) = tool(
        "curl",
        &[
            "-sS",
            "--max-time",
            "20",
            "--http1.1",
            "-T",
            file.to_str().unwrap(),
            "-w",
            "%{http_code}",
            &url,
        ],
    ) else {
        return;
    };
    assert!(out.ends_with("201"), "PUT: {out}");
    let back = dir.path().join("download");
    tool(
        "curl",
        &[
            "-sS",
            "--max-time",
            "20",
            "--http1.1",
            "-o",
            back.to_str().unwrap(),
            &url,
        ],
    )
    .unwrap();
    assert!(
        std::fs::read(&back).unwrap() == data,
        "1 MiB came back changed"
    );
    let log = std::fs::read_to_string(nginx.dir().join("access.log")).unwrap();
    let put = log
        .lines()
        .find(|l| l.contains(" PUT "))
        .unwrap_or_else(|| panic!("no PUT in NGINX's log: {log}"));
    assert!(put.contains(" HTTP/2.0 PUT 201 "), "{log}");
    assert!(log.contains(" HTTP/2.0 GET 200 "), "{log}");
}

#[test]
fn over_tls_alpn_picks_h2_or_falls_back_to_http11() {
    let dir = TempDir::new("uph2-tls");
    let (ca, cert, key) = certificates(dir.path());
    let (h2_port, h1_port) = (free_port(), free_port());
    let Some(_h2) = nginx_on(h2_port, " ssl http2", Some((&cert, &key))) else {
        return;
    };
    let Some(_h1) = nginx_on(h1_port, " ssl", Some((&cert, &key))) else {
        return;
    };
    let ca = format!("upstream_ca {}", ca.display());
    for (port, protocol) in [(h2_port, "HTTP/2.0"), (h1_port, "HTTP/1.1")] {
        let q = Quill::start(&[
            "-H",
            "-O",
            "upstream_tls",
            "-O",
            &ca,
            "-O",
            "upstream_h2",
            "{port}",
            &format!("127.0.0.1:{port}"),
        ]);
        let answers = many_at_once(q.addr(), 50);
        let mut used = BTreeSet::new();
        for (status, body) in &answers {
            assert_eq!(*status, 200, "{body}");
            let fields: Vec<&str> = body.split_whitespace().collect();
            assert_eq!(fields.get(1), Some(&protocol), "{body}");
            assert_eq!(fields.get(2), Some(&"127.0.0.1"), "{body}");
            used.insert(fields[0].to_string());
        }
        if protocol == "HTTP/2.0" {
            assert!(used.len() <= 4, "{used:?}");
        }
    }
}

#[test]
fn prior_knowledge_to_a_server_without_http2_fails_over_before_any_request() {
    let (h1_port, h2_port) = (free_port(), free_port());
    let Some(h1) = nginx_on(h1_port, "", None) else {
        return;
    };
    let Some(_h2) = nginx_on(h2_port, " http2", None) else {
        return;
    };
    // Round robin sends requests to the HTTP/1.1-only server too: its connection is found
    // not to be HTTP/2 before a request goes over it, so the request fails over.
    let q = Quill::start(&[
        "-H",
        "-r",
        "-O",
        "upstream_h2",
        "-O",
        "blacklist 30",
        "{port}",
        &format!("127.0.0.1:{h1_port}"),
        &format!("127.0.0.1:{h2_port}"),
    ]);
    let answers: Vec<_> = (0..10).map(|_| get(q.addr(), "/who")).collect();
    h2_connections(&answers);
    let log = std::fs::read_to_string(h1.dir().join("access.log")).unwrap_or_default();
    assert!(!log.contains(" GET "), "{log}");
    // Alone, it leaves no server: 503 at once, not a hang.
    let q = quill_h2(h1_port, &[]);
    let started = Instant::now();
    let (status, body) = get(q.addr(), "/who");
    assert_eq!(status, 503, "{body}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn a_restarted_server_is_reconnected_to_without_failed_requests() {
    let port = free_port();
    let Some(nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let q = quill_h2(port, &["blacklist 1"]);
    h2_connections(&many_at_once(q.addr(), 20));
    drop(nginx);
    // Started again (listening once this returns): the connections quill had are closed.
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let after = h2_connections(&many_at_once(q.addr(), 50));
    assert!(after.len() <= 4, "{after:?}");
}

#[test]
fn a_full_connection_makes_the_next_request_open_another() {
    // Four streams per connection, and answers that take a second each (8 KiB at 8 KiB/s).
    let port = free_port();
    let Some(nginx) = nginx_at(
        port,
        " http2",
        " http2_max_concurrent_streams 4;\n \
         log_format up '$connection $server_protocol $request_method $status $request_length';",
        "  location /slow { limit_rate 8k; }\n  access_log access.log up;",
        &[("slow", &[b'x'; 8192])],
    ) else {
        return;
    };
    let q = quill_h2(port, &["workers 2"]);
    let started = Instant::now();
    let threads: Vec<_> = (0..20)
        .map(|_| {
            let addr = q.addr();
            std::thread::spawn(move || get(addr, "/slow"))
        })
        .collect();
    for t in threads {
        let (status, body) = t.join().unwrap();
        assert_eq!((status, body.len()), (200, 8192));
    }
    // Queued behind full connections, 20 answers would take five rounds (5 s).
    let took = started.elapsed();
    assert!(took < Duration::from_secs(4), "took {took:?}");
    let log = std::fs::read_to_string(nginx.dir().join("access.log")).unwrap();
    let used: BTreeSet<&str> = log
        .lines()
        .inspect(|l| assert!(l.contains(" HTTP/2.0 GET 200 "), "{log}"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    // 20 streams four at a time over two event loops: at least five connections, and no
    // more than the two loops' shares need.
    assert!((5..=6).contains(&used.len()), "{used:?}\n{log}");
}

#[test]
fn a_server_sent_the_proxy_protocol_keeps_http11_with_a_connection_per_request() {
    // The header describes one client, and an HTTP/2 connection would carry many: such a
    // server gets HTTP/1.1 even with upstream_h2 (this NGINX does not speak HTTP/2 at all).
    let port = free_port();
    let Some(_nginx) = nginx_at(
        port,
        " proxy_protocol",
        "",
        "  location /who { default_type text/plain; \
         return 200 \"$connection $server_protocol $proxy_protocol_addr\\n\"; }",
        &[],
    ) else {
        return;
    };
    let q = quill_h2(port, &["proxy_protocol v1"]);
    let answers: Vec<_> = (0..5).map(|_| get(q.addr(), "/who")).collect();
    let mut used = BTreeSet::new();
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        let fields: Vec<&str> = body.split_whitespace().collect();
        assert_eq!(
            fields.get(1..3),
            Some(&["HTTP/1.1", "127.0.0.1"][..]),
            "{body}"
        );
        used.insert(fields[0].to_string());
    }
    assert_eq!(used.len(), 5, "{used:?}");
}

/// With `upstream_h2` quill serves HTTP/1.x clients through hyper (each request a stream
/// to the server), and an idle one leaves hyper after `idle_park` to wait on its socket
/// alone: parked so, it still hears a drain (its next answer says `Connection: close`, and
/// the connection ends after it) and the stop (it is closed at once).
#[test]
fn http11_clients_parked_out_of_hyper_hear_a_drain_and_the_stop() {
    use support::http_echo::read_final_response;
    let port = free_port();
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let (mut q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "upstream_h2",
        "-O",
        "idle_park 1",
        "-O",
        "shutdown_grace 60",
        "-O",
        "http_request_timeout 60",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let parked = |n: u64| {
        wait_until(Duration::from_secs(15), "the client parked", || {
            support::ctl::status_json(&ctl)["connections"]["parked"] == n
        })
    };
    let ask = |s: &mut TcpStream| {
        s.write_all(b"GET /who HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
            .unwrap();
        let answer = read_final_response(s).expect("an answer");
        assert_eq!(answer.status, 200);
        answer
    };
    let mut s = q.connect();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    ask(&mut s);
    parked(1);
    support::ctl::ctl_ok(&ctl, "drain");
    let after = ask(&mut s);
    assert_eq!(
        after.field("connection").as_deref(),
        Some("close"),
        "{}",
        after.head
    );
    expect_closed(&mut s, Duration::from_secs(10));
    support::ctl::ctl_ok(&ctl, "drain 0");

    let mut idle = q.connect();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    ask(&mut idle);
    parked(1);
    q.signal("TERM");
    expect_closed(&mut idle, Duration::from_secs(10));
    drop(idle);
    assert!(
        q.wait_exit(Duration::from_secs(10)).is_some(),
        "quill still runs, waiting out shutdown_grace"
    );
}

/// Stopping, an HTTP/1.1 client that has just read an answer saying nothing of a close
/// (hyper's connection, not parked yet) may be sending its next request already: that
/// request is answered, with `Connection: close`, and the connection closes after it.
/// Shut at once, hyper closed the connection under it (`wrk` counted a read error on 8 of
/// its 20 connections at a binary upgrade).
#[test]
fn stopping_answers_the_request_a_keep_alive_client_sends_right_after_its_answer() {
    use support::http_echo::read_final_response;
    let port = free_port();
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let mut q = quill_h2(port, &["shutdown_grace 60"]);
    let ask = |s: &mut TcpStream, path: &str| {
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        read_final_response(s)
    };
    let mut s = q.connect();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let first = ask(&mut s, "/who").expect("an answer");
    assert_eq!(first.field("connection"), None, "{}", first.head);
    q.stop_accepting();
    let second = ask(&mut s, "/who").expect("the request sent after the stop is answered");
    assert_eq!(second.status, 200);
    q.expect_last_answer(s, &second);
}

#[test]
fn a_server_that_sends_goaway_gets_the_next_requests_on_a_new_connection() {
    // NGINX sends GOAWAY on a connection once it has taken `keepalive_requests` streams.
    let port = free_port();
    let Some(_nginx) = nginx_at(port, " http2", " keepalive_requests 5;", WHO, &[]) else {
        return;
    };
    let q = quill_h2(port, &["workers 1"]);
    let answers: Vec<_> = (0..30).map(|_| get(q.addr(), "/who")).collect();
    let used = h2_connections(&answers);
    assert_eq!(used.len(), 6, "{used:?}");
    // And at once, with streams in flight when the GOAWAY comes.
    for _ in 0..3 {
        h2_connections(&many_at_once(q.addr(), 20));
    }
}

#[test]
fn hop_by_hop_fields_stay_behind_and_host_becomes_the_authority() {
    let port = free_port();
    let Some(_nginx) = nginx_at(
        port,
        " http2",
        "",
        "  location /hop { default_type text/plain; return 200 \
         \"$server_protocol|$host|$http_keep_alive|$http_x_drop|$http_te|$http_x_keep\\n\"; }",
        &[],
    ) else {
        return;
    };
    let q = quill_h2(port, &[]);
    let mut s = TcpStream::connect(q.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(
        b"GET /hop HTTP/1.1\r\nHost: example.test:8080\r\nConnection: close, x-drop\r\n\
          Keep-Alive: timeout=5\r\nX-Drop: 1\r\nTE: trailers\r\nX-Keep: 2\r\n\r\n",
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // NGINX refuses connection-specific fields over HTTP/2 (400): 200 says none went.
    assert!(
        text.ends_with("HTTP/2.0|example.test|||trailers|2\n"),
        "{text}"
    );
}

/// Requests after a connection's first go through hyper's HTTP/1.1 server, not the byte
/// pump that reads the first head: there too, two `Host` fields, or an absolute-form
/// target whose authority is not the `Host`, are a 400 and never reach the server (which
/// would pick one name, and a check before it the other).
#[test]
fn an_ambiguous_host_after_the_first_request_is_a_400() {
    let port = free_port();
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let q = quill_h2(port, &[]);
    let answer = |second: &str| {
        let mut s = TcpStream::connect(q.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(b"GET /who HTTP/1.1\r\nHost: a.example\r\n\r\n")
            .unwrap();
        // The first answer, by its length.
        let mut raw = Vec::new();
        let mut byte = [0u8; 1];
        let end = loop {
            assert_eq!(s.read(&mut byte).unwrap(), 1, "{raw:?}");
            raw.push(byte[0]);
            let text = String::from_utf8_lossy(&raw).to_ascii_lowercase();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap();
                if body.len() == length {
                    break text;
                }
            }
        };
        assert!(end.starts_with("http/1.1 200"), "{end}");
        s.write_all(second.as_bytes()).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        String::from_utf8_lossy(&rest).into_owned()
    };
    for bad in [
        "GET /who HTTP/1.1\r\nHost: public.example\r\nHost: admin.internal\r\nConnection: close\r\n\r\n",
        "GET http://admin.internal/who HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n",
    ] {
        let got = answer(bad);
        assert!(got.starts_with("HTTP/1.1 400 "), "{bad:?}: {got}");
    }
    let good =
        "GET http://A.example/who HTTP/1.1\r\nHost: a.example:80\r\nConnection: close\r\n\r\n";
    let got = answer(good);
    assert!(got.starts_with("HTTP/1.1 200 "), "{got}");
}

/// The head of the answer to an HTTP/1.1 `GET path` on a connection of its own.
fn head_of(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    text.split_once("\r\n\r\n")
        .map_or(text.clone(), |(head, _)| head.to_string())
}

/// HTTP/2 field names are lowercase; an HTTP/1.1 client gets them in title case, as
/// servers write them (some clients look fields up by their exact case), and quill's own
/// answers too.
#[test]
fn http11_clients_get_field_names_in_title_case() {
    let port = free_port();
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let q = quill_h2(port, &[]);
    let head = head_of(q.addr(), "/who");
    for name in ["Server: ", "Content-Type: ", "Content-Length: "] {
        assert!(head.contains(name), "{name:?} in {head}");
    }
    let down = quill_h2(free_port(), &[]);
    let head = head_of(down.addr(), "/who");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    assert!(head.contains("Content-Length: "), "{head}");
    assert!(!head.contains("content-length"), "{head}");
}

/// Connections established to `port` on this host (from /proc/net/tcp): quill's to its
/// server, in these tests.
fn established_to(port: u16) -> usize {
    let port = format!(":{port:04X}");
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[3] == "01" && f[2].ends_with(&port)
        })
        .count()
}

/// NGINX over HTTP/2 in plain answering "fine" to every request, and 413 at once (then a
/// reset of the stream) to one whose body is over 1 KiB.
fn nginx_refusing_uploads(port: u16) -> Option<Daemon> {
    nginx_at(
        port,
        " http2",
        " client_max_body_size 1k;",
        "  location / { return 200 \"fine\\n\"; }",
        &[],
    )
}

#[test]
fn an_upload_the_server_refuses_early_gets_its_answer_and_the_server_stays_in() {
    // NGINX answers 413 as soon as it reads the head, then resets the stream: the answer
    // must reach the client while its 2 MB are still on their way, and no later request
    // may find the server taken out of service.
    let port = free_port();
    let Some(_nginx) = nginx_refusing_uploads(port) else {
        return;
    };
    let q = quill_h2(port, &["h2c"]);
    let dir = TempDir::new("uph2");
    let file = dir.path().join("upload");
    std::fs::write(&file, vec![b'u'; 2 << 20]).unwrap();
    let url = format!("http://127.0.0.1:{}/up", q.port);
    let upload = format!("@{}", file.display());
    for _ in 0..3 {
        for version in ["--http1.1", "--http2-prior-knowledge"] {
            let Some(out) = tool(
                "curl",
                &[
                    "-sS",
                    "--max-time",
                    "20",
                    version,
                    "-o",
                    "/dev/null",
                    "-w",
                    "%{http_code}",
                    "--data-binary",
                    &upload,
                    &url,
                ],
            ) else {
                return;
            };
            // Over HTTP/2, NGINX reset the stream to quill; quill reads and drops the rest
            // of the client's body instead (a reset makes Debian's curl 7.88 drop the
            // answer it had).
            assert_eq!(out, "413", "upload with curl {version}");
        }
        let Some(out) = tool("nghttp", &["-v", "-d", file.to_str().unwrap(), &url]) else {
            return;
        };
        assert!(out.contains(":status: 413"), "HTTP/2 upload: {out}");
        assert!(!out.contains("recv RST_STREAM"), "HTTP/2 upload: {out}");
        assert_eq!(get(q.addr(), "/after"), (200, "fine\n".to_string()));
    }
}

#[test]
fn a_client_still_uploading_after_an_early_answer_is_not_reset() {
    // The server answers 413 after the head; quill closes the client's connection after
    // it. A client still sending its body (curl only stops once it has read the answer)
    // must not have its connection reset under it: quill shuts its side, then reads and
    // drops the rest until the client closes.
    let port = free_port();
    let Some(_nginx) = nginx_refusing_uploads(port) else {
        return;
    };
    let q = quill_h2(port, &["h2c"]);
    let mut s = TcpStream::connect(q.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let chunk = vec![b'u'; 64 << 10];
    write!(
        s,
        "POST /up HTTP/1.1\r\nHost: example.test\r\nContent-Length: {}\r\n\r\n",
        4 << 20
    )
    .unwrap();
    s.write_all(&chunk).unwrap();
    // The whole answer, then the end of quill's side.
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    // quill has closed its side; the client goes on sending for a while, as curl does
    // until it reads the answer, then closes its own.
    for i in 0..8 {
        s.write_all(&chunk)
            .unwrap_or_else(|e| panic!("write {i} after the answer: {e}"));
    }
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest)
        .expect("the connection ends without a reset");
    assert!(rest.is_empty());
}

#[test]
fn trailers_from_an_http2_server_reach_an_http2_client() {
    let port = free_port();
    let Some(_nginx) = nginx_at(
        port,
        " http2",
        "",
        "  location /sum { add_trailer X-Sum abc; }",
        &[("sum", &[b's'; 100_000])],
    ) else {
        return;
    };
    let q = quill_h2(port, &["h2c"]);
    let url = format!("http://127.0.0.1:{}/sum", q.port);
    let Some(out) = tool("nghttp", &["-v", &url]) else {
        return;
    };
    let lines: Vec<&str> = out.lines().collect();
    let sum = lines
        .iter()
        .position(|l| l.contains("x-sum: abc"))
        .unwrap_or_else(|| panic!("no trailer: {out}"));
    let last_data = lines
        .iter()
        .rposition(|l| l.contains("recv DATA"))
        .unwrap_or_else(|| panic!("no body: {out}"));
    // A trailer comes after the body, on a HEADERS frame of its own.
    assert!(sum > last_data, "{out}");
    assert!(out.contains(":status: 200"), "{out}");
}

#[test]
fn a_connection_that_idles_out_of_the_pool_is_closed() {
    let port = free_port();
    let Some(_nginx) = nginx_at(port, " http2", "", WHO, &[]) else {
        return;
    };
    let q = quill_h2(port, &["upstream_idle_timeout 1"]);
    let answers = many_at_once(q.addr(), 10);
    assert!(!h2_connections(&answers).is_empty());
    // Out of the pool after a second without streams, the connection must end then, not
    // when NGINX tires of it (its keepalive_timeout, 75 s).
    wait_until(
        Duration::from_secs(10),
        "quill closes its idle HTTP/2 connections",
        || established_to(port) == 0,
    );
    // And the next request opens a new one.
    assert_eq!(get(q.addr(), "/who").0, 200);
}

/// A server that speaks HTTP/2 only to turn every connection away: its SETTINGS, then at
/// once a GOAWAY (NO_ERROR, no stream processed), as NGINX sheds connections at its
/// `worker_connections`. Counts the connections it took.
fn turning_away() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&taken);
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            count.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let settings = [0, 0, 0, 4, 0, 0, 0, 0, 0];
                let go_away = [0, 0, 8, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
                let _ = s.write_all(&settings);
                let _ = s.write_all(&go_away);
                let mut sink = [0u8; 4096];
                s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                while matches!(s.read(&mut sink), Ok(n) if n > 0) {}
            });
        }
    });
    (addr, taken)
}

#[test]
fn a_server_that_turns_new_connections_away_is_busy_not_failed() {
    let (server, taken) = turning_away();
    let q = Quill::start(&["-H", "-O", "upstream_h2", "{port}", &server.to_string()]);
    // Each request tries a second new connection, then gets 503 (unavailable for now: not
    // processed); the server is never blacklisted (that would answer 503 without a
    // connection: the connections are counted).
    for round in 1..=3 {
        assert_eq!(get(q.addr(), "/").0, 503, "round {round}");
        let n = taken.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(n, 2 * round, "connections after round {round}");
    }
}

/// `-l IP:PORT`: penlogd hears of each request as the server logs it (`HTTP/2.0`), with
/// the client it came from, though the clients share one server connection.
#[test]
fn penlogd_hears_of_each_request_sent_as_a_stream() {
    let Some(penlogd) = support::penlogd::Penlogd::start() else {
        return;
    };
    let port = free_port();
    let Some(_nginx) = nginx_on(port, " http2", None) else {
        return;
    };
    let penlogd_at = format!("127.0.0.1:{}", penlogd.port);
    let server = format!("127.0.0.1:{port}");
    let q = Quill::start(&[
        "-H",
        "-O",
        "upstream_h2",
        "-l",
        &penlogd_at,
        "{port}",
        &server,
    ]);
    for (src, path) in [("127.0.0.2", "/who?a"), ("127.0.0.3", "/who?b")] {
        let mut s = q.connect_from(src);
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    assert_eq!(
        penlogd.clients_of_gets("HTTP/2.0", &["/who?b", "/who?a"]),
        ["127.0.0.3", "127.0.0.2"]
    );
}

/// `tests/fixtures/h2_resetting_server.py` on a port of its own: an HTTP/2 server that
/// refuses `/refuse` (REFUSED_STREAM), cancels `/cancel` after a head and 5 bytes, and
/// answers anything else; `paths` are the requests it was sent, in order.
struct ResettingServer {
    child: std::process::Child,
    port: u16,
    paths: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl ResettingServer {
    /// `None` (with the reason) where Python's h2 is not installed.
    fn start() -> Option<ResettingServer> {
        use std::io::BufRead;
        let python = python_h2()?;
        let port = free_port();
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h2_resetting_server.py");
        let mut child = std::process::Command::new(python)
            .args([script.to_str().unwrap(), &port.to_string()])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "listening");
        let paths = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = std::sync::Arc::clone(&paths);
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                seen.lock().unwrap().push(line);
            }
        });
        Some(ResettingServer { child, port, paths })
    }

    /// How many requests for `path` reached the server.
    fn sent(&self, path: &str) -> usize {
        self.paths
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == path)
            .count()
    }
}

impl Drop for ResettingServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// nghttp's verbose account of one request (it fails when the stream is reset).
fn nghttp(args: &[&str]) -> Option<String> {
    match std::process::Command::new("nghttp").args(args).output() {
        Ok(out) => Some(String::from_utf8_lossy(&out.stdout).into_owned()),
        Err(_) => {
            eprintln!("SKIPPED: nghttp is not installed (.ci/run installs it)");
            None
        }
    }
}

/// A server that refuses a stream (REFUSED_STREAM: not processed) has refused the request,
/// not failed it. A GET goes once more over a new stream; what quill cannot send again (a
/// POST's body is gone, or the second try was refused too) is refused to an HTTP/2 client
/// in the same words, so that it may send it again itself; an HTTP/1.1 client, which has
/// no such words, gets 503 (unavailable for now) with `Retry-After`. The server stays in
/// service.
#[test]
fn a_request_a_server_refused_unprocessed_is_refused_to_an_http2_client() {
    let Some(server) = ResettingServer::start() else {
        return;
    };
    let q = quill_h2(server.port, &["h2c"]);
    let url = |path: &str| format!("http://127.0.0.1:{}{path}", q.port);

    let dir = TempDir::new("uph2");
    let body = dir.path().join("body");
    std::fs::write(&body, b"form=1").unwrap();
    let Some(out) = nghttp(&["-v", "-d", body.to_str().unwrap(), &url("/refuse")]) else {
        return;
    };
    assert!(out.contains("error_code=REFUSED_STREAM"), "POST: {out}");
    assert!(!out.contains(":status:"), "POST answered: {out}");

    let out = nghttp(&["-v", &url("/refuse")]).unwrap();
    assert!(out.contains("error_code=REFUSED_STREAM"), "GET: {out}");

    let mut s = TcpStream::connect(q.addr()).unwrap();
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.write_all(b"GET /refuse HTTP/1.1\r\nHost: example.test\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let head = answer
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_lowercase();
    assert!(
        head.starts_with("http/1.1 503 "),
        "HTTP/1.1 client: {answer:?}"
    );
    assert!(head.contains("\r\nretry-after: 1\r\n"), "{answer:?}");

    let out = nghttp(&["-v", &url("/after")]).unwrap();
    assert!(
        out.contains(":status: 200"),
        "the server is still in: {out}"
    );
    // The server's account comes through a pipe: once `/after` is in, all before it is.
    wait_until(IO_TIMEOUT, "the server's account of /after", || {
        server.sent("/after") == 1
    });
    assert_eq!(
        server.sent("/refuse"),
        1 + 2 + 2,
        "the POST once, each GET twice (once more, no more)"
    );
}

/// A server that resets a stream in the middle of its answer: an HTTP/2 client gets the
/// head, the bytes that came, and a reset with the server's reason (here CANCEL); an
/// HTTP/1.1 client gets a body that ends short of its `Content-Length`.
#[test]
fn a_server_reset_in_the_middle_of_an_answer_reaches_an_http2_client_with_its_reason() {
    let Some(server) = ResettingServer::start() else {
        return;
    };
    let q = quill_h2(server.port, &["h2c"]);
    let Some(out) = nghttp(&["-v", &format!("http://127.0.0.1:{}/cancel", q.port)]) else {
        return;
    };
    assert!(out.contains(":status: 200"), "{out}");
    assert!(out.contains("error_code=CANCEL"), "{out}");

    let mut s = TcpStream::connect(q.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /cancel HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("Content-Length: 100"), "{text}");
    assert!(
        text.ends_with("\r\n\r\nstart"),
        "the body ends short: {text}"
    );
}

/// A response body pattern no window boundary can hide a lost or repeated chunk in.
fn patterned(len: usize) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect()
}

#[test]
fn an_http11_client_that_stops_reading_holds_a_window_not_the_whole_answer() {
    // 64 MiB against a bound of 12: room for the loopback socket buffers (the kernel grows
    // quill's send buffer up to 4 MiB), the stream's window (256 KiB) and hyper's buffer.
    const SIZE: usize = 64 << 20;
    const BOUND: u64 = 12 << 20;
    let port = free_port();
    let data = patterned(SIZE);
    let Some(_nginx) = nginx_at(port, " http2", "", "", &[("big.bin", &data)]) else {
        return;
    };
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "upstream_h2",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let received = || {
        support::ctl::server_status(&ctl, 0)["bytes_from_server"]
            .as_u64()
            .unwrap()
    };
    let rss_before = q.rss_kib();
    let mut s = TcpStream::connect(q.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(b"GET /big.bin HTTP/1.1\r\nHost: example.test\r\nConnection: close\r\n\r\n")
        .unwrap();
    // The head and a little of the body, then the client reads no more.
    let mut got = vec![0; 64 << 10];
    s.read_exact(&mut got).unwrap();

    // Until quill has stopped taking the answer from the server (the same count for a
    // second), or has taken more than the bound.
    let mut last = (received(), Instant::now());
    let settled = poll_until(Duration::from_secs(30), || {
        let now = received();
        if now > BOUND {
            return true;
        }
        if now != last.0 {
            last = (now, Instant::now());
        }
        last.1.elapsed() >= Duration::from_secs(1)
    });
    let held = received();
    assert!(
        settled,
        "quill never stopped taking the answer ({held} bytes)"
    );
    assert!(
        held <= BOUND,
        "a client that read 64 KiB made quill take {held} bytes of a {SIZE}-byte answer"
    );
    if let (Some(before), Some(now)) = (rss_before, q.rss_kib()) {
        assert!(
            now.saturating_sub(before) < 24 << 10,
            "quill's RSS grew from {before} to {now} KiB for a client that does not read"
        );
    }

    // Reading again, the client gets all of it, exactly.
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got[..got.len().min(1024)]);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let body = got
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|at| &got[at + 4..])
        .unwrap_or_else(|| panic!("no end of head: {text}"));
    assert_eq!(body.len(), SIZE, "the body's length");
    assert!(body == &data[..], "the body came changed");
    assert_eq!(received(), SIZE as u64);
}
