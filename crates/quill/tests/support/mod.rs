//! Shared harness for quill's end-to-end tests.
//!
//! Everything here talks to the real binary through real sockets:
//!
//! * [`Quill`] starts the daemon in the foreground (`-f` is always added) with
//!   Pen-style arguments and kills it when dropped.  Its stderr goes to a file
//!   that is printed when the test fails.
//! * [`IdentityBackend`] is a TCP server running on threads of the test
//!   process: on each connection it first writes its name and a newline, then
//!   echoes every byte; when the client half-closes it finishes writing, shuts
//!   its write side down and closes.  It can be stopped (connects are then
//!   refused) and restarted on the same port.
//! * [`client_from`] connects from a chosen loopback source address, which is
//!   how the tests play several distinct clients (127.0.0.2, 127.0.0.3, ...).
//!
//! The binary is `CARGO_BIN_EXE_quill` unless `QUILL_BIN` points elsewhere
//! (e.g. `QUILL_BIN=/usr/bin/pen` to check the tests against Pen itself).
//!
//! In the argument lists given to [`Quill::start`], the placeholder `{port}`
//! stands for a free TCP port chosen by the harness (so a start that loses a
//! bind race can be retried on another port), `{sock}` for a Unix socket
//! path in a private temporary directory and `{dir}` for that directory.  The first argument holding one of
//! them is taken to be the listening address.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod browser;
pub mod ctl;
pub mod daemon;
pub mod dns;
pub mod hosts;
pub mod http;
pub mod http_echo;
pub mod load;
pub mod netns;
pub mod penlogd;
pub mod pki;

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use socket2::{Domain, SockAddr, SockRef, Socket, Type};

/// How long the daemon may take to start listening (or to exit when it should). Starting
/// takes milliseconds; the margin is for a machine loaded by parallel test binaries, and
/// costs time only when something is wrong.
pub const START_DEADLINE: Duration = Duration::from_secs(30);
/// Default read/write timeout of client sockets: no test can hang forever on I/O.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);
/// Deadline for a connect attempt.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

// ---------------------------------------------------------------------------
// Binary under test
// ---------------------------------------------------------------------------

/// The binary under test: `$QUILL_BIN` if set, else the crate's `quill`.
pub fn bin() -> PathBuf {
    match std::env::var_os("QUILL_BIN") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_BIN_EXE_quill")),
    }
}

/// True when the suite is pointed at Pen (`QUILL_BIN=/usr/bin/pen`).
pub fn is_pen() -> bool {
    bin()
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("pen"))
}

/// Returns true (and says so) when running against Pen, for behaviour in
/// which quill deliberately differs from Pen.  Use as
/// `if skip_on_pen("why") { return; }`.
pub fn skip_on_pen(why: &str) -> bool {
    if is_pen() {
        eprintln!("SKIPPED against pen: {why}");
        true
    } else {
        false
    }
}

// ---------------------------------------------------------------------------
// Waiting for conditions
// ---------------------------------------------------------------------------

/// Polls `cond` until it holds or `timeout` elapses; returns whether it held.
pub fn poll_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(200);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        // A poll interval, not synchronisation: the condition is re-checked.
        thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Like [`poll_until`] but panics with `what` on timeout.
pub fn wait_until(timeout: Duration, what: impl Display, cond: impl FnMut() -> bool) {
    if !poll_until(timeout, cond) {
        panic!("timed out after {timeout:?} waiting until {what}");
    }
}

// ---------------------------------------------------------------------------
// Temporary directories and ports
// ---------------------------------------------------------------------------

/// A private temporary directory, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("qe2e-{}-{tag}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("cannot create {}: {e}", p.display()));
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A port free a moment ago for TCP and UDP on 127.0.0.1, never handed out before in this
/// test process, and (where the host leaves room) below the kernel's ephemeral range: a
/// port of that range, released by `bind(0)`, could be taken as the source port of any
/// test's outgoing connection before the server meant for it binds it (`EADDRINUSE`), and
/// the kernel may give it to the next `bind(0)` of a test running in parallel; quill's
/// listeners set SO_REUSEPORT, so two quills given the same port would both bind it and
/// share its connections.
pub fn free_port() -> u16 {
    static NEXT: Mutex<Option<(HashSet<u16>, u32)>> = Mutex::new(None);
    let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
    let (given, cursor) = next.get_or_insert_with(|| (HashSet::new(), std::process::id()));
    let (low, high) = below_ephemeral_ports();
    let span = u32::from(high - low);
    for _ in 0..span {
        *cursor = cursor.wrapping_add(1);
        let port = low + (*cursor % span) as u16;
        if !given.contains(&port) && bindable(port) {
            given.insert(port);
            return port;
        }
    }
    // No room below the ephemeral range (or none of it free): a port the kernel picks.
    loop {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let port = l.local_addr().expect("local_addr").port();
        if given.insert(port) {
            return port;
        }
    }
}

