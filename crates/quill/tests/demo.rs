//! `quill demo`, as a new user runs it: it balances over its two dummy backends, and it
//! stops, with every process it started, on SIGTERM, SIGINT and SIGHUP sent to it alone
//! (not to its process group, as a terminal's Ctrl-C would), and even when it is killed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use support::*;

/// The demo prefers fixed ports (8080, 9001, ...): one demo at a time.
static ONE_DEMO: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The processes whose parent is `pid`, from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: the command may hold spaces, so split after ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// Whether process `pid` still exists (and is not a zombie waiting to be reaped).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z")
    })
}

/// `quill demo` started with its stdout read line by line; returns it once it says
/// "try it", with the lines so far.
fn start_demo() -> (Child, Vec<String>) {
    let mut demo = Command::new(bin())
        .arg("demo")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let stdout = demo.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    while !lines.iter().any(|l: &String| l.contains("try it")) {
        match rx.recv_timeout(START_DEADLINE) {
            Ok(line) => lines.push(line),
            Err(e) => {
                let _ = demo.kill();
                panic!("the demo did not get going ({e}): {lines:?}");
            }
        }
    }
    (demo, lines)
}

#[test]
fn the_demo_balances_over_both_backends() {
    let _one = ONE_DEMO.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(bin())
        .arg("demo")
        .env("QUILL_DEMO_ONCE", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let answers: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("request ")?.split_once(": ").map(|(_, a)| a))
        .collect();
    assert_eq!(answers.len(), 2, "two backends answered: {text}");
}

#[test]
fn the_demo_stops_with_everything_it_started_on_any_stop_signal() {
    if is_pen() {
        return;
    }
    let _one = ONE_DEMO.lock().unwrap_or_else(|e| e.into_inner());
    for signal in ["TERM", "INT", "HUP", "KILL"] {
        let (mut demo, lines) = start_demo();
        let pid = demo.id();
        let started = children_of(pid);
        assert_eq!(
            started.len(),
            3,
            "two backends and a balancer: {started:?} {lines:?}"
        );
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = demo.wait().unwrap();
        if signal != "KILL" {
            assert!(
                status.success(),
                "SIG{signal}: the demo exited with {status}"
            );
        }
        wait_until(
            Duration::from_secs(10),
            format!("every process of the demo gone after SIG{signal}"),
            || !started.iter().any(|&p| alive(p)),
        );
    }
}
