//! UDP and DNS pieces of the harness, for `tests/udp.rs`.
//!
//! * [`UdpQuill`] starts the daemon with `-f -U` on a free UDP port and waits until the
//!   port is bound (read from /proc/net/udp, so no probe datagram disturbs the balancing).
//! * [`DnsBackend`] is a UDP server on a thread of the test process. A datagram that parses
//!   as a DNS query (one question) is answered with one A record holding the backend's own
//!   address (10.0.0.N), so a test sees who answered; any other datagram (garbage, short,
//!   empty, large) is echoed back unchanged. It can be stopped (its port is then closed, so
//!   the kernel answers with ICMP port unreachable), restarted on the same port, or made
//!   silent (it reads and never answers, like a hung host).
//! * [`UdpClient`] plays one client flow: a socket bound to a chosen loopback address and
//!   connected to the balancer, so that only a reply from the address it sent to counts.
//! * [`query`] / [`answer`] build and read just enough DNS for that.
#![allow(dead_code)]

use std::collections::HashSet;
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use super::{bin, is_pen, poll_until, udp_bound, TempDir, START_DEADLINE};

// ---------------------------------------------------------------------------
// DNS, just enough
// ---------------------------------------------------------------------------

/// An A query for `name` with transaction id `id` (recursion desired).
pub fn query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(32 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Offset just past the question of a message with one question, if it is well formed.
fn question_end(msg: &[u8]) -> Option<usize> {
    let mut i = 12;
    loop {
        let len = *msg.get(i)? as usize;
        if len == 0 {
            i += 1;
            break;
        }
        if len > 63 {
            return None;
        }
        i += 1 + len;
    }
    let end = i + 4;
    (end <= msg.len()).then_some(end)
}

/// The reply of a DNS server answering `q` with the A record `ip`, or None if `q` is not
/// a query with exactly one question (additional records, such as dig's EDNS OPT record,
/// are ignored and not echoed).
pub fn reply_to(q: &[u8], ip: Ipv4Addr) -> Option<Vec<u8>> {
    if q.len() < 12 || q[2] & 0x80 != 0 || q[4..6] != [0, 1] || q[6..10] != [0; 4] {
        return None;
    }
    let end = question_end(q)?;
    let mut r = Vec::with_capacity(end + 16);
    r.extend_from_slice(&q[..2]);
    r.extend_from_slice(&[0x85, 0x80, 0, 1, 0, 1, 0, 0, 0, 0]);
    r.extend_from_slice(&q[12..end]);
    // Name pointer to the question, type A, class IN, TTL 0, 4 bytes of address.
    r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 0, 0, 4]);
    r.extend_from_slice(&ip.octets());
    Some(r)
}

/// The address of the first A record of a reply to query `id`.
pub fn answer(reply: &[u8], id: u16) -> Option<Ipv4Addr> {
    if reply.len() < 12 || reply[..2] != id.to_be_bytes() || reply[2] & 0x80 == 0 {
        return None;
    }
    if reply[6..8] == [0, 0] {
        return None;
    }
    let end = question_end(reply)?;
    let rdata = reply.get(end + 12..end + 16)?;
    Some(Ipv4Addr::new(rdata[0], rdata[1], rdata[2], rdata[3]))
}

/// The answer address of backend number `n`: 10.0.0.n.
pub fn backend_ip(n: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, n)
}

// ---------------------------------------------------------------------------
// Backends
// ---------------------------------------------------------------------------

struct BackendInner {
    ip: Ipv4Addr,
    addr: SocketAddr,
    silent: AtomicBool,
    /// Milliseconds to wait before each answer.
    delay_ms: AtomicU64,
    /// Milliseconds after an answer to send it again (a server that answers twice); 0 =
    /// once.
    again_ms: AtomicU64,
    /// Where the last datagram came from.
    last_sender: Mutex<Option<SocketAddr>>,
    stop: AtomicBool,
    received: AtomicUsize,
    answered: AtomicUsize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// A DNS-speaking (and otherwise echoing) UDP backend; see the module documentation.
pub struct DnsBackend {
    inner: Arc<BackendInner>,
}

impl DnsBackend {
    /// Backend answering 10.0.0.`n`, on 127.0.0.1:(free port).
    pub fn start(n: u8) -> DnsBackend {
        Self::start_on(n, "127.0.0.1:0")
    }