/// The ports `free_port` hands out: up to 20,000 below the first of
/// `net.ipv4.ip_local_port_range` (32768 by default), and from 1024 up.
fn below_ephemeral_ports() -> (u16, u16) {
    let first = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    (first.saturating_sub(20_000).max(1024), first.max(1025))
}

/// Whether 127.0.0.1:`port` can be bound now, for TCP and for UDP.
fn bindable(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
        && std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
}

/// The soft limit on open files of this process (None without /proc).
pub fn open_files_limit() -> Option<u64> {
    let limits = fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line.split_whitespace().nth(3)?;
    if soft == "unlimited" {
        Some(u64::MAX)
    } else {
        soft.parse().ok()
    }
}

/// Whether the host has a usable IPv6 loopback.
pub fn ipv6_available() -> bool {
    TcpListener::bind("[::1]:0").is_ok()
}

// ---------------------------------------------------------------------------
// The daemon
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
pub enum Target {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

/// A running quill (or Pen) in the foreground; killed on drop.
pub struct Quill {
    child: Child,
    target: Target,
    /// The listening port (0 for a Unix socket listener).
    pub port: u16,
    args: Vec<String>,
    dir: TempDir,
}

enum Startup {
    Ready,
    Exited(String),
    TimedOut,
}

fn substitute(args: &[&str], port: u16, dir: &Path) -> Vec<String> {
    let sock = dir.join("q.sock");
    args.iter()
        .map(|a| {
            a.replace("{port}", &port.to_string())
                .replace("{sock}", &sock.to_string_lossy())
                .replace("{dir}", &dir.to_string_lossy())
        })
        .collect()
}

/// Where to connect to reach a listener given as a Pen-style `[host:]port`
/// template containing `{port}`.
fn tcp_target(template: &str, port: u16) -> SocketAddr {
    let host = if let Some(rest) = template.strip_prefix('[') {
        rest.split(']').next().unwrap_or("").to_string()
    } else {
        match template.rfind(':') {
            Some(i) => template[..i].to_string(),
            None => String::new(),
        }
    };
    let ip: IpAddr = match host.as_str() {
        "" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        "::" | ":" => IpAddr::V6(Ipv6Addr::LOCALHOST),
        "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
        h => match h.parse::<IpAddr>() {
            Ok(ip) if ip.is_unspecified() => match ip {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            },
            Ok(ip) => ip,
            Err(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        },
    };
    SocketAddr::new(ip, port)
}

/// The argument that follows `flag` in a command line (`args` as started, placeholders
/// substituted).
pub fn arg_after<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(String::as_str)
}

impl Quill {
    /// Starts the daemon as `BIN -f ARGS...` and waits (at most START_DEADLINE) until it
    /// listens.  `{port}` in ARGS becomes a free port, `{sock}` a Unix socket
    /// path; if the daemon exits before listening because it lost a race for
    /// the port, it is started again on another port, a few times.  Panics
    /// (showing the daemon's stderr) if it does not come up.
    pub fn start(args: &[&str]) -> Quill {
        match Quill::try_start(args) {
            Ok(q) => q,
            Err(e) => panic!("{e}"),
        }
    }

