//! Control-socket pieces of the harness, for `tests/control.rs` and `tests/reload.rs`.
//!
//! * [`quillctl`] runs the workspace's `quillctl` binary (built on first use with
//!   `cargo build -p quillctl`, since `cargo test -p quill` does not build another crate's
//!   binary) and [`penctl`] runs Debian's `penctl` when it is installed.
//! * [`exchange`] / [`exchange_from`] speak the wire protocol by hand (one line in, the reply
//!   until the server closes), optionally from a chosen loopback source address.
//! * [`start_with_control`] starts quill with a TCP control socket on a free port (`{ctl}` in
//!   the arguments), retrying on another port if the control port was taken meanwhile.
//! * [`Quill::start_on`] starts quill whose listening address is not in its arguments (it
//!   comes from a `-F` file) and waits until it listens on the given target.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::Duration;

use socket2::{Domain, SockAddr, Socket, Type};

use super::{
    bin, free_port, poll_until, read_lossy, spawn, substitute, wait_listening, wait_until, Exit,
    Quill, Startup, Target, TempDir, CONNECT_TIMEOUT, IO_TIMEOUT,
};

/// How long a control client (quillctl, penctl) may run.
pub const CTL_DEADLINE: Duration = Duration::from_secs(15);

// ---------------------------------------------------------------------------
// Running tools with a deadline
// ---------------------------------------------------------------------------