    /// Backend answering 10.0.0.`n`, on `addr` (e.g. "[::1]:0").
    pub fn start_on(n: u8, addr: &str) -> DnsBackend {
        let wanted: SocketAddr = addr.parse().unwrap_or_else(|e| panic!("{addr}: {e}"));
        let sock = if wanted.port() == 0 {
            bind_own_port(wanted.ip())
        } else {
            UdpSocket::bind(wanted).unwrap_or_else(|e| panic!("bind {addr}: {e}"))
        };
        let addr = sock.local_addr().expect("local_addr");
        let inner = Arc::new(BackendInner {
            ip: backend_ip(n),
            addr,
            silent: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            again_ms: AtomicU64::new(0),
            last_sender: Mutex::new(None),
            stop: AtomicBool::new(false),
            received: AtomicUsize::new(0),
            answered: AtomicUsize::new(0),
            thread: Mutex::new(None),
        });
        run(&inner, sock);
        DnsBackend { inner }
    }

    pub fn ip(&self) -> Ipv4Addr {
        self.inner.ip
    }

    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// As a Pen server argument: "127.0.0.1:PORT" or "[::1]:PORT".
    pub fn spec(&self) -> String {
        match self.inner.addr {
            SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
            SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
        }
    }

    /// Datagrams received so far.
    pub fn received(&self) -> usize {
        self.inner.received.load(Ordering::SeqCst)
    }

    /// Datagrams answered so far.
    pub fn answered(&self) -> usize {
        self.inner.answered.load(Ordering::SeqCst)
    }

    /// Keep reading but never answer (like a hung host), or answer again.
    pub fn set_silent(&self, silent: bool) {
        self.inner.silent.store(silent, Ordering::SeqCst);
    }

