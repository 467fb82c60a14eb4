//! PROXY protocol: `proxy_protocol v1|v2` (global and per server) read by real consumers
//! (NGINX `listen ... proxy_protocol`, HAProxy `accept-proxy`, from Debian), the
//! LOCAL/UNKNOWN form for Unix-socket clients, and `accept_proxy`: a client behind another
//! balancer is tracked, ACL-checked, logged and X-Forwarded-For'd as the address its
//! header names; a bad header closes the connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use support::daemon::{self, Daemon};
use support::http_echo::{read_response, EchoServer};
use support::*;

/// NGINX answering every request with the PROXY protocol addresses it read.
fn nginx() -> Option<(Daemon, u16)> {
    daemon::nginx(
        " proxy_protocol",
        "",
        "  location / {\n   default_type text/plain;\n\
         return 200 \"client=$proxy_protocol_addr:$proxy_protocol_port dst=$proxy_protocol_server_addr:$proxy_protocol_server_port\\n\";\n  }",
        &[],
    )
}

/// HAProxy answering every request with the source and destination `accept-proxy` read.
fn haproxy() -> Option<(Daemon, u16)> {
    let dir = TempDir::new("haproxy");
    let port = free_port();
    let conf = format!(
        "defaults\n mode http\n timeout connect 5s\n timeout client 10s\n timeout server 10s\n\
         frontend fe\n bind 127.0.0.1:{port} accept-proxy\n\
         http-request return status 200 content-type text/plain lf-string \"client=%[src]:%[src_port] dst=%[dst]:%[dst_port]\\n\"\n"
    );
    let path = dir.path().join("haproxy.cfg");
    std::fs::write(&path, conf).unwrap();
    let args = vec![
        "-db".to_string(),
        "-f".to_string(),
        path.display().to_string(),
    ];
    Daemon::start("/usr/sbin/haproxy", &args, port, dir).map(|h| (h, port))
}

