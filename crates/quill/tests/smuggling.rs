//! `http` (-H) against request smuggling and answer desynchronisation: what a client may
//! not get to a server (an `h2c` upgrade with its `HTTP2-Settings`, an extended CONNECT to
//! another protocol than WebSocket, a request whose site is ambiguous), and what a server
//! may not get to a client (an answer with two framings or two lengths, bytes after the
//! end of an answer), for both ways the byte pump relays HTTP/1.x clients and for HTTP/2
//! clients. The server is a scripted one written here, raw bytes on a socket, that records
//! every request head it reads and the connection it came over.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;

const LIMIT: Duration = Duration::from_secs(10);

/// An answer of `body` with its length.
fn ok(body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// What a server shapes to be read as the client's next answer.
const SURPLUS: &str = "HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nSURPLUS";

/// The scripted server's answer to a head, each written in one piece (surplus included).
fn answer(path: &str, head: &str) -> (String, bool) {
    let upgrade = head
        .to_ascii_lowercase()
        .split("\r\n")
        .any(|l| l.starts_with("upgrade:"));
    match path {
        // A server that takes any upgrade offered (as an h2c server does `h2c`).
        "/switch" if upgrade => (
            "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
                .to_string(),
            true,
        ),
        "/clte" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 60\r\nTransfer-Encoding: chunked\r\n\r\n\
             5\r\nhello\r\n0\r\n\r\n"
                .to_string(),
            false,
        ),
        "/dupcl" => (
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\nok{}",
                "x".repeat(38)
            ),
            false,
        ),
        "/badcl" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 2x\r\n\r\nokSURPLUS".to_string(),
            false,
        ),
        "/head" => (format!("{}{SURPLUS}", ok("body sent to a HEAD")), false),
        "/204" => (format!("HTTP/1.1 204 No Content\r\n\r\n{SURPLUS}"), false),
        "/extra" => (format!("{}{SURPLUS}", ok("first")), false),
        _ => (ok(&format!("normal answer to {path}")), false),
    }
}

/// One request head as the server read it, and the connection (numbered from 1).
#[derive(Debug, Clone)]
struct Seen {
    conn: usize,
    head: String,
}

impl Seen {
    fn path(&self) -> &str {
        self.head.split(' ').nth(1).unwrap_or("")
    }

    /// The head's field lines, lowercased.
    fn fields(&self) -> Vec<String> {
        self.head
            .to_ascii_lowercase()
            .split("\r\n")
            .skip(1)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }
}

struct Scripted {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    fn start() -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let accepted = AtomicUsize::new(0);
        let s = Arc::clone(&seen);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let n = accepted.fetch_add(1, SeqCst) + 1;
                let s = Arc::clone(&s);
                std::thread::spawn(move || serve(conn, n, &s));
            }
        });
        Scripted { port, seen }
    }

    fn spec(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// The request for `path`, once the server has read it.
    fn wait_for(&self, path: &str) -> Seen {
        let mut found = None;
        wait_until(LIMIT, format!("the server reads {path}"), || {
            found = self.seen().into_iter().find(|s| s.path() == path);
            found.is_some()
        });
        found.unwrap()
    }
}

/// Reads heads (these tests send no request bodies) and answers each; after a `101`,
/// echoes bytes.
fn serve(mut conn: TcpStream, n: usize, seen: &Mutex<Vec<Seen>>) {
    loop {
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if conn.read(&mut byte).unwrap_or(0) == 0 {
                return;
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head).into_owned();
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        seen.lock().unwrap().push(Seen {
            conn: n,
            head: head.clone(),
        });
        if path == "/late-head" {
            // A body to a HEAD, written apart and late: after the head, when the client
            // has sent its next request over the same (pooled) server connection.
            let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 21\r\n\r\n");
            std::thread::sleep(Duration::from_millis(100));
            if conn.write_all(b"late body for a HEAD\n").is_err() {
                return;
            }
            continue;
        }
        let (text, switched) = answer(&path, &head);
        if conn.write_all(text.as_bytes()).is_err() {
            return;
        }
        if switched {
            let mut back = conn.try_clone().unwrap();
            let _ = std::io::copy(&mut conn, &mut back);
            return;
        }
    }
}

