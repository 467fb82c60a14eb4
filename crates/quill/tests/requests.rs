//! Request-level proxying with `http`: HTTP/2 from clients (ALPN `h2` on TLS listeners, `h2c`
//! on plain ones) and HTTP/1.1 clients, each request sent to a server chosen for it over the
//! pool of kept-alive server connections (`upstream_keepalive`). With clients nobody here
//! wrote (curl, nghttp, h2load, Debian's headless Chromium driven by Playwright) and
//! Debian's NGINX behind quill, which numbers its connections (`$connection`): that is how
//! the tests see which requests shared one.
//!
//! Each tool is skipped with a message where it is not installed; `.ci/run` installs them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::browser::{browser_tools, run_script, CHROMIUM};
use support::daemon::{nginx, Daemon};
use support::http::metric;
use support::http_echo::read_response;
use support::*;

/// h2load measures: one load at a time on the two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// NGINX answering `/who` with "CONNECTION XFF PROTO HOST URI", serving `/1k`, and
/// storing `PUT`s under `/files/` (the DAV module), behind quill.
fn backend() -> Option<(Daemon, u16)> {
    let page: Vec<u8> = (0..1024).map(|i| b'a' + (i % 26) as u8).collect();
    nginx(
        "",
        " keepalive_requests 1000000;\n client_max_body_size 64m;",
        "  location /who { default_type text/plain; \
         return 200 \"$connection $http_x_forwarded_for $http_x_forwarded_proto $http_host $request_uri\\n\"; }\n\
         location /files/ { dav_methods PUT; create_full_put_path on; }",
        &[("1k", &page)],
    )
}

/// A self-signed P-256 certificate for 127.0.0.1 and localhost, in `dir`.
fn certificate(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
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
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
        ],
    )
    .expect("openssl is needed (.ci/run installs it)");
    (cert, key)
}

/// quill terminating TLS in `http` mode in front of `servers`, with `extra` arguments.
fn tls_quill(dir: &TempDir, extra: &[&str], servers: &[String]) -> Quill {
    let (cert, key) = certificate(dir.path());
    let mut args = vec![
        "-H",
        "-E",
        cert.to_str().unwrap(),
        "-K",
        key.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    args.push("{port}");
    args.extend(servers.iter().map(String::as_str));
    Quill::start(&args)
}

/// curl's output (body, then what `-w` asks) for `args` against quill.
fn curl(args: &[&str]) -> Option<String> {
    let mut all = vec!["-sS", "--max-time", "20"];
    all.extend_from_slice(args);
    tool("curl", &all)
}

/// The numbers NGINX gave the connections the `/who` answers in `out` came over.
fn connections(out: &str) -> BTreeSet<u64> {
    out.lines()
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect()
}

#[test]
fn curl_over_tls_speaks_h2_and_the_server_gets_the_forwarded_headers() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dir = TempDir::new("h2");
    let q = tls_quill(&dir, &["-O", "hsts 600"], &[format!("127.0.0.1:{port}")]);
    let url = format!("https://127.0.0.1:{}/who?x=1", q.port);
    let Some(out) = curl(&[
        "-k",
        "--http2",
        "-D",
        "-",
        "-H",
        "X-Forwarded-For: 10.0.0.1",
        "-H",
        "X-Forwarded-Proto: http",
        "-w",
        "version %{http_version}\n",
        &url,
    ]) else {
        return;
    };
    assert!(out.starts_with("HTTP/2 200"), "{out}");
    assert!(out.contains("version 2\n"), "{out}");
    assert!(
        out.to_lowercase()
            .contains("strict-transport-security: max-age=600"),
        "HSTS on every TLS response: {out}"
    );
    // The client's X-Forwarded-For is kept and the client appended; its
    // X-Forwarded-Proto is replaced; `:authority` became `Host`.
    let line = out
        .lines()
        .find(|l| l.contains("/who"))
        .unwrap_or_else(|| panic!("{out}"));
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        fields[1..],
        [
            "10.0.0.1,",
            "127.0.0.1",
            "https",
            &format!("127.0.0.1:{}", q.port),
            "/who?x=1"
        ],
        "{out}"
    );
}

#[test]
fn a_plain_listener_with_h2c_takes_http2_and_http11_alike() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let q = Quill::start(&["-H", "-O", "h2c", "{port}", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{}/who", q.port);
    let Some(h2) = curl(&[
        "--http2-prior-knowledge",
        "-w",
        "version %{http_version}\n",
        &url,
    ]) else {
        return;
    };
    assert!(h2.contains(" 127.0.0.1 http 127.0.0.1:"), "{h2}");
    assert!(h2.ends_with("version 2\n"), "{h2}");
    let h1 = curl(&["--http1.1", "-w", "version %{http_version}\n", &url]).unwrap();
    assert!(h1.contains(" 127.0.0.1 http 127.0.0.1:"), "{h1}");
    assert!(h1.ends_with("version 1.1\n"), "{h1}");
    // Without `h2c`, the preface is not HTTP/1.x: refused like any bad request.
    let plain = Quill::start(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{}/who", plain.port);
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--http2-prior-knowledge", &url])
        .output()
        .unwrap();
    assert!(!out.status.success(), "h2c needs the h2c command");
}

#[test]
fn alpn_chooses_what_tls_listeners_offer() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dir = TempDir::new("h2");
    let q = tls_quill(
        &dir,
        &["-O", "alpn http/1.1"],
        &[format!("127.0.0.1:{port}")],
    );
    let url = format!("https://127.0.0.1:{}/who", q.port);
    let Some(out) = curl(&["-k", "--http2", "-w", "version %{http_version}\n", &url]) else {
        return;
    };
    assert!(out.ends_with("version 1.1\n"), "{out}");
}

/// Without `http`, a raw TLS relay offers `h2` when told to (as HAProxy's `mode tcp` with
/// `alpn h2`): the client's HTTP/2 goes on decrypted to a server that speaks it with
/// prior knowledge (NGINX's `listen ... http2`). By default it offers `http/1.1` only.
#[test]
fn a_raw_tls_relay_offers_h2_for_servers_that_speak_it() {
    let Some((_nginx, port)) = nginx(
        " http2",
        "",
        "  location /who { default_type text/plain; return 200 \"$server_protocol\\n\"; }",
        &[],
    ) else {
        return;
    };
    let dir = TempDir::new("raw-h2");
    let (cert, key) = certificate(dir.path());
    let raw = |alpn: &[&str]| {
        let mut args = vec!["-E", cert.to_str().unwrap(), "-K", key.to_str().unwrap()];
        args.extend_from_slice(alpn);
        let server = format!("127.0.0.1:{port}");
        Quill::start(&[&args[..], &["{port}", &server]].concat())
    };
    let q = raw(&["-O", "alpn h2"]);
    let url = format!("https://127.0.0.1:{}/who", q.port);
    let Some(out) = curl(&["-k", "--http2", "-w", "version %{http_version}\n", &url]) else {
        return;
    };
    assert_eq!(out, "HTTP/2.0\nversion 2\n");
    let q = raw(&[]);
    let url = format!("https://127.0.0.1:{}/who", q.port);
    let out = Command::new("curl")
        .args(["-sk", "--http2", "-w", "version %{http_version}\n", &url])
        .output()
        .unwrap();
    // curl's HTTP/1.1, to a server that speaks only HTTP/2: no answer it can read.
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(!said.contains("version 2"), "{said}");
}

#[test]
fn h2load_and_nghttp_get_every_stream_answered() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dir = TempDir::new("h2");
    let q = tls_quill(&dir, &[], &[format!("127.0.0.1:{port}")]);
    let url = format!("https://127.0.0.1:{}/1k", q.port);
    let Some(out) = tool("h2load", &["-c10", "-m20", "-n4000", &url]) else {
        return;
    };
    assert!(out.contains("Application protocol: h2"), "{out}");
    assert!(
        out.contains("4000 total, 4000 started, 4000 done, 4000 succeeded, 0 failed"),
        "{out}"
    );
    assert!(out.contains("status codes: 4000 2xx"), "{out}");
    let Some(out) = tool("nghttp", &["-nv", &url]) else {
        return;
    };
    assert!(out.contains(":status: 200"), "{out}");
    assert!(out.contains("content-length: 1024"), "{out}");
}

// ---------------------------------------------------------------------------
// A page in a real browser
// ---------------------------------------------------------------------------

/// Images, scripts and stylesheets of the browser's page: 50 assets, each at a URL of
/// its own.
const IMAGES: usize = 20;
const SCRIPTS: usize = 15;
const STYLES: usize = 15;

/// The page (`index.html`) and its assets, as NGINX serves them: image `i` is an SVG
/// `i + 1` pixels wide; script `i` pushes `i` onto `window.ran`; stylesheet `i` makes its
/// probe element `i + 1` pixels wide. Scripts and stylesheets carry `i` KiB of comment
/// first, so a body cut short or mixed up with another shows.
fn page_and_assets() -> Vec<(String, Vec<u8>)> {
    let padding = |kib: usize| "x".repeat(kib * 1024);
    let mut files = Vec::new();
    let mut head = String::new();
    let mut body = String::new();
    for i in 0..STYLES {
        head.push_str(&format!(
            "<link rel=\"stylesheet\" href=\"/style{i}.css\">\n"
        ));
        body.push_str(&format!("<div data-probe=\"{i}\"></div>\n"));
        files.push((
            format!("style{i}.css"),
            format!(
                "/* {} */\n[data-probe=\"{i}\"] {{ width: {}px; height: 1px; }}\n",
                padding(i),
                i + 1
            )
            .into_bytes(),
        ));
    }
    for i in 0..SCRIPTS {
        head.push_str(&format!("<script src=\"/script{i}.js\"></script>\n"));
        files.push((
            format!("script{i}.js"),
            format!(
                "/* {} */\n(window.ran = window.ran || []).push({i});\n",
                padding(i)
            )
            .into_bytes(),
        ));
    }
    for i in 0..IMAGES {
        body.push_str(&format!("<img src=\"/img{i}.svg\" alt=\"\">\n"));
        files.push((
            format!("img{i}.svg"),
            format!(
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{w}\">\
                 <rect width=\"{w}\" height=\"{w}\" fill=\"#3a7\"/></svg>\n",
                w = i + 1
            )
            .into_bytes(),
        ));
    }
    // No favicon request: the page names an empty one inline.
    let page = format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>fifty assets</title>\n\
         <link rel=\"icon\" href=\"data:,\">\n{head}</head>\n<body>\n{body}</body></html>\n"
    );
    files.push(("index.html".to_string(), page.into_bytes()));
    files
}

/// The value of the sample `name` (with its labels, as written) in a Prometheus text.
fn sample(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            (n == name).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or_else(|| panic!("no sample {name} in:\n{metrics}"))
}

