//! gRPC through the `http` mode, with Google's gRPC library (Debian's `python3-grpcio`) on
//! both sides: the client speaks HTTP/2 to quill (h2c with prior knowledge, or TLS with
//! ALPN `h2`), quill speaks HTTP/2 to the server (`upstream_h2`: h2c, or TLS to a TLS
//! server). gRPC is what most HTTP/2 traffic behind a balancer is, and it leans on what
//! plain web traffic seldom does: trailers carry the status of every call (a failed call
//! is a "trailers-only" answer, one HEADERS frame), streams stay open for many messages in
//! both directions, messages of megabytes cross the flow-control windows, and a deadline
//! or a cancel must reach the server as a stream reset.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::process::Command;
use std::time::Duration;

use support::ctl::{ctl_ok, start_with_tcp_control, status_json, wait_health};
use support::daemon::Daemon;
use support::pki::certificates;
use support::*;

const PYTHON: &str = "/usr/bin/python3";

/// The server: one service with a method of each kind, payloads as raw bytes (no
/// generated code). `Slow` waits until its call is cancelled and says so on stdout;
/// `Vanish` answers one message and then ends the server's process. Its
/// health service (`grpc.health.v1.Health/Check`, as grpcio's own servicer answers it)
/// says what the file `health` beside the script says, SERVING when there is none, and
/// NOT_FOUND for a service other than the whole server ("") and `quill.test.Echo`.
const SERVER: &str = r#"
import os, sys, time
from concurrent import futures
import grpc

HEALTH = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "health")
STATUS = {"SERVING": b"\x08\x01", "NOT_SERVING": b"\x08\x02"}

def check(req, ctx):
    # HealthCheckRequest: empty, or field 1 (0x0a), a one-byte length, the name.
    service = req[2:].decode() if req else ""
    if service == "quill.test.Big":
        # SERVING, then field 2 (0x12, length-delimited) of 20,000 bytes (varint a0 9c 01).
        return b"\x08\x01\x12\xa0\x9c\x01" + b"x" * 20000
    if service not in ("", "quill.test.Echo"):
        ctx.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
    try:
        state = open(HEALTH).read().strip()
    except FileNotFoundError:
        state = "SERVING"
    print("health check", repr(service), state, flush=True)
    return STATUS[state]

def echo(req, ctx):
    md = dict(ctx.invocation_metadata())
    ctx.send_initial_metadata((("x-seen", md.get("x-trace", "none")),))
    ctx.set_trailing_metadata((("x-done", "yes"),))
    return req

def fail(req, ctx):
    ctx.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

def count(req, ctx):
    for i in range(int(req)):
        yield (b"%06d" % i) + b"x" * 1018

def total(messages, ctx):
    return str(sum(len(m) for m in messages)).encode()

def chat(messages, ctx):
    for m in messages:
        yield m

def vanish(req, ctx):
    yield b"first"
    time.sleep(0.2)
    print("vanishing", flush=True)
    os._exit(1)

def slow(req, ctx):
    while ctx.is_active():
        time.sleep(0.01)
    print("cancelled", flush=True)
    return b""

handler = grpc.method_handlers_generic_handler("quill.test.Echo", {
    "Echo": grpc.unary_unary_rpc_method_handler(echo),
    "Fail": grpc.unary_unary_rpc_method_handler(fail),
    "Count": grpc.unary_stream_rpc_method_handler(count),
    "Total": grpc.stream_unary_rpc_method_handler(total),
    "Chat": grpc.stream_stream_rpc_method_handler(chat),
    "Slow": grpc.unary_unary_rpc_method_handler(slow),
    "Vanish": grpc.unary_stream_rpc_method_handler(vanish),
})
server = grpc.server(futures.ThreadPoolExecutor(max_workers=32),
                     options=[("grpc.max_receive_message_length", 64 << 20)])
health = grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
    "Check": grpc.unary_unary_rpc_method_handler(check),
})
server.add_generic_rpc_handlers((handler, health))
addr = "127.0.0.1:" + sys.argv[1]
if len(sys.argv) > 2:
    cert, key = open(sys.argv[2], "rb").read(), open(sys.argv[3], "rb").read()
    server.add_secure_port(addr, grpc.ssl_server_credentials(((key, cert),)))
else:
    server.add_insecure_port(addr)
server.start()
server.wait_for_termination()
"#;

/// The client: every kind of call once, then many at once on one channel; prints one
/// line per check.
const CLIENT: &str = r#"
import sys, time, queue
from concurrent import futures
import grpc

options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.enable_retries", 0)]
if len(sys.argv) > 2:
    ca = open(sys.argv[2], "rb").read()
    options.append(("grpc.ssl_target_name_override", "localhost"))
    channel = grpc.secure_channel(sys.argv[1], grpc.ssl_channel_credentials(root_certificates=ca), options=options)
