//! quill-loadgen: the load generator of quill's benchmark for what wrk cannot do.
//!
//! * `latency`: open-loop, constant request rate over keep-alive connections, latency
//!   measured from each request's *scheduled* send time, so a stalled balancer is charged
//!   for the requests it delayed (no coordinated omission, as wrk2 does it).
//! * `count`: a fixed number of keep-alive requests as fast as possible (for strace -c,
//!   where the figure of merit is system calls per request, not speed).
//! * `idle`: opens N connections spread over several source addresses and holds them
//!   until stdin closes (memory per idle proxied connection).
//! * `dns`: open-loop, constant rate of DNS queries over UDP like `latency`, but every
//!   query goes out of a fresh socket, so from a new source port, as real resolvers send
//!   them (glibc's stub, `dig`, recursive resolvers randomising their ports): to a flow
//!   based balancer every query is a new flow. dnsperf keeps its sockets and ports.
//!
//! One OS thread per connection (for `dns`: per sender) with plain blocking sockets: `thread::sleep` paces with
//! microsecond precision (hrtimers), which a millisecond-tick async timer cannot. Every
//! result is one JSON object on stdout.

use std::io::{self, BufRead, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde_json::json;
use socket2::{Domain, Socket, Type};

const USAGE: &str = "usage:
  quill-loadgen latency --addr HOST:PORT [--path /1k] --rate REQ_PER_S [--connections 50] [--duration 10] [--warmup 2]
  quill-loadgen count   --addr HOST:PORT [--path /1k] --requests N [--connections 50]
  quill-loadgen idle    --addr HOST:PORT --connections N [--sources 127.0.0.2,127.0.0.3]
  quill-loadgen dns     --addr HOST:PORT --rate Q_PER_S [--connections 10] [--duration 10] [--warmup 2]
                        [--name www.example.] [--timeout 1]
                        (a new UDP socket, so a new source port, for every query; type A, class IN)";

/// Longest response head accepted; the benchmark's backends send small heads.
const MAX_HEAD: usize = 16 * 1024;

#[derive(Debug)]
struct Args {
    mode: String,
    addr: SocketAddr,
    path: String,
    rate: f64,
    connections: usize,
    duration: Duration,
    warmup: Duration,
    requests: u64,
    sources: Vec<IpAddr>,
    /// `dns`: the name asked for, and how long to wait for each answer.
    name: String,
    timeout: Duration,
}

fn parse_args() -> Result<Args, String> {
    use lexopt::prelude::*;
    let mut p = lexopt::Parser::from_env();
    let mut mode = None;
    let mut addr = None;
    let mut connections = None;
    let mut a = Args {
        mode: String::new(),
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        path: "/1k".into(),
        rate: 0.0,
        connections: 50,
        duration: Duration::from_secs(10),
        warmup: Duration::from_secs(2),
        requests: 0,
        sources: Vec::new(),
        name: "www.example.".into(),
        timeout: Duration::from_secs(1),
    };
    fn text(p: &mut lexopt::Parser) -> Result<String, String> {
        let v = p.value().map_err(|e| e.to_string())?;
        Ok(v.to_string_lossy().into_owned())
    }
    fn num<T: std::str::FromStr>(p: &mut lexopt::Parser, what: &str) -> Result<T, String> {
        let s = text(p)?;
        s.parse().map_err(|_| format!("{what}: not a number: {s}"))
    }
    while let Some(arg) = p.next().map_err(|e| e.to_string())? {
        match arg {
            Long("addr") => {
                let v = p.value().map_err(|e| e.to_string())?;
                let s = v.to_string_lossy().into_owned();
                addr = Some(
                    s.parse()
                        .map_err(|_| format!("--addr: not HOST:PORT: {s}"))?,
                );
            }
            Long("path") => a.path = text(&mut p)?,
            Long("rate") => a.rate = num(&mut p, "--rate")?,
            Long("connections") => connections = Some(num(&mut p, "--connections")?),
            Long("duration") => a.duration = Duration::from_secs_f64(num(&mut p, "--duration")?),
            Long("warmup") => a.warmup = Duration::from_secs_f64(num(&mut p, "--warmup")?),
            Long("requests") => a.requests = num(&mut p, "--requests")?,
            Long("name") => a.name = text(&mut p)?,
            Long("timeout") => {
                let s: f64 = num(&mut p, "--timeout")?;
                if !(s > 0.0 && s < 3600.0) {
                    return Err("--timeout must be between 0 and 3600 seconds".into());
                }
                a.timeout = Duration::from_secs_f64(s);
            }
            Long("sources") => {
                let v = p.value().map_err(|e| e.to_string())?;
                for s in v.to_string_lossy().split(',').filter(|s| !s.is_empty()) {
                    a.sources.push(
                        s.parse()
                            .map_err(|_| format!("--sources: not an IP: {s}"))?,
                    );
                }
            }
            Long("help") | Short('h') => return Err(USAGE.into()),
            Value(v) if mode.is_none() => mode = Some(v.to_string_lossy().into_owned()),
            other => return Err(format!("{}\n{USAGE}", other.unexpected())),
        }
    }
    a.mode = mode.ok_or(USAGE)?;
    a.addr = addr.ok_or("--addr is required")?;
    // dnsperf's default of ten sockets for `dns`, fifty connections for the others.
    a.connections = connections.unwrap_or(if a.mode == "dns" { 10 } else { 50 });
    if a.connections == 0 {
        return Err("--connections must be at least 1".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("quill-loadgen: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match args.mode.as_str() {
        "latency" if args.rate > 0.0 => latency(&args),
        "latency" => Err("latency needs --rate > 0".into()),
        "count" if args.requests > 0 => count(&args),
        "count" => Err("count needs --requests > 0".into()),
        "idle" => idle(&args),
        "dns" if args.rate > 0.0 => dns(&args),
        "dns" => Err("dns needs --rate > 0".into()),
        m => Err(format!("unknown mode {m}\n{USAGE}")),
    };
    match result {
        Ok(v) => {
            println!("{v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("quill-loadgen: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One keep-alive HTTP/1.1 client connection with its read buffer.
struct Client {
    stream: TcpStream,
    request: Vec<u8>,
    buf: Vec<u8>,
}

impl Client {
    fn connect(addr: SocketAddr, path: &str) -> io::Result<Client> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").into_bytes();
        Ok(Client {
            stream,
            request,
            buf: Vec::with_capacity(4096),
        })
    }

    fn send(&mut self) -> io::Result<()> {
        self.stream.write_all(&self.request)
    }

    /// Reads one whole response (head and Content-Length body). Bytes after it stay in
    /// the buffer for the next response.
    fn receive(&mut self) -> io::Result<u16> {
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 32];
            let mut resp = httparse::Response::new(&mut headers);
            match resp.parse(&self.buf) {
                Ok(httparse::Status::Complete(head)) => {
                    let status = resp.code.unwrap_or(0);
                    let len = content_length(resp.headers)?;
                    let total = head + len;
                    while self.buf.len() < total {
                        self.fill()?;
                    }
                    self.buf.drain(..total);
                    return Ok(status);
                }
                Ok(httparse::Status::Partial) if self.buf.len() < MAX_HEAD => self.fill()?,
                Ok(httparse::Status::Partial) => return Err(bad("response head too long")),
                Err(e) => return Err(bad(&format!("bad response: {e}"))),
            }
        }
    }

    fn fill(&mut self) -> io::Result<()> {
        let mut chunk = [0u8; 64 * 1024];
        let n = self.stream.read(&mut chunk)?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }
}

fn content_length(headers: &[httparse::Header<'_>]) -> io::Result<usize> {
    for h in headers {
        if h.name.eq_ignore_ascii_case("content-length") {
            return std::str::from_utf8(h.value)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| bad("bad Content-Length"));
        }
    }
    Err(bad("response without Content-Length"))
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// What one connection thread measured.
struct Tally {
    hist: Histogram<u64>,
    ok: u64,
    /// `dns`: queries without an answer within --timeout.
    lost: u64,
    errors: u64,
    late: u64,
}

impl Tally {
    fn new() -> Result<Tally, String> {
        Ok(Tally {
            hist: new_hist()?,
            ok: 0,
            lost: 0,
            errors: 0,
            late: 0,
        })
    }

    /// Sleeps until `due`; a send more than one `period` behind it is counted late.
    fn wait_for(&mut self, due: Instant, period: Duration) {
        let now = Instant::now();
        if due > now {
            thread::sleep(due - now);
        } else if now - due > period {
            self.late += 1;
        }
    }

    /// An answer to the request due at `due`.
    fn record(&mut self, due: Instant) {
        self.ok += 1;
        let us = due.elapsed().as_micros() as u64;
        self.hist.saturating_record(us.max(1));
    }
}

/// The threads' tallies, merged.
fn gather(threads: Vec<thread::JoinHandle<Result<Tally, String>>>) -> Result<Tally, String> {
    let mut all = Tally::new()?;
    for t in threads {
        let t = t.join().map_err(|_| "a load thread panicked")??;
        all.hist.add(&t.hist).map_err(|e| e.to_string())?;
        all.ok += t.ok;
        all.lost += t.lost;
        all.errors += t.errors;
        all.late += t.late;
    }
    Ok(all)
}

fn new_hist() -> Result<Histogram<u64>, String> {
    // 1 µs .. 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000, 3).map_err(|e| e.to_string())
}

/// The timetable of an open-loop mode: each of `a.connections` threads sends every
/// `period`, the threads staggered evenly over one period; what is due before
/// `measure_from` is the warm-up.
struct Schedule {
    period: Duration,
    start: Instant,
    measure_from: Instant,
    end: Instant,
    threads: usize,
}

impl Schedule {
    fn new(a: &Args) -> Schedule {
        let start = Instant::now() + Duration::from_millis(100);
        Schedule {
            period: Duration::from_secs_f64(a.connections as f64 / a.rate),
            start,
            measure_from: start + a.warmup,
            end: start + a.warmup + a.duration,
            threads: a.connections,
        }
    }

    /// When thread `i` sends first.
    fn first(&self, i: usize) -> Instant {
        self.start + self.period.mul_f64(i as f64 / self.threads as f64)
    }
}

fn latency(a: &Args) -> Result<serde_json::Value, String> {
    let sched = Schedule::new(a);
    let (period, measure_from, end) = (sched.period, sched.measure_from, sched.end);
    let mut threads = Vec::with_capacity(a.connections);
    for i in 0..a.connections {
        let (addr, path) = (a.addr, a.path.clone());
        let first = sched.first(i);
        threads.push(thread::spawn(move || -> Result<Tally, String> {
            let mut t = Tally::new()?;
            let mut client = Client::connect(addr, &path).map_err(|e| format!("connect: {e}"))?;
            let mut due = first;
            while due < end {
                t.wait_for(due, period);
                let outcome = client.send().and_then(|()| client.receive());
                let counted = due >= measure_from;
                match outcome {
                    Ok(200) if counted => t.record(due),
                    Ok(200) => {}
                    Ok(_) | Err(_) => {
                        if counted {
                            t.errors += 1;
                        }
                        if outcome.is_err() {
                            client = Client::connect(addr, &path)
                                .map_err(|e| format!("reconnect: {e}"))?;
                        }
                    }
                }
                due += period;
            }
            Ok(t)
        }));
    }
    Ok(rate_report("latency", a, &gather(threads)?))
}

fn count(a: &Args) -> Result<serde_json::Value, String> {
    let per = a.requests.div_ceil(a.connections as u64);
    let started = Instant::now();
    let mut threads = Vec::with_capacity(a.connections);
    for _ in 0..a.connections {
        let (addr, path) = (a.addr, a.path.clone());
        threads.push(thread::spawn(move || -> Result<(u64, u64), String> {
            let mut client = Client::connect(addr, &path).map_err(|e| format!("connect: {e}"))?;
            let (mut ok, mut errors) = (0, 0);
            for _ in 0..per {
                match client.send().and_then(|()| client.receive()) {
                    Ok(200) => ok += 1,
                    Ok(_) => errors += 1,
                    Err(_) => {
                        errors += 1;
                        client =
                            Client::connect(addr, &path).map_err(|e| format!("reconnect: {e}"))?;
                    }
                }
            }
            Ok((ok, errors))
        }));
    }
    let (mut ok, mut errors) = (0, 0);
    for t in threads {
        let (o, e) = t.join().map_err(|_| "a connection thread panicked")??;
        ok += o;
        errors += e;
    }
    Ok(json!({
        "mode": "count",
        "ok": ok,
        "errors": errors,
        "seconds": started.elapsed().as_secs_f64(),
    }))
}

fn idle(a: &Args) -> Result<serde_json::Value, String> {
    let sources = if a.sources.is_empty() {
        vec![IpAddr::from([127, 0, 0, 1])]
    } else {
        a.sources.clone()
    };
    let started = Instant::now();
    let mut held = Vec::with_capacity(a.connections);
    for i in 0..a.connections {
        let src = sources[i % sources.len()];
        let sock = Socket::new(Domain::for_address(a.addr), Type::STREAM, None)
            .map_err(|e| format!("socket: {e}"))?;
        sock.bind(&SocketAddr::new(src, 0).into())
            .map_err(|e| format!("bind {src}: {e}"))?;
        sock.connect(&a.addr.into())
            .map_err(|e| format!("connect #{i} from {src}: {e}"))?;
        held.push(sock);
    }
    let connect_s = started.elapsed().as_secs_f64();
    println!(
        "{}",
        json!({"mode": "idle", "connected": held.len(), "connect_s": connect_s})
    );
    io::stdout().flush().map_err(|e| e.to_string())?;
    // Hold until the harness closes our stdin, then check every connection is still open.
    for line in io::stdin().lock().lines() {
        if line.is_err() {
            break;
        }
    }
    let mut closed = 0;
    for s in &held {
        s.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        match s.recv(&mut b) {
            Ok(0) => closed += 1,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => closed += 1,
        }
    }
    Ok(json!({"mode": "idle", "held": held.len(), "closed_by_peer": closed}))
}

/// A DNS query for `name` (type A, class IN, recursion desired) with the given ID.
fn dns_query(id: u16, name: &str) -> Result<Vec<u8>, String> {
    let mut q = Vec::with_capacity(12 + name.len() + 6);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00]); // flags: RD
    q.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]); // QDCOUNT 1, no other records
    for label in name.split('.').filter(|l| !l.is_empty()) {
        if label.len() > 63 {
            return Err(format!("--name: label longer than 63 bytes: {label}"));
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    if q.len() - 12 > 255 {
        return Err("--name: longer than 255 bytes".into());
    }
    q.extend_from_slice(&[0, 1, 0, 1]); // QTYPE A, QCLASS IN
    Ok(q)
}

/// A query ID that differs from query to query and from sender to sender (the
/// finaliser of splitmix64 over both counters; no randomness needed).
fn query_id(sender: usize, seq: u64) -> u16 {
    let mut x = ((sender as u64) << 40) ^ seq;
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) as u16
}

enum Answer {
    Ok,
    Lost,
    Error,
}

/// One query from a socket of its own: bound to port 0 (a new source port), used once
/// and closed.
fn ask(addr: SocketAddr, query: &[u8], timeout: Duration) -> Answer {
    let local: SocketAddr = if addr.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sent = UdpSocket::bind(local).and_then(|s| {
        s.connect(addr)?;
        s.set_read_timeout(Some(timeout))?;
        s.send(query)?;
        Ok(s)
    });
    let Ok(sock) = sent else {
        return Answer::Error;
    };
    let mut buf = [0u8; 4096];
    match sock.recv(&mut buf) {
        // At least a header, our ID, QR (a response) and RCODE 0 (NOERROR).
        Ok(n) if n >= 12 && buf[..2] == query[..2] && buf[2] & 0x80 != 0 && buf[3] & 0x0f == 0 => {
            Answer::Ok
        }
        Ok(_) => Answer::Error,
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            Answer::Lost
        }
        Err(_) => Answer::Error,
    }
}

fn dns(a: &Args) -> Result<serde_json::Value, String> {
    dns_query(0, &a.name)?; // a bad --name fails here, before any thread starts
    let sched = Schedule::new(a);
    let (period, measure_from, end) = (sched.period, sched.measure_from, sched.end);
    let mut threads = Vec::with_capacity(a.connections);
    for i in 0..a.connections {
        let (addr, name, timeout) = (a.addr, a.name.clone(), a.timeout);
        let first = sched.first(i);
        threads.push(thread::spawn(move || -> Result<Tally, String> {
            let mut t = Tally::new()?;
            let mut due = first;
            let mut seq = 0u64;
            while due < end {
                t.wait_for(due, period);
                let query = dns_query(query_id(i, seq), &name)?;
                seq += 1;
                let answer = ask(addr, &query, timeout);
                if due >= measure_from {
                    match answer {
                        Answer::Ok => t.record(due),
                        Answer::Lost => t.lost += 1,
                        Answer::Error => t.errors += 1,
                    }
                }
                due += period;
            }
            Ok(t)
        }));
    }
    Ok(rate_report("dns", a, &gather(threads)?))
}

/// The JSON result of an open-loop mode: rates, counts and latency quantiles.
fn rate_report(mode: &str, a: &Args, t: &Tally) -> serde_json::Value {
    let secs = a.duration.as_secs_f64();
    json!({
        "mode": mode,
        "target_rate": a.rate,
        "achieved_rate": t.ok as f64 / secs,
        "connections": a.connections,
        "duration_s": secs,
        "sent": t.ok + t.lost + t.errors,
        "ok": t.ok,
        "lost": t.lost,
        "errors": t.errors,
        "late_sends": t.late,
        "p50_us": t.hist.value_at_quantile(0.50),
        "p90_us": t.hist.value_at_quantile(0.90),
        "p99_us": t.hist.value_at_quantile(0.99),
        "p999_us": t.hist.value_at_quantile(0.999),
        "max_us": t.hist.max(),
        "mean_us": t.hist.mean(),
    })
}
