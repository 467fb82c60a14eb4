//! Virtual hosts for the DSR, tarpit and transparent-proxy tests: network namespaces joined
//! by veth pairs and bridges (the bridges live in a namespace of their own), built with
//! `ip` and removed on drop, also when a test panics.
//!
//! Namespace names carry the test process's pid and a counter, so concurrent test runs on
//! one machine never collide; interface names live inside the namespaces and need not be
//! unique. Code runs "on" a host with [`Netns::run`]: a thread that enters the namespace
//! (setns) and runs a closure there; the sockets it opens stay in that namespace. Commands
//! run there with [`Netns::cmd`] (`ip netns exec`).
#![allow(dead_code)]

use std::fs::File;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

/// Why the namespace tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    if !rustix::process::geteuid().is_root() {
        return Some("not root: network namespace tests need root (CI runs them as root)".into());
    }
    match Command::new("ip").arg("-V").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("the `ip` command (iproute2) is missing".into()),
    }
}

/// Prints why a test is skipped and returns true, when it must be.
pub fn skip() -> bool {
    match skip_reason() {
        Some(why) => {
            eprintln!("SKIPPED: {why}");
            true
        }
        None => false,
    }
}

/// Runs a command, panicking with its output when it fails.
pub fn run(args: &[&str]) -> Output {
    let out = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    out
}

/// One network namespace, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// Creates a namespace `q{pid}-{n}-{role}` with `lo` up.
    pub fn new(role: &str) -> Netns {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let name = format!("q{}-{n}-{role}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        run(&["ip", "netns", "add", &name]);
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n NAME args...`
    pub fn ip(&self, args: &[&str]) -> Output {
        let mut all = vec!["ip", "-n", &self.name];
        all.extend_from_slice(args);
        run(&all)
    }

    /// A command to run inside the namespace.
    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `program args` in the namespace and panics if it fails.
    pub fn exec(&self, args: &[&str]) -> Output {
        let mut all = vec!["ip", "netns", "exec", &self.name];
        all.extend_from_slice(args);
        run(&all)
    }

    /// Sets sysctls (`key=value`) in the namespace.
    pub fn sysctl(&self, settings: &[&str]) {
        for s in settings {
            self.exec(&["sysctl", "-q", "-w", s]);
        }
    }

    /// Reads a counter of an interface (`rx_bytes`, `tx_bytes`, ...).
    pub fn if_stat(&self, interface: &str, stat: &str) -> u64 {
        let out = self.exec(&[
            "cat",
            &format!("/sys/class/net/{interface}/statistics/{stat}"),
        ]);
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{interface} {stat}: {e}"))
    }

    /// Runs `f` on a thread inside the namespace and returns its result.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.spawn(f)
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }

    /// Starts `f` on a thread inside the namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<T> {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let file = File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("setns {path}: {e}"));
            f()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stdin(Stdio::null())
            .output();
    }
}

/// Creates a veth pair with one end (`a`) in `ns_a` and the other (`b`) in `ns_b`, both up.
pub fn veth(ns_a: &Netns, a: &str, ns_b: &Netns, b: &str) {
    run(&[
        "ip", "-n", &ns_a.name, "link", "add", a, "type", "veth", "peer", "name", b, "netns",
        &ns_b.name,
    ]);
    ns_a.ip(&["link", "set", a, "up"]);
    ns_b.ip(&["link", "set", b, "up"]);
}

/// A bridge `br` in `sw` (no STP, no forwarding delay).
pub fn bridge(sw: &Netns, br: &str) {
    sw.ip(&["link", "add", br, "type", "bridge"]);
    sw.ip(&[
        "link",
        "set",
        br,
        "type",
        "bridge",
        "stp_state",
        "0",
        "forward_delay",
        "0",
    ]);
    sw.ip(&["link", "set", br, "up"]);
}

/// Plugs host `ns` into bridge `br` of `sw` with interface `ifname` and address `cidr`.
pub fn plug(sw: &Netns, br: &str, port: &str, ns: &Netns, ifname: &str, cidr: &str) {
    veth(ns, ifname, sw, port);
    sw.ip(&["link", "set", port, "master", br]);
    ns.ip(&["addr", "add", cidr, "dev", ifname]);
}
