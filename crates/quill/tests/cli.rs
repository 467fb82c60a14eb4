//! The command line: argument errors, --help, --version, and the dummy
//! HTTP server mode.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufRead, BufReader, Write};
use std::time::Duration;

use support::*;

/// Runs `quill -f ARGS` expecting a usage error that names `culprit`:
/// exit status 2 and exactly one line on stderr.  (Against Pen, which exits
/// with status 1 and chattier output, only a failure naming `culprit` is
/// required.)
fn expect_usage_error(args: &[&str], culprit: &str) {
    let (code, stderr) = Quill::start_expect_exit(args);
    if is_pen() {
        assert!(
            code.is_some_and(|c| c != 0),
            "pen {args:?} exited with {code:?}"
        );
        assert!(
            stderr.contains(culprit),
            "stderr does not name {culprit:?}:\n{stderr}"
        );
        return;
    }
    assert_eq!(code, Some(2), "exit status for {args:?}; stderr:\n{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "expected exactly one line on stderr for {args:?}, got:\n{stderr}"
    );
    assert!(
        lines[0].contains(culprit),
        "the error does not name {culprit:?}: {:?}",
        lines[0]
    );
}

#[test]
fn unknown_option_is_a_usage_error() {
    if skip_on_pen("Pen 0.34 does not name unknown long options") {
        return;
    }
    expect_usage_error(&["--frobnicate", "{port}", "127.0.0.1:80"], "frobnicate");
}

#[test]
fn unknown_short_option_is_a_usage_error() {
    if skip_on_pen("Pen 0.34 prints the whole usage text") {
        return;
    }
    expect_usage_error(&["-Y", "{port}", "127.0.0.1:80"], "Y");
}

#[test]
fn malformed_server_address_is_a_usage_error() {
    expect_usage_error(&["{port}", "300.1.1.1"], "300.1.1.1");
}

#[test]
fn listen_port_out_of_range_is_a_usage_error() {
    expect_usage_error(&["70000", "127.0.0.1"], "70000");
}

#[test]
fn non_numeric_server_field_is_a_usage_error() {
    if skip_on_pen("Pen 0.34 reads a non-numeric limit as 0") {
        return;
    }
    expect_usage_error(&["{port}", "127.0.0.1:80:abc"], "abc");
}

#[test]
fn help_prints_usage_on_stdout_and_exits_0() {
    if skip_on_pen("Pen 0.34 prints its usage on stderr") {
        return;
    }
    let out = run(&["--help"]);
    assert_eq!(
        out.code,
        Some(0),
        "--help exit status; stderr:\n{}",
        out.stderr
    );
    assert!(
        out.stdout.to_lowercase().contains("usage"),
        "no usage on stdout:\n{}",
        out.stdout
    );
}

#[test]
fn version_prints_the_version_and_exits_0() {
    if skip_on_pen("Pen 0.34 has no --version") {
        return;
    }
    let out = run(&["--version"]);
    assert_eq!(
        out.code,
        Some(0),
        "--version exit status; stderr:\n{}",
        out.stderr
    );
    assert!(
        out.stdout.contains(env!("CARGO_PKG_VERSION")),
        "--version does not print {}:\n{}",
        env!("CARGO_PKG_VERSION"),
        out.stdout
    );
}

/// Reads one HTTP/1.1 response: (status code, body).
fn read_response(r: &mut impl BufRead) -> (u16, Vec<u8>) {
    let mut status_line = String::new();
    r.read_line(&mut status_line).expect("status line");
    let mut parts = status_line.split_whitespace();
    let version = parts.next().unwrap_or_default();
    assert!(
        version.starts_with("HTTP/1."),
        "not an HTTP response: {status_line:?}"
    );
    let code: u16 = parts
        .next()
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut length = None;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).expect("header line");
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (name, value) = h
            .split_once(':')
            .unwrap_or_else(|| panic!("bad header {h:?}"));
        let name = name.trim().to_ascii_lowercase();
        let value = value.trim();
        if name == "content-length" {
            length = Some(
                value
                    .parse::<usize>()
                    .unwrap_or_else(|_| panic!("bad Content-Length {value:?}")),
            );
        } else if name == "transfer-encoding" && value.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if name == "connection" {
            assert!(
                !value.eq_ignore_ascii_case("close"),
                "the dummy server closes the connection (Connection: close)"
            );
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).expect("chunk size");
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or(""), 16)
                .expect("chunk size");
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).expect("chunk");
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let n = length.expect("a keep-alive response needs Content-Length or chunked encoding");
        body.resize(n, 0);
        r.read_exact(&mut body).expect("body");
    }
    (code, body)
}