    /// Like [`Quill::start`], but returns None (saying "SKIPPED") when the
    /// binary refuses the arguments as a feature it does not support yet
    /// (quill exits with status 2 and "not supported by this build"), so that
    /// tests of planned features start checking as soon as they land.
    pub fn start_unless_unsupported(args: &[&str]) -> Option<Quill> {
        match Quill::try_start(args) {
            Ok(q) => Some(q),
            Err(e) if e.contains("not supported by this build") => {
                eprintln!("SKIPPED: not supported by this build yet:\n{e}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Quill::start`] returning the failure instead of panicking.
    pub fn try_start(args: &[&str]) -> Result<Quill, String> {
        let uses_port = args.iter().any(|a| a.contains("{port}"));
        let uses_sock = args.iter().any(|a| a.contains("{sock}"));
        assert!(
            uses_port || uses_sock,
            "Quill::start needs a listen address containing {{port}} or {{sock}}: {args:?}"
        );
        let mut failures = Vec::new();
        for _attempt in 0..5 {
            let dir = TempDir::new("quill");
            let sock = dir.path().join("q.sock");
            let port = if uses_port { free_port() } else { 0 };
            let real = substitute(args, port, dir.path());
            let template = args
                .iter()
                .find(|a| a.contains("{port}") || a.contains("{sock}"))
                .copied()
                .unwrap_or_default();
            let target = if template.contains("{sock}") {
                Target::Unix(sock.clone())
            } else {
                Target::Tcp(tcp_target(template, port))
            };
            let mut child = spawn(&dir, true, &real);
            match wait_listening(&mut child, &target) {
                Startup::Ready => {
                    return Ok(Quill {
                        child,
                        target,
                        port,
                        args: real,
                        dir,
                    })
                }
                Startup::Exited(status) => {
                    let err = read_lossy(&dir.path().join("stderr"));
                    failures.push(format!(
                        "{real:?} exited ({status}) before listening:\n{err}"
                    ));
                    // Only a lost race for the port is worth another try.
                    let lower = err.to_lowercase();
                    if !(lower.contains("in use") || lower.contains("bind")) {
                        break;
                    }
                }
                Startup::TimedOut => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let err = read_lossy(&dir.path().join("stderr"));
                    return Err(format!(
                        "{} {real:?} did not listen on {target:?} within {START_DEADLINE:?}; stderr:\n{err}",
                        bin().display()
                    ));
                }
            }
        }
        Err(format!(
            "could not start {}:\n{}",
            bin().display(),
            failures.join("\n")
        ))
    }

    /// Runs `BIN -f ARGS...` expecting it to exit on its own (within START_DEADLINE);
    /// returns its exit code and stderr.  `{port}` is substituted as in
    /// [`Quill::start`].
    pub fn start_expect_exit(args: &[&str]) -> (Option<i32>, String) {
        let out = run_with(true, args);
        (out.code, out.stderr)
    }

    /// The address clients connect to (panics for a Unix socket listener).
    pub fn addr(&self) -> SocketAddr {
        match &self.target {
            Target::Tcp(a) => *a,
            Target::Unix(p) => panic!("quill listens on Unix socket {}", p.display()),
        }
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Connects from the default source address (127.0.0.1 or ::1).
    pub fn connect(&self) -> TcpStream {
        connect(self.addr())
    }

    /// Connects from the given loopback source address.
    pub fn connect_from(&self, src: &str) -> TcpStream {
        client_from(src, self.addr()).unwrap_or_else(|e| {
            panic!("connect from {src} to quill at {} failed: {e}", self.addr())
        })
    }

    /// Connects from `src` and returns the name of the backend that answers,
    /// with the open stream.  Panics if the connection is not served.
    pub fn name_from(&self, src: &str) -> (String, TcpStream) {
        let mut s = self.connect_from(src);
        match backend_name(&mut s) {
            Some(n) => (n, s),
            None => {
                panic!("connection from {src} through quill was closed without a backend answering")
            }
        }
    }

    /// Number of file descriptors the daemon has open (None without /proc).
    pub fn fd_count(&self) -> Option<usize> {
        fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .ok()
            .map(|d| d.count())
    }

    /// The number of descriptors once the daemon has finished starting. quill listens as
    /// soon as its sockets are bound (so that a start that cannot bind fails early) and
    /// only then builds its event loops, each with its own descriptors (epoll, eventfd,
    /// signal pipe); a count read in between is lower than the steady state and makes a
    /// later comparison report a leak that is only the rest of the start-up. So this waits
    /// until every event-loop thread (`quill-loop-N` / `quill-udp-N`, one per core the
    /// daemon may run on) exists. Pen has no such threads: its count is taken at once.
    pub fn started_fd_count(&self) -> Option<usize> {
        if !is_pen() {
            let loops = thread::available_parallelism().map_or(1, |n| n.get());
            wait_until(
                START_DEADLINE,
                format_args!("quill has started its {loops} event loops"),
                || self.loop_threads() >= loops,
            );
        }
        self.fd_count()
    }

    /// Event-loop threads of the daemon that exist now.
    fn loop_threads(&self) -> usize {
        let Ok(tasks) = fs::read_dir(format!("/proc/{}/task", self.pid())) else {
            return usize::MAX; // no /proc: nothing to wait for
        };
        tasks
            .flatten()
            .filter(|t| {
                fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.starts_with("quill-loop-") || c.starts_with("quill-udp-"))
            })
            .count()
    }

    /// Resident memory of the daemon in KiB (VmRSS), None without /proc.
    pub fn rss_kib(&self) -> Option<usize> {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find(|l| l.starts_with("VmRSS:"))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }

    /// CPU time (user + system) the daemon has used so far, from /proc/PID/stat.
    pub fn cpu_time(&self) -> Option<Duration> {
        let stat = fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // The command name (field 2) may contain spaces: count fields after its ')'.
        let rest = stat.rsplit_once(')')?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks: u64 =
            fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
        // /proc reports clock ticks of USER_HZ, which is 100 on every Linux architecture.
        Some(Duration::from_millis(ticks * 10))
    }

    /// The instance's private temporary directory (what `{dir}` stood for).
    /// The arguments it was started with, placeholders substituted (without the `-f`).
    pub fn args(&self) -> &[String] {
        &self.args
    }

    /// The value it was started with for `flag` (e.g. `-C`: the control address).
    pub fn arg_after(&self, flag: &str) -> Option<&str> {
        arg_after(&self.args, flag)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Sends a signal (e.g. "TERM", "HUP") to the daemon with kill(1).
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -{sig} {} failed", self.pid());
    }

    /// Sends TERM and waits until quill no longer accepts connections: it has taken the
    /// stop in. A probe whose SYN meets a listener being closed can be dropped and sent
    /// again only after the kernel's 1 s retransmission timeout (seen: the wait took
    /// 1.01 s, past quill's moment for a next request at a stop), so a probe not
    /// answered within 100 ms counts as refused: on loopback a listener that still
    /// accepts answers a SYN at once.
    pub fn stop_accepting(&self) {
        self.signal("TERM");
        let addr = self.addr();
        wait_until(Duration::from_secs(5), "quill stops accepting", || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err()
        });
    }

    /// `answer` came after a stop on `s`: it says `Connection: close`, the connection then
    /// closes, and quill exits (within 10 s, not after `shutdown_grace`).
    pub fn expect_last_answer(&mut self, mut s: TcpStream, answer: &http_echo::Response) {
        assert_eq!(
            answer.field("connection").as_deref(),
            Some("close"),
            "{}",
            answer.head
        );
        expect_closed(&mut s, Duration::from_secs(10));
        drop(s);
        assert!(
            self.wait_exit(Duration::from_secs(10)).is_some(),
            "quill still runs, waiting out shutdown_grace"
        );
    }

    /// Waits up to `timeout` for the daemon to exit; its exit code if it did
    /// (None for death by signal).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<Option<i32>> {
        let mut code = None;
        let exited = poll_until(timeout, || match self.child.try_wait() {
            Ok(Some(s)) => {
                code = Some(s.code());
                true
            }
            _ => false,
        });
        if exited {
            code
        } else {
            None
        }
    }

    /// What the daemon has written to stderr so far.
    pub fn stderr(&self) -> String {
        read_lossy(&self.dir.path().join("stderr"))
    }

    /// Panics if the daemon has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!(
                "quill exited unexpectedly ({status}); stderr:\n{}",
                self.stderr()
            );
        }
    }
}