/// How `-H` relays an HTTP/1.x client.
#[derive(Debug, Clone, Copy)]
enum Pump {
    /// `upstream_keepalive 0`: one server connection per client connection, as Pen.
    Connection,
    /// The default pool: request by request, each over a pooled server connection.
    Request,
}

const PUMPS: [Pump; 2] = [Pump::Request, Pump::Connection];

fn start(pump: Pump, server: &Scripted) -> Quill {
    let spec = server.spec();
    let mut args = vec!["-H", "-O", "h2c"];
    if let Pump::Connection = pump {
        args.extend_from_slice(&["-O", "upstream_keepalive 0"]);
    }
    args.extend_from_slice(&["{port}", &spec]);
    Quill::start(&args)
}

/// Reads one answer: its head, and the body its `Content-Length` or chunks frame (the
/// last chunk ends it). Panics on a close before its end.
fn read_answer(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        assert_eq!(
            s.read(&mut byte).unwrap(),
            1,
            "closed in a head: {:?}",
            String::from_utf8_lossy(&got)
        );
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
    let length = head
        .split("\r\n")
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse::<usize>().unwrap());
    let no_body = head.starts_with("http/1.1 204") || head.starts_with("http/1.1 101");
    if head.contains("transfer-encoding: chunked") {
        while !got.ends_with(b"\r\n0\r\n\r\n") {
            assert_eq!(s.read(&mut byte).unwrap(), 1, "closed in a chunked body");
            got.push(byte[0]);
        }
    } else if let Some(n) = length.filter(|_| !no_body) {
        let mut body = vec![0u8; n];
        s.read_exact(&mut body).unwrap();
        got.extend_from_slice(&body);
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn client(q: &Quill) -> TcpStream {
    let s = q.connect();
    s.set_read_timeout(Some(LIMIT)).unwrap();
    s
}

/// HTTP/1.1 `Upgrade: h2c` with `HTTP2-Settings` left out of `Connection` (as h2csmuggler
/// sends it): the server gets neither, nor the `upgrade` option, and the request is
/// answered as a plain one. Offered beside `websocket`, only `h2c` is left out, and the
/// WebSocket upgrade goes on to a tunnel. Without the fix, the server saw all three (an
/// h2c server switched: the client had a raw HTTP/2 connection to it).
#[test]
fn an_h2c_upgrade_never_reaches_a_server() {
    for pump in PUMPS {
        let server = Scripted::start();
        let q = start(pump, &server);
        let mut s = client(&q);
        s.write_all(
            b"GET /switch HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\
              HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        )
        .unwrap();
        let got = read_answer(&mut s);
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{pump:?}: {got}");
        let seen = server.wait_for("/switch");
        let fields = seen.fields();
        assert!(
            !fields.iter().any(|f| f.starts_with("http2-settings")
                || f.starts_with("upgrade")
                || (f.starts_with("connection:") && f.contains("upgrade"))),
            "{pump:?}: {}",
            seen.head
        );
        assert!(
            fields.iter().any(|f| f == "x-forwarded-for: 127.0.0.1"),
            "{pump:?}: {}",
            seen.head
        );
        // The same client connection goes on with HTTP.
        s.write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let got = read_answer(&mut s);
        assert!(got.ends_with("normal answer to /next"), "{pump:?}: {got}");
        if let Pump::Connection = pump {
            // Over the same server connection, still HTTP/1.1.
            assert_eq!(server.wait_for("/next").conn, seen.conn);
        }

        // A WebSocket upgrade offered beside h2c still switches, h2c left out.
        let mut s = client(&q);
        s.write_all(
            b"GET /switch HTTP/1.1\r\nHost: y\r\nConnection: Upgrade, HTTP2-Settings\r\n\
              Upgrade: websocket, h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        )
        .unwrap();
        let got = read_answer(&mut s);
        assert!(got.starts_with("HTTP/1.1 101 "), "{pump:?}: {got}");
        s.write_all(b"through the tunnel").unwrap();
        let mut echo = [0u8; 18];
        s.read_exact(&mut echo).unwrap();
        assert_eq!(&echo, b"through the tunnel");
        let seen = server
            .seen()
            .into_iter()
            .find(|s| s.fields().iter().any(|f| f == "host: y"))
            .unwrap();
        let fields = seen.fields();
        assert!(
            fields.iter().any(|f| f == "upgrade: websocket"),
            "{pump:?}: {}",
            seen.head
        );
        assert!(
            fields.iter().any(|f| f == "connection: upgrade"),
            "{pump:?}: {}",
            seen.head
        );
        assert!(
            !fields.iter().any(|f| f.starts_with("http2-settings")),
            "{pump:?}: {}",
            seen.head
        );
    }
}

/// Sends an HTTP/2 extended CONNECT with `:protocol` `protocol` (and an `http2-settings`
/// field, as h2csmuggler's variant does) to `/switch`; returns the answer's status.
fn extended_connect(port: u16, protocol: &str) -> u16 {
    use hyper::http::Request;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let (mut client, _conn) = support::http::h2_extended_connect_client(port, LIMIT).await;
        let req = Request::builder()
            .method("CONNECT")
            .uri(format!("http://127.0.0.1:{port}/switch"))
            .extension(h2::ext::Protocol::from(protocol))
            .header("http2-settings", "AAMAAABkAAQAAP__")
            .header("sec-websocket-version", "13")
            .body(())
            .unwrap();
        let (resp, _up) = client.send_request(req, false).unwrap();
        let resp = tokio::time::timeout(LIMIT, resp)
            .await
            .expect("timed out waiting for the answer")
            .unwrap();
        resp.status().as_u16()
    })
}

/// An HTTP/2 extended CONNECT to `h2c` is refused with 501 (as a plain CONNECT is) and no
/// server hears of it; one to `websocket` still opens a tunnel, without `http2-settings`.
/// Without the fix, quill itself wrote `Upgrade: h2c` and `Http2-Settings` to the server.
#[test]
fn an_extended_connect_to_h2c_is_refused() {
    let server = Scripted::start();
    let q = start(Pump::Request, &server);
    assert_eq!(extended_connect(q.port, "h2c"), 501);
    assert_eq!(extended_connect(q.port, "websocket"), 200);
    let seen = server.seen();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let fields = seen[0].fields();
    assert!(
        fields.iter().any(|f| f == "upgrade: websocket"),
        "{}",
        seen[0].head
    );
    assert!(
        !fields.iter().any(|f| f.starts_with("http2-settings")),
        "{}",
        seen[0].head
    );
}

/// An answer with both `Content-Length` and `Transfer-Encoding: chunked` reaches the
/// client without the length (RFC 9112 6.3), so that the client reads the chunks and the
/// next answer where they end.
#[test]
fn a_length_beside_chunked_framing_is_removed() {
    for pump in PUMPS {
        let server = Scripted::start();
        let q = start(pump, &server);
        let mut s = client(&q);
        s.write_all(b"GET /clte HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let got = read_answer(&mut s);
        assert!(
            !got.to_ascii_lowercase().contains("content-length"),
            "{pump:?}: {got}"
        );
        assert!(got.ends_with("5\r\nhello\r\n0\r\n\r\n"), "{pump:?}: {got}");
        s.write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let got = read_answer(&mut s);
        assert!(got.ends_with("normal answer to /next"), "{pump:?}: {got}");
    }
}

/// An answer with two different lengths, or a length that is no number, is a 502 from
/// quill (as HAProxy's), the client's connection closes after it, and the server
/// connection is not used again.
#[test]
fn an_answer_with_two_lengths_or_a_bad_one_is_a_502() {
    for (pump, path) in PUMPS
        .into_iter()
        .flat_map(|p| [(p, "/dupcl"), (p, "/badcl")])
    {
        let server = Scripted::start();
        let q = start(pump, &server);
        let mut s = client(&q);
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        let got = read_answer(&mut s);
        assert!(got.starts_with("HTTP/1.1 502 "), "{pump:?}: {got}");
        assert!(
            got.to_ascii_lowercase()
                .contains("\r\nconnection: close\r\n"),
            "{pump:?}: {got}"
        );
        // The operator is told which server, and why.
        let why = if path == "/dupcl" {
            "two different Content-Length values"
        } else {
            "a Content-Length that is no number"
        };
        let warning = format!(
            "server 0 ({}) sent an answer quill cannot frame ({why})",
            server.spec()
        );
        wait_until(LIMIT, format_args!("stderr says {warning:?}"), || {
            q.stderr().contains(&warning)
        });
        let (rest, _) = expect_closed(&mut s, LIMIT);
        assert!(
            rest.is_empty(),
            "{pump:?}: {:?}",
            String::from_utf8_lossy(&rest)
        );
        let mut s = client(&q);
        s.write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let got = read_answer(&mut s);
        assert!(got.ends_with("normal answer to /next"), "{pump:?}: {got}");
        let (first, next) = (server.wait_for(path), server.wait_for("/next"));
        assert_ne!(first.conn, next.conn, "{pump:?}: reused");
    }
}

/// An HTTP/2 client's request to an HTTP/1.1 server whose answer cannot be framed gets
/// quill's 502 too (quill frames the server's answer into HTTP/2 frames itself), and the
/// operator is told which server and why, as for HTTP/1.x clients.
#[test]
fn an_http2_client_gets_a_502_for_an_answer_with_two_lengths_or_a_bad_one() {
    let server = Scripted::start();
    let q = start(Pump::Request, &server);
    for path in ["/dupcl", "/badcl"] {
        let url = format!("http://127.0.0.1:{}{path}", q.port);
        let args = [
            "-s",
            "--http2-prior-knowledge",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ];
        let Some(status) = tool("curl", &[&args[..], &[url.as_str()]].concat()) else {
            return;
        };
        assert_eq!(status, "502", "{path}");
    }
    // Warned at most every 10 s: the first one.
    let warning = format!(
        "server 0 ({}) sent an answer quill cannot frame (two different Content-Length values)",
        server.spec()
    );
    wait_until(LIMIT, format_args!("stderr says {warning:?}"), || {
        q.stderr().contains(&warning)
    });
}

/// Bytes a server sends beyond the answer due (a body to a `HEAD`, after a 204, an answer
/// nobody asked for) never reach the client: its next request gets its own answer.
/// Request by request the client's connection goes on, the server's is not used again;
/// when the server's connection is the client's own, the client's ends after the answer.
#[test]
fn bytes_after_an_answer_are_dropped() {
    for pump in PUMPS {
        let server = Scripted::start();
        let q = start(pump, &server);
        for (method, path) in [("HEAD", "/head"), ("GET", "/204"), ("GET", "/extra")] {
            let mut s = client(&q);
            s.write_all(format!("{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .unwrap();
            let got = if method == "HEAD" {
                // Read the head alone: a HEAD's answer has no body.
                let mut got = Vec::new();
                let mut byte = [0u8; 1];
                while !got.ends_with(b"\r\n\r\n") {
                    assert_eq!(s.read(&mut byte).unwrap(), 1);
                    got.push(byte[0]);
                }
                String::from_utf8_lossy(&got).into_owned()
            } else {
                read_answer(&mut s)
            };
            assert!(!got.contains("SURPLUS"), "{pump:?} {path}: {got}");
            let first = server.wait_for(path);
            match s.write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n") {
                Ok(()) => {}
                Err(_) if matches!(pump, Pump::Connection) => continue,
                Err(e) => panic!("{pump:?} {path}: {e}"),
            }
            match pump {
                Pump::Request => {
                    let rest = read_answer(&mut s);
                    assert!(rest.ends_with("normal answer to /next"), "{path}: {rest}");
                    let next = server.wait_for("/next");
                    assert_ne!(
                        first.conn, next.conn,
                        "{path}: the server connection was reused"
                    );
                }
                // The server's connection, out of step, ended the client's.
                Pump::Connection => {
                    let (rest, _) = expect_closed(&mut s, LIMIT);
                    let rest = String::from_utf8_lossy(&rest);
                    assert!(rest.is_empty(), "{path}: {rest}");
                }
            }
            server.seen.lock().unwrap().clear();
        }
    }
}

/// A body a server sends to a `HEAD` late, once the next request went over the same pooled
/// connection, is not that request's answer: quill answers 502 (as HAProxy does) instead
/// of passing the bytes on raw (they were written for the `HEAD`'s client, which another
/// client's request on that pooled connection would have received).
#[test]
fn late_bytes_on_a_reused_server_connection_are_a_502_not_an_answer() {
    let server = Scripted::start();
    let q = start(Pump::Request, &server);
    let mut s = client(&q);
    s.write_all(b"HEAD /late-head HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).unwrap(), 1);
        head.push(byte[0]);
    }
    s.write_all(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let got = read_answer(&mut s);
    assert!(!got.contains("late body"), "{got}");
    assert!(
        got.starts_with("HTTP/1.1 502") || got.ends_with("normal answer to /next"),
        "{got}"
    );
}

/// An HTTP/2 client's answer from an HTTP/1.1 server that has a transfer coding other
/// than chunked (the body runs to the close) and a `Content-Length`: the length is left
/// out, and the client gets the whole body (with it, the HTTP/2 answer said less than it
/// carried and clients reset it).
#[test]
fn an_http2_answer_framed_by_the_close_says_no_length() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") {
                if conn.read(&mut byte).unwrap_or(0) == 0 {
                    break;
                }
                head.push(byte[0]);
            }
            let _ = conn.write_all(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\nContent-Length: 2\r\n\r\n\
                  ok-and-then-more-bytes-until-close",
            );
        }
    });
    let spec = format!("127.0.0.1:{port}");
    let q = Quill::start(&["-H", "-O", "h2c", "{port}", &spec]);
    let qport = q.port;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (length, body) = rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(("127.0.0.1", qport))
            .await
            .unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let mut client = client.ready().await.unwrap();
        let req = hyper::http::Request::builder()
            .uri(format!("http://127.0.0.1:{qport}/x"))
            .body(())
            .unwrap();
        let (resp, _) = client.send_request(req, true).unwrap();
        let resp = tokio::time::timeout(LIMIT, resp).await.unwrap().unwrap();
        let length = resp.headers().get("content-length").cloned();
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while let Some(data) = tokio::time::timeout(LIMIT, body.data()).await.unwrap() {
            let data = data.expect("the answer's body failed");
            body.flow_control().release_capacity(data.len()).unwrap();
            got.extend_from_slice(&data);
        }
        (length, got)
    });
    assert_eq!(length, None);
    assert_eq!(body, b"ok-and-then-more-bytes-until-close");
}