else:
    channel = grpc.insecure_channel(sys.argv[1], options=options)
method = lambda name: "/quill.test.Echo/" + name

echo = channel.unary_unary(method("Echo"))
answer, call = echo.with_call(b"hello", metadata=(("x-trace", "abc"),), timeout=10)
print("unary", answer.decode(), dict(call.initial_metadata()).get("x-seen"),
      dict(call.trailing_metadata()).get("x-done"), call.code().name)

big = bytes(range(256)) * (16 << 10)
print("unary 4 MiB", echo(big, timeout=20) == big)

try:
    channel.unary_unary(method("Fail"))(b"", timeout=10)
    print("fail none")
except grpc.RpcError as e:
    print("fail", e.code().name, e.details())

print("server stream", sum(1 for _ in channel.unary_stream(method("Count"))(b"1000", timeout=20)))
print("client stream", channel.stream_unary(method("Total"))(iter([b"z" * 65536] * 128), timeout=20).decode())

# Each message must come back before the next is sent: nothing may wait in quill for more.
outgoing = queue.Queue()
def messages():
    while (m := outgoing.get()) is not None:
        yield m
answers = channel.stream_stream(method("Chat"))(messages(), timeout=20)
matched = 0
for i in range(50):
    outgoing.put(b"ping %d" % i)
    matched += next(answers) == b"ping %d" % i
outgoing.put(None)
print("ping-pong", matched)

started = time.monotonic()
try:
    channel.unary_unary(method("Slow"))(b"", timeout=0.5)
    print("deadline none")
except grpc.RpcError as e:
    print("deadline", e.code().name, time.monotonic() - started < 5)

# More calls at once than quill's streams per client connection (100).
count = channel.unary_stream(method("Count"))
def calls(i):
    good = sum(echo(b"%d-%d" % (i, j), timeout=20) == b"%d-%d" % (i, j) for j in range(20))
    return good + (sum(1 for _ in count(b"50", timeout=20)) == 50)
with futures.ThreadPoolExecutor(150) as pool:
    print("concurrent", sum(pool.map(calls, range(150))))
"#;

const EXPECTED: &[&str] = &[
    "unary hello abc yes OK",
    "unary 4 MiB True",
    "fail NOT_FOUND no such thing",
    "server stream 1000",
    "client stream 8388608",
    "ping-pong 50",
    "deadline DEADLINE_EXCEEDED True",
    "concurrent 3150",
];

/// Whether Python's gRPC library is there; says why the test is skipped when not.
fn has_grpc() -> bool {
    let ok = Command::new(PYTHON)
        .args(["-c", "import grpc"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !ok {
        eprintln!("SKIPPED: python3-grpcio is not installed (.ci/run installs it)");
    }
    ok
}

/// Starts the gRPC server on a free port, over TLS with `tls` = (certificate, key).
fn grpc_server(tls: Option<(&str, &str)>) -> (Daemon, u16) {
    let dir = TempDir::new("grpc-server");
    let script = dir.path().join("server.py");
    std::fs::write(&script, SERVER).unwrap();
    let port = free_port();
    let mut args = vec![script.to_str().unwrap().to_string(), port.to_string()];
    if let Some((cert, key)) = tls {
        args.extend([cert.to_string(), key.to_string()]);
    }
    let daemon = Daemon::start(PYTHON, &args, port, dir).expect("python3 is installed");
    (daemon, port)
}

/// Runs the client against `target` (with `ca`: over TLS, the server's name `localhost`)
/// and checks each of its lines.
fn run_client(target: &str, ca: Option<&str>) {
    let dir = TempDir::new("grpc-client");
    let script = dir.path().join("client.py");
    std::fs::write(&script, CLIENT).unwrap();
    let mut args = vec![script.to_str().unwrap(), target];
    args.extend(ca);
    let out = tool(PYTHON, &args).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines, EXPECTED, "the client said:\n{out}");
}

/// The server's stdout saw a cancelled call within a few seconds.
fn expect_cancelled_at(server: &Daemon) {
    let log = server.dir().join("daemon.log");
    wait_until(
        Duration::from_secs(5),
        "the server sees the call cancelled",
        || std::fs::read_to_string(&log).is_ok_and(|s| s.contains("cancelled")),
    );
}

/// quill taking h2c from clients and speaking it to the server on `port`.
fn quill_h2c(port: u16) -> Quill {
    Quill::start(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "upstream_h2",
        "{port}",
        &format!("127.0.0.1:{port}"),
    ])
}