/// Runs `program args...` to completion (killed after `deadline`), capturing its output.
pub fn run_tool<S: AsRef<OsStr>>(program: &Path, args: &[S], deadline: Duration) -> Exit {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let mut out = child.stdout.take().expect("stdout pipe");
    let mut err = child.stderr.take().expect("stderr pipe");
    let out_reader = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err_reader = thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let mut status = None;
    let exited = poll_until(deadline, || match child.try_wait() {
        Ok(Some(s)) => {
            status = Some(s);
            true
        }
        _ => false,
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = String::from_utf8_lossy(&out_reader.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_reader.join().unwrap_or_default()).into_owned();
    assert!(
        exited,
        "`{} {:?}` still running after {deadline:?}; stdout:\n{stdout}\nstderr:\n{stderr}",
        program.display(),
        args.iter()
            .map(|a| a.as_ref().to_owned())
            .collect::<Vec<_>>()
    );
    Exit {
        code: status.and_then(|s| s.code()),
        stdout,
        stderr,
    }
}

// ---------------------------------------------------------------------------
// quillctl and penctl
// ---------------------------------------------------------------------------

/// The directory of the quill binary cargo built (`target/debug`).
fn cargo_bin_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_quill"))
        .parent()
        .expect("the quill binary has a directory")
        .to_path_buf()
}

fn build_quillctl() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("QUILLCTL_BIN").filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let dir = cargo_bin_dir();
    let exe = dir.join(format!("quillctl{}", std::env::consts::EXE_SUFFIX));
    // Always ask cargo (a no-op when up to date), so a stale quillctl is never tested. The
    // target directory is the one the quill binary is in, whatever way it was chosen.
    let profile = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    let target_dir = dir.parent().expect("target directory").to_path_buf();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--quiet", "-p", "quillctl", "--target-dir"])
        .arg(&target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    match profile.as_deref() {
        Some("debug") | None => {}
        Some("release") => {
            cmd.arg("--release");
        }
        Some(other) => {
            cmd.args(["--profile", other]);
        }
    }
    let built = cmd.output();
    match built {
        Ok(out) if out.status.success() && exe.exists() => Ok(exe),
        Ok(out) if exe.exists() => {
            eprintln!(
                "warning: `cargo build -p quillctl` failed ({}), using the existing {}:\n{}",
                out.status,
                exe.display(),
                String::from_utf8_lossy(&out.stderr)
            );
            Ok(exe)
        }
        Ok(out) => Err(format!(
            "quillctl is not built ({} missing) and `cargo build -p quillctl` failed ({}):\n{}",
            exe.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) if exe.exists() => {
            eprintln!(
                "warning: cannot run cargo ({e}), using the existing {}",
                exe.display()
            );
            Ok(exe)
        }
        Err(e) => Err(format!(
            "quillctl is not built ({} missing) and cargo cannot be run: {e}; \
             build it with `cargo build -p quillctl` or set QUILLCTL_BIN",
            exe.display()
        )),
    }
}

/// The quillctl binary: `$QUILLCTL_BIN`, else `quillctl` next to the quill binary, built
/// (or brought up to date) with `cargo build -p quillctl` once per test process.
pub fn quillctl_bin() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BIN.get_or_init(build_quillctl) {
        Ok(p) => p.clone(),
        Err(e) => panic!("{e}"),
    }
}

/// Runs `quillctl ADDR WORDS...` (each word one argument) and returns its exit status,
/// stdout and stderr.
pub fn quillctl(addr: &str, words: &[&str]) -> Exit {
    let mut args = vec![addr];
    args.extend_from_slice(words);
    run_tool(&quillctl_bin(), &args, CTL_DEADLINE)
}

/// `quillctl ADDR LINE` split on whitespace; panics unless it succeeds (exit 0). Returns
/// stdout.
pub fn ctl_ok(addr: &str, line: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let out = quillctl(addr, &words);
    assert_eq!(
        out.code,
        Some(0),
        "`quillctl {addr} {line}` failed: stdout {:?} stderr {:?}",
        out.stdout,
        out.stderr
    );
    out.stdout
}

/// `quillctl ADDR LINE`; panics unless quill answers with an error (exit 1). Returns the
/// reply.
pub fn ctl_err(addr: &str, line: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let out = quillctl(addr, &words);
    assert_eq!(
        out.code,
        Some(1),
        "`quillctl {addr} {line}` was expected to get an error reply: stdout {:?} stderr {:?}",
        out.stdout,
        out.stderr
    );
    out.stdout
}

/// Debian's penctl, if installed.
pub fn penctl_bin() -> Option<PathBuf> {
    ["/usr/bin/penctl", "/usr/local/bin/penctl"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Runs `penctl ADDR WORDS...`; None (saying SKIPPED) when penctl is not installed.
pub fn penctl(addr: &str, words: &[&str]) -> Option<Exit> {
    let Some(p) = penctl_bin() else {
        eprintln!("SKIPPED: penctl is not installed (Debian package pen)");
        return None;
    };
    let mut args = vec![addr];
    args.extend_from_slice(words);
    Some(run_tool(&p, &args, CTL_DEADLINE))
}

// ---------------------------------------------------------------------------
// The wire protocol by hand
// ---------------------------------------------------------------------------

/// Sends `line` (as given: add the newline yourself) to the control socket `addr`
/// (`host:port` or a path) and reads the reply until the server closes. A reset after a
/// (partial) reply counts as the end of the reply.
pub fn exchange(addr: &str, line: &[u8]) -> io::Result<Vec<u8>> {
    if addr.contains('/') {
        let s = UnixStream::connect(addr)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        talk(s, line)
    } else {
        let a: SocketAddr = addr
            .parse()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
        let s = TcpStream::connect_timeout(&a, CONNECT_TIMEOUT)?;
        s.set_read_timeout(Some(IO_TIMEOUT))?;
        s.set_write_timeout(Some(IO_TIMEOUT))?;
        talk(s, line)
    }
}

/// Like [`exchange`] over TCP, from the loopback source address `src` (e.g. 127.0.0.2).
pub fn exchange_from(src: &str, addr: &str, line: &[u8]) -> io::Result<Vec<u8>> {
    let a: SocketAddr = addr
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
    let ip: IpAddr = src
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{src}: {e}")))?;
    let sock = Socket::new(Domain::for_address(a), Type::STREAM, None)?;
    sock.bind(&SockAddr::from(SocketAddr::new(ip, 0)))?;
    sock.connect_timeout(&SockAddr::from(a), CONNECT_TIMEOUT)?;
    let s = TcpStream::from(sock);
    s.set_read_timeout(Some(IO_TIMEOUT))?;
    s.set_write_timeout(Some(IO_TIMEOUT))?;
    talk(s, line)
}

/// Writes `line` on one thread while reading the reply on this one, so that a server that
/// answers (and closes) before it has read everything cannot block the client.
fn talk<S: Read + Write + Send + 'static + TryCloneStream>(
    s: S,
    line: &[u8],
) -> io::Result<Vec<u8>> {
    let mut reader = s.try_clone_stream()?;
    let mut writer = s;
    let data = line.to_vec();
    let w = thread::spawn(move || {
        let r = writer.write_all(&data);
        // Keep the socket open (no shutdown): penctl does not half-close either.
        (r, writer)
    });
    let mut reply = Vec::new();
    let mut buf = [0u8; 8192];
    let result = loop {
        match reader.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
                ) =>
            {
                break Ok(())
            }
            Err(e) => break Err(e),
        }
    };
    // The writer either finished or fails now that the peer is gone.
    let _ = w.join();
    result.map(|()| reply)
}

