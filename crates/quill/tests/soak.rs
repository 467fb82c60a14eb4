//! Soak: mixed traffic for a long time through one quill (TCP) and one quill -U (UDP), with
//! backends restarted and the configuration reloaded periodically. Not part of the default
//! run (`#[ignore]`): `tests/soak` runs it for 10 minutes, `tests/soak --quick` for one
//! (CI). The duration comes from `SOAK_SECS`.
//!
//! Traffic: keep-alive connections (many echoes each), short connections (one echo each),
//! large transfers (4 MiB each way, SHA-256 compared), keep-alive connections over TLS
//! (through a second quill that terminates TLS in front of the same backends) and UDP
//! datagrams of every size up to 1,400 bytes (compared byte for byte). Checks at the end: every response byte-exact; the
//! only TCP errors are on connections whose backend was restarted under them; UDP loses
//! (almost) nothing; quill's descriptors come back to where they were; its RSS after
//! warm-up stays flat; no panic in its log.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::dns::{DnsBackend, UdpQuill};
use support::*;

const BACKENDS: usize = 3;

/// What the traffic threads share.
struct World {
    addr: SocketAddr,
    /// The TLS-terminating quill, and the client configuration that trusts its certificate.
    tls_addr: SocketAddr,
    tls_client: Arc<rustls::ClientConfig>,
    stop: AtomicBool,
    /// Counts up when a backend restart begins and again when it is over (odd: one is in
    /// progress). A connection that fails after a restart began since it was opened, or
    /// that was opened during one, failed as expected.
    restart_seq: AtomicU64,
    expected_errors: AtomicUsize,
    unexpected: Mutex<Vec<String>>,
    exchanges: AtomicU64,
    /// Of `exchanges`, those over TLS.
    tls_exchanges: AtomicU64,
    bytes: AtomicU64,
}

impl World {
    /// Records a failed exchange on a connection opened when `restart_seq` was `epoch`.
    fn failed(&self, _name: &str, epoch: u64, what: String) {
        if self.restart_seq.load(Ordering::SeqCst) != epoch || epoch % 2 == 1 {
            self.expected_errors.fetch_add(1, Ordering::Relaxed);
        } else {
            self.unexpected.lock().unwrap().push(what);
        }
    }

    fn running(&self) -> bool {
        !self.stop.load(Ordering::SeqCst)
    }
}

/// One connection through quill: the backend's name and `restart_seq` before it opened.
fn open(world: &World, src: &str) -> Option<(TcpStream, String, u64)> {
    let epoch = world.restart_seq.load(Ordering::SeqCst);
    let mut s = match client_from(src, world.addr) {
        Ok(s) => s,
        Err(e) => {
            world
                .unexpected
                .lock()
                .unwrap()
                .push(format!("connect from {src}: {e}"));
            return None;
        }
    };
    match read_line(&mut s) {
        Ok(Some(name)) => Some((s, name, epoch)),
        // All backends can be down at once only if a restart is in progress: expected.
        Ok(None) => {
            world.expected_errors.fetch_add(1, Ordering::Relaxed);
            None
        }
        Err(e) => {
            world
                .unexpected
                .lock()
                .unwrap()
                .push(format!("greeting from {src}: {e}"));
            None
        }
    }
}

/// Sends `msg`, reads its echo; Err says what went wrong.
fn echo(s: &mut TcpStream, msg: &[u8]) -> Result<(), String> {
    s.write_all(msg).map_err(|e| format!("write: {e}"))?;
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).map_err(|e| format!("read: {e}"))?;
    if back != msg {
        return Err(format!("echo of {} bytes differs", msg.len()));
    }
    Ok(())
}

