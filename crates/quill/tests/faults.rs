//! Faults, end to end against the real binary: a backend that dies mid-response, a backend
//! that never answers, running out of file descriptors, abuse of the control socket, and a
//! storm of reloads under traffic. What must hold in each: no client ever gets another
//! client's bytes, quill keeps serving, and nothing spins or changes behind the user's back.
//! (Floods of clients and memory bounds are in `exhaustion.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use support::ctl::*;
use support::*;

/// Connects, reads the backend's name, sends `msg` and checks its echo; returns the name.
fn echo_on(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, msg, "echo through quill");
}

/// Reads until the peer closes (EOF or reset); panics if it stays open past the harness's
/// read timeout.
fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                ) =>
            {
                return got
            }
            Err(e) => panic!(
                "connection still open (or failed) after {} bytes: {e}",
                got.len()
            ),
        }
    }
}

/// The bytes a connection with this id is sent: different for every id.
fn pattern(id: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xDEAD).fill(&mut v);
    v
}

const FIRST_PART: usize = 300 * 1024;
const SECOND_PART: usize = 200 * 1024;

/// A backend that says `dying`, reads `ID\n`, sends `FIRST_PART` bytes of that id's
/// pattern, waits for `more\n`, sends `SECOND_PART` more and dies: odd ids with a reset
/// (SO_LINGER 0, as a crashed host or a killed process with unread input), even ids with a
/// plain close.
struct DyingBackend {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

impl DyingBackend {
    fn start() -> DyingBackend {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut s) = stream else { continue };
                count.fetch_add(1, Ordering::SeqCst);
                thread::spawn(move || {
                    let _ = s.write_all(b"dying\n");
                    let Ok(Some(id)) = read_line(&mut s) else {
                        return;
                    };
                    let id: u64 = id.trim().parse().unwrap();
                    let all = pattern(id, FIRST_PART + SECOND_PART);
                    if s.write_all(&all[..FIRST_PART]).is_err() {
                        return;
                    }
                    if !matches!(read_line(&mut s), Ok(Some(l)) if l == "more") {
                        return;
                    }
                    let _ = s.write_all(&all[FIRST_PART..]);
                    if id % 2 == 1 {
                        let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                    } else {
                        let _ = s.shutdown(Shutdown::Write);
                    }
                });
            }
        });
        DyingBackend { addr, accepted }
    }

    fn spec(&self) -> String {
        self.addr.to_string()
    }
}

#[test]
fn backend_dying_mid_response_closes_only_its_clients() {
    let dying = DyingBackend::start();
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["-r", "127.0.0.1:{port}", &dying.spec(), &b.spec()]);

    // Round robin alternates: half of the clients reach the dying server, half reach b.
    let mut on_dying = Vec::new();
    let mut on_b = Vec::new();
    for i in 0..12 {
        let (name, s) = q.name_from(&format!("127.0.0.{}", 10 + i));
        match name.as_str() {
            "dying" => on_dying.push(s),
            "b" => on_b.push(s),
            other => panic!("unexpected backend {other}"),
        }
    }
    assert_eq!(
        (on_dying.len(), on_b.len()),
        (6, 6),
        "round robin over both servers"
    );

    // Every dying connection gets its own pattern, then the server dies mid-transfer.
    let clients: Vec<_> = on_dying
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            let id = 1000 + i as u64;
            thread::spawn(move || {
                s.write_all(format!("{id}\n").as_bytes()).unwrap();
                let mut first = vec![0u8; FIRST_PART];
                s.read_exact(&mut first).unwrap();
                s.write_all(b"more\n").unwrap();
                let mut got = first;
                got.extend(read_until_closed(&mut s));
                (id, got)
            })
        })
        .collect();
    for c in clients {
        let (id, got) = c.join().unwrap();
        let expected = pattern(id, FIRST_PART + SECOND_PART);
        assert!(
            got.len() <= expected.len() && got == expected[..got.len()],
            "client {id} received {} bytes that are not a prefix of its own response",
            got.len()
        );
        if id % 2 == 0 {
            assert_eq!(
                got.len(),
                expected.len(),
                "a server's clean close loses nothing"
            );
        }
    }

    // A connection the server reset says nothing of the server's others (a client can
    // make a sound server reset its connection): it stays in use, as in Pen.
    let status = status_json(&ctl);
    let server0 = &status["servers"][0];
    assert_eq!(server0["state"], "up", "{status}");
    assert_eq!(server0["failures"], 0, "{status}");
    // The other connections were untouched.
    for (i, s) in on_b.iter_mut().enumerate() {
        echo_on(s, format!("still here {i}\n").as_bytes());
    }
    assert_eq!(dying.accepted.load(Ordering::SeqCst), 6);
}