    /// Answers each datagram `delay` after reading it (one at a time: a slow server).
    pub fn set_delay(&self, delay: Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.inner.delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Sends every answer a second time, `after` the first (a server that answers a
    /// datagram twice, or whose late copy comes after the client has moved on).
    pub fn set_answer_twice(&self, after: Duration) {
        let ms = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
        self.inner.again_ms.store(ms, Ordering::SeqCst);
    }

    /// The address and port the last datagram came from.
    pub fn last_sender(&self) -> Option<SocketAddr> {
        *self.inner.last_sender.lock().expect("lock")
    }

    /// Closes the socket: datagrams to the port now get ICMP port unreachable.
    pub fn stop(&self) {
        self.inner.stop.store(true, Ordering::SeqCst);
        let t = self.inner.thread.lock().expect("lock").take();
        if let Some(t) = t {
            let _ = t.join();
        }
    }

    /// Listens again on the same address after [`stop`](Self::stop).
    pub fn restart(&self) {
        self.stop();
        let mut sock = None;
        let addr = self.inner.addr;
        assert!(
            poll_until(Duration::from_secs(5), || {
                sock = UdpSocket::bind(addr).ok();
                sock.is_some()
            }),
            "cannot bind {addr} again"
        );
        self.inner.stop.store(false, Ordering::SeqCst);
        run(&self.inner, sock.expect("socket"));
    }
}

impl Drop for DnsBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

fn run(inner: &Arc<BackendInner>, sock: UdpSocket) {
    // The read timeout only bounds how long stop() waits for the thread to notice.
    sock.set_read_timeout(Some(Duration::from_millis(50)))
        .expect("timeout");
    let inner2 = Arc::clone(inner);
    let t = thread::Builder::new()
        .name(format!("dns-{}", inner.ip))
        .spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !inner2.stop.load(Ordering::SeqCst) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                *inner2.last_sender.lock().expect("lock") = Some(from);
                inner2.received.fetch_add(1, Ordering::SeqCst);
                if inner2.silent.load(Ordering::SeqCst) {
                    continue;
                }
                let delay = inner2.delay_ms.load(Ordering::SeqCst);
                if delay > 0 {
                    thread::sleep(Duration::from_millis(delay));
                }
                let data = &buf[..n];
                let reply = reply_to(data, inner2.ip).unwrap_or_else(|| data.to_vec());
                if sock.send_to(&reply, from).is_ok() {
                    inner2.answered.fetch_add(1, Ordering::SeqCst);
                }
                let again = inner2.again_ms.load(Ordering::SeqCst);
                if again > 0 {
                    thread::sleep(Duration::from_millis(again));
                    if sock.send_to(&reply, from).is_ok() {
                        inner2.answered.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        })
        .expect("spawn backend");
    *inner.thread.lock().expect("lock") = Some(t);
}

// ---------------------------------------------------------------------------
// Clients
// ---------------------------------------------------------------------------

static NEXT_ID: AtomicU16 = AtomicU16::new(1);

/// One client flow: a socket bound to `src` (any port) and connected to the balancer.
pub struct UdpClient {
    pub sock: UdpSocket,
}

impl UdpClient {
    /// A flow from `src` (e.g. "127.0.0.2", "::1") to `to`.
    pub fn new(src: &str, to: SocketAddr) -> UdpClient {
        let ip: IpAddr = src.parse().unwrap_or_else(|e| panic!("{src}: {e}"));
        let sock = UdpSocket::bind(SocketAddr::new(ip, 0)).expect("bind client");
        sock.connect(to).expect("connect client");
        UdpClient { sock }
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.sock.local_addr().expect("local_addr")
    }

    /// Sends `data` and waits up to `wait` for one datagram back.
    pub fn exchange(&self, data: &[u8], wait: Duration) -> Option<Vec<u8>> {
        self.sock.send(data).ok()?;
        self.receive(wait)
    }

    /// Waits up to `wait` for one datagram.
    pub fn receive(&self, wait: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + wait;
        let mut buf = vec![0u8; 65_536];
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            self.sock
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .ok()?;
            match self.sock.recv(&mut buf) {
                Ok(n) => return Some(buf[..n].to_vec()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                // ECONNREFUSED (the balancer is gone) or a timeout: nothing came.
                Err(_) if Instant::now() < deadline => {}
                Err(_) => return None,
            }
        }
    }

    /// Sends one A query and waits up to `wait` for its answer.
    pub fn ask(&self, wait: Duration) -> Option<Ipv4Addr> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.sock.send(&query(id, "who.example")).ok()?;
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let reply = self.receive(left)?;
            // A late answer to an earlier query is skipped.
            if let Some(ip) = answer(&reply, id) {
                return Some(ip);
            }
        }
    }

    /// Asks again every `every` (as a resolver retries), on this same flow, until an
    /// answer comes or `total` has passed.
    pub fn ask_retrying(&self, every: Duration, total: Duration) -> Option<Ipv4Addr> {
        let deadline = Instant::now() + total;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            if let Some(ip) = self.ask(every.min(left)) {
                return Some(ip);
            }
        }
    }
}

/// `dig` is installed (Debian dnsutils).
pub fn have_dig() -> bool {
    Command::new("dig")
        .arg("-v")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// Asks with `dig @HOST -p PORT -b SRC who.example A +short`, one try of `secs` seconds;
/// the answer address, if any.
pub fn dig(server: SocketAddr, src: &str, secs: u32) -> Option<Ipv4Addr> {
    let out = Command::new("dig")
        .arg(format!("@{}", server.ip()))
        .args(["-p", &server.port().to_string(), "-b", src])
        .args(["who.example", "A", "+short", "+tries=1"])
        .arg(format!("+time={secs}"))
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.trim().parse().ok())
}

