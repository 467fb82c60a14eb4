//! systemd integration against the real binary: `sd_notify` messages on a notification
//! socket the test binds (READY=1 once serving, RELOADING=1 with MONOTONIC_USEC then
//! READY=1 around a SIGHUP reload, STOPPING=1 on SIGTERM), and socket activation through
//! `systemd-socket-activate` (skipped with a message when it is not installed).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

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

#[test]
fn socket_activation_uses_the_listener_systemd_passes() {
    if skip_on_pen("socket activation is a quill extension") {
        return;
    }
    let Some(activate) = find_in_path("systemd-socket-activate") else {
        eprintln!("SKIPPED: systemd-socket-activate is not installed (Debian package systemd)");
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
