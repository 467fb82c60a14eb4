//! HTTP/2 clients' requests to HTTP/1.1 servers, framed by quill itself: every way an
//! HTTP/1.1 server may frame its answer (Content-Length, chunked with trailers, to the
//! close, none for `HEAD`, 204 and 304, an interim `100` first, head and body in two
//! writes), request bodies of known and unknown length, a server that answers before it
//! has read the request (an HTTP/1.1 client's upload refused that way too), and
//! kept-alive connections the server closed under quill.
//!
//! The client is curl (HTTP/2 with prior knowledge on an `h2c` listener); the server is a
//! scripted HTTP/1.1 server written here, raw bytes on a socket, that records what it
//! received and on which connection.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;

/// One request as the scripted server read it.
#[derive(Debug, Clone)]
struct Seen {
    /// The connection it came over (numbered from 1 in accept order).
    conn: usize,
    method: String,
    path: String,
    /// Field names as written, with their values.
    fields: Vec<(String, String)>,
    body: Vec<u8>,
    trailers: Vec<(String, String)>,
}

impl Seen {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The scripted HTTP/1.1 server: answers by path (see `answer`).
struct Scripted {
    port: u16,
    accepted: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    fn start() -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (a, s) = (Arc::clone(&accepted), Arc::clone(&seen));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let n = a.fetch_add(1, SeqCst) + 1;
                let s = Arc::clone(&s);
                std::thread::spawn(move || serve(conn, n, &s));
            }
        });
        Scripted {
            port,
            accepted,
            seen,
        }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn last(&self, path: &str) -> Seen {
        self.seen()
            .into_iter()
            .rev()
            .find(|s| s.path == path)
            .unwrap_or_else(|| panic!("the server saw no request for {path}"))
    }
}

fn read_line(r: &mut impl BufRead) -> Option<String> {
    let mut line = String::new();
    match r.read_line(&mut line) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(line.trim_end_matches(['\r', '\n']).to_string()),
    }
}

fn read_fields(r: &mut impl BufRead) -> Option<Vec<(String, String)>> {
    let mut fields = Vec::new();
    loop {
        let line = read_line(r)?;
        if line.is_empty() {
            return Some(fields);
        }
        let (name, value) = line.split_once(':')?;
        fields.push((name.trim().to_string(), value.trim().to_string()));
    }
}

/// Serves one connection request by request until the client closes it (or a script
/// closes it).
fn serve(conn: TcpStream, n: usize, seen: &Mutex<Vec<Seen>>) {
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    // `/drop-next`: the next request on this connection is read and left unanswered.
    let mut drop_next = false;
    loop {
        let Some(line) = read_line(&mut r) else {
            return;
        };
        let mut words = line.split(' ');
        let (method, path) = (
            words.next().unwrap_or("").to_string(),
            words.next().unwrap_or("").to_string(),
        );
        let Some(fields) = read_fields(&mut r) else {
            return;
        };
        let mut req = Seen {
            conn: n,
            method,
            path,
            fields,
            body: Vec::new(),
            trailers: Vec::new(),
        };
        if req.path == "/early" {
            // Answers at once, reads none of the body, and closes.
            seen.lock().unwrap().push(req);
            let _ = out.write_all(
                b"HTTP/1.1 413 Content Too Large\r\nConnection: close\r\nContent-Length: 9\r\n\r\ntoo large",
            );
            return;
        }
        if req.field("transfer-encoding") == Some("chunked") {
            loop {
                let Some(size) = read_line(&mut r) else {
                    return;
                };
                let size =
                    usize::from_str_radix(size.split(';').next().unwrap().trim(), 16).unwrap();
                if size == 0 {
                    let Some(t) = read_fields(&mut r) else { return };
                    req.trailers = t;
                    break;
                }
                let mut chunk = vec![0; size + 2];
                if r.read_exact(&mut chunk).is_err() {
                    return;
                }
                req.body.extend_from_slice(&chunk[..size]);
            }
        } else if let Some(len) = req.field("content-length") {
            let mut body = vec![0; len.parse().unwrap()];
            if r.read_exact(&mut body).is_err() {
                return;
            }
            req.body = body;
        }
        seen.lock().unwrap().push(req.clone());
        if std::mem::take(&mut drop_next) {
            return;
        }
        drop_next = req.path == "/drop-next";
        if !answer(&mut out, &req) {
            return;
        }
    }
}

/// The 100,000 bytes `/close` sends.
fn pattern() -> Vec<u8> {
    (0..100_000u32).map(|i| b'a' + (i % 26) as u8).collect()
}