/// Headless Chromium loads a page of 50 assets through quill (TLS, ALPN `h2`) from
/// NGINX, which logs per request its connection number and the forwarded headers. The
/// browser got every response, 200 and over `h2`, on one connection, and every body
/// whole; quill accepted one connection, served it as HTTP/2 and counted its 51
/// requests; NGINX saw each with X-Forwarded-For and X-Forwarded-Proto `https`, over
/// fewer connections than requests: as many as quill says it did not reuse.
#[test]
fn chromium_loads_a_page_of_fifty_assets_over_one_h2_connection() {
    if let Err(why) = browser_tools() {
        eprintln!("SKIPPED: the browser test needs node, chromium and playwright-core: {why}");
        return;
    }
    let files = page_and_assets();
    let refs: Vec<(&str, &[u8])> = files
        .iter()
        .map(|(n, c)| (n.as_str(), c.as_slice()))
        .collect();
    let Some((nginx, port)) = nginx(
        "",
        " types { text/html html; text/css css; text/javascript js; image/svg+xml svg; }\n \
         log_format quill '$connection $http_x_forwarded_for $http_x_forwarded_proto \
         $server_protocol $request_uri';\n keepalive_requests 1000000;",
        "  access_log access.log quill;",
        &refs,
    ) else {
        return;
    };
    let dir = TempDir::new("h2page");
    let (cert, key) = certificate(dir.path());
    let backend = format!("127.0.0.1:{port}");
    let (q, m) = support::http::start_with_metrics(&[
        "-H",
        "-E",
        cert.to_str().unwrap(),
        "-K",
        key.to_str().unwrap(),
        "-O",
        "metrics_listen {metrics}",
        "{port}",
        &backend,
    ]);
    let origin = format!("https://127.0.0.1:{}", q.port);
    let profile = TempDir::new("chromium-profile");
    let started = std::time::Instant::now();
    let out = run_script(
        "h2page.test.mjs",
        &[
            ("PAGE_URL", &format!("{origin}/")),
            ("CERT", cert.to_str().unwrap()),
            ("CHROMIUM", CHROMIUM),
            ("PROFILE_DIR", profile.path().to_str().unwrap()),
        ],
        Duration::from_secs(120),
    );
    eprintln!("the browser ran for {:?}", started.elapsed());
    let report: serde_json::Value = out
        .lines()
        .find_map(|l| l.strip_prefix("REPORT "))
        .map(|r| serde_json::from_str(r).expect("the report is JSON"))
        .unwrap_or_else(|| panic!("no report from the browser:\n{out}\n{}", q.stderr()));
    let list = |key: &str| -> Vec<serde_json::Value> {
        report[key]
            .as_array()
            .unwrap_or_else(|| panic!("no {key} in the report: {report}"))
            .clone()
    };
    assert!(list("failed").is_empty(), "failed requests: {report}");
    assert!(list("errors").is_empty(), "errors in the page: {report}");

    // Every request answered 200 over HTTP/2, all on one connection, as the browser saw
    // it (the DevTools protocol) and as the page did (Resource Timing).
    let assets = IMAGES + SCRIPTS + STYLES;
    // The page and its assets.
    let all = assets + 1;
    let responses = list("responses");
    let urls: BTreeSet<String> = responses
        .iter()
        .map(|r| r["url"].as_str().unwrap_or_default().to_string())
        .collect();
    let want: BTreeSet<String> = files
        .iter()
        .map(|(n, _)| match n.as_str() {
            "index.html" => format!("{origin}/"),
            n => format!("{origin}/{n}"),
        })
        .collect();
    assert_eq!(urls, want, "the page and its {assets} assets, each once");
    assert_eq!(responses.len(), all, "{responses:#?}");
    for r in &responses {
        assert_eq!(r["status"], 200, "{r}");
        assert_eq!(r["protocol"], "h2", "{r}");
    }
    let connections: BTreeSet<String> = responses
        .iter()
        .map(|r| r["connectionId"].to_string())
        .collect();
    assert_eq!(connections.len(), 1, "one connection: {responses:#?}");
    let timing = list("resources");
    assert_eq!(timing.len(), assets, "{timing:#?}");
    for t in timing.iter().chain(&list("navigation")) {
        assert_eq!(t["nextHopProtocol"], "h2", "{t}");
        assert_eq!(t["responseStatus"], 200, "{t}");
    }

    // Every body arrived whole: the scripts ran, the images decoded at their own sizes,
    // the stylesheets applied.
    // (Scripts of the head run in document order.)
    let ran: Vec<u64> = list("scripts").iter().filter_map(|v| v.as_u64()).collect();
    assert_eq!(ran, (0..SCRIPTS as u64).collect::<Vec<_>>(), "{report}");
    let images = list("images");
    assert_eq!(images.len(), IMAGES);
    for (i, img) in images.iter().enumerate() {
        assert_eq!(img["src"], format!("{origin}/img{i}.svg"), "{img}");
        assert_eq!(img["naturalWidth"], i + 1, "{img}");
    }
    let styles = list("styles");
    assert_eq!(styles.len(), STYLES);
    for (i, s) in styles.iter().enumerate() {
        assert_eq!(s["width"], format!("{}px", i + 1), "{s}");
    }

    // quill's side: one client connection, one TLS handshake, served as HTTP/2, 51
    // requests.
    let metrics = support::http::get(m, "/metrics").text();
    for (name, want) in [
        ("quill_connections_accepted_total", 1),
        ("quill_tls_handshakes_total{result=\"ok\"}", 1),
        ("quill_tls_handshakes_total{result=\"failed\"}", 0),
        ("quill_h2_connections_total", 1),
        ("quill_h2_requests_total", all),
    ] {
        assert_eq!(sample(&metrics, name), want as f64, "{name}:\n{metrics}");
    }

    // NGINX's side: each request with X-Forwarded-For and X-Forwarded-Proto: https, in
    // HTTP/1.1, over kept-alive connections (fewer than the requests), as many as quill's
    // pool says it opened. (NGINX logs a request once it has answered it.)
    let log_path = nginx.dir().join("access.log");
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    wait_until(
        Duration::from_secs(10),
        "NGINX logged every request",
        || read_log().lines().count() >= all,
    );
    let log = read_log();
    assert_eq!(log.lines().count(), all, "{log}");
    let mut backend_connections = BTreeSet::new();
    let mut uris = BTreeSet::new();
    for line in log.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(fields.len(), 5, "{line}");
        assert_eq!(fields[1..4], ["127.0.0.1", "https", "HTTP/1.1"], "{line}");
        backend_connections.insert(fields[0]);
        uris.insert(format!("{origin}{}", fields[4]));
    }
    assert_eq!(uris, want, "NGINX got the page and each asset: {log}");
    let status = support::http::get(m, "/status.json").json();
    let server = &status["servers"][0];
    let requests = server["requests"].as_u64().unwrap_or_default();
    let reused = server["requests_reused"].as_u64().unwrap_or_default();
    eprintln!(
        "{requests} requests over {} server connections ({reused} reused one)",
        backend_connections.len()
    );
    assert_eq!(requests, all as u64, "{server}");
    assert!(
        backend_connections.len() < all,
        "a server connection per request: {log}"
    );
    assert_eq!(
        backend_connections.len() as u64,
        requests.saturating_sub(reused),
        "{server}\n{log}"
    );
}

/// 200 curl runs of `args` (each a client connection of its own, one after the other) are
/// answered over at most 4 server connections (`upstream_keepalive 4`).
fn two_hundred_clients_use_at_most_four(args: &[&str]) {
    let mut out = String::new();
    for _ in 0..200 {
        let Some(one) = curl(args) else {
            return;
        };
        out.push_str(&one);
    }
    assert_eq!(out.lines().count(), 200, "{out}");
    let used = connections(&out);
    assert!(
        used.len() <= 4,
        "200 client connections used {} server connections: {used:?}",
        used.len()
    );
}

#[test]
fn two_hundred_client_connections_share_the_pooled_server_connections() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dir = TempDir::new("h2");
    let q = tls_quill(
        &dir,
        &["-O", "upstream_keepalive 4"],
        &[format!("127.0.0.1:{port}")],
    );
    let url = format!("https://127.0.0.1:{}/who", q.port);
    two_hundred_clients_use_at_most_four(&["-k", "--http2", &url]);
}

#[test]
fn two_hundred_http11_clients_share_the_pooled_server_connections_too() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "upstream_keepalive 4",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let url = format!("http://127.0.0.1:{}/who", q.port);
    if which("curl").is_none() {
        eprintln!("SKIPPED: curl is not installed (.ci/run installs it)");
        return;
    }
    two_hundred_clients_use_at_most_four(&["--http1.1", &url]);
    // `status json` tells the same per server: every request, nearly all over a reused
    // connection, and the pool's connections.
    let status = support::ctl::status_json(&ctl);
    let server = &status["servers"][0];
    assert_eq!(server["requests"], 200, "{server}");
    assert!(
        server["requests_reused"].as_u64().unwrap() >= 196,
        "{server}"
    );
    assert!(server["pool_open"].as_u64().unwrap() <= 4, "{server}");
}

/// Whether `program` is on the PATH.
fn which(program: &str) -> Option<()> {
    Command::new(program)
        .arg("--version")
        .output()
        .ok()
        .map(|_| ())
}

/// NGINX answering `/port` with the port it listens on.
fn named_backend() -> Option<(Daemon, u16)> {
    nginx(
        "",
        "",
        "  location /port { default_type text/plain; return 200 \"$server_port\\n\"; }",
        &[],
    )
}

#[test]
fn requests_of_one_keep_alive_client_are_balanced_one_by_one() {
    let Some((_a, a)) = named_backend() else {
        return;
    };
    let Some((_b, b)) = named_backend() else {
        return;
    };
    // Round robin without client tracking (-r): Pen's rule, now per request.
    let q = Quill::start(&[
        "-H",
        "-r",
        "{port}",
        &format!("127.0.0.1:{a}"),
        &format!("127.0.0.1:{b}"),
    ]);
    let url = format!("http://127.0.0.1:{}/port", q.port);
    // curl reuses one connection for every URL of its command line.
    let mut args = vec!["--http1.1", "-w", "%{num_connects}\n"];
    let urls = vec![url.as_str(); 6];
    args.extend(urls);
    let Some(out) = curl(&args) else { return };
    let ports: Vec<&str> = out.lines().filter(|l| l.len() > 2).collect();
    assert_eq!(ports.len(), 6, "{out}");
    assert!(ports.contains(&a.to_string().as_str()), "{out}");
    assert!(ports.contains(&b.to_string().as_str()), "{out}");
    let connects: u32 = out
        .lines()
        .filter(|l| l.len() <= 2)
        .map(|l| l.parse::<u32>().unwrap())
        .sum();
    assert_eq!(connects, 1, "one client connection: {out}");
    // With client tracking (the default), one client stays on one server.
    let tracking = Quill::start(&[
        "-H",
        "{port}",
        &format!("127.0.0.1:{a}"),
        &format!("127.0.0.1:{b}"),
    ]);
    let url = format!("http://127.0.0.1:{}/port", tracking.port);
    let mut args = vec!["--http1.1"];
    let urls = vec![url.as_str(); 6];
    args.extend(urls);
    let out = curl(&args).unwrap();
    let distinct: BTreeSet<&str> = out.lines().collect();
    assert_eq!(distinct.len(), 1, "{out}");
}

#[test]
fn http10_clients_share_the_pooled_server_connections() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let q = Quill::start(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{}/who", q.port);
    // Each curl is a client of its own, asking for one request without keep-alive.
    let mut served = BTreeSet::new();
    for _ in 0..20 {
        let Some(out) = curl(&["--http1.0", "-i", &url]) else {
            return;
        };
        let lower = out.to_ascii_lowercase();
        assert!(lower.contains("connection: close"), "{out}");
        assert!(!lower.contains("keep-alive"), "{out}");
        served.extend(connections(&out));
    }
    // One server connection in each event loop's pool (one loop per core) at most.
    let loops = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert!(
        served.len() <= loops,
        "20 clients used {} server connections: {served:?}",
        served.len()
    );
}