/// The TCP state of quill's connection attempts to `to` (from /proc/net/tcp): how many are
/// in SYN_SENT.
fn syn_sent_to(to: SocketAddr) -> usize {
    let port = format!("{:04X}", to.port());
    fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[3] == "02" && f[2].ends_with(&format!(":{port}"))
        })
        .count()
}

#[test]
fn blackholed_backend_times_out_fails_over_and_stalls_nobody() {
    if skip_on_pen("Pen serves one connect at a time per -t in some builds") {
        return;
    }
    let hole = UnresponsiveBackend::start();
    let b = IdentityBackend::start("b");
    // At most one connection on the black hole (max 1, hard 1): while the first client's
    // connect hangs there, round robin has to send everyone else to b.
    let hole_spec = format!("{}:1:1", hole.spec());
    // A long connect timeout: the other clients must be served while it runs, even on a
    // loaded machine (the check below is on the order of events, not on their speed).
    let (q, ctl) =
        start_with_tcp_control(&["-r", "-t", "10", "127.0.0.1:{port}", &hole_spec, &b.spec()]);

    // The first client is sent to the black hole: its connect hangs.
    let mut first = q.connect_from("127.0.0.2");
    wait_until(
        Duration::from_secs(5),
        "quill is connecting to the black hole",
        || syn_sent_to(hole.addr()) >= 1,
    );
    // Meanwhile other clients are served at once by b, on the same event loops.
    for i in 0..5 {
        let (name, mut s) = q.name_from(&format!("127.0.0.{}", 20 + i));
        assert_eq!(name, "b");
        echo_on(&mut s, b"served while another client waits\n");
    }
    assert!(
        syn_sent_to(hole.addr()) >= 1,
        "the other clients were served only after the connect to the black hole ended"
    );
    // After the connect timeout the first client fails over to b, transparently.
    first
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    assert_eq!(backend_name(&mut first).as_deref(), Some("b"));
    echo_on(&mut first, b"failed over\n");
    let status = status_json(&ctl);
    assert_eq!(status["servers"][0]["state"], "blacklisted", "{status}");
    for i in 0..3 {
        let (name, _s) = q.name_from(&format!("127.0.1.{}", 20 + i));
        assert_eq!(name, "b");
    }
}

#[test]
fn running_out_of_descriptors_does_not_spin_and_recovers() {
    if skip_on_pen("Pen's accept loop under EMFILE is not what this test checks") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let baseline = q.started_fd_count().expect("/proc");

    // The limit applies to descriptor numbers (a new one must be below it): set it so
    // that the four connections opened next take the last free numbers below it.
    let lowest_free = lowest_free_fd(q.pid());
    set_fd_limit(q.pid(), (lowest_free + 8) as u64);
    let mut held: Vec<TcpStream> = (0..4)
        .map(|i| q.name_from(&format!("127.0.0.{}", 30 + i)).1)
        .collect();
    wait_until(
        Duration::from_secs(5),
        "quill holds two descriptors per connection",
        || q.fd_count() == Some(baseline + 8),
    );
    assert_eq!(
        lowest_free_fd(q.pid()),
        lowest_free + 8,
        "quill has no descriptor left"
    );

    // New clients are accepted by the kernel but quill cannot take them.
    let waiting: Vec<TcpStream> = (0..6)
        .map(|i| q.connect_from(&format!("127.0.0.{}", 40 + i)))
        .collect();
    // Over a window of wall time, the failing accepts must cost next to no CPU: a loop
    // that retried at once would burn a core for the whole window.
    let cpu_before = q.cpu_time().expect("/proc/PID/stat");
    let wall = Instant::now();
    // Meanwhile the connections quill has keep working.
    for round in 0..20 {
        for (i, s) in held.iter_mut().enumerate() {
            echo_on(s, format!("round {round} connection {i}\n").as_bytes());
        }
    }
    let window = Duration::from_secs(2);
    while wall.elapsed() < window {
        thread::sleep(Duration::from_millis(100)); // a measuring window, not a wait for a condition
    }
    let cpu = q.cpu_time().unwrap() - cpu_before;
    let elapsed = wall.elapsed();
    eprintln!("CPU used while out of descriptors: {cpu:?} in {elapsed:?}");
    assert!(
        cpu < elapsed / 4,
        "quill used {cpu:?} of CPU in {elapsed:?} while it could not accept: it spins"
    );
    wait_until(Duration::from_secs(5), "the accept errors reported", || {
        let stderr = q.stderr();
        stderr.contains("accept failed") || stderr.contains("Too many open files")
    });

    // Descriptors free up (the old clients leave). The clients that waited meanwhile are
    // either served now or, if quill had accepted one but had no descriptor left to reach
    // a server, closed without a byte: nobody hangs, nobody gets garbage.
    drop(held.drain(..));
    let waited: Vec<_> = waiting
        .into_iter()
        .map(|mut s| {
            thread::spawn(move || match backend_name(&mut s) {
                Some(name) => {
                    echo_on(&mut s, b"served after the shortage\n");
                    Some(name)
                }
                None => None,
            })
        })
        .collect();
    let waited: Vec<Option<String>> = waited.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!("clients that waited through the shortage: {waited:?}");
    assert!(
        waited.iter().any(Option::is_some),
        "no waiting client was served"
    );
    wait_until(
        Duration::from_secs(10),
        "quill's descriptors are back to where they were",
        || q.fd_count() <= Some(baseline),
    );
    // And from now on everyone is served again.
    for i in 0..10 {
        let (name, mut s) = q.name_from(&format!("127.0.0.{}", 60 + i));
        assert!(name == "a" || name == "b");
        echo_on(&mut s, b"served after recovery\n");
    }
    // No server was blamed for the local shortage.
    let status = status_json(&ctl);
    for server in status["servers"].as_array().unwrap() {
        assert_eq!(server["state"], "up", "{status}");
        assert_eq!(server["failures"], 0, "{status}");
    }
}

