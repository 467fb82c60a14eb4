//! Servers and the balancer for the namespace tests: backends that report the peer address
//! they see (HTTP over TCP, and UDP), and a quill process started inside a namespace.
#![allow(dead_code)]

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::netns::Netns;

/// Size of the body served for `/big`.
pub const BIG: usize = 1 << 20;

/// A backend server running on threads inside a namespace; stopped on drop.
pub struct Backend {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_http(mut s: TcpStream, name: &str, peer: SocketAddr) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 8192 {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let text = String::from_utf8_lossy(&req);
    let path = text.split_whitespace().nth(1).unwrap_or("/");
    let body = if path.starts_with("/big") {
        vec![b'x'; BIG]
    } else {
        format!("{name} {peer}\n").into_bytes()
    };
    let head = format!(
        "HTTP/1.0 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = s.write_all(head.as_bytes());
    let _ = s.write_all(&body);
}

impl Backend {
    /// An HTTP server on `addr` in `ns` answering `NAME PEER_ADDR:PORT` (or 1 MiB for
    /// `/big`), and, if `udp` is given, a UDP server there answering `NAME PEER`.
    pub fn start(
        ns: &Netns,
        name: &str,
        tcp: Option<SocketAddr>,
        udp: Option<SocketAddr>,
    ) -> Backend {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        if let Some(addr) = tcp {
            let listener = ns.run(move || TcpListener::bind(addr));
            let listener = listener.unwrap_or_else(|e| panic!("bind {addr}: {e}"));
            listener
                .set_nonblocking(true)
                .unwrap_or_else(|e| panic!("{e}"));
            let (stop, name) = (Arc::clone(&stop), name.to_string());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((s, peer)) => {
                            let name = name.clone();
                            let _ = s.set_nonblocking(false);
                            std::thread::spawn(move || serve_http(s, &name, peer));
                        }
                        // A poll interval of the accept loop, not synchronisation.
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            }));
        }
        if let Some(addr) = udp {
            let sock = ns.run(move || UdpSocket::bind(addr));
            let sock = sock.unwrap_or_else(|e| panic!("bind udp {addr}: {e}"));
            sock.set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap_or_else(|e| panic!("{e}"));
            let (stop, name) = (Arc::clone(&stop), name.to_string());
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((_, peer)) = sock.recv_from(&mut buf) {
                        let _ = sock.send_to(format!("{name} {peer}").as_bytes(), peer);
                    }
                }
            }));
        }
        Backend { stop, threads }
    }
}

/// quill running in the foreground inside a namespace; killed on drop. Its stderr is
/// printed when the test fails.
pub struct NsQuill {
    child: Child,
    log: PathBuf,
}

impl NsQuill {
    pub fn start(ns: &Netns, args: &[&str]) -> NsQuill {
        NsQuill::start_as(ns, "quill", args)
    }

    /// [`NsQuill::start`] with its own log file, for a second quill in the namespace.
    pub fn start_as(ns: &Netns, name: &str, args: &[&str]) -> NsQuill {
        let log = std::env::temp_dir().join(format!("{}-{name}.log", ns.name));
        let file = File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let child = ns
            .cmd(&super::bin().to_string_lossy())
            .arg("-f")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start quill: {e}"));
        NsQuill { child, log }
    }

    /// The process id (`ip netns exec` execs quill in its place).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status if quill has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for NsQuill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- quill stderr ---\n{}--- end ---", self.stderr());
        }
        let _ = fs::remove_file(&self.log);
    }
}

/// `curl` from `ns`: the body, or None on failure (timeout `secs`).
pub fn curl(ns: &Netns, url: &str, secs: u32) -> Option<String> {
    let out = ns
        .cmd("curl")
        .args(["-s", "--max-time", &secs.to_string(), url])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// curl's exit status from `ns` (28 = timeout).
pub fn curl_status(ns: &Netns, url: &str, secs: u32) -> Option<i32> {
    ns.cmd("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "--max-time",
            &secs.to_string(),
            url,
        ])
        .stdin(Stdio::null())
        .status()
        .ok()?
        .code()
}