/// Two `Host` fields, or an absolute-form target whose authority is not the `Host`, are
/// refused with 400 (as HAProxy) and reach no server; an absolute-form target that agrees
/// with its `Host` (a missing port being the scheme's) and a request without `Host` pass.
#[test]
fn an_ambiguous_host_is_a_400() {
    for pump in PUMPS {
        let server = Scripted::start();
        let q = start(pump, &server);
        for bad in [
            "GET /two HTTP/1.1\r\nHost: public.example\r\nHost: admin.internal\r\n\r\n",
            "GET http://admin.internal/abs HTTP/1.1\r\nHost: public.example\r\n\r\n",
            "GET http://a.example:8080/port HTTP/1.1\r\nHost: a.example\r\n\r\n",
        ] {
            let mut s = client(&q);
            s.write_all(bad.as_bytes()).unwrap();
            let got = read_answer(&mut s);
            assert!(got.starts_with("HTTP/1.1 400 "), "{pump:?} {bad:?}: {got}");
        }
        for good in [
            "GET http://A.example/same HTTP/1.1\r\nHost: a.example:80\r\n\r\n",
            "GET /nohost HTTP/1.1\r\n\r\n",
        ] {
            let mut s = client(&q);
            s.write_all(good.as_bytes()).unwrap();
            let got = read_answer(&mut s);
            assert!(got.starts_with("HTTP/1.1 200 "), "{pump:?} {good:?}: {got}");
        }
        let paths: Vec<String> = server.seen().iter().map(|s| s.path().to_string()).collect();
        assert_eq!(
            paths,
            ["http://A.example/same", "/nohost"],
            "{pump:?}: only the unambiguous requests reach the server"
        );
    }
}