/// Keep-alive echoes over TLS: the same checks as [`keep_alive`], through the TLS quill.
fn tls_keep_alive(world: &World, id: usize) {
    let mut rng = Rng::new(id as u64 + 77);
    while world.running() {
        let epoch = world.restart_seq.load(Ordering::SeqCst);
        let sock = match client_from(&format!("127.0.8.{}", 1 + id), world.tls_addr) {
            Ok(s) => s,
            Err(e) => {
                world
                    .unexpected
                    .lock()
                    .unwrap()
                    .push(format!("TLS connect: {e}"));
                return;
            }
        };
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let conn = rustls::ClientConnection::new(Arc::clone(&world.tls_client), name).unwrap();
        let mut s = rustls::StreamOwned::new(conn, sock);
        // The backend's greeting is its name and a newline.
        let mut greeting = Vec::new();
        let mut b = [0u8; 1];
        let greeted = loop {
            match s.read(&mut b) {
                Ok(1) if b[0] == b'\n' => break true,
                Ok(1) => greeting.push(b[0]),
                _ => break false,
            }
        };
        if !greeted {
            world.failed("?", epoch, format!("TLS {id}: no greeting"));
            continue;
        }
        let name = String::from_utf8_lossy(&greeting).into_owned();
        let mut n = 0;
        while world.running() && n < 500 {
            let mut msg = vec![0u8; 1 + (rng.next_u64() % 16_384) as usize];
            rng.fill(&mut msg);
            let mut back = vec![0u8; msg.len()];
            let result = s
                .write_all(&msg)
                .and_then(|()| s.flush())
                .and_then(|()| s.read_exact(&mut back));
            match result {
                Ok(()) if back == msg => {
                    world.exchanges.fetch_add(1, Ordering::Relaxed);
                    world.tls_exchanges.fetch_add(1, Ordering::Relaxed);
                    world.bytes.fetch_add(msg.len() as u64, Ordering::Relaxed);
                }
                Ok(()) => {
                    world.unexpected.lock().unwrap().push(format!(
                        "TLS {id} on {name}: echo of {} bytes differs",
                        msg.len()
                    ));
                    break;
                }
                Err(e) => {
                    world.failed(
                        &name,
                        epoch,
                        format!("TLS {id} on {name}, exchange {n}: {e}"),
                    );
                    break;
                }
            }
            n += 1;
        }
    }
}

