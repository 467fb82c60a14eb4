//! `quill demo`: two dummy backends and a round-robin balancer (with its metrics listener
//! and dashboard) on loopback, started as real quill processes, with a few requests sent
//! through to show the balancing. Runs until SIGTERM, SIGINT (Ctrl-C) or SIGHUP (or, with
//! QUILL_DEMO_ONCE=1 in the environment, exits after the requests).
//!
//! Its children never outlive it: on any of those signals, an error or a normal end it
//! stops them (SIGTERM, then SIGKILL after a grace), and each child asks the kernel for
//! SIGTERM when the demo dies (`PR_SET_PDEATHSIG`, see [`die_with_parent`]), which covers
//! a demo that is itself SIGKILLed.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The environment variable through which the demo asks a child to die with it: the
/// demo's process id.
const PARENT_ENV: &str = "QUILL_DIE_WITH_PARENT";
/// How long a child has to stop after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Children are stopped when the demo ends, however it ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        use rustix::process::{kill_process, Pid, Signal};
        for c in &self.0 {
            if let Some(pid) = i32::try_from(c.id()).ok().and_then(Pid::from_raw) {
                let _ = kill_process(pid, Signal::Term);
            }
        }
        let deadline = Instant::now() + STOP_GRACE;
        for c in &mut self.0 {
            // Polling the child's exit with a deadline: a short pause between looks.
            while matches!(c.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// In a child of the demo (its process id in [`PARENT_ENV`]): asks the kernel to send
/// SIGTERM to this process when the demo dies, and exits at once if it has died already
/// (before the request was made). Called first thing by `main`; does nothing elsewhere.
pub fn die_with_parent() {
    let Some(parent) = std::env::var(PARENT_ENV)
        .ok()
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return;
    };
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::Term));
    let now = rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get());
    if now != parent {
        std::process::exit(0);
    }
}

fn free_port(preferred: u16) -> io::Result<u16> {
    if TcpListener::bind((Ipv4Addr::LOCALHOST, preferred)).is_ok() {
        return Ok(preferred);
    }
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

fn wait_until_accepting(port: u16, child: &mut Child) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if let Some(status) = child.try_wait()? {
            return Err(io::Error::other(format!(
                "a quill process exited early ({status})"
            )));
        }
        // Polling a condition with a deadline: a short pause between attempts.
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(io::Error::other(format!(
        "port {port} did not open within 10 s"
    )))
}

fn get(port: u16) -> io::Result<String> {
    let mut s = TcpStream::connect((Ipv4Addr::LOCALHOST, port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n")?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    Ok(reply
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or("")
        .trim_end()
        .to_string())
}

/// Runs the demo.
pub fn run() -> io::Result<()> {
    let exe = std::env::current_exe()?;
    // The signals that end the demo are caught from the start, so that one arriving
    // while it starts still stops the children it has by then.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut stop = rt.block_on(async { Stop::new() })?;
    let me = std::process::id().to_string();
    let spawn = |args: &[String]| {
        Command::new(&exe)
            .args(args)
            .env(PARENT_ENV, &me)
            .stdin(Stdio::null())
            .spawn()
    };
    let b1 = free_port(9001)?;
    let b2 = free_port(9002)?;
    let lb = free_port(8080)?;
    let metrics = free_port(9180)?;
    let mut children = Children(Vec::new());
    for port in [b1, b2] {
        let mut child = spawn(&[
            "-f".into(),
            "-O".into(),
            "dummy".into(),
            format!("127.0.0.1:{port}"),
        ])?;
        wait_until_accepting(port, &mut child)?;
        children.0.push(child);
    }
    let mut balancer = spawn(&[
        "-f".into(),
        "-r".into(),
        "-O".into(),
        format!("metrics_listen 127.0.0.1:{metrics}"),
        format!("127.0.0.1:{lb}"),
        format!("127.0.0.1:{b1}"),
        format!("127.0.0.1:{b2}"),
    ])?;
    wait_until_accepting(lb, &mut balancer)?;
    children.0.push(balancer);

    println!("backends: dummy web servers on 127.0.0.1:{b1} and 127.0.0.1:{b2}");
    println!(
        "balancer: quill -f -r -O \"metrics_listen 127.0.0.1:{metrics}\" 127.0.0.1:{lb} 127.0.0.1:{b1} 127.0.0.1:{b2}"
    );
    println!(
        "dashboard: http://127.0.0.1:{metrics}/  (Prometheus: http://127.0.0.1:{metrics}/metrics)"
    );
    for i in 1..=4 {
        println!("request {i}: {}", get(lb)?);
    }
    if std::env::var_os("QUILL_DEMO_ONCE").is_some() {
        return Ok(());
    }
    println!("\ntry it:  curl http://127.0.0.1:{lb}/     (Ctrl-C stops the demo)");
    let why = rt.block_on(stop.until_stopped(&mut children))?;
    println!("\n{why}: stopping the demo");
    drop(children);
    Ok(())
}

/// The signals that stop the demo.
struct Stop {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
    hup: tokio::signal::unix::Signal,
}

impl Stop {
    fn new() -> io::Result<Stop> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Stop {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Waits for a stop signal, or for a child to exit on its own; says which.
    async fn until_stopped(&mut self, children: &mut Children) -> io::Result<String> {
        let mut look = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                _ = self.term.recv() => return Ok("SIGTERM".into()),
                _ = self.int.recv() => return Ok("SIGINT".into()),
                _ = self.hup.recv() => return Ok("SIGHUP".into()),
                _ = look.tick() => {
                    for c in &mut children.0 {
                        if let Some(status) = c.try_wait()? {
                            return Ok(format!("a quill process exited ({status})"));
                        }
                    }
                }
            }
        }
    }
}