/// The server connections twenty streams of one HTTP/2 client connection (curl reuses it
/// for every URL, one stream after the other) came over, with quill's `option`.
fn connections_for_twenty_streams(option: &str) -> Option<usize> {
    let (_nginx, port) = backend()?;
    let dir = TempDir::new("h2");
    let q = tls_quill(&dir, &["-O", option], &[format!("127.0.0.1:{port}")]);
    let url = format!("https://127.0.0.1:{}/who", q.port);
    let mut args = vec!["-k", "--http2"];
    args.extend(vec![url.as_str(); 20]);
    let out = curl(&args)?;
    assert_eq!(out.lines().count(), 20, "{out}");
    Some(connections(&out).len())
}

#[test]
fn upstream_keepalive_0_opens_a_server_connection_per_request() {
    if let Some(n) = connections_for_twenty_streams("upstream_keepalive 0") {
        assert_eq!(n, 20);
    }
}

#[test]
fn upstream_max_requests_retires_a_server_connection() {
    // Each server connection carries five requests, then closes.
    if let Some(n) = connections_for_twenty_streams("upstream_max_requests 5") {
        assert_eq!(n, 4);
    }
}

#[test]
fn a_server_that_refuses_is_failed_over_request_by_request() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dead = free_port();
    let dir = TempDir::new("h2");
    let q = tls_quill(
        &dir,
        &["-r"],
        &[format!("127.0.0.1:{dead}"), format!("127.0.0.1:{port}")],
    );
    let url = format!("https://127.0.0.1:{}/1k", q.port);
    let Some(out) = tool("h2load", &["-c4", "-m10", "-n400", &url]) else {
        return;
    };
    assert!(
        out.contains("400 total, 400 started, 400 done, 400 succeeded, 0 failed"),
        "{out}"
    );
}

#[test]
fn a_request_body_and_a_large_response_stream_through_byte_exact() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dir = TempDir::new("h2");
    let q = tls_quill(&dir, &[], &[format!("127.0.0.1:{port}")]);
    let file = dir.path().join("upload");
    let data: Vec<u8> = (0..8u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(&file, &data).unwrap();
    let url = format!("https://127.0.0.1:{}/files/blob", q.port);
    let Some(out) = curl(&[
        "-k",
        "--http2",
        "-T",
        file.to_str().unwrap(),
        "-w",
        "%{http_code} %{http_version}\n",
        &url,
    ]) else {
        return;
    };
    assert!(out.ends_with("201 2\n"), "PUT over h2: {out}");
    let back = dir.path().join("download");
    curl(&["-k", "--http2", "-o", back.to_str().unwrap(), &url]).unwrap();
    assert!(
        std::fs::read(&back).unwrap() == data,
        "8 MiB came back changed"
    );
    // A client that reads slower than quill writes, with HTTP/2 windows that do not hold
    // quill back: quill's socket fills now and then (writes gathered for one turn wait
    // for it), and every byte still arrives, in order.
    let Some(python) = python_h2() else {
        return;
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h2_slow_reader.py");
    let port = q.port.to_string();
    let out = tool(python, &[script.to_str().unwrap(), &port, "/files/blob"]).unwrap();
    use sha2::Digest;
    let sha: String = sha2::Sha256::digest(&data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        out.trim(),
        format!("200 {} {sha} ended", data.len()),
        "a slow reader's download"
    );
}

/// A server that answers each request's head at once and its body after `delay`.
fn slow_server(delay: Duration) -> (u16, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let started = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&started);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let seen = Arc::clone(&seen);
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    while let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        got.drain(..end + 4);
                        seen.fetch_add(1, SeqCst);
                        let head = "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n";
                        if conn.write_all(head.as_bytes()).is_err() {
                            return;
                        }
                        std::thread::sleep(delay);
                        if conn.write_all(b"done\n").is_err() {
                            return;
                        }
                    }
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    (port, started)
}

#[test]
fn stopping_sends_goaway_and_lets_the_streams_in_flight_finish() {
    let (port, started) = slow_server(Duration::from_secs(2));
    let dir = TempDir::new("h2");
    let mut q = tls_quill(&dir, &[], &[format!("127.0.0.1:{port}")]);
    let url = format!("https://127.0.0.1:{}/slow", q.port);
    if Command::new("curl").arg("--version").output().is_err() {
        eprintln!("SKIPPED: curl is not installed (.ci/run installs it)");
        return;
    }
    let client = std::thread::spawn(move || curl(&["-k", "--http2", "-w", " %{http_code}", &url]));
    wait_until(
        Duration::from_secs(10),
        "the request reaches the server",
        || started.load(SeqCst) == 1,
    );
    q.signal("TERM");
    let out = client.join().unwrap().unwrap();
    assert_eq!(out, "done\n 200", "the stream in flight finished");
    assert!(
        q.wait_exit(Duration::from_secs(10)).is_some(),
        "quill stops once its streams are done"
    );
}

#[test]
fn a_client_that_never_sends_a_request_is_sent_away() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let q = Quill::start(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "http_request_timeout 1",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    // The preface and an empty SETTINGS frame, then nothing: an HTTP/2 slowloris.
    let mut s = q.connect();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .unwrap();
    let (got, _) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(has_goaway(&got), "no GOAWAY in {got:?}");
}

/// Whether the HTTP/2 frames in `got` (after the server's preface) include a GOAWAY.
fn has_goaway(got: &[u8]) -> bool {
    let mut at = 0;
    while at + 9 <= got.len() {
        let len = u32::from_be_bytes([0, got[at], got[at + 1], got[at + 2]]) as usize;
        if got[at + 3] == 7 {
            return true;
        }
        at += 9 + len;
    }
    false
}

/// quill terminating TLS in `http` mode in front of NGINX, with a metrics listener.
fn tls_quill_with_metrics(dir: &TempDir, port: u16) -> (Quill, std::net::SocketAddr) {
    let (cert, key) = certificate(dir.path());
    support::http::start_with_metrics(&[
        "-H",
        "-E",
        cert.to_str().unwrap(),
        "-K",
        key.to_str().unwrap(),
        "-O",
        "metrics_listen 127.0.0.1:{metrics}",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ])
}

/// The counts of h2load's `requests:` line: total, started, done, succeeded, failed.
fn h2load_requests(out: &str) -> [u64; 5] {
    let line = out
        .lines()
        .find(|l| l.starts_with("requests:"))
        .unwrap_or_else(|| panic!("no requests line in:\n{out}"));
    let numbers: Vec<u64> = line
        .split([' ', ','])
        .filter_map(|w| w.parse().ok())
        .collect();
    numbers[..5].try_into().unwrap()
}

/// A reload sends every HTTP/2 client GOAWAY; each stream quill took before it is answered.
/// (h2load does not reconnect after GOAWAY, from quill or NGINX alike: its clients end
/// there, the requests they had left count as failed.)
#[test]
fn a_reload_sends_h2_clients_away_and_answers_every_stream_it_took() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = backend() else {
        return;
    };
    if which("h2load").is_none() {
        eprintln!("SKIPPED: h2load is not installed (.ci/run installs nghttp2-client)");
        return;
    }
    let dir = TempDir::new("h2");
    let (q, metrics) = tls_quill_with_metrics(&dir, port);
    let url = format!("https://127.0.0.1:{}/1k", q.port);
    let load = std::thread::spawn(move || tool("h2load", &["-c4", "-m10", "-n40000", &url]));
    wait_until(Duration::from_secs(10), "h2load's streams flow", || {
        metric(metrics, "quill_h2_requests_total") >= 200
    });
    support::ctl::signal_when_handled(&q, "HUP");
    let out = load.join().unwrap().unwrap();
    let [total, _, done, succeeded, _] = h2load_requests(&out);
    assert!(done < total, "its clients were not sent away\n{out}");
    let taken = metric(metrics, "quill_h2_requests_total");
    assert_eq!(
        succeeded, taken,
        "quill took {taken} streams, h2load saw {succeeded} succeed\n{out}"
    );
    assert!(out.contains("0 4xx, 0 5xx"), "{out}");
    assert_eq!(metric(metrics, "quill_h2_connections_total"), 4, "{out}");
}

/// Sends SIGHUP to quill every 100 ms until `done`; returns how many it sent.
fn reload_until(q: &Quill, done: &std::sync::atomic::AtomicBool) -> u32 {
    let mut sent = 0;
    while !done.load(SeqCst) {
        support::ctl::signal_when_handled(q, "HUP");
        sent += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    sent
}

/// Clients that reconnect (curl over HTTP/2, h2load's HTTP/1.1 clients after a
/// `Connection: close`) lose no request to reloads every 100 ms, and do reconnect.
#[test]
fn clients_that_reconnect_lose_no_request_to_a_reload_loop() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = backend() else {
        return;
    };
    if which("curl").is_none() || which("h2load").is_none() {
        eprintln!("SKIPPED: curl or h2load is not installed (.ci/run installs them)");
        return;
    }
    let dir = TempDir::new("h2");
    let (q, metrics) = tls_quill_with_metrics(&dir, port);
    let done = std::sync::atomic::AtomicBool::new(false);

    // curl multiplexes its transfers over one HTTP/2 connection at a time.
    let urls: Vec<String> = (0..3000)
        .map(|i| format!("https://127.0.0.1:{}/1k?{i}", q.port))
        .collect();
    let mut args = vec![
        "-k",
        "--http2",
        "--parallel",
        "--parallel-max",
        "20",
        "-w",
        "%{http_code} %{http_version}\n",
    ];
    for url in &urls {
        args.extend(["-o", "/dev/null", url]);
    }
    let (out, reloads) = std::thread::scope(|s| {
        let curl = s.spawn(|| {
            let out = curl(&args);
            done.store(true, SeqCst);
            out
        });
        let reloads = reload_until(&q, &done);
        (curl.join().unwrap().unwrap(), reloads)
    });
    let answered = out.lines().filter(|l| *l == "200 2").count();
    assert_eq!(answered, 3000, "{reloads} reloads; curl said:\n{out}");
    let h2 = metric(metrics, "quill_h2_connections_total");
    assert!(
        reloads < 2 || h2 >= 2,
        "{reloads} reloads, but curl used {h2} connection(s)"
    );

    // HTTP/1.1 keep-alive clients get `Connection: close` and come back. The load lasts
    // several reload periods: a reload before the clients connect, or after one of them
    // has had its share, moves fewer than four.
    let accepted = metric(metrics, "quill_connections_accepted_total");
    done.store(false, SeqCst);
    let url = format!("https://127.0.0.1:{}/1k", q.port);
    let (out, reloads) = std::thread::scope(|s| {
        let load = s.spawn(|| {
            let out = tool("h2load", &["--h1", "-c4", "-n12000", &url]);
            done.store(true, SeqCst);
            out
        });
        let reloads = reload_until(&q, &done);
        (load.join().unwrap().unwrap(), reloads)
    });
    assert!(out.contains("12000 succeeded, 0 failed"), "{out}");
    let reconnected = metric(metrics, "quill_connections_accepted_total") - accepted - 4;
    assert!(
        reloads < 3 || reconnected >= 4,
        "{reloads} reloads, {reconnected} reconnections\n{out}"
    );
}

