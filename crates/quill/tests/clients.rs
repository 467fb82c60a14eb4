//! Real clients that nobody here wrote (wrk paced by a `delay()` script, h2load, ab, curl
//! `--parallel`, Python `requests`, nmap's and testssl.sh's TLS checks) through quill to a
//! real backend: Debian's NGINX with
//! `sendfile on`, whose every response leaves in two writes (head, then body), as many
//! application servers' do. Each tool is skipped with a message where it is not installed;
//! `.ci/run` installs them all.
//!
//! No timing is asserted. A stall of tens of milliseconds per request (Nagle's algorithm
//! holding a response's body until the client's delayed ACK) is a functional defect, so
//! the paced runs assert that quill serves nearly as many requests as the direct run does
//! in the same time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use support::ctl::run_tool;
use support::daemon::{nginx, nginx_files, Daemon};
use support::pki::certificates;
use support::*;

/// The tools measure rates: one at a time, so that they do not share the two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const KIB: usize = 1024;

/// A 1 KiB page of printable bytes, served by NGINX as `/1k`.
fn page() -> Vec<u8> {
    (0..KIB).map(|i| b'a' + (i % 26) as u8).collect()
}

fn nginx_with_page() -> Option<(Daemon, u16)> {
    nginx_files(&[("1k", &page())])
}

/// The number in `text` that follows `before` (up to the next space), e.g. wrk's
/// "  3177 requests in 3.00s".
fn number_before(text: &str, after: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let at = l.find(after)?;
            l[..at].split_whitespace().last()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no number before {after:?} in:\n{text}"))
}

/// wrk with one thread and `connections` connections, each waiting 20 ms after every
/// answer before its next request: the requests completed in 3 s. Few connections and a
/// long pause make a stall of tens of milliseconds per response stand out against what
/// a loaded machine adds (a millisecond or two).
fn paced_wrk(port: u16, connections: usize) -> Option<u64> {
    paced_wrk_to(&format!("http://127.0.0.1:{port}/1k"), connections)
}

/// [`paced_wrk`] to `url` (an `https` one too: wrk does not check certificates).
fn paced_wrk_to(url: &str, connections: usize) -> Option<u64> {
    let dir = TempDir::new("wrk");
    let script = dir.path().join("pace.lua");
    std::fs::write(&script, "function delay() return 20 end\n").unwrap();
    let out = tool(
        "wrk",
        &[
            "-t1",
            &format!("-c{connections}"),
            "-d3s",
            "-s",
            script.to_str().unwrap(),
            url,
        ],
    )?;
    assert!(!out.contains("Non-2xx"), "wrk saw errors:\n{out}");
    assert!(
        !out.contains("Socket errors"),
        "wrk saw socket errors:\n{out}"
    );
    Some(number_before(&out, "requests in"))
}

/// An HTTP/1.1 keep-alive server that answers every request with the 1 KiB page in two
/// writes a millisecond apart, the head and then the body (as an application server
/// that flushes its head before it has rendered the body), so the body always arrives
/// at quill as a second read. Like NGINX it sets TCP_NODELAY. Runs until the test ends.
fn two_write_server() -> u16 {
    two_write_server_with(true, 0)
}

/// [`two_write_server`], with Nagle's algorithm on when `nodelay` is false (as many
/// application servers leave it): its kernel then holds each second write until the
/// first is acknowledged. The first write carries the head and the body's first
/// `with_head` bytes.
fn two_write_server_with(nodelay: bool, with_head: usize) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let _ = conn.set_nodelay(nodelay);
                answer_in_two_writes(&mut conn, with_head);
            });
        }
    });
    port
}

/// [`two_write_server_with`] behind TLS that offers only `http/1.1` (so an `upstream_h2`
/// quill speaks HTTP/1.1 to it, through hyper's client), with Nagle's algorithm on unless
/// `nodelay`: each write is a record of its own. `cert` and `key` from [`certificates`].
fn tls_two_write_server(cert: &Path, key: &Path, nodelay: bool) -> u16 {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from_pem_file(cert).unwrap()],
            PrivateKeyDer::from_pem_file(key).unwrap(),
        )
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let config = std::sync::Arc::new(config);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let config = std::sync::Arc::clone(&config);
            std::thread::spawn(move || {
                let _ = conn.set_nodelay(nodelay);
                let Ok(tls) = rustls::ServerConnection::new(config) else {
                    return;
                };
                answer_in_two_writes(&mut rustls::StreamOwned::new(tls, conn), 0);
            });
        }
    });
    port
}