// ---------------------------------------------------------------------------
// The daemon in UDP mode
// ---------------------------------------------------------------------------

/// A free UDP port (one of [`bind_own_port`]'s on 0.0.0.0, released): no concurrent
/// test's socket is given it before the daemon binds it.
pub fn free_udp_port() -> u16 {
    let s = bind_own_port(Ipv4Addr::UNSPECIFIED.into());
    s.local_addr().expect("local_addr").port()
}

/// `127.0.0.1:PORT` where nothing listens and nothing of a concurrent test will, so
/// datagrams to it draw ICMP port unreachable: a port of [`bind_own_port`]'s, bound once
/// and closed. (A port freed by a socket bound to port 0 does not do: the thousands of
/// sockets `udp.rs`'s tests open may be given it.)
pub fn refused_udp_spec() -> String {
    let port = bind_own_port(Ipv4Addr::LOCALHOST.into())
        .local_addr()
        .expect("local_addr")
        .port();
    format!("127.0.0.1:{port}")
}

/// Where [`bind_own_port`] looks next.
static NEXT_OWN_PORT: AtomicU16 = AtomicU16::new(0);

/// A UDP socket on `ip` at a port below the kernel's ephemeral range (32768 and up here),
/// which a `bind` to port 0 is never given, and never handed out twice by this process:
/// so a backend that stops leaves its port closed until it binds it again, whatever the
/// concurrent tests open. The range starts at an offset from the process id, as test
/// binaries of other runs may hold some of it.
fn bind_own_port(ip: IpAddr) -> UdpSocket {
    const FIRST: u16 = 20_000;
    const SPAN: u16 = 10_000;
    let base = (std::process::id() % u32::from(SPAN)) as u16;
    (0..SPAN)
        .find_map(|_| {
            let n = NEXT_OWN_PORT.fetch_add(1, Ordering::Relaxed);
            let port = FIRST + base.wrapping_add(n) % SPAN;
            UdpSocket::bind((ip, port)).ok()
        })
        .unwrap_or_else(|| panic!("no free UDP port on {ip} in {FIRST}..{}", FIRST + SPAN))
}

/// A TCP port that was free a moment ago (for `-C`).
pub fn free_tcp_port() -> u16 {
    super::free_port()
}

/// quill (or Pen) started as `BIN -f -U ARGS...`; killed on drop.
pub struct UdpQuill {
    child: Child,
    pub port: u16,
    target: SocketAddr,
    args: Vec<String>,
    dir: TempDir,
    /// Where quill says it is ready (`NOTIFY_SOCKET`), kept open for its later messages.
    _notify: Option<UnixDatagram>,
}