/// One request through quill from `src`; returns the body and the client's own port.
fn ask(q: &Quill, src: &str) -> (String, u16) {
    let mut s = q.connect_from(src);
    let port = s.local_addr().unwrap().port();
    s.write_all(b"GET / HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut s).expect("an answer");
    assert_eq!(resp.status, 200, "{}", resp.head);
    (String::from_utf8_lossy(&resp.body).trim().to_string(), port)
}

#[test]
fn nginx_reads_the_real_client_from_v1_and_v2() {
    let Some((_nginx, port)) = nginx() else {
        return;
    };
    for version in ["v1", "v2"] {
        let cmd = format!("proxy_protocol {version}");
        let backend = format!("127.0.0.1:{port}");
        let q = Quill::start(&["-O", &cmd, "127.0.0.1:{port}", &backend]);
        let (body, client_port) = ask(&q, "127.0.0.2");
        assert_eq!(
            body,
            format!("client=127.0.0.2:{client_port} dst=127.0.0.1:{}", q.port),
            "{version}"
        );
    }
}

#[test]
fn haproxy_reads_the_real_client_from_v2_and_v1() {
    let Some((_haproxy, port)) = haproxy() else {
        return;
    };
    for version in ["v2", "v1"] {
        let cmd = format!("proxy_protocol {version}");
        let backend = format!("127.0.0.1:{port}");
        let q = Quill::start(&["-O", &cmd, "127.0.0.1:{port}", &backend]);
        let (body, client_port) = ask(&q, "127.0.0.3");
        assert_eq!(
            body,
            format!("client=127.0.0.3:{client_port} dst=127.0.0.1:{}", q.port),
            "{version}"
        );
    }
}

#[test]
fn ipv6_clients_are_announced_as_tcp6() {
    if !ipv6_available() {
        eprintln!("SKIPPED: no IPv6 loopback");
        return;
    }
    let Some((_nginx, port)) = nginx() else {
        return;
    };
    for version in ["v1", "v2"] {
        let cmd = format!("proxy_protocol {version}");
        let backend = format!("127.0.0.1:{port}");
        let q = Quill::start(&["-O", &cmd, "[::1]:{port}", &backend]);
        let (body, client_port) = ask(&q, "::1");
        assert_eq!(
            body,
            format!("client=::1:{client_port} dst=::1:{}", q.port),
            "{version}"
        );
    }
}

/// The bytes an echoing backend received first, as the client sees them echoed.
fn echoed_prefix(s: &mut impl Read, len: usize) -> Vec<u8> {
    let mut got = vec![0; len];
    s.read_exact(&mut got).unwrap();
    got
}

const V2_SIGNATURE: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";

#[test]
fn the_server_setting_overrides_the_global_one() {
    let echo = IdentityBackend::start("echo");
    // Global off, server 0 v2.
    let q = Quill::start(&[
        "-O",
        "server 0 proxy_protocol v2",
        "127.0.0.1:{port}",
        &echo.spec(),
    ]);
    let mut s = q.connect_from("127.0.0.4");
    assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
    let header = echoed_prefix(&mut s, 28);
    assert_eq!(&header[..12], V2_SIGNATURE);
    assert_eq!(&header[12..16], &[0x21, 0x11, 0, 12]);
    assert_eq!(&header[16..20], &[127, 0, 0, 4]);
    drop(q);
    // Global v1, server 0 off.
    let q = Quill::start(&[
        "-O",
        "proxy_protocol v1",
        "-O",
        "server 0 proxy_protocol off",
        "127.0.0.1:{port}",
        &echo.spec(),
    ]);
    let mut s = q.connect();
    assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
    s.write_all(b"data\n").unwrap();
    assert_eq!(echoed_prefix(&mut s, 5), b"data\n");
}

#[test]
fn unix_socket_clients_get_the_local_form() {
    let echo = IdentityBackend::start("echo");
    for (version, expected) in [
        ("v1", b"PROXY UNKNOWN\r\n".to_vec()),
        ("v2", [V2_SIGNATURE, &[0x20, 0x00, 0, 0]].concat()),
    ] {
        let cmd = format!("proxy_protocol {version}");
        let q = Quill::start(&["-O", &cmd, "{sock}", &echo.spec()]);
        let Target::Unix(path) = q.target().clone() else {
            panic!("not a Unix listener")
        };
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
        assert_eq!(echoed_prefix(&mut s, expected.len()), expected, "{version}");
    }
}

#[test]
fn accept_proxy_names_the_real_client_in_x_forwarded_for_and_the_log() {
    let backend = EchoServer::start();
    let q = Quill::start(&[
        "-H",
        "-O",
        "accept_proxy",
        "-l",
        "{dir}/conn.log",
        "127.0.0.1:{port}",
        &backend.spec(),
    ]);
    let mut s = q.connect_from("127.0.0.2");
    s.write_all(b"PROXY TCP4 127.0.0.9 127.0.0.1 40000 80\r\nGET /v1 HTTP/1.1\r\n\r\n")
        .unwrap();
    let seen = read_response(&mut s).unwrap().seen();
    assert_eq!(seen.request_line(), "GET /v1 HTTP/1.1");
    assert_eq!(seen.fields("x-forwarded-for"), ["127.0.0.9"]);
    drop(s);
    // Version 2, and the header split over two writes.
    let mut s = q.connect_from("127.0.0.2");
    let mut header = V2_SIGNATURE.to_vec();
    header.extend_from_slice(&[0x21, 0x21, 0, 36]);
    header.extend_from_slice(
        &"2001:db8::9"
            .parse::<std::net::Ipv6Addr>()
            .unwrap()
            .octets(),
    );
    header.extend_from_slice(&std::net::Ipv6Addr::LOCALHOST.octets());
    header.extend_from_slice(&[0x9c, 0x40, 0, 80]);
    s.write_all(&header[..10]).unwrap();
    s.flush().unwrap();
    s.write_all(&header[10..]).unwrap();
    s.write_all(b"GET /v2 HTTP/1.1\r\n\r\n").unwrap();
    let seen = read_response(&mut s).unwrap().seen();
    assert_eq!(seen.request_line(), "GET /v2 HTTP/1.1");
    assert_eq!(seen.fields("x-forwarded-for"), ["2001:db8::9"]);
    drop(s);
    let log = q.dir().join("conn.log");
    wait_until(Duration::from_secs(10), "two log lines", || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() >= 2)
    });
    let text = std::fs::read_to_string(&log).unwrap();
    // A line is written when its connection ends, and the two may end in either order.
    let mut clients: Vec<&str> = text.lines().filter_map(|l| l.split(' ').next()).collect();
    clients.sort_unstable();
    assert_eq!(clients, ["127.0.0.9", "2001:db8::9"], "{text}");
}