/// Answers every request head read from `conn` with the 1 KiB page in two writes a
/// millisecond apart: the head and the body's first `with_head` bytes, then the rest.
/// Returns when the client closes or a write fails.
fn answer_in_two_writes(conn: &mut (impl std::io::Read + std::io::Write), with_head: usize) {
    let mut head = format!("HTTP/1.1 200 OK\r\nContent-Length: {KIB}\r\n\r\n").into_bytes();
    let mut body = page();
    head.extend(body.drain(..with_head));
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            got.drain(..end + 4);
            if conn.write_all(&head).is_err() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
            if conn.write_all(&body).is_err() {
                return;
            }
        }
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// The issue's reproduction: at a moderate paced load, a response written as a head and a
/// body must not wait for the client's delayed ACK. With Nagle's algorithm on quill's
/// client socket (`no tcp_nodelay`, Pen's default) every body waited for wrk's delayed
/// ACK and quill served about a third of the direct run's requests; by default it keeps
/// up.
#[test]
fn paced_wrk_through_quill_keeps_up_with_the_direct_run() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let port = two_write_server();
    let q = Quill::start(&["-r", "{port}", &format!("127.0.0.1:{port}")]);
    let Some(direct) = paced_wrk(port, 4) else {
        return;
    };
    let proxied = paced_wrk(q.addr().port(), 4).unwrap();
    eprintln!("paced wrk, 3 s: {direct} requests direct, {proxied} through quill");
    assert!(
        proxied * 10 >= direct * 9,
        "through quill {proxied} requests in 3 s, direct {direct}: responses stall"
    );
}

/// A server that writes an answer in two writes (the head, or the head and the start of
/// the body, then the rest) with Nagle's algorithm on holds the second until the first is
/// acknowledged, and a reader's kernel delays that ACK by up to 40 ms (a client straight
/// to such a server waits that long for every answer after the first few). In `http` mode
/// quill acknowledges at once a read that brought an answer's head and not all of its
/// body: HTTP/1.1 clients over pooled server connections and over their own
/// (`upstream_keepalive 0`), and HTTP/2 clients, are served as fast as from a server with
/// TCP_NODELAY. A raw relay, plain or behind TLS, knows no heads, nor does hyper's
/// HTTP/1.1 client (`upstream_h2` to a TLS server that declines HTTP/2): they acknowledge
/// a server's reads at once after they have seen the server wait for an acknowledgement
/// once.
#[test]
fn a_server_with_nagles_algorithm_on_does_not_wait_for_delayed_acks() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("nagle");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    self_signed(&cert, &key);
    let tls = ["-E", cert.to_str().unwrap(), "-K", key.to_str().unwrap()];
    let nodelay = two_write_server_with(true, 0);
    let pooled: &[&str] = &["-H"];
    let one_to_one: &[&str] = &["-H", "-O", "upstream_keepalive 0"];
    let raw: &[&str] = &[];
    // TLS to servers that decline HTTP/2 under `upstream_h2`: hyper's HTTP/1.1 client.
    let (ca, server_cert, server_key) = certificates(dir.path());
    let ca = format!("upstream_ca {}", ca.display());
    let declined: &[&str] = &["-H", "-O", "upstream_tls", "-O", &ca, "-O", "upstream_h2"];
    let tls_nodelay = tls_two_write_server(&server_cert, &server_key, true);
    let two_writes = |with_head| (nodelay, two_write_server_with(false, with_head));
    for (what, (nodelay, nagle), options) in [
        ("head, body", two_writes(0), pooled),
        ("head and 100 bytes, the rest", two_writes(100), pooled),
        ("head, body", two_writes(0), one_to_one),
        ("head, body", two_writes(0), raw),
        ("head, body", two_writes(0), &tls[..]),
        (
            "head, body, over TLS",
            (
                tls_nodelay,
                tls_two_write_server(&server_cert, &server_key, false),
            ),
            declined,
        ),
    ] {
        let through = |port: u16| {
            let server = format!("127.0.0.1:{port}");
            let mut args = options.to_vec();
            args.extend(["{port}", &server]);
            let q = Quill::start(&args);
            let scheme = if options.contains(&"-E") {
                "https"
            } else {
                "http"
            };
            paced_wrk_to(&format!("{scheme}://127.0.0.1:{}/1k", q.addr().port()), 4)
        };
        let Some(fast) = through(nodelay) else {
            return;
        };
        let slow = through(nagle).unwrap();
        eprintln!("{options:?}, {what}: paced wrk, 3 s: {slow} requests from the Nagle server, {fast} from the other");
        assert!(
            slow * 10 >= fast * 9,
            "{options:?}, {what}: {slow} requests from the server with Nagle's algorithm, {fast} without"
        );
    }
    // HTTP/2 clients, one request at a time (each would wait out a delayed ACK).
    let nagle = two_write_server_with(false, 100);
    let h2 = |port: u16| -> Option<f64> {
        let q = Quill::start(&["-H", "-O", "h2c", "{port}", &format!("127.0.0.1:{port}")]);
        let out = tool(
            "h2load",
            &[
                "-c1",
                "-m1",
                "-n200",
                &format!("http://127.0.0.1:{}/1k", q.addr().port()),
            ],
        )?;
        assert_eq!(number_before(&out, "succeeded"), 200, "h2load:\n{out}");
        out.lines()
            .find(|l| l.starts_with("finished in"))
            .and_then(|l| l.split(", ").nth(1)?.strip_suffix(" req/s")?.parse().ok())
    };
    let Some(fast) = h2(nodelay) else {
        return;
    };
    let slow = h2(nagle).unwrap();
    eprintln!("h2load, one stream at a time: {slow:.0} req/s from the Nagle server, {fast:.0} from the other");
    assert!(
        slow * 2.0 >= fast,
        "HTTP/2: {slow:.0} req/s from the server with Nagle's algorithm, {fast:.0} without"
    );
}