impl Drop for Quill {
    fn drop(&mut self) {
        let still_running = matches!(self.child.try_wait(), Ok(None));
        let _ = self.child.kill();
        let _ = self.child.wait();
        if thread::panicking() {
            eprintln!(
                "---- {} {:?} ({}) stderr ----\n{}---- end of stderr ----",
                bin().display(),
                self.args,
                if still_running {
                    "was running"
                } else {
                    "had exited"
                },
                self.stderr()
            );
        }
    }
}

fn spawn(dir: &TempDir, foreground: bool, args: &[String]) -> Child {
    let out = File::create(dir.path().join("stdout")).expect("create stdout file");
    let err = File::create(dir.path().join("stderr")).expect("create stderr file");
    let mut cmd = Command::new(bin());
    if foreground {
        cmd.arg("-f");
    }
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .env_remove("RUST_LOG");
    cmd.spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin().display()))
}

fn read_lossy(p: &Path) -> String {
    fs::read(p)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Result of running the binary to completion.
#[derive(Debug)]
pub struct Exit {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `BIN ARGS...` (without adding `-f`) to completion, at most START_DEADLINE.
pub fn run(args: &[&str]) -> Exit {
    run_with(false, args)
}

fn run_with(foreground: bool, args: &[&str]) -> Exit {
    let dir = TempDir::new("run");
    let real = substitute(args, free_port(), dir.path());
    let mut child = spawn(&dir, foreground, &real);
    let mut status = None;
    let exited = poll_until(START_DEADLINE, || match child.try_wait() {
        Ok(Some(s)) => {
            status = Some(s);
            true
        }
        _ => false,
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "expected `{} {}{real:?}` to exit, but it was still running after {START_DEADLINE:?}; stderr:\n{}",
            bin().display(),
            if foreground { "-f " } else { "" },
            read_lossy(&dir.path().join("stderr"))
        );
    }
    Exit {
        code: status.and_then(|s| s.code()),
        stdout: read_lossy(&dir.path().join("stdout")),
        stderr: read_lossy(&dir.path().join("stderr")),
    }
}

fn wait_listening(child: &mut Child, target: &Target) -> Startup {
    let pid = child.id();
    let deadline = Instant::now() + START_DEADLINE;
    let mut pause = Duration::from_micros(500);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Startup::Exited(status.to_string());
        }
        if is_listening(pid, target) {
            return Startup::Ready;
        }
        if Instant::now() >= deadline {
            return Startup::TimedOut;
        }
        thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Socket inodes held by process `pid`.
fn socket_inodes(pid: u32) -> HashSet<String> {
    let mut set = HashSet::new();
    if let Ok(dir) = fs::read_dir(format!("/proc/{pid}/fd")) {
        for e in dir.flatten() {
            if let Ok(link) = fs::read_link(e.path()) {
                let l = link.to_string_lossy();
                if let Some(inode) = l.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')) {
                    set.insert(inode.to_string());
                }
            }
        }
    }
    set
}

/// Whether process `pid` has a UDP socket bound to `port` (read from /proc/net/udp*, so
/// that the check neither sends a datagram nor binds the port itself, which would race
/// the process for it).
pub fn udp_bound(pid: u32, port: u16) -> bool {
    let inodes = socket_inodes(pid);
    ["/proc/net/udp", "/proc/net/udp6"].iter().any(|table| {
        fs::read_to_string(table).is_ok_and(|text| {
            text.lines().skip(1).any(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                f.len() >= 10
                    && f[1]
                        .rsplit(':')
                        .next()
                        .and_then(|p| u16::from_str_radix(p, 16).ok())
                        == Some(port)
                    && inodes.contains(f[9])
            })
        })
    })
}

