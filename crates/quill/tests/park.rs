//! `idle_park`: a raw connection silent for that many seconds leaves its task and waits,
//! parked, until a byte, an EOF or a close arrives. Parking must be invisible to both ends:
//! bytes flow again in either direction, half-closes pass, `idle_timeout` and `close N`
//! still end the connection, and the byte counters and `status` stay true.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

use support::ctl::*;
use support::http_echo::{read_response, EchoServer, Response};
use support::*;

const PATIENCE: Duration = Duration::from_secs(15);

/// A backend that hands each accepted connection to the test, so the test can speak for
/// the server side too.
struct Backend(TcpListener);

impl Backend {
    fn start() -> Backend {
        Backend(TcpListener::bind("127.0.0.1:0").unwrap())
    }

    fn spec(&self) -> String {
        self.0.local_addr().unwrap().to_string()
    }

    fn accept(&self) -> TcpStream {
        let (s, _) = self.0.accept().unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        s
    }
}

/// A backend, and quill in front of it parking connections after 1 s, with `extra`
/// arguments and a control socket.
fn start_parking(extra: &[&str]) -> (Backend, Quill, String) {
    let backend = Backend::start();
    let spec = backend.spec();
    let mut args = vec!["-O", "idle_park 1"];
    args.extend_from_slice(extra);
    args.extend(["127.0.0.1:{port}", spec.as_str()]);
    let (q, ctl) = start_with_tcp_control(&args);
    (backend, q, ctl)
}

/// Opens a connection through quill and returns (client side, server side).
fn pair(q: &Quill, backend: &Backend) -> (TcpStream, TcpStream) {
    let client = q.connect();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    (client, backend.accept())
}

fn send_and_expect(from: &mut TcpStream, to: &mut TcpStream, msg: &[u8]) {
    from.write_all(msg).unwrap();
    let mut got = vec![0u8; msg.len()];
    to.read_exact(&mut got).unwrap();
    assert_eq!(got, msg);
}

fn connections(ctl: &str) -> serde_json::Value {
    status_json(ctl)["connections"].clone()
}

fn wait_parked(ctl: &str, n: u64) {
    wait_until(PATIENCE, format!("{n} connection(s) parked"), || {
        connections(ctl)["parked"] == n
    });
}

/// A connection that wakes right after parking (a client that thinks a little longer than
/// `idle_park`) waits twice as long before it parks again: parking and waking cost more
/// CPU than the memory saved for so short a sleep is worth.
#[test]
fn a_connection_that_wakes_soon_after_parking_waits_longer_to_park_again() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (backend, q, ctl) = start_parking(&[]);
    let (mut client, mut server) = pair(&q, &backend);
    send_and_expect(&mut client, &mut server, b"hello");
    wait_parked(&ctl, 1);
    send_and_expect(&mut client, &mut server, b"awake at once");
    let woke = std::time::Instant::now();
    wait_until(PATIENCE, "the connection woke", || {
        connections(&ctl)["parked"] == 0
    });
    wait_parked(&ctl, 1);
    let silent = woke.elapsed();
    // Silence is counted in whole periods of the park delay, from the period the wake-up's
    // bytes were in: 2 s after waking with 1 s, 4 s with twice that.
    assert!(
        silent >= Duration::from_secs(3),
        "parked again after {silent:?} of silence, as if it had not woken at once"
    );
    send_and_expect(&mut server, &mut client, b"and still relayed");
}

#[test]
fn parked_connections_wake_for_bytes_from_either_side() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (backend, q, ctl) = start_parking(&[]);
    let mut pairs: Vec<_> = (0..20).map(|_| pair(&q, &backend)).collect();
    for (client, server) in &mut pairs {
        send_and_expect(client, server, b"hello");
        send_and_expect(server, client, b"hi there");
    }
    wait_parked(&ctl, 20);
    assert_eq!(connections(&ctl)["open"], 20);

    // The server speaks first after the silence: its socket wakes the connection.
    let (client, server) = &mut pairs[0];
    send_and_expect(server, client, b"news from the server");
    send_and_expect(client, server, b"and a reply");
    // The client speaks first on another.
    let (client, server) = &mut pairs[1];
    send_and_expect(client, server, b"client again");
    send_and_expect(server, client, b"server again");
    // A large transfer after waking goes through whole and in order.
    let (client, server) = &mut pairs[2];
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    let writer = {
        let mut server = server.try_clone().unwrap();
        let big = big.clone();
        std::thread::spawn(move || server.write_all(&big).unwrap())
    };
    let mut got = vec![0u8; big.len()];
    client.read_exact(&mut got).unwrap();
    writer.join().unwrap();
    assert!(got == big, "3 MB after waking arrived altered");

    // The woken ones park again; the others never left.
    wait_parked(&ctl, 20);
    for (client, server) in &mut pairs {
        send_and_expect(client, server, b"everyone");
        send_and_expect(server, client, b"still here");
    }
}