/// h2load over HTTP/1.1 at full speed on two connections through quill: every request
/// succeeds, and the rate is of the same order as the direct one (with Nagle's algorithm
/// each response waited for a delayed ACK: a few dozen requests a second).
#[test]
fn h2load_http1_through_quill_succeeds_without_stalls() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = nginx_with_page() else {
        return;
    };
    let q = Quill::start(&["-r", "{port}", &format!("127.0.0.1:{port}")]);
    let run = |port: u16| -> Option<(u64, f64)> {
        let out = tool(
            "h2load",
            &[
                "--h1",
                "-c2",
                "-n2000",
                &format!("http://127.0.0.1:{port}/1k"),
            ],
        )?;
        let succeeded = number_before(&out, "succeeded");
        assert_eq!(succeeded, 2000, "h2load:\n{out}");
        let rate: f64 = out
            .lines()
            .find(|l| l.starts_with("finished in"))
            .and_then(|l| l.split(", ").nth(1)?.strip_suffix(" req/s")?.parse().ok())
            .unwrap_or_else(|| panic!("no rate in:\n{out}"));
        Some((succeeded, rate))
    };
    let Some((_, direct)) = run(port) else {
        return;
    };
    let (_, proxied) = run(q.addr().port()).unwrap();
    eprintln!("h2load: {direct:.0} req/s direct, {proxied:.0} req/s through quill");
    assert!(
        proxied * 10.0 >= direct,
        "through quill {proxied:.0} req/s, direct {direct:.0} req/s: responses stall"
    );
}

/// ApacheBench with keep-alive through the `http` mode: no failed request, every body
/// complete.
#[test]
fn ab_keepalive_through_http_mode_fails_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = nginx_with_page() else {
        return;
    };
    let q = Quill::start(&["-H", "-r", "{port}", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{}/1k", q.addr().port());
    let Some(out) = tool("ab", &["-k", "-c", "20", "-n", "5000", &url]) else {
        return;
    };
    assert!(out.contains("Complete requests:      5000"), "{out}");
    assert!(out.contains("Failed requests:        0"), "{out}");
    assert!(out.contains("Keep-Alive requests:    5000"), "{out}");
    assert!(!out.contains("Non-2xx"), "{out}");
}

/// curl fetching 200 URLs over at most 20 parallel connections, plain and through the
/// `http` mode: every body byte-exact.
#[test]
fn curl_parallel_fetches_are_byte_exact() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = nginx_with_page() else {
        return;
    };
    for mode in [&[][..], &["-H"][..]] {
        let mut args: Vec<&str> = mode.to_vec();
        let backend = format!("127.0.0.1:{port}");
        args.extend(["-r", "{port}", &backend]);
        let q = Quill::start(&args);
        let dir = TempDir::new("curl");
        let mut cmd = vec![
            "--silent".to_string(),
            "--fail".to_string(),
            "--parallel".to_string(),
            "--parallel-max".to_string(),
            "20".to_string(),
        ];
        for i in 0..200 {
            cmd.push(format!("http://127.0.0.1:{}/1k", q.addr().port()));
            cmd.push("-o".to_string());
            cmd.push(dir.path().join(format!("{i}")).display().to_string());
        }
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        if tool("curl", &args).is_none() {
            return;
        }
        for i in 0..200 {
            let got = std::fs::read(dir.path().join(format!("{i}"))).unwrap();
            assert_eq!(got, page(), "response {i} through quill {mode:?}");
        }
    }
}

