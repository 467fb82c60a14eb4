//! Debian's `penlogd` (Pen's log consolidator) and `penlog` (what web servers pipe their
//! access logs through to it), for the tests of `-l IP:PORT`.
#![allow(dead_code)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{free_port, udp_bound, wait_until, TempDir};

/// A running penlogd, its consolidated log on a line-buffered stdout.
pub struct Penlogd {
    child: Child,
    /// The UDP port it receives on.
    pub port: u16,
    out: PathBuf,
    _dir: TempDir,
}

impl Penlogd {
    /// Starts penlogd and waits until it listens; `None` (with a SKIP line) without
    /// Debian's pen package.
    pub fn start() -> Option<Penlogd> {
        let found = |name: &str| {
            std::env::var_os("PATH")
                .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(name).is_file()))
        };
        if !found("penlogd") || !found("penlog") || !found("stdbuf") {
            eprintln!("SKIP: penlogd, penlog or stdbuf missing (Debian's pen package)");
            return None;
        }
        let dir = TempDir::new("penlogd");
        let out = dir.path().join("merged.log");
        // The port is free for TCP; a UDP socket of a concurrent test (quill's `-l` sends
        // from ephemeral ports) may hold it, and then penlogd exits: try another.
        for _ in 0..5 {
            let port = free_port();
            // To stdout, line-buffered: its own log file is written only when it exits.
            let mut child = Command::new("stdbuf")
                .args(["-oL", "penlogd", "-f", &port.to_string()])
                .stdout(std::fs::File::create(&out).unwrap())
                .stderr(Stdio::null())
                .spawn()
                .expect("penlogd starts");
            // stdbuf execs penlogd, so the pid is penlogd's. Read from /proc rather than
            // probed by binding the port, which could take it from penlogd as it binds.
            let pid = child.id();
            let mut exited = false;
            wait_until(Duration::from_secs(5), "penlogd listens", || {
                exited = matches!(child.try_wait(), Ok(Some(_)));
                exited || udp_bound(pid, port)
            });
            if !exited {
                return Some(Penlogd {
                    child,
                    port,
                    out,
                    _dir: dir,
                });
            }
        }
        panic!("penlogd could not bind any of five UDP ports");
    }

    /// A web server at `server_ip` logs `lines` (Apache's common format) through penlog.
    pub fn web_server_logs(&self, server_ip: &str, lines: &str) {
        let mut penlog = Command::new("penlog")
            .args([server_ip, &self.port.to_string(), server_ip])
            .stdin(Stdio::piped())
            .spawn()
            .expect("penlog starts");
        penlog
            .stdin
            .take()
            .unwrap()
            .write_all(lines.as_bytes())
            .unwrap();
        assert!(penlog.wait().unwrap().success());
    }

    /// A web server at 127.0.0.1 (quill's address as the client's) logs a `GET` of each of
    /// `paths` over `protocol` (`HTTP/1.1`) through penlog; the clients penlogd gives them.
    pub fn clients_of_gets(&self, protocol: &str, paths: &[&str]) -> Vec<String> {
        let lines: String = paths
            .iter()
            .map(|p| {
                format!(
                    "127.0.0.1 - - [29/Nov/2026:04:00:00 +0000] \"GET {p} {protocol}\" 200 20\n"
                )
            })
            .collect();
        self.web_server_logs("127.0.0.1", &lines);
        self.clients(paths.len())
    }

    /// The first field (the client's address) of each of the `n` lines penlogd writes.
    pub fn clients(&self, n: usize) -> Vec<String> {
        let text = || std::fs::read_to_string(&self.out).unwrap_or_default();
        wait_until(
            Duration::from_secs(5),
            format!("penlogd writes {n} lines"),
            || text().lines().count() >= n,
        );
        let text = text();
        text.lines()
            .map(|l| l.split(' ').next().unwrap_or_default().to_string())
            .collect()
    }
}

impl Drop for Penlogd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
