//! systemd integration against the real binary: `sd_notify` messages on a notification
//! socket the test binds (READY=1 once serving, RELOADING=1 with MONOTONIC_USEC then
//! READY=1 around a SIGHUP reload, STOPPING=1 on SIGTERM), and socket activation through
//! `systemd-socket-activate` (skipped with a message when it is not installed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

/// Kills the child when the test ends, however it ends.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn next_message(sock: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    let n = sock
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("no sd_notify message within the deadline: {e}"));
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn kill(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn sd_notify_ready_reloading_stopping() {
    if skip_on_pen("sd_notify is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let dir = TempDir::new("notify");
    let notify = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let child = Command::new(bin())
        .args(["-f", &listen, &a.spec()])
        .env("NOTIFY_SOCKET", &notify)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut child = Reap(child);
    let pid = child.0.id();

    let ready = next_message(&sock);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");
    assert!(
        ready.lines().any(|l| l == format!("MAINPID={pid}")),
        "{ready:?}"
    );
    // Ready means serving: a client is answered at once.
    let mut s = connect(listen.parse().unwrap());
    assert_eq!(backend_name(&mut s).as_deref(), Some("a"));
    drop(s);

    wait_until(Duration::from_secs(5), "quill catches SIGHUP", || {
        ctl::catches(pid, "HUP")
    });
    kill(pid, "HUP");
    let reloading = next_message(&sock);
    assert!(
        reloading.lines().any(|l| l == "RELOADING=1"),
        "{reloading:?}"
    );
    let usec = reloading
        .lines()
        .find_map(|l| l.strip_prefix("MONOTONIC_USEC="))
        .unwrap_or_else(|| panic!("no MONOTONIC_USEC in {reloading:?}"));
    assert!(usec.parse::<u64>().unwrap() > 0);
    let ready = next_message(&sock);
    assert!(ready.lines().any(|l| l == "READY=1"), "{ready:?}");

    kill(pid, "TERM");
    let stopping = next_message(&sock);
    assert!(stopping.lines().any(|l| l == "STOPPING=1"), "{stopping:?}");
    let mut code = None;
    wait_until(
        Duration::from_secs(20),
        "quill exits after TERM",
        || match child.0.try_wait() {
            Ok(Some(s)) => {
                code = s.code();
                true
            }
            _ => false,
        },
    );
    assert_eq!(code, Some(0));
}

fn find_in_path(name: &str) -> Option<std::path::PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// `systemd-socket-activate`, or `None` (with the reason said) where the test cannot run.
fn socket_activator() -> Option<std::path::PathBuf> {
    if skip_on_pen("socket activation is a quill extension") {
        return None;
    }
    let found = find_in_path("systemd-socket-activate");
    if found.is_none() {
        eprintln!("SKIPPED: systemd-socket-activate is not installed (Debian package systemd)");
    }
    found
}

#[test]
fn socket_activation_uses_the_listener_systemd_passes() {
    let Some(activate) = socket_activator() else {
        return;
    };
    let a = IdentityBackend::start("a");
    let dir = TempDir::new("activate");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    // systemd-socket-activate binds the port itself and execs quill with it as fd 3
    // (LISTEN_FDS=1). Were quill to bind on its own, the port would be in use and it
    // would exit; it logs (with -d) where its listener came from.
    let child = Command::new(activate)
        .args(["-l", &listen])
        .arg(bin())
        .args(["-f", "-d", "-r", &listen, &a.spec()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut child = Reap(child);
    let addr = listen.parse().unwrap();
    let mut names = Vec::new();
    wait_until(
        Duration::from_secs(20),
        "quill answers on the activated socket",
        || {
            if let Ok(Some(status)) = child.0.try_wait() {
                panic!(
                    "exited ({status}): {}",
                    std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default()
                );
            }
            match try_connect(addr) {
                Ok(mut s) => {
                    if let Some(n) = backend_name(&mut s) {
                        names.push(n);
                    }
                    !names.is_empty()
                }
                Err(_) => false,
            }
        },
    );
    for _ in 0..5 {
        let mut s = connect(addr);
        assert_eq!(backend_name(&mut s).as_deref(), Some("a"));
    }
    let log = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    assert!(
        log.contains("socket activation: 1 listener(s) from systemd"),
        "{log}"
    );
}

/// A server that answers every chunk it reads with two writes a millisecond apart, `a` and
/// then `b`, with TCP_NODELAY (so its own kernel sends each at once). Runs until the test
/// ends.
fn two_write_server() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                conn.set_nodelay(true).unwrap();
                let mut buf = [0u8; 64];
                while matches!(conn.read(&mut buf), Ok(n) if n > 0) {
                    if conn.write_all(b"a").is_err() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    if conn.write_all(b"b").is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Sends a byte and reads the two-write answer, `count` times: how long it took.
fn exchanges(stream: &mut TcpStream, count: usize) -> Duration {
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let start = Instant::now();
    for _ in 0..count {
        stream.write_all(b"x").unwrap();
        let mut answer = [0u8; 2];
        stream.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"ab");
    }
    start.elapsed()
}

/// The client whose connection made systemd start quill connected before quill had the
/// listener, so its socket did not inherit TCP_NODELAY from it: quill gives it the
/// listener's options when it accepts it. Else Nagle's algorithm in quill's kernel holds
/// each second write of an answer until the client's delayed ACK of the first (40 ms or
/// more a request, against a millisecond). The same stall hit any client that connected
/// between quill's `listen` and its event loop's first accept, when quill set the options
/// only then.
#[test]
fn the_client_that_activates_quill_is_not_held_by_nagles_algorithm() {
    let Some(activate) = socket_activator() else {
        return;
    };
    let server = two_write_server();
    let dir = TempDir::new("activate-nodelay");
    let listen = format!("127.0.0.1:{}", free_port());
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let child = Command::new(activate)
        .args(["-l", &listen])
        .arg(bin())
        .args(["-f", "-r", &listen, &server.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let _child = Reap(child);
    let addr = listen.parse().unwrap();
    let mut first = None;
    wait_until(
        Duration::from_secs(20),
        "systemd-socket-activate listens",
        || {
            first = try_connect(addr).ok();
            first.is_some()
        },
    );
    let mut first = first.unwrap();
    // The first exchange waits for quill to start; the delayed ACKs come once the
    // client's kernel has left its quick-ACK start.
    exchanges(&mut first, 1);
    let activating = exchanges(&mut first, 20);
    let mut later = connect(addr);
    exchanges(&mut later, 1);
    let after = exchanges(&mut later, 20);
    eprintln!(
        "20 two-write answers: {activating:?} to the activating client, {after:?} to a later one"
    );
    assert!(
        activating < after * 4 + Duration::from_millis(200),
        "the activating client waited {activating:?} for 20 answers, a later one {after:?}: \
         {}",
        std::fs::read_to_string(dir.path().join("stderr")).unwrap_or_default()
    );
}