fn read_lossy(p: &Path) -> String {
    fs::read(p)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

impl UdpQuill {
    /// Starts `BIN -f -U ARGS...`, `{port}` standing for a free UDP port and `{cport}` for a
    /// free TCP port; waits until the UDP port is bound and, for quill, until it says it is
    /// ready (sd_notify `READY=1`: a socket of quill's on the port could still be the probe
    /// bind that start-up closes before binding the real ones). Panics with the daemon's
    /// stderr if it does not come up.
    pub fn start(args: &[&str]) -> UdpQuill {
        UdpQuill::try_start(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`UdpQuill::start`] returning the failure (with the daemon's stderr) instead.
    pub fn try_start(args: &[&str]) -> Result<UdpQuill, String> {
        let mut failures = Vec::new();
        for _ in 0..5 {
            let dir = TempDir::new("udp");
            let port = free_udp_port();
            let cport = free_tcp_port();
            let real: Vec<String> = args
                .iter()
                .map(|a| {
                    a.replace("{port}", &port.to_string())
                        .replace("{cport}", &cport.to_string())
                        .replace("{dir}", &dir.path().to_string_lossy())
                })
                .collect();
            let template = args
                .iter()
                .find(|a| a.contains("{port}"))
                .copied()
                .unwrap_or("{port}");
            let ip: IpAddr = if template.starts_with('[') || template.starts_with("::") {
                let host = template
                    .trim_start_matches('[')
                    .split(']')
                    .next()
                    .unwrap_or("");
                match host.parse::<IpAddr>() {
                    Ok(ip) if !ip.is_unspecified() => ip,
                    _ => "::1".parse().expect("::1"),
                }
            } else {
                match template.rsplit_once(':').map(|(h, _)| h.parse::<IpAddr>()) {
                    Some(Ok(ip)) if !ip.is_unspecified() => ip,
                    _ => IpAddr::V4(Ipv4Addr::LOCALHOST),
                }
            };
            let out = fs::File::create(dir.path().join("stdout")).expect("stdout file");
            let err = fs::File::create(dir.path().join("stderr")).expect("stderr file");
            let mut command = Command::new(bin());
            command
                .args(["-f", "-U"])
                .args(&real)
                .stdin(Stdio::null())
                .stdout(Stdio::from(out))
                .stderr(Stdio::from(err))
                .env_remove("RUST_LOG");
            let notify = (!is_pen()).then(|| {
                let path = dir.path().join("notify.sock");
                let sock = UnixDatagram::bind(&path).expect("bind the notify socket");
                sock.set_nonblocking(true)
                    .expect("nonblocking notify socket");
                command.env("NOTIFY_SOCKET", &path);
                sock
            });
            let mut child = command
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin().display()));
            let pid = child.id();
            let mut exited = None;
            let mut ready = notify.is_none();
            let up = poll_until(START_DEADLINE, || {
                if let Ok(Some(st)) = child.try_wait() {
                    exited = Some(st);
                    return true;
                }
                if let Some(sock) = &notify {
                    let mut msg = [0u8; 512];
                    while let Ok(n) = sock.recv(&mut msg) {
                        ready |= msg[..n].split(|&b| b == b'\n').any(|l| l == b"READY=1");
                    }
                }
                ready && udp_bound(pid, port)
            });
            let stderr = read_lossy(&dir.path().join("stderr"));
            match (up, exited) {
                (true, None) => {
                    return Ok(UdpQuill {
                        child,
                        port,
                        target: SocketAddr::new(ip, port),
                        args: real,
                        dir,
                        _notify: notify,
                    })
                }
                (_, Some(st)) => {
                    failures.push(format!("{real:?} exited ({st}):\n{stderr}"));
                    if !stderr.to_lowercase().contains("in use") {
                        break;
                    }
                }
                (false, None) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(format!(
                        "{real:?} did not bind udp port {port} within {START_DEADLINE:?}:\n{stderr}"
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

    /// Where clients send (127.0.0.1 or ::1 for a wildcard listener).
    pub fn addr(&self) -> SocketAddr {
        self.target
    }

    /// The (substituted) argument that followed `flag` on the command line.
    pub fn arg_after(&self, flag: &str) -> Option<&str> {
        super::arg_after(&self.args, flag)
    }

    /// A client flow from `src` to the balancer.
    pub fn client(&self, src: &str) -> UdpClient {
        UdpClient::new(src, self.addr())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(&self) -> String {
        read_lossy(&self.dir.path().join("stderr"))
    }

    /// Descriptors the daemon has open.
    pub fn fd_count(&self) -> usize {
        fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }

    /// The daemon's UDP sockets connected to `server`: one per live flow to that server.
    /// Read from /proc/net/udp*, keeping only sockets among the daemon's descriptors: a
    /// test running beside this one may hold a socket still connected to a port it used,
    /// which the kernel has since given to this test's backend. The kernel writes those
    /// tables a page at a time and finds its place again by counting: while tests beside
    /// this one open and close sockets, a read can skip a line. So the count is read until
    /// two reads in a row agree.
    pub fn flows_to(&self, server: SocketAddr) -> usize {
        let mut last = self.flows_to_once(server);
        for _ in 0..10 {
            let again = self.flows_to_once(server);
            if again == last {
                break;
            }
            last = again;
        }
        last
    }

    fn flows_to_once(&self, server: SocketAddr) -> usize {
        let own: HashSet<String> = fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|dir| {
                dir.filter_map(|e| fs::read_link(e.ok()?.path()).ok())
                    .filter_map(|target| {
                        let t = target.to_string_lossy();
                        Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
                    })
                    .collect()
            })
            .unwrap_or_default();
        let want = match server.ip() {
            IpAddr::V4(ip) => format!(
                "{:08X}:{:04X}",
                u32::from_ne_bytes(ip.octets()),
                server.port()
            ),
            IpAddr::V6(ip) => {
                let o = ip.octets();
                let words: String = o
                    .chunks(4)
                    .map(|c| format!("{:08X}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
                    .collect();
                format!("{words}:{:04X}", server.port())
            }
        };
        ["/proc/net/udp", "/proc/net/udp6"]
            .iter()
            .filter_map(|t| fs::read_to_string(t).ok())
            .map(|text| {
                text.lines()
                    .skip(1)
                    .map(|l| l.split_whitespace().collect::<Vec<_>>())
                    // Columns: 2 is the remote address, 9 the socket's inode.
                    .filter(|cols| {
                        cols.get(2) == Some(&want.as_str())
                            && cols.get(9).is_some_and(|inode| own.contains(*inode))
                    })
                    .count()
            })
            .sum()
    }

    /// Resident memory of the daemon in KiB.
    pub fn rss_kib(&self) -> usize {
        fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
            })
            .unwrap_or(0)
    }

    /// Sends a signal with kill(1).
    pub fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(st.success());
    }

    /// Waits up to `timeout` for the daemon to exit; its exit status if it did.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        poll_until(timeout, || match self.child.try_wait() {
            Ok(Some(s)) => {
                status = Some(s);
                true
            }
            _ => false,
        });
        status
    }

    /// Panics if the daemon has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(st)) = self.child.try_wait() {
            panic!(
                "quill exited unexpectedly ({st}); stderr:\n{}",
                self.stderr()
            );
        }
    }
}