/// `drain` sends the node's HTTP/2 clients GOAWAY, so that they reconnect elsewhere.
#[test]
fn drain_sends_h2_clients_goaway() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "h2c",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let mut s = q.connect();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .unwrap();
    // quill's SETTINGS: the connection is served.
    let mut head = [0u8; 9];
    s.read_exact(&mut head).unwrap();
    assert_eq!(head[3], 4, "{head:?}");
    let mut settings = vec![0u8; u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize];
    s.read_exact(&mut settings).unwrap();
    support::ctl::ctl_ok(&ctl, "drain");
    let (got, took) = expect_closed(&mut s, Duration::from_secs(10));
    assert!(has_goaway(&got), "no GOAWAY in {got:?}");
    assert!(
        took < Duration::from_secs(5),
        "closed after {took:?}, by a timer rather than the drain"
    );
    support::ctl::ctl_ok(&ctl, "drain 0");
}

/// Runs `tests/fixtures/h2_attack.py MODE PORT N` (hyper-h2's framing library builds the
/// frames); its one line of output says what quill did. `None` when python3-h2 is missing.
fn attack(mode: &str, port: u16, n: u32) -> Option<String> {
    let python = python_h2()?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h2_attack.py");
    tool(
        python,
        &[
            script.to_str().unwrap(),
            mode,
            &port.to_string(),
            &n.to_string(),
        ],
    )
}

/// quill with `h2c` in front of NGINX, for the attacks (plain HTTP/2 frames are easier to
/// write than TLS; the HTTP/2 code is the same).
fn h2c_quill(port: u16, extra: &[&str]) -> Quill {
    let mut args = vec!["-H", "-O", "h2c"];
    args.extend_from_slice(extra);
    let server = format!("127.0.0.1:{port}");
    args.extend(["{port}", server.as_str()]);
    Quill::start(&args)
}

/// After an attack: quill is up, small, and serves a well-behaved client.
fn still_serving(q: &mut Quill) {
    q.assert_running();
    let url = format!("http://127.0.0.1:{}/who", q.port);
    let out = curl(&["--http2-prior-knowledge", &url]).unwrap();
    assert!(out.contains("/who"), "{out}");
    if let Some(rss) = q.rss_kib() {
        assert!(rss < 64 * 1024, "quill's RSS grew to {rss} KiB");
    }
}

/// CVE-2023-44487: streams opened and reset at once, 2,000 in one burst. quill (hyper's
/// h2) answers GOAWAY ENHANCE_YOUR_CALM (0xb) once more than 20 resets wait.
#[test]
fn a_rapid_reset_attack_is_sent_away_enhance_your_calm() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let mut q = h2c_quill(port, &[]);
    let Some(out) = attack("rapid_reset", q.port, 2000) else {
        return;
    };
    assert_eq!(out.trim(), "goaway 11", "{out}");
    still_serving(&mut q);
}

/// The 2024 CONTINUATION flood: a head that never ends, 16 kB a frame, up to 32 MB. quill
/// stops at `http_header_max` and sends GOAWAY before the attacker is through.
#[test]
fn a_continuation_flood_is_cut_short() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let mut q = h2c_quill(port, &[]);
    let Some(out) = attack("continuation", q.port, 2000) else {
        return;
    };
    let words: Vec<&str> = out.split_whitespace().collect();
    assert!(
        matches!(words[..2], ["goaway", "11"] | ["closed", "None"]),
        "{out}"
    );
    let sent: u64 = words[words.len() - 1].parse().unwrap();
    assert!(
        sent < 16 << 20,
        "quill read {sent} bytes of one head: {out}"
    );
    still_serving(&mut q);
}

/// 200,000 PINGs from a client that never reads the answers: quill's memory stays bounded
/// (hyper's h2 keeps one PONG pending), and other clients are served.
#[test]
fn a_ping_flood_leaves_quill_small() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let mut q = h2c_quill(port, &[]);
    if attack("ping_flood", q.port, 200).is_none() {
        return;
    }
    still_serving(&mut q);
}

/// `h2_max_streams 7`: eight requests at once against a slow server, the eighth is refused
/// (RST_STREAM REFUSED_STREAM, 0x7, which a client may retry elsewhere).
#[test]
fn streams_beyond_h2_max_streams_are_refused() {
    let (port, _) = slow_server(Duration::from_secs(3));
    let q = Quill::start(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "h2_max_streams 7",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let Some(out) = attack("streams", q.port, 8) else {
        return;
    };
    assert_eq!(out.trim(), "refused [(15, 7)]", "{out}");
}

/// A burst of 20 clients at once leaves up to 20 idle server connections; within about two
/// seconds the pool is back to `upstream_keepalive` of them, the least recently used closed.
/// Meanwhile every request was answered and most server connections were reused.
#[test]
fn the_pool_shrinks_back_to_upstream_keepalive_after_a_burst() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let (q, metrics) = support::http::start_with_metrics(&[
        "-H",
        "-O",
        "upstream_keepalive 4",
        "-O",
        "metrics_listen 127.0.0.1:{metrics}",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let url = format!("http://127.0.0.1:{}/1k", q.port);
    let Some(out) = tool("h2load", &["--h1", "-c20", "-n4000", &url]) else {
        return;
    };
    assert!(out.contains("4000 succeeded, 0 failed"), "{out}");
    let made = metric(metrics, "quill_server_connections_total");
    let reused = metric(metrics, "quill_server_requests_reused_total");
    assert!(
        reused >= 3000,
        "{reused} of 4000 requests reused a connection ({made} made)"
    );
    wait_until(Duration::from_secs(10), "the pool trimmed to 4", || {
        metric(metrics, "quill_server_pool_idle") <= 4
    });
    assert!(
        metric(metrics, "quill_server_pool_idle") >= 1,
        "the share is kept"
    );
}

/// `access_log FILE`: one line per request, eleven fields (client, time, method, authority,
/// target, protocol, status, body bytes in and out, milliseconds, server), HTTP/2 and
/// HTTP/1.1 alike, quill's own answers with `-` for the server.
#[test]
fn the_access_log_has_a_line_per_request() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dead = free_port();
    let q = Quill::start(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "access_log {dir}/access.log",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let base = format!("http://127.0.0.1:{}", q.port);
    let Some(_) = curl(&["--http2-prior-knowledge", &format!("{base}/who?x=1")]) else {
        return;
    };
    let upload = q.dir().join("upload");
    std::fs::write(&upload, [b'u'; 100]).unwrap();
    curl(&[
        "--http1.1",
        "-T",
        upload.to_str().unwrap(),
        &format!("{base}/files/a"),
    ])
    .unwrap();
    // A second quill with only a dead server answers 503 itself.
    let q2 = Quill::start(&[
        "-H",
        "-O",
        "access_log {dir}/access.log",
        "{port}",
        &format!("127.0.0.1:{dead}"),
    ]);
    let out = Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}"])
        .arg(format!("http://127.0.0.1:{}/gone", q2.port))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "503");
    let log = q.dir().join("access.log");
    wait_until(
        Duration::from_secs(10),
        "two lines in the access log",
        || std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() == 2),
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    assert!(lines.iter().all(|f| f.len() == 11), "{text}");
    let authority = format!("127.0.0.1:{}", q.port);
    let server = format!("127.0.0.1:{port}");
    assert_eq!(lines[0][0], "127.0.0.1", "{text}");
    assert_eq!(
        lines[0][2..9],
        [
            "GET",
            authority.as_str(),
            "/who?x=1",
            "HTTP/2.0",
            "200",
            "0",
            lines[0][8]
        ],
        "{text}"
    );
    assert!(lines[0][8].parse::<u64>().unwrap() > 0, "{text}");
    assert_eq!(lines[0][10], server, "{text}");
    assert_eq!(
        lines[1][2..8],
        [
            "PUT",
            authority.as_str(),
            "/files/a",
            "HTTP/1.1",
            "201",
            "100"
        ],
        "{text}"
    );
    let log2 = q2.dir().join("access.log");
    wait_until(Duration::from_secs(10), "the 503's line", || {
        std::fs::read_to_string(&log2).is_ok_and(|t| t.lines().count() == 1)
    });
    let text = std::fs::read_to_string(&log2).unwrap();
    let fields: Vec<&str> = text.trim_end().split(' ').collect();
    assert_eq!(
        fields[2..7],
        ["GET", fields[3], "/gone", "HTTP/1.1", "503"],
        "{text}"
    );
    assert_eq!(fields[10], "-", "{text}");
}