/// `try_clone` for both stream kinds.
pub trait TryCloneStream: Sized {
    fn try_clone_stream(&self) -> io::Result<Self>;
}

impl TryCloneStream for TcpStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
}

impl TryCloneStream for UnixStream {
    fn try_clone_stream(&self) -> io::Result<Self> {
        self.try_clone()
    }
}

/// [`exchange`] of `line` plus a newline, as text; panics on an I/O error.
pub fn ask(addr: &str, line: &str) -> String {
    let mut bytes = line.as_bytes().to_vec();
    bytes.push(b'\n');
    let reply = exchange(addr, &bytes).unwrap_or_else(|e| panic!("control {addr} {line:?}: {e}"));
    String::from_utf8_lossy(&reply).into_owned()
}

// ---------------------------------------------------------------------------
// Starting quill with a control socket
// ---------------------------------------------------------------------------

/// Starts quill with `{ctl}` in `args` replaced by a free TCP port (the control socket,
/// e.g. `-C 127.0.0.1:{ctl}`); returns the daemon and the control address `127.0.0.1:PORT`.
/// A start that fails because the control port was taken is retried on another port.
pub fn start_with_control(args: &[&str]) -> (Quill, String) {
    let mut failures = Vec::new();
    for _ in 0..5 {
        let port = free_port();
        let real: Vec<String> = args
            .iter()
            .map(|a| a.replace("{ctl}", &port.to_string()))
            .collect();
        let refs: Vec<&str> = real.iter().map(String::as_str).collect();
        match Quill::try_start(&refs) {
            Ok(q) => return (q, format!("127.0.0.1:{port}")),
            Err(e) if e.contains("control socket") && e.to_lowercase().contains("in use") => {
                failures.push(e);
            }
            Err(e) => panic!("{e}"),
        }
    }
    panic!(
        "could not start quill with a control socket:\n{}",
        failures.join("\n")
    );
}

impl Quill {
    /// Starts `BIN -f ARGS...` (with `{dir}` substituted; `{port}` and `{sock}` are not
    /// needed) and waits until it listens on `target`, e.g. an address that comes from a
    /// `-F` file. No retries.
    pub fn start_on(args: &[&str], target: Target) -> Result<Quill, String> {
        let dir = TempDir::new("quill");
        let port = match &target {
            Target::Tcp(a) => a.port(),
            Target::Unix(_) => 0,
        };
        let real = substitute(args, port, dir.path());
        let mut child = spawn(&dir, true, &real);
        match wait_listening(&mut child, &target) {
            Startup::Ready => Ok(Quill {
                child,
                target,
                port,
                args: real,
                dir,
            }),
            Startup::Exited(status) => Err(format!(
                "{real:?} exited ({status}) before listening on {target:?}:\n{}",
                read_lossy(&dir.path().join("stderr"))
            )),
            Startup::TimedOut => {
                let _ = child.kill();
                let _ = child.wait();
                Err(format!(
                    "{} {real:?} did not listen on {target:?} in time; stderr:\n{}",
                    bin().display(),
                    read_lossy(&dir.path().join("stderr"))
                ))
            }
        }
    }
}