#[test]
fn half_close_and_close_reach_the_other_side_of_a_parked_connection() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (backend, q, ctl) = start_parking(&[]);
    let (mut client, mut server) = pair(&q, &backend);
    send_and_expect(&mut client, &mut server, b"request");
    wait_parked(&ctl, 1);

    // The client half-closes while parked: the server sees EOF, and can still answer.
    client.shutdown(Shutdown::Write).unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(server.read(&mut buf).unwrap(), 0, "EOF passed on");
    send_and_expect(&mut server, &mut client, b"last words");
    drop(server);
    let (rest, _) = expect_closed(&mut client, PATIENCE);
    assert!(rest.is_empty(), "{rest:?}");
    wait_until(PATIENCE, "the connection gone", || {
        connections(&ctl)["open"] == 0
    });

    // A client that closes a parked connection: the server sees it, and once it closes
    // too, the connection is gone.
    let (mut client, mut server) = pair(&q, &backend);
    send_and_expect(&mut client, &mut server, b"x");
    wait_parked(&ctl, 1);
    drop(client);
    let (rest, _) = expect_closed(&mut server, PATIENCE);
    assert!(rest.is_empty(), "{rest:?}");
    drop(server);
    wait_until(PATIENCE, "nothing open or parked", || {
        let c = connections(&ctl);
        c["open"] == 0 && c["parked"] == 0
    });
}

#[test]
fn idle_timeout_ends_a_parked_connection_and_its_bytes_are_counted() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (backend, q, ctl) = start_parking(&["-O", "idle_timeout 3"]);
    let (mut client, mut server) = pair(&q, &backend);
    send_and_expect(&mut client, &mut server, b"0123456789");
    send_and_expect(&mut server, &mut client, b"abcde");
    wait_parked(&ctl, 1);
    expect_closed(&mut client, PATIENCE);
    expect_closed(&mut server, PATIENCE);
    let status = status_json(&ctl);
    assert_eq!(status["connections"]["open"], 0);
    assert_eq!(status["connections"]["parked"], 0);
    let s0 = &status["servers"][0];
    assert_eq!(s0["bytes_to_server"], 10, "{s0}");
    assert_eq!(s0["bytes_from_server"], 5, "{s0}");
}

#[test]
fn close_n_closes_a_parked_connection() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (backend, q, ctl) = start_parking(&[]);
    let (mut one, mut one_server) = pair(&q, &backend);
    let (mut two, mut two_server) = pair(&q, &backend);
    send_and_expect(&mut one, &mut one_server, b"1");
    send_and_expect(&mut two, &mut two_server, b"2");
    wait_parked(&ctl, 2);
    let reply = ctl_ok(&ctl, "connection 1");
    assert!(reply.starts_with("connection 1 client "), "{reply:?}");

    assert_eq!(ctl_ok(&ctl, "close 1"), "");
    expect_closed(&mut one, PATIENCE);
    expect_closed(&mut one_server, PATIENCE);
    assert_one_line_error(&ctl_err(&ctl, "connection 1"), "connection of a closed one");
    // The other parked connection is untouched, and wakes as usual.
    send_and_expect(&mut two, &mut two_server, b"still here");
    send_and_expect(&mut two_server, &mut two, b"yes");
    assert_eq!(connections(&ctl)["open"], 1);
}

#[test]
fn idle_park_is_a_setting_like_any_other() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let backend = Backend::start();
    let (_q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &backend.spec()]);
    let dir = TempDir::new("park-setting");
    assert!(
        written_config(&ctl, dir.path(), "default").contains("\nidle_park 1\n"),
        "parking after 1 s is the default"
    );
    assert_eq!(ctl_ok(&ctl, "idle_park 0"), "");
    assert!(written_config(&ctl, dir.path(), "off").contains("\nidle_park 0\n"));
    assert_one_line_error(&ctl_err(&ctl, "idle_park soon"), "a non-number");
}

// ---------------------------------------------------------------------------
// HTTP/1.x clients served request by request (`-H` with `upstream_keepalive`)
// ---------------------------------------------------------------------------

/// quill in `http` mode (request by request, the default pool) in front of the echo
/// server, parking idle clients after 1 s, with `extra` arguments and a control socket.
fn start_http_parking(extra: &[&str]) -> (EchoServer, Quill, String) {
    let backend = EchoServer::start();
    let spec = backend.spec();
    let mut args = vec!["-H", "-O", "idle_park 1"];
    args.extend_from_slice(extra);
    args.extend(["127.0.0.1:{port}", spec.as_str()]);
    let (q, ctl) = start_with_tcp_control(&args);
    (backend, q, ctl)
}