/// Whether `pid` listens on `target`.  On Linux this reads /proc (so that
/// the check opens no connection: a probe connection would be balanced to a
/// backend and would disturb round robin and client tracking); elsewhere it
/// falls back to a probe connection.
fn is_listening(pid: u32, target: &Target) -> bool {
    let have_proc = Path::new("/proc/net/tcp").exists();
    if !have_proc {
        return match target {
            Target::Tcp(a) => TcpStream::connect_timeout(a, Duration::from_millis(200)).is_ok(),
            Target::Unix(p) => UnixStream::connect(p).is_ok(),
        };
    }
    let inodes = socket_inodes(pid);
    if inodes.is_empty() {
        return false;
    }
    match target {
        Target::Tcp(a) => {
            for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
                let Ok(text) = fs::read_to_string(table) else {
                    continue;
                };
                for line in text.lines().skip(1) {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    if f.len() < 10 || f[3] != "0A" {
                        continue;
                    }
                    let port = f[1]
                        .rsplit(':')
                        .next()
                        .and_then(|p| u16::from_str_radix(p, 16).ok());
                    if port == Some(a.port()) && inodes.contains(f[9]) {
                        return true;
                    }
                }
            }
            false
        }
        Target::Unix(p) => {
            let Ok(text) = fs::read_to_string("/proc/net/unix") else {
                return false;
            };
            let want = p.to_string_lossy();
            text.lines().skip(1).any(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                f.len() >= 8 && f[3] == "00010000" && inodes.contains(f[6]) && f[7] == want
            })
        }
    }
}

// ---------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------

fn with_timeouts(s: TcpStream) -> TcpStream {
    let _ = s.set_read_timeout(Some(IO_TIMEOUT));
    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
    let _ = s.set_nodelay(true);
    s
}

/// Connects to `addr` (from the default source address); panics on failure.
pub fn connect(addr: SocketAddr) -> TcpStream {
    try_connect(addr).unwrap_or_else(|e| panic!("connect to {addr} failed: {e}"))
}

/// Connects to `addr` with the harness's timeouts.
pub fn try_connect(addr: SocketAddr) -> io::Result<TcpStream> {
    TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map(with_timeouts)
}

/// Connects to `addr` from the loopback source address `src` (e.g.
/// "127.0.0.2"), so that the balancer sees a distinct client.
pub fn client_from(src: &str, addr: SocketAddr) -> io::Result<TcpStream> {
    let ip: IpAddr = src
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{src}: {e}")))?;
    let mut last = None;
    // bind(src:0) can collide with ports in TIME_WAIT under heavy churn; retry.
    for _ in 0..20 {
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
        sock.set_reuse_address(true)?;
        if let Err(e) = sock.bind(&SockAddr::from(SocketAddr::new(ip, 0))) {
            last = Some(e);
            continue;
        }
        match sock.connect_timeout(&SockAddr::from(addr), CONNECT_TIMEOUT) {
            Ok(()) => return Ok(with_timeouts(TcpStream::from(sock))),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse || e.raw_os_error() == Some(99) => {
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("client_from: no attempt made")))
}

/// Reads one line (without the newline), byte by byte so nothing after it is
/// consumed.  Ok(None) if the peer closed (EOF or reset) before a full line.
/// Timeouts are returned as errors.
pub fn read_line(r: &mut impl Read) -> io::Result<Option<String>> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match r.read(&mut b) {
            Ok(0) => return Ok(None),
            Ok(_) if b[0] == b'\n' => {
                return Ok(Some(String::from_utf8_lossy(&line).into_owned()));
            }
            Ok(_) => line.push(b[0]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_closed_error(&e) => return Ok(None),
            Err(e) => return Err(e),
        }
    }
}

fn is_closed_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected
    )
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// The first line of a connection through the balancer: the name of the
/// backend serving it, or None if the connection was closed without one.
/// Panics if nothing arrives within the socket's read timeout.
pub fn backend_name(r: &mut impl Read) -> Option<String> {
    match read_line(r) {
        Ok(n) => n,
        Err(e) if is_timeout(&e) => panic!("no backend answered within {IO_TIMEOUT:?}"),
        Err(e) => panic!("reading the backend's name failed: {e}"),
    }
}