fn v1_header(claimed: &str) -> String {
    format!("PROXY TCP4 {claimed} 127.0.0.1 40000 80\r\n")
}

#[test]
fn accept_proxy_clients_are_acl_checked_as_the_claimed_address() {
    let echo = IdentityBackend::start("echo");
    let q = Quill::start(&[
        "-O",
        "accept_proxy",
        "-O",
        "acl 1 deny 127.0.0.9",
        "-O",
        "client_acl 1",
        "127.0.0.1:{port}",
        &echo.spec(),
    ]);
    let mut s = q.connect_from("127.0.0.2");
    s.write_all(v1_header("127.0.0.9").as_bytes()).unwrap();
    expect_closed_without_data(&mut s, Duration::from_secs(10));
    let mut s = q.connect_from("127.0.0.9");
    s.write_all(v1_header("127.0.0.8").as_bytes()).unwrap();
    assert_eq!(backend_name(&mut s).as_deref(), Some("echo"));
    s.write_all(b"after the header\n").unwrap();
    assert_eq!(echoed_prefix(&mut s, 17), b"after the header\n");
}

#[test]
fn accept_proxy_clients_are_tracked_as_the_claimed_address() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&[
        "-O",
        "accept_proxy",
        "127.0.0.1:{port}",
        &a.spec(),
        &b.spec(),
    ]);
    let claimed = ["127.0.0.20", "127.0.0.21", "127.0.0.22", "127.0.0.23"];
    let mut first = Vec::new();
    for c in claimed {
        let mut s = q.connect_from("127.0.0.2");
        s.write_all(v1_header(c).as_bytes()).unwrap();
        first.push(backend_name(&mut s).unwrap());
    }
    assert!(
        first.iter().any(|n| n == "a") && first.iter().any(|n| n == "b"),
        "new clients should be spread: {first:?}"
    );
    // The same claimed clients through another proxy address return to their server.
    for (c, server) in claimed.iter().zip(&first) {
        let mut s = q.connect_from("127.0.0.3");
        s.write_all(v1_header(c).as_bytes()).unwrap();
        assert_eq!(backend_name(&mut s).as_ref(), Some(server), "{c}");
    }
}

#[test]
fn accept_proxy_closes_on_a_bad_or_missing_header() {
    let echo = IdentityBackend::start("echo");
    let q = Quill::start(&[
        "-t",
        "1",
        "-O",
        "accept_proxy",
        "127.0.0.1:{port}",
        &echo.spec(),
    ]);
    for bad in [
        &b"PROXY TCP4 999.0.0.1 127.0.0.1 1 2\r\n"[..],
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"PROXY TCP4 127.0.0.1 127.0.0.1 1 2\n",
        b"\r\n\r\n\0\r\nQUIT\n\x31\x11\x00\x0c",
    ] {
        let mut s = q.connect();
        s.write_all(bad).unwrap();
        expect_closed_without_data(&mut s, Duration::from_secs(10));
    }
    // Silence: closed once the header's time (-t) has passed.
    let mut s = q.connect();
    expect_closed_without_data(&mut s, Duration::from_secs(10));
    assert_eq!(echo.accepted(), 0, "no bad client reached the server");
}

#[test]
fn accept_proxy_then_proxy_protocol_passes_the_real_client_on() {
    let Some((_nginx, port)) = nginx() else {
        return;
    };
    let backend = format!("127.0.0.1:{port}");
    let q = Quill::start(&[
        "-O",
        "accept_proxy",
        "-O",
        "proxy_protocol v2",
        "127.0.0.1:{port}",
        &backend,
    ]);
    let mut s = q.connect_from("127.0.0.2");
    s.write_all(b"PROXY TCP4 127.0.0.9 192.0.2.80 40000 443\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut s).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&resp.body).trim(),
        "client=127.0.0.9:40000 dst=192.0.2.80:443"
    );
}