/// A log file that stops taking lines (a log shipper reading from a named pipe that
/// stalled, a disk that hangs) does not stop requests: lines wait in memory, written by
/// the log's own thread, and reach the file once it takes them again. Before, the event
/// loop itself blocked in `write` once the pipe was full, and every client with it.
#[test]
fn a_stalled_access_log_does_not_stall_requests() {
    use std::os::unix::fs::OpenOptionsExt;
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("quill-stalled-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fifo = dir.join("access.log");
    let _ = std::fs::remove_file(&fifo);
    let made = Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo {}", fifo.display());
    // The reader opens first (quill's open would wait for one), then reads nothing.
    let mut reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let q = Quill::start(&[
        "-H",
        "-O",
        &format!("access_log {}", fifo.display()),
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    // About 90 bytes a line: far more than the pipe's 64 KiB.
    const REQUESTS: usize = 3000;
    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    for i in 0..REQUESTS {
        client
            .write_all(b"GET /1k HTTP/1.1\r\nHost: a.example\r\n\r\n")
            .unwrap();
        let resp = read_response(&mut client)
            .unwrap_or_else(|| panic!("request {i} of {REQUESTS} got no answer"));
        assert_eq!(resp.status, 200, "{}", resp.head);
    }
    // The log reads again: every line comes, whole.
    let mut text = Vec::new();
    wait_until(
        Duration::from_secs(10),
        "every line through the pipe",
        || {
            let mut chunk = [0u8; 65536];
            while let Ok(n @ 1..) = reader.read(&mut chunk) {
                text.extend_from_slice(&chunk[..n]);
            }
            text.iter().filter(|&&b| b == b'\n').count() >= REQUESTS
        },
    );
    let text = String::from_utf8(text).unwrap();
    assert_eq!(text.lines().count(), REQUESTS);
    assert!(
        text.lines()
            .all(|l| l.split(' ').nth(2) == Some("GET") && l.split(' ').count() == 11),
        "{text}"
    );
    drop(q);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `-l IP:PORT` (Pen's entries for penlogd) with requests served one by one over pooled
/// server connections: an entry per request, to the server it went to, before the server
/// has it, so that penlogd gives each of the web server's lines its client's address
/// (several clients' requests share a server connection).
#[test]
fn penlogd_hears_of_each_request_served_over_pooled_connections() {
    let Some(penlogd) = support::penlogd::Penlogd::start() else {
        return;
    };
    let Some((_nginx, port)) = backend() else {
        return;
    };
    // With the access log too: both logs take their fields from each request's head.
    let q = Quill::start(&[
        "-H",
        "-O",
        "access_log {dir}/access.log",
        "-l",
        &format!("127.0.0.1:{}", penlogd.port),
        "127.0.0.1:{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    // Two keep-alive clients, two requests each, one after the other: with the pool,
    // the second client's requests may go over the first one's server connection.
    for (src, paths) in [
        ("127.0.0.2", ["/1k?a", "/1k?b"]),
        ("127.0.0.3", ["/1k?c", "/1k?d"]),
    ] {
        let mut client = q.connect_from(src);
        client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        for path in paths {
            client
                .write_all(format!("GET {path} HTTP/1.1\r\nHost: a\r\n\r\n").as_bytes())
                .unwrap();
            assert_eq!(read_response(&mut client).expect("an answer").status, 200);
        }
    }
    // NGINX's lines for them, as it logged them (quill's address as the client's).
    assert_eq!(
        penlogd.clients_of_gets("HTTP/1.1", &["/1k?a", "/1k?c", "/1k?b", "/1k?d"]),
        ["127.0.0.2", "127.0.0.3", "127.0.0.2", "127.0.0.3"]
    );
    let log = q.dir().join("access.log");
    wait_until(Duration::from_secs(5), "four access log lines", || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.lines().count() == 4)
    });
}

/// HTTP/2 clients' requests go to servers one by one too: penlogd hears of each, as the
/// server will log it (`HTTP/1.1`), with the client it came from.
#[test]
fn penlogd_hears_of_each_request_of_an_http2_client() {
    let Some(penlogd) = support::penlogd::Penlogd::start() else {
        return;
    };
    let Some((_nginx, port)) = backend() else {
        return;
    };
    // Named as Pen users name it: a host name and a port.
    let penlogd_at = format!("localhost:{}", penlogd.port);
    let q = h2c_quill(port, &["-l", &penlogd_at]);
    // Two clients, two requests each (a connection each: Debian's curl 7.88 fails a second
    // request over a reused h2c connection, NGINX's own as well).
    for (src, path) in [
        ("127.0.0.2", "/1k?a"),
        ("127.0.0.3", "/1k?c"),
        ("127.0.0.2", "/1k?b"),
        ("127.0.0.3", "/1k?d"),
    ] {
        let url = format!("http://127.0.0.1:{}{path}", q.port);
        let out = curl(&[
            "--http2-prior-knowledge",
            "--interface",
            src,
            "-o",
            "/dev/null",
            "-w",
            "%{http_version} %{http_code}",
            &url,
        ])
        .expect("curl");
        assert_eq!(out, "2 200");
    }
    assert_eq!(
        penlogd.clients_of_gets("HTTP/1.1", &["/1k?c", "/1k?a", "/1k?d", "/1k?b"]),
        ["127.0.0.3", "127.0.0.2", "127.0.0.3", "127.0.0.2"]
    );
}

/// Lines wait for the log's thread (up to 0.1 s), but not past the end: a request answered
/// just before SIGTERM has its line in the file when quill has exited.
#[test]
fn the_access_log_is_written_out_when_quill_stops() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let mut q = Quill::start(&[
        "-H",
        "-O",
        "access_log {dir}/access.log",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    for _ in 0..3 {
        client
            .write_all(b"GET /1k HTTP/1.1\r\nHost: a.example\r\n\r\n")
            .unwrap();
        assert_eq!(read_response(&mut client).expect("an answer").status, 200);
    }
    drop(client);
    q.signal("TERM");
    assert_eq!(q.wait_exit(Duration::from_secs(10)), Some(Some(0)));
    let text = std::fs::read_to_string(q.dir().join("access.log")).unwrap();
    assert_eq!(text.lines().count(), 3, "{text}");
}

/// With `upstream_keepalive 0` (one server connection for each client's, the byte pump's
/// whole-connection relay) every request has its line too, written as its answer ends,
/// while the connection stays open: pipelined requests each with its own status and
/// bytes, and the request quill could find no server for with `-`.
#[test]
fn one_server_connection_per_client_logs_each_request_as_its_answer_ends() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let q = Quill::start(&[
        "-H",
        "-O",
        "upstream_keepalive 0",
        "-O",
        "access_log {dir}/access.log",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let log = q.dir().join("access.log");
    let lines = || -> Vec<Vec<String>> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| l.split(' ').map(str::to_string).collect())
            .collect()
    };
    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(
            b"GET /1k HTTP/1.1\r\nHost: a.example\r\n\r\n\
              PUT /files/p HTTP/1.1\r\nHost: a.example\r\nContent-Length: 5\r\n\r\nhello\
              GET /missing HTTP/1.1\r\nHost: a.example\r\n\r\n",
        )
        .unwrap();
    for want in [200, 201, 404] {
        let resp = read_response(&mut client).expect("an answer");
        assert_eq!(resp.status, want, "{}", resp.head);
    }
    wait_until(
        Duration::from_secs(10),
        "three lines while the connection is open",
        || lines().len() == 3,
    );
    let got = lines();
    let server = format!("127.0.0.1:{port}");
    let want = [
        ["GET", "a.example", "/1k", "HTTP/1.1", "200", "0", "1024"],
        [
            "PUT",
            "a.example",
            "/files/p",
            "HTTP/1.1",
            "201",
            "5",
            got[1][8].as_str(),
        ],
        [
            "GET",
            "a.example",
            "/missing",
            "HTTP/1.1",
            "404",
            "0",
            got[2][8].as_str(),
        ],
    ];
    for (line, want) in got.iter().zip(want) {
        assert_eq!(line.len(), 11, "{got:?}");
        assert_eq!(line[2..9], want, "{got:?}");
        assert_eq!(line[10], server, "{got:?}");
    }
    // A connection that keeps going logs its next request the same way.
    client
        .write_all(b"GET /who HTTP/1.1\r\nHost: a.example\r\n\r\n")
        .unwrap();
    assert_eq!(read_response(&mut client).expect("an answer").status, 200);
    wait_until(Duration::from_secs(10), "the fourth line", || {
        lines().len() == 4
    });
    drop(client);
    // No server to take the connection: its first request is answered 503 (as request by
    // request; Pen closes the connection unanswered), the one pipelined behind it not at
    // all (the 503 says `Connection: close`), and the line has `503` and `-`.
    let q2 = Quill::start(&[
        "-H",
        "-O",
        "upstream_keepalive 0",
        "-O",
        "access_log {dir}/access.log",
        "{port}",
        &format!("127.0.0.1:{}", free_port()),
    ]);
    let mut client = q2.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(b"GET /x HTTP/1.1\r\n\r\nGET /y HTTP/1.1\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut client).expect("an answer");
    assert_eq!(resp.status, 503, "{}", resp.head);
    assert_eq!(resp.field("connection").as_deref(), Some("close"));
    assert_eq!(resp.body, b"Service Unavailable\n");
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    let log2 = q2.dir().join("access.log");
    wait_until(Duration::from_secs(10), "the 503's line", || {
        std::fs::read_to_string(&log2).is_ok_and(|t| t.lines().count() == 2)
    });
    let text = std::fs::read_to_string(&log2).unwrap();
    let fields: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
    assert_eq!(
        (
            fields[0][2],
            fields[0][3],
            fields[0][4],
            fields[0][6],
            fields[0][10]
        ),
        ("GET", "-", "/x", "503", "-"),
        "{text}"
    );
    assert_eq!((fields[1][4], fields[1][6]), ("/y", "0"), "{text}");
    // A first head that is refused gets its refusal, server or none.
    let mut client = q2.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut client).expect("an answer");
    assert_eq!(resp.status, 400, "{}", resp.head);
}

/// A server that drains (or leaves the configuration) keeps no idle pooled connection: the
/// pool closes them within a couple of seconds instead of at `upstream_idle_timeout`.
#[test]
fn a_draining_server_keeps_no_idle_connection() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    if which("curl").is_none() {
        eprintln!("SKIPPED: curl is not installed (.ci/run installs it)");
        return;
    }
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "upstream_keepalive 4",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ]);
    let url = format!("http://127.0.0.1:{}/1k", q.port);
    for _ in 0..5 {
        curl(&["--http1.1", "-o", "/dev/null", &url]).unwrap();
    }
    let server = |field: &str| support::ctl::status_json(&ctl)["servers"][0][field].as_u64();
    assert!(server("pool_idle") >= Some(1), "nothing was kept idle");
    support::ctl::ctl_ok(&ctl, "server 0 drain");
    wait_until(
        Duration::from_secs(5),
        "the drained server's idle connections closed",
        || server("pool_open") == Some(0),
    );
}

/// Pen's connection log (`-l`) has a line for every client connection, HTTP/2 ones too:
/// no single server (each request has its own: the access log tells), and the preface's
/// request line.
#[test]
fn the_connection_log_has_a_line_per_h2_connection() {
    let Some((_nginx, port)) = backend() else {
        return;
    };
    if which("curl").is_none() {
        eprintln!("SKIPPED: curl is not installed (.ci/run installs it)");
        return;
    }
    let dir = TempDir::new("h2");
    let log = dir.path().join("connections.log");
    let q = tls_quill(
        &dir,
        &["-l", log.to_str().unwrap()],
        &[format!("127.0.0.1:{port}")],
    );
    let url = format!("https://127.0.0.1:{}/1k", q.port);
    for version in ["--http2", "--http1.1"] {
        curl(&["-k", version, "-o", "/dev/null", &url]).unwrap();
    }
    let mut lines = Vec::new();
    wait_until(Duration::from_secs(5), "two lines in the log", || {
        lines = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect();
        lines.len() == 2
    });
    let fields: Vec<Vec<&str>> = lines.iter().map(|l| l.splitn(4, ' ').collect()).collect();
    assert_eq!(fields[0][0], "127.0.0.1", "{lines:?}");
    assert_eq!(fields[0][2], "-", "{lines:?}");
    assert_eq!(fields[0][3], "PRI * HTTP/2.0", "{lines:?}");
    assert_eq!(fields[1][3], "GET /1k HTTP/1.1", "{lines:?}");
}

/// An HTTP/1.1 server of WebSockets, small: records each request head. `/ws` is answered
/// `101 Switching Protocols` and then echoes each WebSocket message (RFC 6455 frames:
/// the client's are masked, the server's not); `/raw` switches too and echoes bytes as
/// they come; `/plain` is a `200` (a server that ignores `Upgrade`); `/` a small page; any
/// other path a `404`. Plain answers keep the connection for the next request.
fn websocket_server() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&heads);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let seen = Arc::clone(&seen);
            std::thread::spawn(move || websocket_connection(conn, &seen));
        }
    });
    (port, heads)
}