#[test]
fn grpc_calls_of_every_kind_pass_through_h2c_on_both_sides() {
    if !has_grpc() {
        return;
    }
    let (server, port) = grpc_server(None);
    let q = quill_h2c(port);
    run_client(&q.addr().to_string(), None);
    expect_cancelled_at(&server);
}

/// Seed 004's shape: TLS from the client (ALPN `h2`), TLS to the server.
#[test]
fn grpc_calls_of_every_kind_pass_through_tls_on_both_sides() {
    if !has_grpc() {
        return;
    }
    let tls = TlsServer::start();
    let (cert, key) = (&tls.cert, &tls.key);
    let mut args = vec![
        "-H".to_string(),
        "-O".to_string(),
        format!("ssl_cert {cert}"),
        "-O".to_string(),
        format!("ssl_key {key}"),
    ];
    args.extend(tls.quill_args());
    let q = Quill::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    run_client(&q.addr().to_string(), Some(&tls.ca));
    expect_cancelled_at(&tls.server);
}

/// Without `http`: a raw TLS relay told to offer `h2` (`alpn h2`, as HAProxy's `mode tcp`
/// with `alpn h2`) terminates TLS for a gRPC server that speaks h2c, and over
/// `upstream_tls` asks a TLS server for `h2` in its turn (gRPC servers insist on it).
#[test]
fn grpc_calls_pass_a_raw_tls_relay_that_offers_h2() {
    if !has_grpc() {
        return;
    }
    let tls = TlsServer::start();
    let (cert, key) = (&tls.cert, &tls.key);
    let terminating = |server: &[&str]| {
        let args = [&["-E", cert, "-K", key, "-O", "alpn h2"], server].concat();
        Quill::start(&args)
    };
    let (plain, port) = grpc_server(None);
    let q = terminating(&["{port}", &format!("127.0.0.1:{port}")]);
    run_client(&q.addr().to_string(), Some(&tls.ca));
    expect_cancelled_at(&plain);
    let ca = format!("upstream_ca {}", tls.ca);
    let server = format!("127.0.0.1:{}", tls.port);
    let q = terminating(&[
        "-O",
        "upstream_tls",
        "-O",
        &ca,
        "-O",
        "upstream_sni localhost",
        "{port}",
        &server,
    ]);
    run_client(&q.addr().to_string(), Some(&tls.ca));
    expect_cancelled_at(&tls.server);
}

/// The gRPC server over TLS, its certificate (for `localhost`) from the test CA.
struct TlsServer {
    server: Daemon,
    port: u16,
    ca: String,
    cert: String,
    key: String,
    _pki: TempDir,
}

impl TlsServer {
    fn start() -> TlsServer {
        let pki = TempDir::new("grpc-pki");
        let text = |p: std::path::PathBuf| p.to_str().unwrap().to_string();
        let (ca, cert, key) = certificates(pki.path());
        let (ca, cert, key) = (text(ca), text(cert), text(key));
        let (server, port) = grpc_server(Some((&cert, &key)));
        TlsServer {
            server,
            port,
            ca,
            cert,
            key,
            _pki: pki,
        }
    }

    /// quill's options to speak HTTP/2 over TLS to it, then `{port}` and its address.
    fn quill_args(&self) -> Vec<String> {
        [
            "-O",
            "upstream_tls",
            "-O",
            &format!("upstream_ca {}", self.ca),
            "-O",
            "upstream_sni localhost",
            "-O",
            "upstream_h2",
            "{port}",
            &format!("127.0.0.1:{}", self.port),
        ]
        .map(String::from)
        .to_vec()
    }
}

/// One unary call; prints the code and the details it ends with.
const ONE_CALL: &str = r#"
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
try:
    channel.unary_unary("/quill.test.Echo/Echo")(b"x", timeout=10)
    print("OK")
except grpc.RpcError as e:
    print(e.code().name, e.details())
"#;

fn one_call(target: &str) -> String {
    tool(PYTHON, &["-c", ONE_CALL, target]).unwrap()
}

/// When quill answers a call itself, the client reads a gRPC status with quill's words,
/// as from a gRPC server (a trailers-only answer), not a bare HTTP status it can only call
/// "unexpected".
#[test]
fn a_call_quill_answers_itself_gets_a_grpc_status() {
    if !has_grpc() {
        return;
    }
    // Nothing listens on the server's port.
    let q = quill_h2c(free_port());
    let out = one_call(&q.addr().to_string());
    assert_eq!(out.trim(), "UNAVAILABLE Service Unavailable", "{out}");
}

