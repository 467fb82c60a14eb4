//! Capacity: many concurrent connections, no descriptor leaks, conn_max.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use support::*;

/// These tests each push thousands of connections through backends that are threads of
/// this test process; run in parallel they starve each other's backends and their
/// deadlines measure the harness, not quill. They take turns.
static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits until quill holds no more than two descriptors above `baseline`. A descriptor that
/// leaked never comes back, so a generous deadline only costs time when something is wrong;
/// closes can lag when the test process's own backends are busy. On failure the message
/// lists quill's descriptors and its sockets' TCP states.
fn assert_descriptors_settle(q: &Quill, baseline: usize, what: &str) {
    let mut now = baseline;
    let settled = poll_until(Duration::from_secs(60), || {
        now = q.fd_count().unwrap_or(usize::MAX);
        now <= baseline + 2
    });
    if !settled {
        let pid = q.pid();
        let listing = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ls -l /proc/{pid}/fd; ss -tanpo | grep 'pid={pid},'"
            ))
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        panic!(
            "quill had {baseline} descriptors before {what} and still has {now} after\n{listing}"
        );
    }
}

/// Runs `per_thread` jobs on each of `threads` threads; job(thread, i).
fn pool<T: Send + 'static>(
    threads: usize,
    per_thread: usize,
    job: impl Fn(usize, usize) -> T + Send + Sync + 'static,
) -> Vec<Vec<T>> {
    let job = Arc::new(job);
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let job = Arc::clone(&job);
            thread::spawn(move || (0..per_thread).map(|i| job(t, i)).collect::<Vec<T>>())
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("worker panicked"))
        .collect()
}

#[test]
fn two_thousand_concurrent_connections_are_all_served() {
    let _turn = one_at_a_time();
    const THREADS: usize = 16;
    const PER_THREAD: usize = 125;
    const TOTAL: usize = THREADS * PER_THREAD;
    // This process holds each connection's client socket and the backend's
    // socket (plus a clone); quill holds two per connection.
    if let Some(limit) = open_files_limit() {
        if limit < 8192 {
            eprintln!("SKIPPED: the open files limit ({limit}) is below 8192");
            return;
        }
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&[
        "-r",
        "-x",
        "5000",
        "-c",
        "5000",
        "127.0.0.1:{port}",
        &a.spec(),
        &b.spec(),
    ]);
    let addr = q.addr();

    let start = Instant::now();
    let held: Vec<Vec<(String, TcpStream)>> = pool(THREADS, PER_THREAD, move |t, i| {
        let src = format!("127.0.0.{}", 10 + t);
        let mut s = client_from(&src, addr)
            .unwrap_or_else(|e| panic!("connection {} from {src} failed: {e}", t * PER_THREAD + i));
        let name = backend_name(&mut s).unwrap_or_else(|| {
            panic!(
                "connection {} from {src} closed unserved",
                t * PER_THREAD + i
            )
        });
        (name, s)
    });
    let held: Vec<(String, TcpStream)> = held.into_iter().flatten().collect();
    eprintln!("{TOTAL} connections opened in {:?}", start.elapsed());

    assert_eq!(held.len(), TOTAL);
    let t = tally(held.iter().map(|(n, _)| n));
    assert_eq!(
        t.get("a").copied().unwrap_or(0) + t.get("b").copied().unwrap_or(0),
        TOTAL,
        "{t:?}"
    );
    // All of them are open at the same time, end to end.
    assert_eq!(
        a.open() + b.open(),
        TOTAL,
        "backends do not see {TOTAL} open connections"
    );

    drop(held);
    wait_until(
        Duration::from_secs(20),
        "every backend connection is closed after the clients closed",
        || a.open() + b.open() == 0,
    );
}

#[test]
fn ten_thousand_connections_leak_no_descriptors() {
    let _turn = one_at_a_time();
    const THREADS: usize = 8;
    const PER_THREAD: usize = 1250;
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let Some(baseline) = q.started_fd_count() else {
        eprintln!("SKIPPED: /proc/PID/fd is not available");
        return;
    };
    let addr = q.addr();
    let served = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&served);

    let start = Instant::now();
    pool(THREADS, PER_THREAD, move |_, _| {
        let mut s = connect(addr);
        if backend_name(&mut s).is_some() {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
    eprintln!(
        "{} connections in {:?}",
        THREADS * PER_THREAD,
        start.elapsed()
    );
    assert_eq!(
        served.load(Ordering::Relaxed),
        THREADS * PER_THREAD,
        "not every connection was served"
    );

    assert_descriptors_settle(&q, baseline, "10,000 connections that all closed");
    wait_until(
        Duration::from_secs(10),
        "the backends' connections are all closed",
        || a.open() + b.open() == 0,
    );

    // Under that load quill's event loops may poll instead of sleeping (`proxy::polling`).
    // Once the traffic has ended they must stop: an idle balancer costs no CPU. (Each try
    // measures quill's CPU time over half a second of wall time.)
    wait_until(
        Duration::from_secs(20),
        "quill, idle again, uses under a tenth of a core",
        || {
            let (before, wall) = (q.cpu_time(), Instant::now());
            thread::sleep(Duration::from_millis(500)); // a measuring window, not a wait
            match (before, q.cpu_time()) {
                (Some(before), Some(after)) => after - before < wall.elapsed() / 10,
                _ => true,
            }
        },
    );
}

/// Voluntary context switches (sleeps that ended) of each of the process's threads.
fn wake_ups(pid: u32) -> Vec<(String, u64)> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return vec![];
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let field = |key: &str| {
                status
                    .lines()
                    .find_map(|l| l.strip_prefix(key))
                    .map(|v| v.trim().to_string())
            };
            let name = field("Name:")?;
            let switches = field("voluntary_ctxt_switches:")?.parse().ok()?;
            Some((
                format!("{name} ({})", t.file_name().to_string_lossy()),
                switches,
            ))
        })
        .collect()
}

