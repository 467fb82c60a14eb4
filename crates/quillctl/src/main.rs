//! `quillctl`: send one command to a running quill's control socket and print the reply.
//!
//! The wire protocol is Pen's, so quillctl also drives Pen and penctl drives quill: connect,
//! send the command words joined by spaces and a newline, read the reply until the server
//! closes. Exit status: 0 on success, 1 when the server answers with an error, 2 on usage
//! or connection problems.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;
use std::time::Duration;

const USAGE: &str = "usage: quillctl host:port|/path/to/socket command [args...]\n";

/// How long to wait for the balancer to answer.
const TIMEOUT: Duration = Duration::from_secs(10);

fn exchange<S: Read + Write>(mut s: S, line: &str) -> io::Result<String> {
    s.write_all(line.as_bytes())?;
    s.write_all(b"\n")?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    Ok(reply)
}

fn send(target: &str, line: &str) -> io::Result<String> {
    if target.contains('/') {
        let s = UnixStream::connect(target)?;
        s.set_read_timeout(Some(TIMEOUT))?;
        return exchange(s, line);
    }
    // A bare port means the local host, as with penctl.
    let target = if target.bytes().all(|b| b.is_ascii_digit()) {
        format!("localhost:{target}")
    } else {
        target.to_string()
    };
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in target.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, TIMEOUT) {
            Ok(s) => {
                s.set_read_timeout(Some(TIMEOUT))?;
                return exchange(s, line);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--help") {
        print!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if args.len() < 2 {
        eprint!("{USAGE}");
        return ExitCode::from(2);
    }
    let line = args[1..].join(" ");
    match send(&args[0], &line) {
        Ok(reply) => {
            print!("{reply}");
            if reply.starts_with("error") {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("quillctl: {}: {e}", args[0]);
            ExitCode::from(2)
        }
    }
}