/// A server that vanishes in the middle of its answer (its process gone, the connection
/// with it): the call ends with UNAVAILABLE, as when a client loses its own connection to
/// a server, so that the client may retry it — not with the INTERNAL a client reads from
/// a reset stream, which it must not retry. The messages before the loss are delivered.
#[test]
fn a_server_lost_in_the_middle_of_an_answer_ends_the_call_unavailable() {
    if !has_grpc() {
        return;
    }
    let (server, port) = grpc_server(None);
    let q = quill_h2c(port);
    let out = tool(PYTHON, &["-c", VANISHING_CALL, &q.addr().to_string()]).unwrap();
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "message first",
            "UNAVAILABLE the server's answer broke off: its connection was lost"
        ],
        "{out}"
    );
    let log = std::fs::read_to_string(server.dir().join("daemon.log")).unwrap();
    assert!(log.contains("vanishing"), "{log}");
}

/// A server-streaming call to `Vanish`: prints each message, then the code and details.
const VANISHING_CALL: &str = r#"
import sys, grpc
channel = grpc.insecure_channel(sys.argv[1])
try:
    for m in channel.unary_stream("/quill.test.Echo/Vanish")(b"", timeout=10):
        print("message", m.decode(), flush=True)
    print("OK")
except grpc.RpcError as e:
    print(e.code().name, e.details())
"#;

/// `check grpc` calls the server's gRPC health service over HTTP/2 (h2c here): the server
/// is up while it answers SERVING, down when it answers NOT_SERVING (and calls then get
/// quill's own UNAVAILABLE), up again after; a service the server does not know fails
/// the check of that service, and so does an answer too large to be a health answer.
#[test]
fn check_grpc_follows_the_servers_health_service() {
    if !has_grpc() {
        return;
    }
    let (server, port) = grpc_server(None);
    let target = format!("127.0.0.1:{port}");
    let (q, ctl) = start_with_tcp_control(&[
        "-H",
        "-O",
        "h2c",
        "-O",
        "upstream_h2",
        "-O",
        "check grpc",
        "-O",
        "check_interval 50ms",
        "-O",
        "check_fall 2",
        "-O",
        "check_rise 1",
        "{port}",
        &target,
    ]);
    let up = wait_health(&ctl, 0, "up");
    assert_eq!(up["health_check"], "grpc", "{up}");
    let log = server.dir().join("daemon.log");
    assert!(
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("health check '' SERVING"),
        "the server's own log shows the calls"
    );
    assert_eq!(one_call(&q.addr().to_string()).trim(), "OK");

    std::fs::write(server.dir().join("health"), "NOT_SERVING").unwrap();
    wait_health(&ctl, 0, "down");
    wait_until(Duration::from_secs(5), "quill says why", || {
        q.stderr().contains("last: serving status NOT_SERVING")
    });
    let out = one_call(&q.addr().to_string());
    assert!(out.starts_with("UNAVAILABLE"), "{out}");

    std::fs::remove_file(server.dir().join("health")).unwrap();
    wait_health(&ctl, 0, "up");

    // A service of the server, by name: `write` keeps it.
    ctl_ok(&ctl, "server 0 check grpc quill.test.Echo");
    wait_until(Duration::from_secs(5), "the service is asked about", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("'quill.test.Echo' SERVING"))
    });
    assert_eq!(
        status_json(&ctl)["servers"][0]["health_check"],
        "grpc quill.test.Echo"
    );
    ctl_ok(&ctl, "server 0 check grpc no.such.Service");
    wait_health(&ctl, 0, "down");
    wait_until(Duration::from_secs(5), "quill says why", || {
        q.stderr().contains("last: gRPC status 5: unknown service")
    });
    // An answer larger than any health answer needs is not read to its end.
    ctl_ok(&ctl, "server 0 check grpc quill.test.Echo");
    wait_health(&ctl, 0, "up");
    ctl_ok(&ctl, "server 0 check grpc quill.test.Big");
    wait_health(&ctl, 0, "down");
    wait_until(Duration::from_secs(5), "quill says why", || {
        q.stderr()
            .contains("last: gRPC answer: an answer over 16384 bytes")
    });
}

/// Over TLS the check offers ALPN `h2` and verifies the server as clients' traffic does
/// (`upstream_tls`, `upstream_ca`, `upstream_sni`).
#[test]
fn check_grpc_speaks_tls_to_a_tls_server() {
    if !has_grpc() {
        return;
    }
    let tls = TlsServer::start();
    let mut args = [
        "-H",
        "-O",
        "check grpc quill.test.Echo",
        "-O",
        "check_interval 50ms",
    ]
    .map(String::from)
    .to_vec();
    args.extend(tls.quill_args());
    let (_q, ctl) = start_with_tcp_control(&args.iter().map(String::as_str).collect::<Vec<_>>());
    wait_health(&ctl, 0, "up");
    let log = tls.server.dir().join("daemon.log");
    assert!(std::fs::read_to_string(log)
        .unwrap()
        .contains("health check 'quill.test.Echo' SERVING"));
}