/// Answers `req` by its path; false when the connection ends after it.
fn answer(out: &mut TcpStream, req: &Seen) -> bool {
    let pause = || std::thread::sleep(Duration::from_millis(100));
    let w = |out: &mut TcpStream, b: &[u8]| out.write_all(b).is_ok();
    match req.path.as_str() {
        "/chunked" => {
            w(out, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Checksum\r\n\r\n5\r\nhello\r\n")
                && { pause(); w(out, b"6\r\n worl") }
                && { pause(); w(out, b"d\r\n0\r\nX-Checksum: c0ffee\r\n\r\n") }
        }
        "/close" => {
            let mut all = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n".to_vec();
            all.extend_from_slice(&pattern());
            let _ = out.write_all(&all);
            false
        }
        "/split" => {
            w(out, b"HTTP/1.1 200 OK\r\nContent-Length: 11\r\n\r\n") && {
                pause();
                w(out, b"hello world")
            }
        }
        "/head" => w(out, b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"),
        "/hop" => w(
            out,
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nX-End: kept\r\nContent-Length: 2\r\n\r\nok",
        ),
        "/keep" => w(
            out,
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nContent-Length: 2\r\n\r\nok",
        ),
        "/no-content" => w(out, b"HTTP/1.1 204 No Content\r\n\r\n"),
        "/not-modified" => w(out, b"HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\n\r\n"),
        "/continue" => w(
            out,
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        ),
        _ => {
            let text = format!(
                "conn={} len={} sum={}",
                req.conn,
                req.body.len(),
                req.body.iter().map(|&b| u64::from(b)).sum::<u64>()
            );
            w(
                out,
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{text}", text.len()).as_bytes(),
            )
        }
    }
}

/// quill taking HTTP/2 with prior knowledge on a plain listener, in front of `server`.
fn quill(server: &Scripted) -> Quill {
    let backend = format!("127.0.0.1:{}", server.port);
    // One event loop: one pool, so that the tests can tell which connection a request took.
    Quill::start(&["-H", "-O", "h2c", "-O", "workers 1", "{port}", &backend])
}

/// curl over HTTP/2 with prior knowledge; its output, or `None` (said) without curl.
/// One URL a call: curl 7.88 fails a second request over a prior-knowledge connection
/// ("Error in the HTTP2 framing layer") in front of any server; each call is a new client
/// connection, and the pooled server connection is shared across them.
fn curl(args: &[&str]) -> Option<String> {
    let mut all = vec!["-sS", "--http2-prior-knowledge", "--max-time", "20"];
    all.extend_from_slice(args);
    tool("curl", &all)
}

/// The body and status (`BODY[STATUS]`) of a GET of `path` through `q`.
fn get(q: &Quill, path: &str) -> Option<String> {
    curl(&[
        "-w",
        "[%{http_code}]",
        &format!("http://127.0.0.1:{}{path}", q.port),
    ])
}

/// The end of a long output, for a failure's message.
fn tail(out: &str) -> &str {
    &out[out.len().saturating_sub(2000)..]
}

#[test]
fn a_chunked_answer_reaches_the_client_with_its_trailers() {
    let server = Scripted::start();
    let q = quill(&server);
    let url = format!("http://127.0.0.1:{}/chunked", q.port);
    let Some(out) = curl(&["-D", "-", "-H", "TE: trailers", &url]) else {
        return;
    };
    assert!(out.starts_with("HTTP/2 200"), "{out}");
    assert!(out.contains("hello world"), "{out}");
    assert!(
        out.to_ascii_lowercase().contains("x-checksum: c0ffee"),
        "{out}"
    );
    assert!(
        !out.to_ascii_lowercase().contains("transfer-encoding"),
        "{out}"
    );
}

#[test]
fn an_answer_that_ends_with_the_connection_arrives_whole_and_the_connection_is_not_reused() {
    let server = Scripted::start();
    let q = quill(&server);
    let Some(out) = get(&q, "/close") else {
        return;
    };
    let body = pattern();
    assert!(
        out.as_bytes().starts_with(&body) && out.len() == body.len() + "[200]".len(),
        "the close-delimited body was cut or changed ({} bytes)",
        out.len()
    );
    // The connection that ended the answer cannot carry the next request.
    assert_eq!(get(&q, "/after").unwrap(), "conn=2 len=0 sum=0[200]");
}

#[test]
fn a_head_and_body_written_apart_and_bodiless_answers_pass_and_keep_the_connection() {
    let server = Scripted::start();
    let q = quill(&server);
    let base = format!("http://127.0.0.1:{}", q.port);
    let Some(split) = get(&q, "/split") else {
        return;
    };
    assert_eq!(split, "hello world[200]");
    assert_eq!(get(&q, "/no-content").unwrap(), "[204]");
    assert_eq!(get(&q, "/not-modified").unwrap(), "[304]");
    assert_eq!(get(&q, "/continue").unwrap(), "ok[200]");
    assert_eq!(get(&q, "/last").unwrap(), "conn=1 len=0 sum=0[200]");
    let Some(head) = curl(&["-I", &format!("{base}/head")]) else {
        return;
    };
    assert!(head.starts_with("HTTP/2 200"), "{head}");
    assert!(head.contains("content-length: 1000"), "{head}");
    let Some(next) = curl(&[&format!("{base}/next")]) else {
        return;
    };
    assert_eq!(
        next, "conn=1 len=0 sum=0",
        "the connection outlived a HEAD's answer"
    );
    assert_eq!(server.accepted.load(SeqCst), 1);
}

#[test]
fn request_bodies_of_known_and_unknown_length_arrive_byte_exact() {
    let server = Scripted::start();
    let q = quill(&server);
    let dir = TempDir::new("h2-upload");
    let file = dir.path().join("body");
    let body: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &body).unwrap();
    let sum: u64 = body.iter().map(|&b| u64::from(b)).sum();
    let url = format!("http://127.0.0.1:{}/upload", q.port);
    let data = format!("@{}", file.display());
    // Known length: curl sends content-length, and so does quill.
    let Some(out) = curl(&["--data-binary", &data, &url]) else {
        return;
    };
    assert_eq!(out, format!("conn=1 len={} sum={sum}", body.len()));
    let seen = server.last("/upload");
    assert_eq!(seen.field("content-length"), Some("300000"));
    assert_eq!(seen.field("transfer-encoding"), None);
    // Unknown length (from a pipe): the server gets it chunked.
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cat {} | curl -sS --http2-prior-knowledge --max-time 20 -T - {url}",
            file.display()
        ))
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.ends_with(&format!("len={} sum={sum}", body.len())),
        "{out}"
    );
    let seen = server.last("/upload");
    assert_eq!(seen.method, "PUT");
    assert_eq!(seen.field("transfer-encoding"), Some("chunked"));
    assert_eq!(seen.field("content-length"), None);
}