impl Drop for UdpQuill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if thread::panicking() {
            eprintln!(
                "---- {} -f -U {:?} stderr ----\n{}---- end of stderr ----",
                bin().display(),
                self.args,
                self.stderr()
            );
        }
    }
}

/// Sends one control command with Pen's protocol (a line; the answer until close).
pub fn control(port: u16, line: &str) -> io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(line.as_bytes())?;
    s.write_all(b"\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

/// quill with `args` and a control socket (`-C 127.0.0.1:{cport}`, `-u root` when the
/// tests run as root); its port. `None` (skipped) where the build refuses one.
pub fn with_control(args: &[&str]) -> Option<(UdpQuill, u16)> {
    let mut all = vec!["-C", "127.0.0.1:{cport}"];
    let root = std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    if root {
        all.extend(["-u", "root"]);
    }
    all.extend_from_slice(args);
    let q = match UdpQuill::try_start(&all) {
        Ok(q) => q,
        Err(e) if e.contains("not supported") || e.contains("-C") => {
            eprintln!("SKIPPED: this build refuses the control socket (-C):\n{e}");
            return None;
        }
        Err(e) => panic!("{e}"),
    };
    let cport: u16 = q
        .arg_after("-C")
        .and_then(|v| v.rsplit(':').next().and_then(|p| p.parse().ok()))
        .expect("control port");
    Some((q, cport))
}

/// Sends `line` to quill's control socket; it must not be refused.
pub fn command(cport: u16, line: &str) {
    let reply = control(cport, line).expect("control socket");
    assert!(!reply.contains("error"), "{line}: {reply}");
}