#[test]
fn control_socket_abuse_gets_clear_errors_and_changes_nothing() {
    if skip_on_pen("quill's error replies") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (mut q, ctl) = start_with_tcp_control(&[
        "-O",
        "acl 3 permit 127.0.0.1",
        "-O",
        "control_acl 3",
        "127.0.0.1:{port}",
        &a.spec(),
    ]);
    let before = written_config(&ctl, q.dir(), "before");
    let servers = without_counters(&ctl_ok(&ctl, "servers"));

    // A 1 MiB line without a newline until its end: refused with a clear error, which the
    // client can read (quill drains what it will not use instead of resetting).
    let mut huge = vec![b'a'; 1 << 20];
    huge.extend_from_slice(b"\n");
    let reply = String::from_utf8_lossy(&exchange(&ctl, &huge).unwrap()).into_owned();
    assert_eq!(reply, "error: command longer than 65536 bytes\n");
    // A 1 MiB line that is a command followed by garbage: the command is too long as well.
    let mut long = b"timeout 9 ".to_vec();
    long.extend(vec![b'9'; 1 << 20]);
    long.push(b'\n');
    let reply = String::from_utf8_lossy(&exchange(&ctl, &long).unwrap()).into_owned();
    assert_one_line_error(&reply, "1 MiB command");

    // Binary garbage of many sizes, with and without a newline.
    let mut rng = Rng::new(99);
    for len in [1usize, 2, 100, 4095, 4096, 4097, 65_536, 65_537, 300_000] {
        let mut junk = vec![0u8; len];
        rng.fill(&mut junk);
        junk[0] = 0xfe;
        junk.push(b'\n');
        let reply = String::from_utf8_lossy(&exchange(&ctl, &junk).unwrap()).into_owned();
        assert_one_line_error(&reply, &format!("{len} bytes of garbage"));
    }

    // A client outside control_acl: refused, whatever it sends.
    for line in [&b"timeout 1\n"[..], b"exit\n", &huge] {
        let reply = exchange_from("127.0.0.2", &ctl, line).unwrap();
        let reply = String::from_utf8_lossy(&reply).into_owned();
        assert_eq!(reply, "error: access denied by control_acl\n");
    }

    // 1,000 connections open at the same time, then each asks something.
    let addr: SocketAddr = ctl.parse().unwrap();
    let mut conns: Vec<TcpStream> = (0..1000)
        .map(|i| {
            TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT)
                .unwrap_or_else(|e| panic!("control connection {i}: {e}"))
        })
        .collect();
    for (i, s) in conns.iter_mut().enumerate() {
        let line = match i % 3 {
            0 => "timeout\n",
            1 => "mode\n",
            _ => "frobnicate\n",
        };
        s.write_all(line.as_bytes()).unwrap();
    }
    for (i, s) in conns.iter_mut().enumerate() {
        s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply)
            .unwrap_or_else(|e| panic!("parallel control client {i}: {e}"));
        match i % 3 {
            0 => assert_eq!(reply, "5\n", "#{i}"),
            1 => assert_eq!(
                reply, "no hash no roundrobin no stubborn no weight no prio\n",
                "#{i}"
            ),
            _ => assert_one_line_error(&reply, &format!("#{i}")),
        }
    }
    drop(conns);

    q.assert_running();
    assert_eq!(
        written_config(&ctl, q.dir(), "after"),
        before,
        "the configuration changed"
    );
    assert_eq!(without_counters(&ctl_ok(&ctl, "servers")), servers);
    let (name, mut s) = q.name_from("127.0.0.3");
    assert_eq!(name, "a");
    echo_on(&mut s, b"still balancing\n");
}