#[test]
fn a_server_that_answers_before_reading_the_body_is_heard() {
    let server = Scripted::start();
    let q = quill(&server);
    let dir = TempDir::new("h2-early");
    let file = dir.path().join("big");
    std::fs::write(&file, vec![b'x'; 8 << 20]).unwrap();
    let url = format!("http://127.0.0.1:{}/early", q.port);
    let Some(out) = tool("nghttp", &["-v", "-d", file.to_str().unwrap(), &url]) else {
        return;
    };
    assert!(out.contains(":status: 413"), "{}", tail(&out));
    assert!(out.contains("too large"), "{}", tail(&out));
    // The rest of the body is read and dropped, not reset (RST_STREAM NO_ERROR, which
    // RFC 9113 8.1 allows, makes Debian's curl 7.88 drop the answer it had).
    assert!(!out.contains("recv RST_STREAM"), "{}", tail(&out));
    // The connection it closed is not handed to the next request.
    assert_eq!(get(&q, "/next").unwrap(), "conn=2 len=0 sum=0[200]");
    // curl gives up its upload once it has the whole answer.
    let Some(out) = tool(
        "curl",
        &[
            "-sS",
            "--max-time",
            "20",
            "--http2-prior-knowledge",
            "-w",
            "[%{http_code}]",
            "-T",
            file.to_str().unwrap(),
            &url,
        ],
    ) else {
        return;
    };
    assert_eq!(out, "too large[413]");
}

#[test]
fn an_http11_upload_the_server_refused_early_is_answered_and_blacklists_nothing() {
    let server = Scripted::start();
    let q = quill(&server);
    let status = upload_refused_early(&q);
    assert_eq!(status, 413);
}

/// With `access_log` HTTP/1.x clients stay on the byte pump: the early answer passes the
/// same way, and its line says what the client got, from which server.
#[test]
fn with_the_access_log_such_an_upload_is_answered_and_logged() {
    let server = Scripted::start();
    let dir = TempDir::new("h1-early-log");
    let log = dir.path().join("access.log");
    let access_log = format!("access_log {}", log.display());
    let backend = format!("127.0.0.1:{}", server.port);
    let q = Quill::start(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "workers 1",
        "-O",
        &access_log,
        "{port}",
        &backend,
    ]);
    assert_eq!(upload_refused_early(&q), 413);
    let line = || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.lines()
            .find(|l| l.contains(" /early "))
            .map(str::to_string)
    };
    wait_until(
        Duration::from_secs(10),
        "the upload's access log line",
        || line().is_some(),
    );
    let line = line().unwrap();
    let fields: Vec<&str> = line.split(' ').collect();
    assert_eq!(fields.len(), 11, "{line}");
    assert_eq!(
        fields[2..7],
        ["POST", "t", "/early", "HTTP/1.1", "413"],
        "{line}"
    );
    assert_eq!(fields[10], backend, "{line}");
}