/// Asserts that the peer closes `s` (EOF or reset) within `within` without
/// sending a single byte.  Returns how long that took.
pub fn expect_closed_without_data(s: &mut TcpStream, within: Duration) -> Duration {
    let start = Instant::now();
    s.set_read_timeout(Some(within)).expect("set_read_timeout");
    let mut buf = [0u8; 256];
    let r = s.read(&mut buf);
    let elapsed = start.elapsed();
    match r {
        Ok(0) => elapsed,
        Ok(n) => panic!(
            "expected the connection to be closed, but received {:?}",
            String::from_utf8_lossy(&buf[..n])
        ),
        Err(e) if is_closed_error(&e) => elapsed,
        Err(e) if is_timeout(&e) => panic!("connection still open after {within:?}"),
        Err(e) => panic!("unexpected error while waiting for close: {e}"),
    }
}

/// Asserts that the peer closes `s` within `within`, accepting any data that
/// arrives before the close.  Returns (data received, time taken).
pub fn expect_closed(s: &mut TcpStream, within: Duration) -> (Vec<u8>, Duration) {
    let start = Instant::now();
    let deadline = start + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            panic!(
                "connection still open after {within:?} (received {:?})",
                String::from_utf8_lossy(&got)
            );
        }
        s.set_read_timeout(Some(left)).expect("set_read_timeout");
        match s.read(&mut buf) {
            Ok(0) => return (got, start.elapsed()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if is_closed_error(&e) => return (got, start.elapsed()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if is_timeout(&e) => {}
            Err(e) => panic!("unexpected error while waiting for close: {e}"),
        }
    }
}

/// Tallies backend names: name -> count.
pub fn tally<'a>(names: impl IntoIterator<Item = &'a String>) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for n in names {
        *m.entry(n.clone()).or_insert(0) += 1;
    }
    m
}

// ---------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Echo each chunk as soon as it is read.
    Echo,
    /// Collect everything until the client half-closes, then send it back.
    Deferred,
    /// Shut the write side down right after the name, then read until EOF.
    Listen,
}

struct ListenerHandle {
    /// A clone of the listening socket, used to wake and stop the acceptor.
    sock: TcpListener,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

struct BackendInner {
    name: String,
    addr: SocketAddr,
    mode: Mode,
    accepted: AtomicUsize,
    open: AtomicUsize,
    received: AtomicUsize,
    conns: Mutex<HashMap<u64, TcpStream>>,
    next_id: AtomicU64,
    listener: Mutex<Option<ListenerHandle>>,
}

/// A backend server in the test process; see the module documentation.
pub struct IdentityBackend {
    inner: Arc<BackendInner>,
}

fn bind_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    if addr.is_ipv6() {
        sock.set_only_v6(true)?;
    }
    sock.bind(&SockAddr::from(addr))?;
    sock.listen(4096)?;
    Ok(TcpListener::from(sock))
}

impl IdentityBackend {
    /// An echoing backend named `name` on 127.0.0.1:(free port).
    pub fn start(name: &str) -> IdentityBackend {
        Self::start_at(name, "127.0.0.1:0".parse().expect("addr"), Mode::Echo)
    }

    /// An echoing backend on the given address (port 0 = any free port).
    pub fn start_on(name: &str, addr: &str) -> IdentityBackend {
        let a: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
        Self::start_at(name, a, Mode::Echo)
    }

    /// A backend that sends its name at once but holds back the echo until
    /// the client has half-closed, then sends everything back at once.
    pub fn start_deferred(name: &str) -> IdentityBackend {
        Self::start_at(name, "127.0.0.1:0".parse().expect("addr"), Mode::Deferred)
    }

    /// A backend that sends its name, at once shuts down its write side (the
    /// client sees EOF after the name) and then only reads, counting bytes.
    pub fn start_listening_only(name: &str) -> IdentityBackend {
        Self::start_at(name, "127.0.0.1:0".parse().expect("addr"), Mode::Listen)
    }

