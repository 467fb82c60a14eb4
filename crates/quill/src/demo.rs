//! `quill demo`: two dummy backends and a round-robin balancer (with its metrics listener
//! and dashboard) on loopback, started as real quill processes, with a few requests sent
//! through to show the balancing. Runs until Ctrl-C (or, with QUILL_DEMO_ONCE=1 in the environment, exits after the requests).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Children are killed when the demo ends, however it ends.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
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
    let spawn = |args: &[String]| Command::new(&exe).args(args).stdin(Stdio::null()).spawn();
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
    // Wait for the balancer; Ctrl-C reaches the whole process group and ends everything.
    if let Some(balancer) = children.0.last_mut() {
        balancer.wait()?;
    }
    Ok(())
}