/// Whether `path` exists (a file, a socket, anything).
pub fn exists(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

// ---------------------------------------------------------------------------
// Small checks
// ---------------------------------------------------------------------------

/// Whether the tests run with effective uid 0 (as in CI).
pub fn running_as_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `["-u", "root"]` when running as root (quill, like Pen, refuses a control socket as root
/// without it), nothing otherwise.
pub fn run_as_args() -> Vec<&'static str> {
    if running_as_root() {
        vec!["-u", "root"]
    } else {
        Vec::new()
    }
}

/// Starts quill with a TCP control socket: `-C 127.0.0.1:{ctl} [-u root] ARGS...`.
pub fn start_with_tcp_control(args: &[&str]) -> (Quill, String) {
    let mut all = vec!["-C", "127.0.0.1:{ctl}"];
    all.extend(run_as_args());
    all.extend_from_slice(args);
    start_with_control(&all)
}

/// `status json`, parsed.
pub fn status_json(ctl: &str) -> serde_json::Value {
    let text = ctl_ok(ctl, "status json");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("status json is not JSON ({e}): {text}"))
}

/// Server `index`'s entry of `status json`.
pub fn server_status(ctl: &str, index: usize) -> serde_json::Value {
    let doc = status_json(ctl);
    doc["servers"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["index"] == index))
        .cloned()
        .unwrap_or_else(|| panic!("no server {index} in {doc}"))
}

/// Waits (20 s at most) until server `index`'s health check reports `health` (`up`,
/// `down`, `unchecked`); returns the server's `status json` entry then.
pub fn wait_health(ctl: &str, index: usize, health: &str) -> serde_json::Value {
    let mut last = serde_json::Value::Null;
    let became = poll_until(Duration::from_secs(20), || {
        last = server_status(ctl, index);
        last["health"] == health
    });
    assert!(became, "server {index} never became {health}: {last}");
    last
}

/// What `write FILE` saves now: the whole running configuration (into a fresh file in
/// `dir`).
pub fn written_config(ctl: &str, dir: &Path, tag: &str) -> String {
    let path = dir.join(format!("written-{tag}.cfg"));
    assert_eq!(ctl_ok(ctl, &format!("write {}", path.display())), "");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("write did not create {path:?}: {e}"))
}

/// The `servers` reply without the counters that change with traffic (`conn`, `sx`, `rx`)
/// and without the runtime state quill appends (`state`, `health`).
pub fn without_counters(servers: &str) -> Vec<String> {
    servers
        .lines()
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let mut kept = Vec::new();
            let mut i = 0;
            while i < words.len() {
                if matches!(words[i], "conn" | "sx" | "rx" | "state" | "health")
                    && i + 1 < words.len()
                {
                    i += 2;
                } else {
                    kept.push(words[i]);
                    i += 1;
                }
            }
            kept.join(" ")
        })
        .collect()
}

/// Panics unless `reply` is exactly one line starting with `error: `.
pub fn assert_one_line_error(reply: &str, what: &str) {
    assert!(
        reply.starts_with("error: ") && reply.ends_with('\n') && reply.matches('\n').count() == 1,
        "{what}: expected a one-line `error: ...` reply, got {reply:?}"
    );
}

// ---------------------------------------------------------------------------
// Signals
// ---------------------------------------------------------------------------

/// The signal number of a name as `kill -NAME` takes it (the ones the tests send).
pub fn signal_number(name: &str) -> u32 {
    match name {
        "HUP" => 1,
        "INT" => 2,
        "KILL" => 9,
        "USR1" => 10,
        "USR2" => 12,
        "TERM" => 15,
        other => panic!("unknown signal name {other}"),
    }
}

/// The signals process `pid` catches (`SigCgt` of /proc/PID/status, bit N-1 = signal N);
/// None without /proc or once the process is gone.
pub fn caught_signals(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

/// Whether `pid` has a handler for signal `name`.
pub fn catches(pid: u32, name: &str) -> bool {
    caught_signals(pid).is_some_and(|m| m & (1 << (signal_number(name) - 1)) != 0)
}

/// Sends signal `name` to quill once it has a handler for it (quill installs its handlers
/// a moment after it starts listening; a signal before that would kill it, which is what
/// `reload.rs` checks separately). Without /proc the signal is sent at once.
pub fn signal_when_handled(q: &Quill, name: &str) {
    if Path::new("/proc/self/status").exists() {
        wait_until(
            Duration::from_secs(5),
            format_args!("quill (pid {}) catches SIG{name}", q.pid()),
            || catches(q.pid(), name),
        );
    }
    q.signal(name);
}