fn websocket_connection(mut conn: std::net::TcpStream, seen: &Mutex<Vec<String>>) {
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
        seen.lock().unwrap().push(head);
        let plain = |body: &str, status: &str| {
            format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
        };
        let answer = match path.split('?').next().unwrap_or("") {
            "/plain" => plain("ok", "200 OK"),
            "/" => plain(
                "<!doctype html><link rel=icon href=\"data:,\"><title>ws</title><p>ws",
                "200 OK",
            ),
            "/ws" | "/raw" => break,
            _ => plain("", "404 Not Found"),
        };
        if conn.write_all(answer.as_bytes()).is_err() {
            return;
        }
    }
    let raw = seen.lock().unwrap().last().unwrap().starts_with("GET /raw");
    let _ = conn.write_all(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\
          Connection: Upgrade\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n",
    );
    let mut back = conn.try_clone().unwrap();
    if raw {
        let _ = std::io::copy(&mut conn, &mut back);
        return;
    }
    // Frames: a 2-byte head, a 16-bit length when 126, the 4-byte mask, the payload.
    loop {
        let mut h = [0u8; 2];
        if conn.read_exact(&mut h).is_err() {
            return;
        }
        let mut len = usize::from(h[1] & 0x7f);
        if len == 126 {
            let mut l = [0u8; 2];
            conn.read_exact(&mut l).unwrap();
            len = usize::from(u16::from_be_bytes(l));
        }
        let mut mask = [0u8; 4];
        if h[1] & 0x80 != 0 {
            conn.read_exact(&mut mask).unwrap();
        }
        let mut payload = vec![0u8; len];
        conn.read_exact(&mut payload).unwrap();
        for (i, b) in payload.iter_mut().enumerate() {
            *b ^= mask[i % 4];
        }
        let mut frame = vec![h[0]];
        if len < 126 {
            frame.push(len as u8);
        } else {
            frame.push(126);
            frame.extend_from_slice(&(len as u16).to_be_bytes());
        }
        frame.extend_from_slice(&payload);
        if back.write_all(&frame).is_err() || h[0] & 0x0f == 8 {
            return;
        }
    }
}

/// Runs `tests/fixtures/h2_websocket.py` (hyper-h2's protocol library as the client);
/// `None` when python3-h2 is missing.
fn h2_websocket(port: u16, path: &str, message: &str, method: &str) -> Option<String> {
    let python = python_h2()?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/h2_websocket.py");
    tool(
        python,
        &[
            script.to_str().unwrap(),
            &port.to_string(),
            path,
            message,
            method,
        ],
    )
}

/// RFC 8441: a WebSocket opened over an HTTP/2 stream (extended CONNECT) reaches an
/// HTTP/1.1 server as RFC 6455's handshake (`GET` with `Upgrade: websocket`, a fresh
/// `Sec-WebSocket-Key`, the forwarded headers); the server's `101` is the stream's `200`
/// without `Sec-WebSocket-Accept`, and the stream carries the bytes both ways.
#[test]
fn a_websocket_over_h2_reaches_an_http11_server_as_an_upgrade() {
    let (server, heads) = websocket_server();
    let q = h2c_quill(server, &[]);
    let Some(out) = h2_websocket(q.port, "/raw?room=1", "hello over a stream", "connect") else {
        return;
    };
    assert!(out.contains("settings ENABLE_CONNECT_PROTOCOL=1"), "{out}");
    assert!(out.contains("status 200"), "{out}");
    assert!(
        !out.to_ascii_lowercase().contains("sec-websocket-accept"),
        "{out}"
    );
    assert!(
        !out.to_ascii_lowercase().contains("header upgrade"),
        "{out}"
    );
    assert!(out.contains("echo hello over a stream"), "{out}");
    let heads = heads.lock().unwrap();
    let head = heads.first().expect("the server got no request");
    let lower = head.to_ascii_lowercase();
    assert!(head.starts_with("GET /raw?room=1 HTTP/1.1\r\n"), "{head}");
    assert!(lower.contains("\r\nupgrade: websocket\r\n"), "{head}");
    assert!(lower.contains("\r\nconnection: upgrade\r\n"), "{head}");
    assert!(
        lower.contains("\r\nsec-websocket-version: 13\r\n"),
        "{head}"
    );
    assert!(
        lower.contains(&format!("\r\nhost: 127.0.0.1:{}\r\n", q.port)),
        "{head}"
    );
    assert!(
        lower.contains("\r\nx-forwarded-for: 127.0.0.1\r\n"),
        "{head}"
    );
    let key = lower
        .split("\r\n")
        .find_map(|l| l.strip_prefix("sec-websocket-key: "))
        .expect("no Sec-WebSocket-Key");
    assert_eq!(key.len(), 24, "a key is 16 bytes in base64: {head}");
}

/// A server that answers the upgrade with a plain `200` opened no tunnel: the HTTP/2
/// client gets `502`, not the `200` that would tell it the WebSocket is open. A `CONNECT`
/// without `:protocol` (a TCP tunnel) is still not proxied over HTTP/2: `501`.
#[test]
fn a_websocket_over_h2_the_server_does_not_take_is_a_502_and_plain_connect_a_501() {
    let (server, _heads) = websocket_server();
    let q = h2c_quill(server, &[]);
    let Some(out) = h2_websocket(q.port, "/plain", "x", "connect") else {
        return;
    };
    assert!(out.contains("status 502"), "{out}");
    let out = h2_websocket(q.port, "/", "x", "plain-connect").unwrap();
    assert!(out.contains("status 501"), "{out}");
}

/// A WebSocket over HTTP/2 outlives a `drain`: the client gets GOAWAY (no new stream is
/// taken on the connection) while its tunnel stream goes on carrying bytes both ways; once
/// the client ends the tunnel, the connection closes. (Client: the `h2` crate, which keeps
/// the streams a GOAWAY spared.)
#[test]
fn a_websocket_over_h2_outlives_a_drain_and_the_connection_closes_after_it() {
    use bytes::Bytes;
    use hyper::http::Request;

    let (server, heads) = websocket_server();
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "h2c",
        "{port}",
        &format!("127.0.0.1:{server}"),
    ]);
    let port = q.port;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let ctl = ctl.as_str();
    rt.block_on(async move {
        let limit = Duration::from_secs(10);
        let (mut client, mut conn) = support::http::h2_extended_connect_client(port, limit).await;
        let req = Request::builder()
            .method("CONNECT")
            .uri(format!("http://127.0.0.1:{port}/raw"))
            .extension(h2::ext::Protocol::from("websocket"))
            .header("sec-websocket-version", "13")
            .body(())
            .unwrap();
        let (resp, mut up) = client.send_request(req, false).unwrap();
        let resp = tokio::time::timeout(limit, resp)
            .await
            .expect("timed out waiting for the tunnel's answer")
            .unwrap();
        assert_eq!(resp.status(), 200);
        let mut down = resp.into_body();
        let mut echo = async |msg: &'static str| {
            up.send_data(Bytes::from_static(msg.as_bytes()), false)
                .unwrap();
            let mut got = Vec::new();
            while got.len() < msg.len() {
                let data = tokio::time::timeout(limit, down.data())
                    .await
                    .expect("timed out waiting for the echo")
                    .expect("the tunnel ended")
                    .unwrap();
                down.flow_control().release_capacity(data.len()).unwrap();
                got.extend_from_slice(&data);
            }
            assert_eq!(got, msg.as_bytes());
        };
        echo("before the drain").await;
        support::ctl::ctl_ok(ctl, "drain");
        // GOAWAY: the connection takes no new stream.
        tokio::time::timeout(limit, async {
            loop {
                let req = Request::builder()
                    .uri(format!("http://127.0.0.1:{port}/plain"))
                    .body(())
                    .unwrap();
                match client.send_request(req, true) {
                    Err(e) if e.is_go_away() => return,
                    Err(e) => panic!("a new stream failed, not for GOAWAY: {e}"),
                    // Sent before the GOAWAY came: answered, or refused.
                    Ok((resp, _)) => match resp.await {
                        Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                        Err(e) if e.is_go_away() || e.is_reset() => return,
                        Err(e) => panic!("a new stream failed, not for GOAWAY: {e}"),
                    },
                }
            }
        })
        .await
        .expect("timed out waiting for GOAWAY");
        echo("after the drain").await;
        up.send_data(Bytes::new(), true).unwrap();
        // After GOAWAY the connection ends with its last stream (the client keeps its
        // handle: nothing else ends it).
        tokio::time::timeout(limit, &mut conn)
            .await
            .expect("timed out waiting for the connection to close after the tunnel")
            .unwrap()
            .ok();
        drop(client);
    });
    support::ctl::ctl_ok(ctl, "drain 0");
    let heads = heads.lock().unwrap();
    assert!(heads[0].starts_with("GET /raw HTTP/1.1\r\n"), "{heads:?}");
}

/// A browser's WebSocket through quill's TLS listener: headless Chromium loads a page over
/// HTTP/2 and opens a WebSocket to the same origin, sends two messages and gets both back
/// from an HTTP/1.1 WebSocket server behind quill. The access log says which way it went:
/// Chromium's WebSocket over HTTP/2 is an extended CONNECT (RFC 8441) on the page's
/// connection; over HTTP/1.1 it would be a GET with `Upgrade` on a connection of its own.
#[test]
fn chromium_opens_a_websocket_through_quill_over_h2() {
    if let Err(why) = browser_tools() {
        eprintln!("SKIPPED: the browser test needs node, chromium and playwright-core: {why}");
        return;
    }
    let (server, heads) = websocket_server();
    let dir = TempDir::new("h2ws");
    let q = tls_quill(
        &dir,
        &["-O", "access_log {dir}/access.log"],
        &[format!("127.0.0.1:{server}")],
    );
    let profile = TempDir::new("chromium-profile");
    let out = run_script(
        "websocket.test.mjs",
        &[
            ("PAGE_URL", &format!("https://127.0.0.1:{}/", q.port)),
            ("CERT", dir.path().join("cert.pem").to_str().unwrap()),
            ("CHROMIUM", CHROMIUM),
            ("PROFILE_DIR", profile.path().to_str().unwrap()),
        ],
        Duration::from_secs(120),
    );
    let report: serde_json::Value = out
        .lines()
        .find_map(|l| l.strip_prefix("REPORT "))
        .map(|r| serde_json::from_str(r).expect("the report is JSON"))
        .unwrap_or_else(|| panic!("no report from the browser:\n{out}\n{}", q.stderr()));
    assert_eq!(report["page"], "h2", "{report}");
    assert_eq!(
        report["echoed"],
        serde_json::json!(["first", "second"]),
        "{report}"
    );
    assert_eq!(report["errors"], serde_json::json!([]), "{report}");
    let ws = heads
        .lock()
        .unwrap()
        .iter()
        .find(|h| h.starts_with("GET /ws "))
        .cloned()
        .expect("the server got no WebSocket handshake");
    assert!(
        ws.to_ascii_lowercase()
            .contains("\r\nupgrade: websocket\r\n"),
        "{ws}"
    );
    let log = q.dir().join("access.log");
    let line = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .find(|l| l.contains(" /ws "))
            .map(str::to_string)
    };
    wait_until(
        Duration::from_secs(10),
        "the WebSocket's access log line",
        || line().is_some(),
    );
    let line = line().unwrap();
    assert!(
        line.contains(" CONNECT ") && line.contains(" HTTP/2.0 200 "),
        "{line}"
    );
}

// ---------------------------------------------------------------------------
// HTTP/1.x clients relayed by the byte pump, request by request
// ---------------------------------------------------------------------------