/// Python's `requests` with one keep-alive session through the `http` mode: every request
/// of the session reaches NGINX with the client's X-Forwarded-For and X-Forwarded-Proto.
#[test]
fn python_requests_session_gets_forwarded_headers_on_every_request() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = nginx(
        "",
        "",
        "  location /who { default_type text/plain; \
         return 200 \"$http_x_forwarded_for $http_x_forwarded_proto $connection\\n\"; }",
        &[],
    ) else {
        return;
    };
    let q = Quill::start(&["-H", "-r", "{port}", &format!("127.0.0.1:{port}")]);
    let script = format!(
        "import requests\n\
         s = requests.Session()\n\
         for i in range(100):\n\
         \x20   r = s.get('http://127.0.0.1:{}/who', timeout=10)\n\
         \x20   r.raise_for_status()\n\
         \x20   print(r.text.strip())\n",
        q.addr().port()
    );
    let python = "/usr/bin/python3";
    let has_requests = Command::new(python)
        .args(["-c", "import requests"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_requests {
        eprintln!("SKIPPED: python3-requests is not installed (.ci/run installs it)");
        return;
    }
    let out = tool(python, &["-c", &script]).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 100, "{out}");
    // One keep-alive connection to NGINX carried all of them (quill relays one client
    // connection over one server connection), each with its own headers.
    let connection = lines[0].split_whitespace().nth(2).unwrap();
    for line in &lines {
        assert_eq!(line, &format!("127.0.0.1 http {connection}"), "{out}");
    }
}

/// nmap's `ssl-enum-ciphers` script grades every protocol and cipher quill's default TLS
/// listener offers: TLS 1.2 and 1.3 only, every cipher graded A, server preference.
#[test]
fn nmap_grades_every_default_tls_cipher_a() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("nmap");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    self_signed(&cert, &key);
    let q = Quill::start(&[
        "-E",
        cert.to_str().unwrap(),
        "-K",
        key.to_str().unwrap(),
        "-O",
        "dummy",
        "{port}",
        "127.0.0.1:9",
    ]);
    let port = q.addr().port().to_string();
    let Some(out) = tool(
        "nmap",
        &[
            "-Pn",
            "-n",
            "-p",
            &port,
            "--script",
            "ssl-enum-ciphers",
            "127.0.0.1",
        ],
    ) else {
        return;
    };
    assert!(
        out.contains("TLSv1.2:") && out.contains("TLSv1.3:"),
        "{out}"
    );
    for old in ["SSLv3:", "TLSv1.0:", "TLSv1.1:"] {
        assert!(!out.contains(old), "{old} offered:\n{out}");
    }
    assert!(out.contains("least strength: A"), "{out}");
    assert!(!out.contains("cipher preference: client"), "{out}");
}

/// testssl.sh's protocol, cipher, forward-secrecy and vulnerability checks against quill's
/// default TLS listener, and against Pen's A+ recipe in `http` mode (TLS 1.2 and up, ECDHE
/// suites only, HSTS): no finding worse than LOW. (Certificate trust is left out: the test
/// certificate is self-signed by design.)
#[test]
fn testssl_finds_nothing_worse_than_low() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = nginx_with_page() else {
        return;
    };
    let dir = TempDir::new("testssl");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    self_signed(&cert, &key);
    let backend = format!("127.0.0.1:{port}");
    let tls = ["-E", cert.to_str().unwrap(), "-K", key.to_str().unwrap()];
    let default: Vec<&str> = tls
        .iter()
        .copied()
        .chain(["-O", "dummy", "{port}", "127.0.0.1:9"])
        .collect();
    let recipe: Vec<&str> = tls
        .iter()
        .copied()
        .chain([
            "-H",
            "-O",
            "ssl_option no_tlsv1.1",
            "-O",
            "ssl_ciphers ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-ECDSA-CHACHA20-POLY1305",
            "-O",
            "hsts 31536000",
            "{port}",
            &backend,
        ])
        .collect();
    for (name, args) in [("default", default), ("Pen's A+ recipe", recipe)] {
        let q = Quill::start(&args);
        let Some(findings) = testssl(&q, &["-p", "-s", "-f", "-U"], dir.path()) else {
            return;
        };
        let worse: Vec<String> = findings
            .iter()
            .filter(|f| matches!(f["severity"].as_str(), Some("MEDIUM" | "HIGH" | "CRITICAL")))
            .map(|f| format!("{} {}: {}", f["severity"], f["id"], f["finding"]))
            .collect();
        assert!(
            worse.is_empty(),
            "testssl against quill's {name}: {worse:#?}"
        );
    }
}