#[test]
fn a_storm_of_reloads_under_traffic_loses_no_request() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let dir = TempDir::new("hup-storm");
    let cfg = dir.path().join("quill.cfg");
    fs::write(
        &cfg,
        format!(
            "roundrobin\nserver 0 address 127.0.0.1 port {}\nserver 1 address 127.0.0.1 port {}\ntimeout 3\n",
            a.port(),
            b.port()
        ),
    )
    .unwrap();
    let (mut q, ctl) = start_with_tcp_control(&["-F", cfg.to_str().unwrap(), "127.0.0.1:{port}"]);
    let addr = q.addr();
    let stop = Arc::new(AtomicBool::new(false));

    // Short connections (one request each) and long ones (many requests each) run while
    // quill reloads its configuration 100 times.
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let mut done = 0usize;
                let mut long = if w % 2 == 0 {
                    let mut s = client_from(&format!("127.0.2.{}", 10 + w), addr).unwrap();
                    backend_name(&mut s).expect("long connection served");
                    Some(s)
                } else {
                    None
                };
                while !stop.load(Ordering::SeqCst) || done < 50 {
                    let msg = format!("worker {w} request {done}\n");
                    match long.as_mut() {
                        Some(s) => echo_on(s, msg.as_bytes()),
                        None => {
                            let mut s = client_from(&format!("127.0.2.{}", 10 + w), addr)
                                .unwrap_or_else(|e| panic!("worker {w} request {done}: {e}"));
                            let name = backend_name(&mut s).unwrap_or_else(|| {
                                panic!("worker {w} request {done} closed unserved")
                            });
                            assert!(name == "a" || name == "b");
                            echo_on(&mut s, msg.as_bytes());
                        }
                    }
                    done += 1;
                }
                done
            })
        })
        .collect();
    for _ in 0..100 {
        q.signal("HUP");
    }
    // Signals are handled in order: once a change made before one last HUP is in force,
    // every reload of the storm is done. Traffic runs on until then. The file is replaced
    // by a rename, as an operator must while reloads may run: a reload reading a file
    // truncated by an in-place write would find no server in it.
    let next = dir.path().join("quill.cfg.new");
    fs::write(
        &next,
        fs::read_to_string(&cfg)
            .unwrap()
            .replace("timeout 3", "timeout 7"),
    )
    .unwrap();
    fs::rename(&next, &cfg).unwrap();
    q.signal("HUP");
    wait_until(Duration::from_secs(30), "the last reload is done", || {
        ctl_ok(&ctl, "timeout") == "7\n"
    });
    stop.store(true, Ordering::SeqCst);
    let total: usize = workers.into_iter().map(|w| w.join().unwrap()).sum();
    eprintln!("{total} requests served during 100 reloads");
    q.assert_running();
    assert!(!q.stderr().contains("reload failed"), "{}", q.stderr());
    let (name, _s) = q.name_from("127.0.0.9");
    assert!(name == "a" || name == "b");
}

#[test]
fn a_stalled_reader_of_stderr_stalls_no_connection() {
    if skip_on_pen("Pen writes its log lines itself") {
        return;
    }
    let backend = IdentityBackend::start("a");
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // stderr is a pipe nobody reads for now (a paused pager, a blocked container log
    // driver); with -dd every connection writes a line, and the pipe's 64 KiB are full
    // after a few hundred.
    let mut child = std::process::Command::new(bin())
        .args(["-f", "-dd", &addr.to_string(), &backend.spec()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .env_remove("RUST_LOG")
        .spawn()
        .unwrap();
    let mut stderr = child.stderr.take().unwrap();
    wait_until(START_DEADLINE, "quill listening", || {
        try_connect(addr).is_ok()
    });
    const CONNECTIONS: usize = 2000;
    for i in 0..CONNECTIONS {
        let mut c = connect(addr);
        assert_eq!(
            backend_name(&mut c).as_deref(),
            Some("a"),
            "connection {i} of {CONNECTIONS}"
        );
    }
    // Read at last, stderr gets every line, and plain text: no colours outside a terminal.
    let text = Arc::new(std::sync::Mutex::new(Vec::new()));
    let reader = {
        let text = Arc::clone(&text);
        thread::spawn(move || {
            let mut chunk = [0u8; 65536];
            while let Ok(n @ 1..) = stderr.read(&mut chunk) {
                text.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        })
    };
    let served_lines = |text: &[u8]| {
        String::from_utf8_lossy(text)
            .lines()
            .filter(|l| l.contains("DEBUG") && l.contains(&backend.addr().to_string()))
            .count()
    };
    wait_until(
        Duration::from_secs(10),
        "a line for every connection",
        || served_lines(&text.lock().unwrap()) >= CONNECTIONS,
    );
    let _ = child.kill();
    let _ = child.wait();
    reader.join().unwrap();
    let text = text.lock().unwrap();
    assert!(!text.contains(&0x1b), "escape sequences in stderr");
}