fn get(client: &mut TcpStream, path: &str) -> Response {
    client
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .unwrap();
    let resp = read_response(client).unwrap_or_else(|| panic!("no answer to {path}"));
    assert_eq!(resp.status, 200, "{}", resp.head);
    assert_eq!(resp.seen().request_line(), format!("GET {path} HTTP/1.1"));
    resp
}

/// Between two requests an idle keep-alive client is taken off hyper (its buffers freed)
/// and waits on its socket alone; its next request, whole or in pieces, is served on the
/// same connection as if nothing happened.
#[test]
fn keep_alive_http_clients_park_between_requests_and_are_served_on() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (_backend, q, ctl) = start_http_parking(&[]);
    let mut client = q.connect();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    for path in ["/one", "/two", "/three"] {
        get(&mut client, path);
        wait_parked(&ctl, 1);
    }
    // The first piece of a head wakes the connection; a partial head is never parked
    // (hyper holds its bytes), so the rest completes it however long it takes.
    client.write_all(b"GET /in-pieces HT").unwrap();
    wait_until(PATIENCE, "the connection woke", || {
        connections(&ctl)["parked"] == 0
    });
    std::thread::sleep(Duration::from_millis(2500)); // a slow client, longer than idle_park
    assert_eq!(connections(&ctl)["parked"], 0, "parked with half a head");
    client.write_all(b"TP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let resp = read_response(&mut client).expect("an answer to the head sent in pieces");
    assert_eq!(resp.seen().request_line(), "GET /in-pieces HTTP/1.1");
    // Two requests in one write after parking: both answered, in order.
    wait_parked(&ctl, 1);
    client
        .write_all(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    for path in ["/a", "/b"] {
        let resp = read_response(&mut client).unwrap_or_else(|| panic!("no answer to {path}"));
        assert_eq!(resp.seen().request_line(), format!("GET {path} HTTP/1.1"));
    }
    let status = status_json(&ctl);
    assert_eq!(status["connections"]["open"], 1);
    assert_eq!(status["connections"]["accepted"], 1);
}

/// A client nobody here wrote: curl fetching two URLs 3 s apart (`--rate 20/m`) on one
/// keep-alive connection. Between them the connection parks, and the second request goes
/// over the same connection (curl makes no second connect) and is answered.
#[test]
fn curl_reuses_a_connection_that_parked_between_its_requests() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (_backend, q, ctl) = start_http_parking(&[]);
    let url = format!("http://127.0.0.1:{}/paced", q.port);
    let curl = std::thread::spawn(move || {
        let args = [
            "-sS",
            "--rate",
            "20/m",
            "-o",
            "/dev/null",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{num_connects}\\n",
            &url,
            &url,
        ];
        tool("curl", &args)
    });
    let parked = poll_until(PATIENCE, || connections(&ctl)["parked"] == 1);
    let Some(out) = curl.join().unwrap() else {
        return;
    };
    assert!(
        parked,
        "the connection never parked between curl's requests"
    );
    assert_eq!(
        out, "200 1\n200 0\n",
        "each answer, and the connects curl made for it"
    );
    assert_eq!(connections(&ctl)["accepted"], 1);
}

/// Parked, a client still owes its next head within `http_request_timeout` of the last
/// answer: then it is closed (counted as a request timeout), as under hyper; and a client
/// that closes while parked is gone at once.
#[test]
fn a_parked_http_client_is_closed_when_its_next_head_is_overdue() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (_backend, q, ctl) = start_http_parking(&["-O", "http_request_timeout 3"]);
    let mut lingering = q.connect();
    lingering.set_read_timeout(Some(PATIENCE)).unwrap();
    let mut leaving = q.connect();
    leaving.set_read_timeout(Some(PATIENCE)).unwrap();
    get(&mut lingering, "/lingering");
    get(&mut leaving, "/leaving");
    wait_parked(&ctl, 2);
    drop(leaving);
    wait_until(PATIENCE, "the client that left is gone", || {
        let c = connections(&ctl);
        c["open"] == 1 && c["parked"] == 1
    });
    expect_closed(&mut lingering, PATIENCE);
    wait_until(PATIENCE, "no connection left", || {
        let c = connections(&ctl);
        c["open"] == 0 && c["parked"] == 0
    });
    assert_eq!(connections(&ctl)["http_request_timeouts"], 1);
}

/// `close N` ends a parked HTTP client too, and the count of parked connections follows.
#[test]
fn close_n_closes_a_parked_http_client() {
    if skip_on_pen("idle_park is a quill extension") {
        return;
    }
    let (_backend, q, ctl) = start_http_parking(&[]);
    let mut client = q.connect();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    get(&mut client, "/");
    wait_parked(&ctl, 1);
    assert_eq!(ctl_ok(&ctl, "close 1"), "");
    expect_closed(&mut client, PATIENCE);
    wait_until(PATIENCE, "nothing open or parked", || {
        let c = connections(&ctl);
        c["open"] == 0 && c["parked"] == 0
    });
}