/// testssl.sh's protocol checks (`-p`, which try ALPN protocol by protocol with
/// `openssl s_client -alpn`) against quill's TLS listener in `http` mode: `h2` offered
/// beside `http/1.1` by default, and not offered with `alpn http/1.1`.
#[test]
fn testssl_finds_h2_offered_by_alpn_only_where_configured() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = nginx_with_page() else {
        return;
    };
    let dir = TempDir::new("testssl-alpn");
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    self_signed(&cert, &key);
    let backend = format!("127.0.0.1:{port}");
    let tls = [
        "-H",
        "-E",
        cert.to_str().unwrap(),
        "-K",
        key.to_str().unwrap(),
    ];
    // What testssl found about ALPN: the `ALPN_HTTP2` finding (only written when h2 is
    // offered) and `ALPN` (the other protocols offered, or "not offered").
    let alpn = |extra: &[&str]| {
        let args: Vec<&str> = tls
            .iter()
            .chain(extra)
            .copied()
            .chain(["{port}", backend.as_str()])
            .collect();
        let q = Quill::start(&args);
        let findings = testssl(&q, &["-p"], dir.path())?;
        let finding = |id: &str| {
            findings
                .iter()
                .find(|f| f["id"] == id)
                .map(|f| f["finding"].as_str().unwrap_or_default().to_string())
        };
        Some((finding("ALPN_HTTP2"), finding("ALPN")))
    };
    let Some((h2, others)) = alpn(&[]) else {
        return;
    };
    assert_eq!(h2.as_deref(), Some("h2"), "h2 offered by default");
    assert_eq!(others.as_deref(), Some("http/1.1"));
    let (h2, others) = alpn(&["-O", "alpn http/1.1"]).expect("testssl ran before");
    assert_eq!(h2, None, "h2 offered with `alpn http/1.1`");
    assert_eq!(others.as_deref(), Some("http/1.1"));
}

/// How long one testssl run may take (its checks are many handshakes, each bounded by
/// its own `--connect-timeout` and `--openssl-timeout`).
const TESTSSL_DEADLINE: Duration = Duration::from_secs(600);

/// testssl.sh's `checks` against quill's listener: its JSON findings, or `None` (with a
/// message) where testssl is not installed. The JSON file goes to `dir`.
fn testssl(q: &Quill, checks: &[&str], dir: &Path) -> Option<Vec<serde_json::Value>> {
    if Command::new("testssl").arg("--version").output().is_err() {
        eprintln!("SKIPPED: testssl is not installed (.ci/run installs testssl.sh)");
        return None;
    }
    let json = dir.join(format!("{}.json", q.addr().port()));
    let target = format!("127.0.0.1:{}", q.addr().port());
    let mut args = vec![
        "--quiet",
        "--color",
        "0",
        "--warnings",
        "off",
        "--connect-timeout",
        "10",
        "--openssl-timeout",
        "10",
    ];
    args.extend_from_slice(checks);
    args.extend(["--jsonfile", json.to_str().unwrap(), &target]);
    let run = run_tool(Path::new("testssl"), &args, TESTSSL_DEADLINE);
    assert_eq!(
        run.code,
        Some(0),
        "testssl {args:?}:\n{}{}",
        run.stdout,
        run.stderr
    );
    let text = std::fs::read_to_string(&json)
        .unwrap_or_else(|e| panic!("testssl wrote no {}: {e}", json.display()));
    let findings: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("testssl's {} is not JSON ({e}): {text}", json.display()));
    match findings {
        serde_json::Value::Array(all) => Some(all),
        other => panic!("testssl's findings are not a list: {other}"),
    }
}

/// A self-signed P-256 certificate for `localhost` made with `openssl req`.
fn self_signed(cert: &std::path::Path, key: &std::path::Path) {
    tool(
        "openssl",
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "30",
            "-subj",
            "/CN=localhost",
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
        ],
    )
    .expect("openssl is needed (.ci/run installs it)");
}