    fn start_at(name: &str, addr: SocketAddr, mode: Mode) -> IdentityBackend {
        let listener =
            bind_listener(addr).unwrap_or_else(|e| panic!("backend {name}: bind {addr}: {e}"));
        let addr = listener.local_addr().expect("local_addr");
        let inner = Arc::new(BackendInner {
            name: name.to_string(),
            addr,
            mode,
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            received: AtomicUsize::new(0),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            listener: Mutex::new(None),
        });
        run_acceptor(&inner, listener);
        IdentityBackend { inner }
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    pub fn port(&self) -> u16 {
        self.inner.addr.port()
    }

    /// The server as a Pen command-line field: "127.0.0.1:PORT" or "[::1]:PORT".
    pub fn spec(&self) -> String {
        match self.inner.addr {
            SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
            SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
        }
    }

    /// `spec()` followed by extra Pen server fields, e.g. `spec_with("2:4")`.
    pub fn spec_with(&self, fields: &str) -> String {
        format!("{}:{fields}", self.spec())
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.inner.accepted.load(Ordering::SeqCst)
    }

    /// Bytes received from clients so far, over all connections.
    pub fn received(&self) -> usize {
        self.inner.received.load(Ordering::SeqCst)
    }

    /// Connections currently open.
    pub fn open(&self) -> usize {
        self.inner.open.load(Ordering::SeqCst)
    }

    /// Closes the listening socket: from now on connects are refused.
    /// Connections already established are not touched.
    pub fn stop(&self) {
        let handle = self.inner.listener.lock().expect("lock").take();
        if let Some(h) = handle {
            h.stop.store(true, Ordering::SeqCst);
            // On Linux shutdown() wakes a thread blocked in accept(); the
            // connect is a fallback for systems where it does not.
            let _ = SockRef::from(&h.sock).shutdown(Shutdown::Both);
            if !h.thread.is_finished() {
                let _ = TcpStream::connect_timeout(&self.inner.addr, Duration::from_millis(200));
            }
            let _ = h.thread.join();
            drop(h.sock);
        }
    }

    /// Listens again on the same address (after [`stop`](Self::stop)).
    pub fn restart(&self) {
        let addr = self.inner.addr;
        let mut listener = None;
        wait_until(
            Duration::from_secs(5),
            format_args!("{addr} can be bound again"),
            || match bind_listener(addr) {
                Ok(l) => {
                    listener = Some(l);
                    true
                }
                Err(_) => false,
            },
        );
        run_acceptor(&self.inner, listener.expect("listener"));
    }

    /// Resets every open connection (the acceptor keeps running).
    pub fn drop_connections(&self) {
        let conns: Vec<TcpStream> = self
            .inner
            .conns
            .lock()
            .expect("lock")
            .drain()
            .map(|(_, s)| s)
            .collect();
        for c in conns {
            let _ = c.shutdown(Shutdown::Both);
        }
    }

    pub fn wait_open(&self, n: usize, timeout: Duration) {
        wait_until(
            timeout,
            format_args!(
                "backend {} has {n} open connections (has {})",
                self.name(),
                self.open()
            ),
            || self.open() == n,
        );
    }

    pub fn wait_accepted(&self, n: usize, timeout: Duration) {
        wait_until(
            timeout,
            format_args!(
                "backend {} has accepted {n} connections (has {})",
                self.name(),
                self.accepted()
            ),
            || self.accepted() >= n,
        );
    }
}

impl Drop for IdentityBackend {
    fn drop(&mut self) {
        self.stop();
        self.drop_connections();
    }
}

fn run_acceptor(inner: &Arc<BackendInner>, listener: TcpListener) {
    let stop = Arc::new(AtomicBool::new(false));
    let clone = listener.try_clone().expect("clone listener");
    let thread = {
        let inner = Arc::clone(inner);
        let stop = Arc::clone(&stop);
        thread::Builder::new()
            .name(format!("backend-{}-accept", inner.name))
            .spawn(move || accept_loop(inner, listener, stop))
            .expect("spawn acceptor")
    };
    *inner.listener.lock().expect("lock") = Some(ListenerHandle {
        sock: clone,
        stop,
        thread,
    });
}

fn accept_loop(inner: Arc<BackendInner>, listener: TcpListener, stop: Arc<AtomicBool>) {
    loop {
        let r = listener.accept();
        if stop.load(Ordering::SeqCst) {
            return;
        }
        match r {
            Ok((stream, _)) => {
                inner.accepted.fetch_add(1, Ordering::SeqCst);
                inner.open.fetch_add(1, Ordering::SeqCst);
                let id = inner.next_id.fetch_add(1, Ordering::SeqCst);
                if let Ok(c) = stream.try_clone() {
                    inner.conns.lock().expect("lock").insert(id, c);
                }
                let inner2 = Arc::clone(&inner);
                let spawned = thread::Builder::new()
                    .stack_size(128 * 1024)
                    .spawn(move || serve(&inner2, stream, id));
                if spawned.is_err() {
                    inner.conns.lock().expect("lock").remove(&id);
                    inner.open.fetch_sub(1, Ordering::SeqCst);
                }
            }
            Err(e) if e.raw_os_error() == Some(24) || e.raw_os_error() == Some(23) => {
                // Out of file descriptors: give the others a moment.
                thread::sleep(Duration::from_millis(5));
            }
            Err(_) => {}
        }
    }
}

fn serve(inner: &BackendInner, mut stream: TcpStream, id: u64) {
    let _ = stream.set_nodelay(true);
    let mut greeting = inner.name.clone().into_bytes();
    greeting.push(b'\n');
    if stream.write_all(&greeting).is_ok() {
        match inner.mode {
            Mode::Echo => {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            inner.received.fetch_add(n, Ordering::SeqCst);
                            if stream.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            }
            Mode::Deferred => {
                let mut all = Vec::new();
                let ok = stream.read_to_end(&mut all).is_ok();
                inner.received.fetch_add(all.len(), Ordering::SeqCst);
                if ok {
                    let _ = stream.write_all(&all);
                }
            }
            Mode::Listen => {
                let _ = stream.shutdown(Shutdown::Write);
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match stream.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            inner.received.fetch_add(n, Ordering::SeqCst);
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
            }
        }
        let _ = stream.shutdown(Shutdown::Write);
    }
    drop(stream);
    inner.conns.lock().expect("lock").remove(&id);
    inner.open.fetch_sub(1, Ordering::SeqCst);
}

/// A server that never answers: its listen queue (backlog 0) is kept full,
/// so the kernel drops further SYNs and a connect to it times out, as with a
/// hung or unreachable host.  [`revive`](Self::revive) turns it into a
/// normal [`IdentityBackend`] on the same port.
pub struct UnresponsiveBackend {
    listener: TcpListener,
    fillers: Vec<TcpStream>,
    addr: SocketAddr,
}

impl UnresponsiveBackend {
    /// On 127.0.0.1:(free port).
    pub fn start() -> UnresponsiveBackend {
        Self::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
    }