/// An idle balancer costs its host next to nothing: with no client, no thread wakes more
/// than a couple of times a second (on a virtual machine each wake-up of an idle CPU is an
/// interrupt and an exit to the hypervisor). Each try counts every thread's wake-ups over
/// four seconds of wall time; the first tries may still see the start-up's measurements.
#[test]
fn an_idle_balancer_wakes_its_threads_rarely() {
    const WINDOW: Duration = Duration::from_secs(4);
    const MAX_PER_WINDOW: u64 = 10;
    let a = IdentityBackend::start("a");
    let q = Quill::start(&["-r", "127.0.0.1:{port}", &a.spec()]);
    // Every event loop is up before the wake-ups are counted.
    q.started_fd_count();
    assert_eq!(q.name_from("127.0.0.1").0, "a");
    wait_until(
        Duration::from_secs(30),
        "no thread of an idle quill wakes more than 10 times in 4 s",
        || {
            let (before, wall) = (wake_ups(q.pid()), Instant::now());
            while wall.elapsed() < WINDOW {
                thread::sleep(Duration::from_millis(250)); // a measuring window, not a wait
            }
            let after = wake_ups(q.pid());
            let woke: Vec<_> = after
                .iter()
                .map(|(name, n)| {
                    let was = before
                        .iter()
                        .find(|(b, _)| b == name)
                        .map_or(0, |(_, b)| *b);
                    (name.clone(), n.saturating_sub(was))
                })
                .collect();
            eprintln!("wake-ups in {:?}: {woke:?}", wall.elapsed());
            !woke.is_empty() && woke.iter().all(|(_, n)| *n <= MAX_PER_WINDOW)
        },
    );
}

/// At `-x` connections, quill stops accepting: the next client waits in the kernel's
/// listen queue (neither served nor closed) and is served as soon as a place frees, as
/// with Pen, HAProxy's `maxconn` and NGINX's `worker_connections` (before, quill accepted
/// it only to close it: a burst above the limit failed instead of waiting).
#[test]
fn conn_max_holds_connections_beyond_the_limit_until_a_place_frees() {
    let _turn = one_at_a_time();
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-x", "2", "-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);

    let (_, first) = q.name_from("127.0.0.1");
    let (_, _second) = q.name_from("127.0.0.1");

    let mut third = q.connect_from("127.0.0.1");
    third
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut byte = [0u8; 1];
    match third.read(&mut byte) {
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut => {}
        other => panic!("the connection beyond -x 2 was not left waiting: {other:?}"),
    }
    assert_eq!(
        a.accepted() + b.accepted(),
        2,
        "a connection beyond -x 2 reached a server"
    );

    drop(first);
    third.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert!(
        backend_name(&mut third).is_some(),
        "the waiting connection was served once a place freed"
    );
}

#[test]
fn reset_and_failed_over_connections_leak_no_descriptors() {
    let _turn = one_at_a_time();
    if skip_on_pen("Pen 0.34 leaves some clients hanging when a server refuses connections") {
        return;
    }
    const THREADS: usize = 8;
    const PER_THREAD: usize = 250;
    // Server a is down: every other pick fails over (or, in Pen, is closed).
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let q = Quill::start(&["-r", "-b", "0", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    a.stop();
    let Some(baseline) = q.started_fd_count() else {
        eprintln!("SKIPPED: /proc/PID/fd is not available");
        return;
    };
    let addr = q.addr();

    pool(THREADS, PER_THREAD, move |_, i| {
        let mut s = connect(addr);
        let served = backend_name(&mut s).is_some();
        if served && i % 2 == 0 {
            // Abort with a reset instead of a clean close, mid-conversation.
            let _ = s.write_all(b"unfinished business");
            let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
        }
    });

    assert_descriptors_settle(&q, baseline, "2,000 aborted or failed-over connections");
    wait_until(
        Duration::from_secs(10),
        "the backend's connections are all closed",
        || b.open() == 0,
    );
}

#[test]
fn a_burst_beyond_pending_max_waits_in_the_backlog_and_is_all_served() {
    let _turn = one_at_a_time();
    const BURST: usize = 400;
    let a = IdentityBackend::start("a");
    let q = Quill::start(&[
        "-r",
        "-x",
        "1000",
        "-q",
        "1024",
        "-O",
        "pending_max 4",
        "127.0.0.1:{port}",
        &a.spec(),
    ]);
    // All connects complete in the kernel's backlog before quill has connected on even a
    // few of them, so most of the burst arrives while pending_max is reached.
    let mut clients: Vec<TcpStream> = (0..BURST).map(|_| q.connect_from("127.0.0.1")).collect();
    wait_until(
        Duration::from_secs(30),
        format_args!("the backend holds all {BURST} connections"),
        || a.open() >= BURST,
    );
    for (i, c) in clients.iter_mut().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(
            backend_name(c).as_deref(),
            Some("a"),
            "client {i} of the burst was not served"
        );
    }
}