/// A server that answers the first request of each connection (keep-alive, the body
/// names the connection) and then closes the connection as the next request arrives,
/// unanswered: what a kept-alive connection looks like when the server's idle timeout
/// crosses a request. Counts the request heads it received.
fn forgetful_server() -> (u16, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let received = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&received);
    std::thread::spawn(move || {
        for (n, conn) in listener.incoming().enumerate() {
            let Ok(mut conn) = conn else { continue };
            let count = Arc::clone(&count);
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let mut heads = 0;
                loop {
                    if got.windows(4).any(|w| w == b"\r\n\r\n") {
                        heads += 1;
                        count.fetch_add(1, SeqCst);
                        if heads == 2 {
                            return; // the second request: closed unanswered
                        }
                        got.clear();
                        let body = format!("conn {n}\n");
                        let answer = format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if conn.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    (port, received)
}

/// A kept-alive server connection that the server closes as a request arrives costs the
/// client nothing when the request can be sent again (no body, idempotent method): it
/// goes once more over a new connection, and the server is not blacklisted. A request
/// with a body is not sent twice: the client gets 502 and its connection closes.
#[test]
fn a_reused_connection_the_server_closed_is_replaced_without_failing_a_request() {
    let (port, received) = forgetful_server();
    let q = Quill::start(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{}/again", q.port);
    let mut args = vec!["--http1.1", "-w", "%{http_code} %{num_connects}\n"];
    args.extend(vec![url.as_str(); 4]);
    let Some(out) = curl(&args) else { return };
    let codes: Vec<&str> = out.lines().filter(|l| !l.starts_with("conn")).collect();
    assert_eq!(codes, ["200 1", "200 0", "200 0", "200 0"], "{out}");
    let conns: BTreeSet<&str> = out.lines().filter(|l| l.starts_with("conn")).collect();
    assert_eq!(
        conns.len(),
        4,
        "each request after the first on a new connection: {out}"
    );
    // The second, third and fourth requests each went first to the connection the
    // request before had used, which the server closed.
    assert_eq!(received.load(SeqCst), 4 + 3, "{out}");

    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let first = read_response(&mut client).expect("an answer");
    assert_eq!(first.status, 200);
    client
        .write_all(b"POST /twice HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody")
        .unwrap();
    let refused = read_response(&mut client).expect("an answer");
    assert_eq!(refused.status, 502, "{}", refused.head);
    let mut rest = Vec::new();
    assert_eq!(
        client.read_to_end(&mut rest).unwrap_or(0),
        0,
        "closed after the 502"
    );
    // Not the server's failure: it still serves.
    assert!(curl(&["--http1.1", &url]).unwrap().starts_with("conn"));
}

/// Requests a client pipelines in one write are taken one at a time, each sent to the
/// server chosen for it (round robin), and answered in order.
#[test]
fn pipelined_requests_go_one_by_one_each_to_its_server() {
    let Some((_a, a)) = named_backend() else {
        return;
    };
    let Some((_b, b)) = named_backend() else {
        return;
    };
    let q = Quill::start(&[
        "-H",
        "-r",
        "{port}",
        &format!("127.0.0.1:{a}"),
        &format!("127.0.0.1:{b}"),
    ]);
    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    let one = "GET /port HTTP/1.1\r\nHost: x\r\n\r\n";
    client.write_all(one.repeat(6).as_bytes()).unwrap();
    let ports: Vec<String> = (0..6)
        .map(|_| {
            let resp = read_response(&mut client).expect("an answer");
            assert_eq!(resp.status, 200, "{}", resp.head);
            String::from_utf8_lossy(&resp.body).trim().to_string()
        })
        .collect();
    for pair in ports.chunks(2) {
        assert_ne!(pair[0], pair[1], "round robin per request: {ports:?}");
    }
    let seen: BTreeSet<String> = ports.iter().cloned().collect();
    assert_eq!(seen, BTreeSet::from([a.to_string(), b.to_string()]));
}

/// A server that says `Connection: close` (NGINX's `keepalive_requests`) gets a new
/// connection for its next request, and no request fails; that `close`, and the server's
/// `Keep-Alive`, are about its own connection: the client keeps its connection. A
/// client's `close` ends the client's. A client that half-closes after its request still
/// gets the answer.
#[test]
fn a_server_that_closes_ends_its_own_connection_not_the_clients() {
    // NGINX closes each connection after its second request (`Connection: close`, as
    // any server at its `keepalive_requests`) and says `Keep-Alive: timeout=50` on the
    // others: both are about the server's connection, not the client's.
    let Some((_nginx, port)) = nginx(
        "",
        " keepalive_requests 2;\n keepalive_timeout 60 50;",
        "  location /who { default_type text/plain; return 200 \"$connection\\n\"; }",
        &[],
    ) else {
        return;
    };
    let q = Quill::start(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let url = format!("http://127.0.0.1:{}/who", q.port);
    let mut args = vec!["--http1.1", "-i", "-w", "connects=%{num_connects}\n"];
    args.extend(vec![url.as_str(); 6]);
    let Some(out) = curl(&args) else { return };
    let connects: u32 = out
        .lines()
        .filter_map(|l| l.strip_prefix("connects="))
        .map(|n| n.parse::<u32>().unwrap())
        .sum();
    assert_eq!(connects, 1, "one client connection for six requests: {out}");
    let lower = out.to_ascii_lowercase();
    assert_eq!(lower.matches("200 ok").count(), 6, "{out}");
    assert!(!lower.contains("keep-alive: "), "{out}");
    assert!(!lower.contains("connection: close"), "{out}");
    // Three server connections carried the six requests.
    let served: BTreeSet<&str> = out
        .lines()
        .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
        .collect();
    assert_eq!(served.len(), 3, "{out}");
    // A client's own `close` ends its connection, told so, and not the server's.
    let closing = curl(&["--http1.1", "-i", "-H", "Connection: close", &url, &url]).unwrap();
    assert_eq!(
        closing
            .to_ascii_lowercase()
            .matches("connection: close")
            .count(),
        2,
        "{closing}"
    );

    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(b"GET /who HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    let resp = read_response(&mut client).expect("the answer");
    assert_eq!(resp.status, 200, "{}", resp.head);
}

/// A server as NGINX behaves to the cases below: a `POST` is read to the end of its body
/// and answered, and closed unanswered when the client's EOF comes first; `GET /444` is
/// closed unanswered (NGINX's `return 444`, a common rule for bad bots); `GET /cut` is
/// answered with a head announcing 1,000,000 bytes, 10,000 of them, and the close of a
/// server that died; `GET /until-close` with a body the close ends (no length), `GET
/// /not-http` with a line that is not HTTP, then the close; `GET /think` is answered after
/// a minute of work, which stops when the connection ends first (as a Go server's request
/// context is cancelled). Counts the connections it closed on an unfinished body or work.
fn unfinished_server() -> (u16, Arc<AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let abandoned = Arc::new(AtomicUsize::new(0));
    let count = Arc::clone(&abandoned);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let count = Arc::clone(&count);
            std::thread::spawn(move || {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let head_end = loop {
                    if let Some(at) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break at + 4;
                    }
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&got[..head_end]).to_ascii_lowercase();
                if head.starts_with("get /until-close") {
                    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\n\r\nthe close ends this body");
                    return;
                }
                if head.starts_with("get /444") {
                    return; // NGINX's `return 444`: closed, no answer
                }
                if head.starts_with("get /not-http") {
                    let _ = conn.write_all(b"SSH-2.0-quill-test\r\n");
                    return;
                }
                if head.starts_with("get /think") {
                    conn.set_read_timeout(Some(Duration::from_secs(60)))
                        .unwrap();
                    if matches!(conn.read(&mut buf), Ok(0) | Err(_)) {
                        count.fetch_add(1, SeqCst);
                        return;
                    }
                }
                if head.starts_with("get /cut") {
                    let mut answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n".to_vec();
                    answer.resize(answer.len() + 10_000, b'x');
                    let _ = conn.write_all(&answer);
                    return; // dies: the connection closes with the answer cut
                }
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                let mut body = got.len() - head_end;
                while body < length {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => {
                            count.fetch_add(1, SeqCst);
                            return;
                        }
                        Ok(n) => body += n,
                    }
                }
                let _ = conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
            });
        }
    });
    (port, abandoned)
}

/// A client that closes its connection halfway through an upload has given the request
/// up; the server that then closes without answering did nothing wrong and stays in
/// (before, any client could blacklist every server that way, one upload each).
#[test]
fn a_client_that_gives_up_an_upload_does_not_blacklist_the_server() {
    let (port, abandoned) = unfinished_server();
    let (q, ctl) =
        support::ctl::start_with_tcp_control(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let mut client = q.connect();
    client
        .write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nfoo=bar")
        .unwrap();
    client.shutdown(std::net::Shutdown::Write).unwrap();
    wait_until(IO_TIMEOUT, "the server saw the upload given up", || {
        abandoned.load(SeqCst) == 1
    });
    drop(client);
    wait_until(IO_TIMEOUT, "quill let the connection go", || {
        support::ctl::status_json(&ctl)["connections"]["open"] == 0
    });
    let server = support::ctl::server_status(&ctl, 0);
    assert_eq!(server["blacklisted"], false, "{server}");
    assert_eq!(server["failures"], 0, "{server}");
    let mut next = q.connect();
    next.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    next.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        .unwrap();
    let resp = read_response(&mut next).expect("the next client's answer");
    assert_eq!(resp.status, 200, "{}", resp.head);
}

/// A client that leaves while its server still works on the answer (curl's `--max-time`,
/// a closed tab) is seen leaving: its end goes on to the server at once, as it would
/// without quill, so that the server can stop working. The server that then closes
/// unanswered is not blamed, nor is its connection kept for another request. The same for
/// a client that resets its connection. (Before, request by request, the client was not
/// read while its answer came: the server worked on, and quill held both connections,
/// until the answer.)
#[test]
fn a_client_that_leaves_before_its_answer_is_seen_leaving_by_the_server() {
    let (port, abandoned) = unfinished_server();
    let (q, ctl) =
        support::ctl::start_with_tcp_control(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let mut client = q.connect();
    client
        .write_all(b"GET /think HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    drop(client);
    wait_until(IO_TIMEOUT, "the server saw its client leave", || {
        abandoned.load(SeqCst) == 1
    });
    let client = q.connect();
    (&client)
        .write_all(b"GET /think HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    socket2::SockRef::from(&client)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(client); // a reset
    wait_until(IO_TIMEOUT, "the server saw its client reset", || {
        abandoned.load(SeqCst) == 2
    });
    wait_until(IO_TIMEOUT, "quill let the connections go", || {
        support::ctl::status_json(&ctl)["connections"]["open"] == 0
    });
    let server = support::ctl::server_status(&ctl, 0);
    assert_eq!(server["blacklisted"], false, "{server}");
    assert_eq!(server["failures"], 0, "{server}");
    assert_eq!(server["pool_idle"], 0, "{server}");
    let mut next = q.connect();
    next.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    next.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let resp = read_response(&mut next).expect("the next client's answer");
    assert_eq!(resp.status, 200, "{}", resp.head);
}

/// A server that dies in the middle of an answer ends the client's connection (the answer
/// cut short, as the client can tell by its length), and is not blacklisted for it (the
/// next connect tells whether it is down; see the next test); quill keeps
/// nothing of the connection (before, request by request, the client was not read while
/// its answer came, and its leaving went unseen: the connection stayed open for good).
#[test]
fn a_server_that_dies_mid_answer_ends_the_clients_connection() {
    let (port, _) = unfinished_server();
    let (q, ctl) =
        support::ctl::start_with_tcp_control(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(b"GET /cut HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    client
        .read_to_end(&mut got)
        .expect("the connection ends after the cut answer");
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&got)
    );
    assert!(got.len() < 1_000_000, "{} bytes", got.len());
    drop(client);
    wait_until(IO_TIMEOUT, "quill let the connection go", || {
        support::ctl::status_json(&ctl)["connections"]["open"] == 0
    });
    let server = support::ctl::server_status(&ctl, 0);
    assert_eq!(server["blacklisted"], false, "{server}");
}

/// A request the server closes unanswered (NGINX's `return 444` for a client it does not
/// want) is that client's 502, not everyone's 503: the server stays in use, for HTTP/1.1
/// and HTTP/2 clients alike (before, one such request blacklisted it for 30 s).
#[test]
fn a_request_the_server_closes_unanswered_takes_it_out_for_no_one() {
    let (port, _) = unfinished_server();
    let backend = format!("127.0.0.1:{port}");
    let (q, ctl) = support::ctl::start_with_tcp_control(&["-H", "-O", "h2c", "{port}", &backend]);
    let ask = |client: &mut std::net::TcpStream, path: &str| {
        write!(client, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        read_response(client).expect("an answer").status
    };
    let mut bot = q.connect();
    bot.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert_eq!(ask(&mut bot, "/444"), 502);
    let mut other = q.connect();
    other.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    other
        .write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        .unwrap();
    assert_eq!(read_response(&mut other).expect("an answer").status, 200);
    let server = support::ctl::server_status(&ctl, 0);
    assert_eq!(server["blacklisted"], false, "{server}");
    let url = |path: &str| format!("http://127.0.0.1:{}{path}", q.port);
    let Some(out) = curl(&[
        "--http2-prior-knowledge",
        "-w",
        "[%{http_code}]",
        &url("/444"),
    ]) else {
        return;
    };
    assert!(out.ends_with("[502]"), "{out}");
    let out = curl(&[
        "--http2-prior-knowledge",
        "-w",
        "[%{http_code}]",
        "-d",
        "abc",
        &url("/upload"),
    ])
    .expect("curl");
    assert!(out.ends_with("[200]"), "{out}");
    let server = support::ctl::server_status(&ctl, 0);
    assert_eq!(server["blacklisted"], false, "{server}");
}

/// An answer that the server's close ends (a body without a length, or no HTTP at all)
/// reaches the client whole, and its connection ends after it: it cannot carry another
/// request. quill keeps nothing of it (before, request by request, the client was not
/// read after such an answer and its leaving went unseen: the connection stayed open).
#[test]
fn an_answer_the_servers_close_ends_ends_the_clients_connection_too() {
    let (port, _) = unfinished_server();
    let (q, ctl) =
        support::ctl::start_with_tcp_control(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    for (path, body) in [
        ("/until-close", "the close ends this body"),
        ("/not-http", "SSH-2.0-quill-test\r\n"),
    ] {
        let mut client = q.connect();
        client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        write!(client, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut got = Vec::new();
        client
            .read_to_end(&mut got)
            .expect("the connection ends after the answer");
        let got = String::from_utf8_lossy(&got);
        assert!(got.ends_with(body), "{path}: {got:?}");
        drop(client);
        wait_until(
            IO_TIMEOUT,
            format_args!("quill let {path}'s connection go"),
            || support::ctl::status_json(&ctl)["connections"]["open"] == 0,
        );
    }
    let server = support::ctl::server_status(&ctl, 0);
    assert_eq!(server["blacklisted"], false, "{server}");
}

/// The fields about the client's connection to quill (`Keep-Alive`, `Proxy-Connection`,
/// what its `Connection` names) do not reach the server, pooled or one-to-one; the others
/// do, and a named field that frames the body still frames it.
#[test]
fn hop_by_hop_fields_of_a_request_stay_behind() {
    let Some((_nginx, port)) = nginx(
        "",
        "",
        "  location /hop { default_type text/plain; return 200 \
         \"$http_keep_alive|$http_proxy_connection|$http_x_drop|$http_x_keep\\n\"; }",
        &[],
    ) else {
        return;
    };
    for pool in ["32", "0"] {
        let q = Quill::start(&[
            "-H",
            "-O",
            &format!("upstream_keepalive {pool}"),
            "{port}",
            &format!("127.0.0.1:{port}"),
        ]);
        let url = format!("http://127.0.0.1:{}/hop", q.port);
        let Some(out) = curl(&[
            "--http1.1",
            "-s",
            "-H",
            "Connection: keep-alive, X-Drop, Content-Length",
            "-H",
            "Keep-Alive: timeout=5",
            "-H",
            "Proxy-Connection: keep-alive",
            "-H",
            "X-Drop: 1",
            "-H",
            "X-Keep: 2",
            "--data-binary",
            "body",
            &url,
            &url,
        ]) else {
            return;
        };
        // The second request on the same connection is answered too: the server found the
        // first one's end.
        assert_eq!(out, "|||2\n|||2\n", "upstream_keepalive {pool}");
    }
}

/// An HTTP/1.1 `Upgrade` relayed by the byte pump after a plain request: its head gets the
/// forwarding fields, the `101` passes, and the connection is a tunnel both ways from then
/// on (bytes that look like HTTP included).
#[test]
fn an_http11_upgrade_after_a_plain_request_becomes_a_tunnel() {
    let (port, heads) = websocket_server();
    let q = Quill::start(&["-H", "{port}", &format!("127.0.0.1:{port}")]);
    let mut client = q.connect();
    client.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    client
        .write_all(b"GET /plain HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let plain = read_response(&mut client).expect("an answer");
    assert_eq!((plain.status, plain.body.as_slice()), (200, &b"ok"[..]));
    client
        .write_all(
            b"GET /raw HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
              Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        )
        .unwrap();
    let switched = read_response(&mut client).expect("the 101");
    assert_eq!(switched.status, 101, "{}", switched.head);
    for message in [&b"not HTTP at all\r\n\r\n"[..], b"GET / HTTP/1.1\r\n\r\n"] {
        client.write_all(message).unwrap();
        let mut back = vec![0u8; message.len()];
        client.read_exact(&mut back).unwrap();
        assert_eq!(back, message, "the tunnel passes bytes untouched");
    }
    let heads = heads.lock().unwrap();
    assert_eq!(heads.len(), 2, "{heads:?}");
    assert!(
        heads[1].contains("X-Forwarded-For: 127.0.0.1"),
        "{}",
        heads[1]
    );
}

/// A server that refuses connections is blacklisted and each HTTP/1.1 request of a
/// keep-alive client fails over to the next one (round robin, Pen's rule per request):
/// none is lost, and the emergency server takes them when no server is left.
#[test]
fn http11_requests_fail_over_one_by_one_and_reach_the_emergency_server() {
    let Some((_live, live)) = named_backend() else {
        return;
    };
    let Some((_spare, spare)) = named_backend() else {
        return;
    };
    let dead = free_port();
    let q = Quill::start(&[
        "-H",
        "-r",
        "{port}",
        &format!("127.0.0.1:{dead}"),
        &format!("127.0.0.1:{live}"),
    ]);
    let url = format!("http://127.0.0.1:{}/port", q.port);
    let mut args = vec!["--http1.1", "-w", "HTTP %{http_code} %{num_connects}\n"];
    args.extend(vec![url.as_str(); 6]);
    let Some(out) = curl(&args) else { return };
    let answers: Vec<&str> = out.lines().filter(|l| l.starts_with("HTTP")).collect();
    assert_eq!(answers.len(), 6, "{out}");
    assert!(answers.iter().all(|a| a.starts_with("HTTP 200")), "{out}");
    assert_eq!(
        out.lines().filter(|l| *l == live.to_string()).count(),
        6,
        "{out}"
    );

    let q = Quill::start(&[
        "-H",
        "-e",
        &format!("127.0.0.1:{spare}"),
        "{port}",
        &format!("127.0.0.1:{dead}"),
    ]);
    let url = format!("http://127.0.0.1:{}/port", q.port);
    let out = curl(&["--http1.1", &url, &url]).unwrap();
    assert_eq!(out, format!("{spare}\n{spare}\n"));
}

/// A client the client ACL denies gets the abuse server for every request, over HTTP/1.1
/// (the byte pump, request by request) and over HTTP/2 (hyper's gateway); the table's
/// server never sees one.
#[test]
fn denied_clients_requests_go_to_the_abuse_server_over_http11_and_http2() {
    let Some((_server, server)) = named_backend() else {
        return;
    };
    let Some((_abuse, abuse)) = named_backend() else {
        return;
    };
    let q = Quill::start(&[
        "-H",
        "-B",
        &format!("127.0.0.1:{abuse}"),
        "-O",
        "acl 1 deny 127.0.0.1",
        "-O",
        "client_acl 1",
        "-O",
        "h2c",
        "{port}",
        &format!("127.0.0.1:{server}"),
    ]);
    let url = format!("http://127.0.0.1:{}/port", q.port);
    let Some(out) = curl(&["--http1.1", &url, &url]) else {
        return;
    };
    assert_eq!(out, format!("{abuse}\n{abuse}\n"), "HTTP/1.1");
    // One URL per curl: curl 7.88 fails a second request over a prior-knowledge
    // connection ("Error in the HTTP2 framing layer"), against NGINX as well.
    for _ in 0..2 {
        let out = curl(&["--http2-prior-knowledge", &url]).unwrap();
        assert_eq!(out, format!("{abuse}\n"), "HTTP/2");
    }
}

/// `queue_timeout` under real clients: h2load's 200 concurrent HTTP/2 streams and 50
/// HTTP/1.1 clients to a server at `max 4` all wait their turn and are answered; without
/// it, Pen's way, the same load gets refusals (503), so the load does reach the limit.
#[test]
fn requests_beyond_a_servers_max_wait_their_turn_with_queue_timeout() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if skip_on_pen("queue_timeout is a quill extension") {
        return;
    }
    let Some((_nginx, port)) = backend() else {
        return;
    };
    let server = format!("127.0.0.1:{port}:4");
    let status_codes = |q: &Quill, h1: bool| {
        let url = format!("http://127.0.0.1:{}/1k", q.port);
        let mut args = vec!["-c10", "-m20", "-n10000", &url];
        if h1 {
            args = vec!["--h1", "-c50", "-n10000", &url];
        }
        let out = tool("h2load", &args)?;
        out.lines()
            .find(|l| l.starts_with("status codes:"))
            .map(str::to_owned)
    };
    let (q, ctl) = support::ctl::start_with_tcp_control(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "queue_timeout 5",
        "{port}",
        &server,
    ]);
    for h1 in [false, true] {
        let Some(codes) = status_codes(&q, h1) else {
            return;
        };
        assert_eq!(
            codes, "status codes: 10000 2xx, 0 3xx, 0 4xx, 0 5xx",
            "h1: {h1}"
        );
        // Every place taken, handed over or given back is free again.
        wait_until(Duration::from_secs(5), "the server's places free", || {
            let status = support::ctl::status_json(&ctl);
            status["servers"][0]["connections"] == 0 && status["connections"]["queued"] == 0
        });
    }
    drop(q);
    let q = Quill::start(&["-H", "-O", "h2c", "{port}", &server]);
    let codes = status_codes(&q, false).expect("h2load ran before");
    assert!(
        !codes.ends_with(" 0 5xx"),
        "no refusal without queue_timeout: {codes}"
    );
}