#[test]
fn dummy_server_answers_get_requests_with_keep_alive() {
    if skip_on_pen("Pen's dummy mode differs") {
        return;
    }
    let q = Quill::start(&["-O", "dummy", "{port}"]);
    let s = q.connect();
    let mut w = s.try_clone().unwrap();
    let mut r = BufReader::new(s);
    for path in ["/", "/second"] {
        write!(
            w,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\r\n",
            q.port
        )
        .unwrap();
        let (code, body) = read_response(&mut r);
        assert_eq!(code, 200, "GET {path}");
        let body = String::from_utf8_lossy(&body);
        assert!(
            body.contains(&q.port.to_string()),
            "body of GET {path} does not mention port {}: {body:?}",
            q.port
        );
    }
}

#[test]
fn pid_file_holds_the_daemon_pid() {
    let a = IdentityBackend::start("a");
    let spec = a.spec();
    let Some(q) =
        Quill::start_unless_unsupported(&["-p", "{dir}/quill.pid", "127.0.0.1:{port}", &spec])
    else {
        return;
    };
    let path = q.dir().join("quill.pid");
    let mut content = String::new();
    wait_until(Duration::from_secs(5), "the pid file is written", || {
        content = std::fs::read_to_string(&path).unwrap_or_default();
        content.trim().parse::<u32>().is_ok()
    });
    assert_eq!(content.trim(), q.pid().to_string(), "pid file content");
}

#[test]
fn term_signal_stops_an_idle_daemon_promptly() {
    let a = IdentityBackend::start("a");
    let mut q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let addr = q.addr();
    drop(q.name_from("127.0.0.1"));
    a.wait_open(0, Duration::from_secs(5));
    q.signal("TERM");
    let exit = q.wait_exit(Duration::from_secs(5));
    assert!(exit.is_some(), "still running 5 s after SIGTERM");
    assert_eq!(exit, Some(Some(0)), "exit status after SIGTERM");
    assert!(
        try_connect(addr).is_err(),
        "the port still accepts after the daemon exited"
    );
}

#[test]
fn term_signal_lets_established_connections_finish() {
    if skip_on_pen("Pen 0.34 exits at once on SIGTERM, closing established connections") {
        return;
    }
    let a = IdentityBackend::start("a");
    let mut q = Quill::start(&["127.0.0.1:{port}", &a.spec()]);
    let addr = q.addr();
    let (_, mut open) = q.name_from("127.0.0.1");
    q.signal("TERM");

    // No new connections...
    wait_until(
        Duration::from_secs(5),
        "the listener is closed after SIGTERM",
        || try_connect(addr).is_err(),
    );
    // ...but the established one still works...
    open.write_all(b"still here\n").unwrap();
    assert_eq!(read_line(&mut open).unwrap().as_deref(), Some("still here"));
    // ...and once it is done the daemon exits.
    drop(open);
    let exit = q.wait_exit(Duration::from_secs(5));
    assert!(
        exit.is_some(),
        "still running 5 s after its last connection closed"
    );
}

#[test]
fn server_port_defaults_to_the_listening_port() {
    // The server listens on 127.0.0.2:P and quill on 127.0.0.1:P, given the server as a
    // bare host. P comes from below the ephemeral range (`free_port`): a port the kernel
    // picked for 127.0.0.2 could be a parallel test's connection's on 127.0.0.1.
    let port = free_port();
    let a = IdentityBackend::start_on("same-port", &format!("127.0.0.2:{port}"));
    let listen = format!("127.0.0.1:{port}");
    let target = Target::Tcp(listen.parse().unwrap());
    let q = Quill::start_on(&[&listen, "127.0.0.2"], target).unwrap_or_else(|e| panic!("{e}"));
    let (name, _) = q.name_from("127.0.0.1");
    assert_eq!(name, a.name());
}

#[test]
fn http_commands_without_http_are_named_at_start_up() {
    // A raw relay does nothing with `h2c` or a pool to servers: quill says so rather than
    // start as if they were in force.
    if skip_on_pen("h2c and upstream_keepalive are quill's") {
        return;
    }
    let a = IdentityBackend::start("plain");
    let q = Quill::start(&[
        "-O",
        "h2c",
        "-O",
        "upstream_keepalive 4",
        "{port}",
        &a.spec(),
    ]);
    wait_until(
        Duration::from_secs(5),
        "quill names the commands it ignores",
        || {
            q.stderr()
                .contains("ignored without http (-H): h2c, upstream_keepalive")
        },
    );
    let (name, _) = q.name_from("127.0.0.1");
    assert_eq!(name, a.name(), "the relay serves all the same");
}