    /// On the given IPv4 address, e.g. the address of a stopped
    /// [`IdentityBackend`] (retried for up to 5 s if the port is busy).
    pub fn start_on(addr: SocketAddr) -> UnresponsiveBackend {
        let bind = || -> io::Result<TcpListener> {
            let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
            sock.set_reuse_address(true)?;
            sock.bind(&SockAddr::from(addr))?;
            sock.listen(0)?;
            Ok(TcpListener::from(sock))
        };
        let mut listener = None;
        wait_until(
            Duration::from_secs(5),
            format_args!("{addr} can be bound"),
            || {
                listener = bind().ok();
                listener.is_some()
            },
        );
        let listener = listener.expect("listener");
        let addr = listener.local_addr().expect("local_addr");
        // Fill the accept queue until a connect times out.
        let mut fillers = Vec::new();
        for _ in 0..8 {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
                Ok(s) => fillers.push(s),
                Err(_) => break,
            }
        }
        assert!(
            fillers.len() < 8,
            "could not fill the listen queue of {addr}"
        );
        UnresponsiveBackend {
            listener,
            fillers,
            addr,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn spec(&self) -> String {
        format!("{}:{}", self.addr.ip(), self.addr.port())
    }

    /// Starts answering as an echoing [`IdentityBackend`] named `name`.  The
    /// connections that filled the queue are closed first, but the backend
    /// still accepts them (its counters include them).
    pub fn revive(self, name: &str) -> IdentityBackend {
        drop(self.fillers);
        let _ = SockRef::from(&self.listener).listen(4096);
        let inner = Arc::new(BackendInner {
            name: name.to_string(),
            addr: self.addr,
            mode: Mode::Echo,
            accepted: AtomicUsize::new(0),
            open: AtomicUsize::new(0),
            received: AtomicUsize::new(0),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            listener: Mutex::new(None),
        });
        run_acceptor(&inner, self.listener);
        IdentityBackend { inner }
    }
}

// ---------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------

/// A small deterministic pseudo-random generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// Debian's python3 when it has hyper-h2 (python3-h2); `None`, said, when it has not.
pub fn python_h2() -> Option<&'static str> {
    let python = "/usr/bin/python3";
    let has_h2 = Command::new(python)
        .args(["-c", "import h2, hyperframe, hpack"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_h2 {
        eprintln!("SKIPPED: python3-h2 is not installed (.ci/run installs it)");
        return None;
    }
    Some(python)
}

/// Runs `program args` and returns its output; `None` (with a message) when it is not
/// installed. Panics when it fails.
pub fn tool(program: &str, args: &[&str]) -> Option<String> {
    match Command::new(program).args(args).output() {
        Ok(out) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success(), "{program} {args:?} failed:\n{text}");
            Some(text)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("SKIPPED: {program} is not installed (.ci/run installs it)");
            None
        }
        Err(e) => panic!("{program}: {e}"),
    }
}

/// The lowest descriptor number process `pid` has free.
pub fn lowest_free_fd(pid: u32) -> usize {
    let used: std::collections::HashSet<usize> = fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !used.contains(n)).unwrap()
}

/// Sets the soft limit on open files of process `pid` (the hard limit stays).
pub fn set_fd_limit(pid: u32, soft: u64) {
    let out = std::process::Command::new("prlimit")
        .arg(format!("--pid={pid}"))
        .arg(format!("--nofile={soft}:"))
        .output()
        .expect("run prlimit (util-linux)");
    assert!(
        out.status.success(),
        "prlimit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