/// An HTTP/1.1 client uploads 8 MiB to `/early`, which the server answers 413 at once
/// and closes, resetting the body it did not read; the client reads an answer while still
/// sending (its status is returned), and the next request reaches the server over a new
/// connection: the server was not blacklisted.
fn upload_refused_early(q: &Quill) -> u16 {
    let mut client = TcpStream::connect(("127.0.0.1", q.port)).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    client
        .write_all(b"POST /early HTTP/1.1\r\nHost: t\r\nContent-Length: 8388608\r\n\r\n")
        .unwrap();
    // The body keeps coming while the answer does (until quill stops taking it).
    let mut body = client.try_clone().unwrap();
    let uploading = std::thread::spawn(move || {
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..128 {
            if body.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let answer = http_echo::read_final_response(&mut client).expect("an answer to the upload");
    if answer.status == 413 {
        assert_eq!(answer.body, b"too large");
    }
    // The server went away after answering, as it said it would: it did its part, and
    // stays in service (not blacklisted: the next request is its, not a 503).
    assert_eq!(get(q, "/next").unwrap(), "conn=2 len=0 sum=0[200]");
    uploading.join().unwrap();
    answer.status
}

#[test]
fn a_kept_alive_connection_the_server_closed_is_replaced_for_a_repeatable_request() {
    let server = Scripted::start();
    let q = quill(&server);
    // The server answers `/drop-next`, then reads the next request on that connection and
    // closes it without a word: quill sends the GET again over a new connection.
    let Some(first) = get(&q, "/drop-next") else {
        return;
    };
    assert_eq!(first, "conn=1 len=0 sum=0[200]");
    assert_eq!(get(&q, "/again").unwrap(), "conn=2 len=0 sum=0[200]");
    let again: Vec<usize> = server
        .seen()
        .iter()
        .filter(|s| s.path == "/again")
        .map(|s| s.conn)
        .collect();
    assert_eq!(
        again,
        [1, 2],
        "sent once on the dropped connection, once on a new one"
    );
}

#[test]
fn the_server_gets_forwarded_fields_in_title_case_and_one_cookie_field() {
    let server = Scripted::start();
    let q = quill(&server);
    let url = format!("http://127.0.0.1:{}/fields", q.port);
    let Some(_) = curl(&[
        "-H",
        "Cookie: a=1",
        "-H",
        "Cookie: b=2",
        "-H",
        "X-Custom: yes",
        &url,
    ]) else {
        return;
    };
    let seen = server.last("/fields");
    assert_eq!(seen.field("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(seen.field("x-forwarded-proto"), Some("http"));
    assert_eq!(
        seen.field("host"),
        Some(format!("127.0.0.1:{}", q.port).as_str())
    );
    assert_eq!(seen.field("x-custom"), Some("yes"));
    assert_eq!(seen.field("cookie"), Some("a=1; b=2"));
    let names: Vec<&str> = seen.fields.iter().map(|(n, _)| n.as_str()).collect();
    for name in [
        "Host",
        "X-Custom",
        "Cookie",
        "X-Forwarded-For",
        "X-Forwarded-Proto",
    ] {
        assert!(names.contains(&name), "{name} not among {names:?}");
    }
}

/// Fields about the server's connection stay behind (HTTP/2 forbids them): `Connection`,
/// what it names, `Keep-Alive`, `Proxy-Connection`; the connection is kept all the same.
#[test]
fn hop_by_hop_fields_of_an_answer_stay_behind() {
    let server = Scripted::start();
    let q = quill(&server);
    for path in ["/hop", "/keep"] {
        let url = format!("http://127.0.0.1:{}{path}", q.port);
        let Some(out) = curl(&["-D", "-", &url]) else {
            return;
        };
        let lower = out.to_ascii_lowercase();
        assert!(lower.starts_with("http/2 200"), "{out}");
        assert!(lower.ends_with("\r\n\r\nok"), "{out}");
        for gone in ["connection:", "x-hop:", "keep-alive:", "proxy-connection:"] {
            assert!(!lower.contains(gone), "{gone} passed: {out}");
        }
        if path == "/hop" {
            assert!(lower.contains("x-end: kept"), "{out}");
        }
    }
    // Both answers came over one server connection, kept for the next request.
    assert_eq!(get(&q, "/after").unwrap(), "conn=1 len=0 sum=0[200]");
}