/// A self-signed certificate for "localhost" in `dir`, and a client configuration that
/// trusts it.
fn tls_identity(dir: &std::path::Path) -> (String, String, Arc<rustls::ClientConfig>) {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    fs::write(&cert, made.cert.pem()).unwrap();
    fs::write(&key, made.signing_key.serialize_pem()).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(made.cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    (
        cert.to_string_lossy().into_owned(),
        key.to_string_lossy().into_owned(),
        Arc::new(config),
    )
}

fn keep_alive(world: &World, id: usize) {
    let mut rng = Rng::new(id as u64 + 1);
    let src = format!("127.0.5.{}", 10 + id);
    while world.running() {
        let Some((mut s, name, epoch)) = open(world, &src) else {
            continue;
        };
        let mut n = 0;
        while world.running() && n < 2000 {
            let mut msg = vec![0u8; 1 + (rng.next_u64() % 16_384) as usize];
            rng.fill(&mut msg);
            match echo(&mut s, &msg) {
                Ok(()) => {
                    world.exchanges.fetch_add(1, Ordering::Relaxed);
                    world.bytes.fetch_add(msg.len() as u64, Ordering::Relaxed);
                }
                Err(e) => {
                    world.failed(
                        &name,
                        epoch,
                        format!("keep-alive {id} on {name}, exchange {n}: {e}"),
                    );
                    break;
                }
            }
            n += 1;
        }
    }
}

fn short(world: &World, id: usize) {
    let mut n = 0u64;
    while world.running() {
        let src = format!("127.0.6.{}", 1 + (n % 200));
        n += 1;
        let Some((mut s, name, epoch)) = open(world, &src) else {
            continue;
        };
        let msg = format!("short {id} #{n}\n");
        match echo(&mut s, msg.as_bytes()) {
            Ok(()) => {
                world.exchanges.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => world.failed(&name, epoch, format!("short {id} #{n} on {name}: {e}")),
        }
    }
}

fn large(world: &World, id: usize) {
    const SIZE: usize = 4 << 20;
    let mut seed = 1000 + id as u64;
    while world.running() {
        let Some((s, name, epoch)) = open(world, &format!("127.0.7.{}", 1 + id)) else {
            continue;
        };
        seed += 1;
        let mut writer = s.try_clone().unwrap();
        let sender = thread::spawn(move || {
            let mut rng = Rng::new(seed);
            let mut hash = Sha256::new();
            let mut chunk = vec![0u8; 64 * 1024];
            for _ in 0..SIZE / chunk.len() {
                rng.fill(&mut chunk);
                hash.update(&chunk);
                if writer.write_all(&chunk).is_err() {
                    return None;
                }
            }
            Some(hash.finalize().to_vec())
        });
        let mut reader = s;
        let mut hash = Sha256::new();
        let mut got = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        let mut error = None;
        while got < SIZE {
            match reader.read(&mut buf[..(SIZE - got).min(64 * 1024)]) {
                Ok(0) => {
                    error = Some(format!("closed after {got} bytes"));
                    break;
                }
                Ok(n) => {
                    hash.update(&buf[..n]);
                    got += n;
                }
                Err(e) => {
                    error = Some(format!("read after {got} bytes: {e}"));
                    break;
                }
            }
        }
        if error.is_some() {
            // Unblock the sender if it is still writing.
            let _ = reader.shutdown(std::net::Shutdown::Both);
        }
        let sent = sender.join().unwrap();
        match (error, sent) {
            (None, Some(sent)) if sent == hash.finalize().to_vec() => {
                world.exchanges.fetch_add(1, Ordering::Relaxed);
                world.bytes.fetch_add(SIZE as u64, Ordering::Relaxed);
            }
            (None, Some(_)) => world
                .unexpected
                .lock()
                .unwrap()
                .push(format!("large {id} on {name}: 4 MiB came back different")),
            (Some(e), _) => world.failed(&name, epoch, format!("large {id} on {name}: {e}")),
            (None, None) => {
                world.failed(&name, epoch, format!("large {id} on {name}: write failed"))
            }
        }
    }
}

/// UDP datagrams of every size through quill -U; returns (sent, answered).
fn udp(world: &World, q: &UdpQuill) -> (u64, u64) {
    let mut rng = Rng::new(77);
    let (mut sent, mut answered) = (0u64, 0u64);
    let client = q.client("127.0.8.1");
    while world.running() {
        let mut msg = vec![0u8; 1 + (rng.next_u64() % 1400) as usize];
        rng.fill(&mut msg);
        sent += 1;
        match client.exchange(&msg, Duration::from_secs(2)) {
            Some(back) if back == msg => answered += 1,
            Some(back) => world.unexpected.lock().unwrap().push(format!(
                "UDP datagram of {} bytes came back as {} different bytes",
                msg.len(),
                back.len()
            )),
            None => {}
        }
    }
    (sent, answered)
}

#[test]
#[ignore = "soak test: run tests/soak (10 minutes) or tests/soak --quick (1 minute)"]
fn soak() {
    let secs: u64 = std::env::var("SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(600);
    let duration = Duration::from_secs(secs);
    let backends: Vec<IdentityBackend> = (0..BACKENDS)
        .map(|i| IdentityBackend::start(&format!("b{i}")))
        .collect();
    let dir = TempDir::new("soak");
    let cfg = dir.path().join("quill.cfg");
    let mut text = String::from("roundrobin\nblacklist 1\ntimeout 2\nidle_timeout 60\n");
    for (i, b) in backends.iter().enumerate() {
        text.push_str(&format!("server {i} address 127.0.0.1 port {}\n", b.port()));
    }
    fs::write(&cfg, &text).unwrap();
    let mut q = Quill::start(&["-F", cfg.to_str().unwrap(), "127.0.0.1:{port}"]);
    q.started_fd_count().expect("/proc");
    // Pipes are left out: the relay keeps a per-thread pool of kernel pipes for splice(2)
    // once large transfers have used them; sockets and files must all come back.
    let baseline_fds = fds_but_pipes(q.pid());
    let (cert, key, tls_client) = tls_identity(dir.path());
    let mut tq = Quill::start(&[
        "-E",
        &cert,
        "-K",
        &key,
        "-F",
        cfg.to_str().unwrap(),
        "127.0.0.1:{port}",
    ]);
    let udp_backend = DnsBackend::start(1);
    let uq = UdpQuill::start(&["-r", "{port}", &udp_backend.spec()]);

    let world = Arc::new(World {
        addr: q.addr(),
        tls_addr: tq.addr(),
        tls_client,
        stop: AtomicBool::new(false),
        restart_seq: AtomicU64::new(0),
        expected_errors: AtomicUsize::new(0),
        unexpected: Mutex::new(Vec::new()),
        exchanges: AtomicU64::new(0),
        tls_exchanges: AtomicU64::new(0),
        bytes: AtomicU64::new(0),
    });
    let start = Instant::now();
    let mut workers = Vec::new();
    for id in 0..2 {
        let w = Arc::clone(&world);
        workers.push(thread::spawn(move || keep_alive(&w, id)));
    }
    for id in 0..3 {
        let w = Arc::clone(&world);
        workers.push(thread::spawn(move || short(&w, id)));
    }
    {
        let w = Arc::clone(&world);
        workers.push(thread::spawn(move || large(&w, 0)));
    }
    for id in 0..2 {
        let w = Arc::clone(&world);
        workers.push(thread::spawn(move || tls_keep_alive(&w, id)));
    }
    let udp_worker = {
        let w = Arc::clone(&world);
        thread::spawn(move || {
            let r = udp(&w, &uq);
            (r, uq)
        })
    };

    // The operator's side: a reload every 2 s, a backend restart every tenth of the run
    // (at least every 6 s), RSS read once warmed up (after a fifth of the run).
    let restart_every = (duration / 10)
        .max(Duration::from_secs(6))
        .min(Duration::from_secs(60));
    let (mut reloads, mut restarts) = (0u32, 0usize);
    let mut next_reload = Instant::now() + Duration::from_secs(2);
    let mut next_restart = Instant::now() + restart_every;
    let mut warm_rss = None;
    while start.elapsed() < duration {
        // The schedule's tick: this loop paces the operator's actions, it waits for nothing.
        thread::sleep(Duration::from_millis(100));
        if Instant::now() >= next_reload {
            q.signal("HUP");
            tq.signal("HUP");
            reloads += 1;
            next_reload += Duration::from_secs(2);
        }
        if Instant::now() >= next_restart {
            let b = &backends[restarts % BACKENDS];
            world.restart_seq.fetch_add(1, Ordering::SeqCst);
            b.stop();
            b.drop_connections();
            b.restart();
            world.restart_seq.fetch_add(1, Ordering::SeqCst);
            restarts += 1;
            next_restart += restart_every;
        }
        if warm_rss.is_none() && start.elapsed() >= duration / 5 {
            warm_rss = q.rss_kib();
        }
        q.assert_running();
        tq.assert_running();
    }
    world.stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().unwrap();
    }
    let ((udp_sent, udp_answered), uq) = udp_worker.join().unwrap();
    let end_rss = q.rss_kib().unwrap();
    let warm_rss = warm_rss.unwrap_or(end_rss);

    let unexpected = world.unexpected.lock().unwrap().clone();
    eprintln!(
        "soak {:?}: {} TCP exchanges ({} over TLS; {} MiB echoed), {} errors on restarted backends, {} unexpected; \
         UDP {udp_answered}/{udp_sent} answered; {reloads} reloads, {restarts} backend restarts; \
         RSS {warm_rss} KiB after warm-up, {end_rss} KiB at the end",
        start.elapsed(),
        world.exchanges.load(Ordering::Relaxed),
        world.tls_exchanges.load(Ordering::Relaxed),
        world.bytes.load(Ordering::Relaxed) >> 20,
        world.expected_errors.load(Ordering::Relaxed),
        unexpected.len()
    );
    assert!(
        unexpected.is_empty(),
        "unexpected errors:\n{}",
        unexpected.join("\n")
    );
    assert!(world.exchanges.load(Ordering::Relaxed) > 0);
    assert!(
        world.tls_exchanges.load(Ordering::Relaxed) > 0,
        "no exchange over TLS"
    );
    // Loopback drops a datagram only when a socket buffer overflows; a few may be lost
    // while the answer-timeout of a flow runs, nothing like a steady loss.
    assert!(
        udp_answered * 1000 >= udp_sent * 999,
        "UDP: only {udp_answered} of {udp_sent} datagrams answered"
    );
    let mut fds = None;
    let settled = poll_until(Duration::from_secs(30), || {
        fds = Some(fds_but_pipes(q.pid()));
        fds <= Some(baseline_fds)
    });
    if !settled {
        let pid = q.pid();
        let listing = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("ss -tanpo | grep 'pid={pid},'"))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        panic!("quill holds {fds:?} descriptors, {baseline_fds} before the soak; its sockets:\n{listing}");
    }
    assert!(
        end_rss <= warm_rss + (warm_rss / 4).max(4096),
        "RSS grew from {warm_rss} KiB after warm-up to {end_rss} KiB"
    );
    for (what, log) in [
        ("quill", q.stderr()),
        ("quill (TLS)", tq.stderr()),
        ("quill -U", uq.stderr()),
    ] {
        assert!(!log.contains("panicked"), "{what} panicked:\n{log}");
    }
}

/// Descriptors of process `pid` other than pipes.
fn fds_but_pipes(pid: u32) -> usize {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    fs::read_link(e.path())
                        .map(|l| !l.to_string_lossy().starts_with("pipe:"))
                        .unwrap_or(false)
                })
                .count()
        })
        .unwrap_or(0)
}
