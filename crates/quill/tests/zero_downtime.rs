//! Zero-downtime operations against the real binary, under load: many SIGHUP reloads and
//! a binary upgrade (`--takeover`) while client threads run exchanges back to back, with
//! not one failed exchange allowed; the failure modes of an upgrade leave the old process
//! serving.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::path::Path;
use std::time::Duration;

use support::ctl::*;
use support::load::Load;
use support::*;

const DEADLINE: Duration = Duration::from_secs(30);

fn assert_no_failures(load: Load) -> u64 {
    let (ok, failed, reasons) = load.stop();
    assert_eq!(
        failed,
        0,
        "{failed} failed exchanges of {}: {reasons:?}",
        ok + failed
    );
    ok
}

#[test]
fn twenty_five_reloads_under_load_fail_no_request() {
    if skip_on_pen("quill's reload is atomic; the test also counts on `timeout` answers") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let dir = TempDir::new("reload-load");
    let cfg = dir.path().join("q.cfg");
    let write_cfg = |i: u64| {
        // Every reload changes something real: the timeout and the servers' weights.
        let text = format!(
            "roundrobin\ntimeout {}\nserver 0 address 127.0.0.1 port {} weight {}\nserver 1 address 127.0.0.1 port {} weight {}\n",
            10 + i,
            a.port(),
            1 + i % 3,
            b.port(),
            1 + (i + 1) % 3
        );
        std::fs::write(&cfg, text).unwrap();
    };
    write_cfg(0);
    let mut args = vec!["-C", "127.0.0.1:{ctl}"];
    args.extend(run_as_args());
    let cfg_arg = cfg.to_string_lossy().into_owned();
    args.extend(["-F", &cfg_arg, "127.0.0.1:{port}"]);
    let (q, ctl) = start_with_control(&args);
    let load = Load::start(q.addr(), 4);
    load.wait_more(20, DEADLINE);
    for i in 1..=25u64 {
        write_cfg(i);
        signal_when_handled(&q, "HUP");
        let want = format!("{}\n", 10 + i);
        wait_until(DEADLINE, format_args!("reload {i} is in force"), || {
            ctl_ok(&ctl, "timeout") == want
        });
        load.wait_more(5, DEADLINE);
    }
    let ok = assert_no_failures(load);
    assert!(ok >= 145, "{ok}");
    assert!(a.accepted() > 0 && b.accepted() > 0);
}

/// The arguments of the old and the new process: the same, the new one with --takeover.
fn upgrade_args<'a>(ctl: &'a str, port: &'a str, a: &'a str, b: &'a str) -> Vec<&'a str> {
    let mut v = vec!["-C", ctl];
    v.extend(run_as_args());
    v.extend(["-r", port, a, b]);
    v
}

fn exchange_on(s: &mut std::net::TcpStream, fill: u8) {
    let block = vec![fill; 64 * 1024];
    s.write_all(&block).unwrap();
    let mut back = vec![0u8; block.len()];
    s.read_exact(&mut back).unwrap();
    assert!(back == block, "echo differs");
}

#[test]
fn binary_upgrade_under_load_fails_no_request() {
    if skip_on_pen("binary upgrade is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (sa, sb) = (a.spec(), b.spec());
    let dir = TempDir::new("upgrade");
    let ctl_path = dir.path().join("ctl.sock");
    let ctl = ctl_path.to_string_lossy().into_owned();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let old_args = upgrade_args(&ctl, &listen, &sa, &sb);
    let mut old = Quill::start_on(&old_args, Target::Tcp(listen.parse().unwrap())).unwrap();
    let old_pid = old.pid();
    assert_eq!(ctl_ok(&ctl, "pid").trim(), old_pid.to_string());

    // A long connection through the old process, and load from four clients.
    let (_, mut long) = old.name_from("127.0.0.2");
    exchange_on(&mut long, 1);
    let load = Load::start(old.addr(), 4);
    load.wait_more(50, DEADLINE);

    let mut new_args = vec!["--takeover"];
    new_args.extend(upgrade_args(&ctl, &listen, &sa, &sb));
    let new = Quill::start_on(&new_args, Target::Tcp(old.addr())).unwrap();
    wait_until(DEADLINE, "the old process has handed over", || {
        old.stderr().contains("no longer accepting")
    });
    assert!(
        new.stderr().is_empty() || !new.stderr().contains("ERROR"),
        "{}",
        new.stderr()
    );
    // The new process answers on the same control socket.
    wait_until(DEADLINE, "the control socket is the new process's", || {
        ctl_ok(&ctl, "pid").trim() == new.pid().to_string()
    });
    load.wait_more(100, DEADLINE);

    // The old process still relays its long connection, then exits once it is done.
    old.assert_running();
    exchange_on(&mut long, 2);
    long.shutdown(Shutdown::Write).unwrap();
    let (rest, _) = expect_closed(&mut long, Duration::from_secs(10));
    assert!(rest.is_empty());
    assert_eq!(old.wait_exit(DEADLINE), Some(Some(0)), "{}", old.stderr());
    // Its exit removed nothing the new process uses.
    assert!(exists(&ctl_path), "the control socket file was removed");
    load.wait_more(100, DEADLINE);
    assert_no_failures(load);
    assert_eq!(ctl_ok(&ctl, "pid").trim(), new.pid().to_string());
    assert_ne!(new.pid(), old_pid);
}

#[test]
fn a_new_binary_that_cannot_start_leaves_the_old_one_serving() {
    if skip_on_pen("binary upgrade is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (sa, sb) = (a.spec(), b.spec());
    let dir = TempDir::new("upgrade-fail");
    let ctl_path = dir.path().join("ctl.sock");
    let ctl = ctl_path.to_string_lossy().into_owned();
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let mut old = Quill::start_on(
        &upgrade_args(&ctl, &listen, &sa, &sb),
        Target::Tcp(listen.parse().unwrap()),
    )
    .unwrap();
    let load = Load::start(old.addr(), 2);
    load.wait_more(20, DEADLINE);

    // A configuration mistake: refused before anything is touched.
    let mut bad = vec!["--takeover"];
    bad.extend(upgrade_args(&ctl, &listen, &sa, &sb));
    bad.extend(["-O", "check_fall 0"]);
    let out = run(&bad);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    // Another listening address: the sockets cannot move, so the upgrade is refused.
    let other = format!("127.0.0.1:{}", free_port());
    let mut moved = vec!["-f", "--takeover"];
    moved.extend(upgrade_args(&ctl, &other, &sa, &sb));
    let out = run(&moved);
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("restart to move them"),
        "{}",
        out.stderr
    );
    // A control socket nobody serves.
    let nobody = dir.path().join("nobody.sock");
    let nobody = nobody.to_string_lossy().into_owned();
    let mut lost = vec!["-f", "--takeover"];
    lost.extend(upgrade_args(&nobody, &listen, &sa, &sb));
    let out = run(&lost);
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("cannot reach the running quill"),
        "{}",
        out.stderr
    );
    // A TCP control socket cannot carry descriptors.
    let out = run(&["-f", "--takeover", "-C", "127.0.0.1:1", &listen, &sa]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);

    // A new process that takes the sockets but dies before it is ready: the old one
    // never stopped accepting. (Played by a client that asks and then hangs up.)
    {
        let mut s = std::os::unix::net::UnixStream::connect(Path::new(&ctl)).unwrap();
        s.write_all(b"upgrade\n").unwrap();
        let mut head = [0u8; 15];
        s.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"quill-upgrade 1");
    }
    wait_until(
        DEADLINE,
        "the old process noticed the abandoned upgrade",
        || old.stderr().contains("upgrade abandoned"),
    );
    load.wait_more(50, DEADLINE);
    old.assert_running();
    assert_eq!(ctl_ok(&ctl, "pid").trim(), old.pid().to_string());
    assert_no_failures(load);
}

#[test]
fn shutdown_grace_zero_waits_for_connections_and_a_second_term_ends_the_wait() {
    if skip_on_pen("shutdown_grace is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let mut q = Quill::start(&["-O", "shutdown_grace 0", "127.0.0.1:{port}", &a.spec()]);
    let addr = q.addr();
    let (_, mut open) = q.name_from("127.0.0.1");
    q.signal("TERM");
    wait_until(DEADLINE, "the listener is closed after SIGTERM", || {
        try_connect(addr).is_err()
    });
    exchange_on(&mut open, 3);
    q.assert_running();
    // The operator's way out of an unlimited grace: TERM again.
    q.signal("TERM");
    assert_eq!(q.wait_exit(DEADLINE), Some(Some(0)), "{}", q.stderr());
    let (rest, _) = expect_closed(&mut open, Duration::from_secs(10));
    assert!(rest.is_empty());
    assert!(q.stderr().contains("second signal"), "{}", q.stderr());
}

#[test]
fn connections_cut_when_shutdown_grace_runs_out_are_in_the_log() {
    if skip_on_pen("shutdown_grace is a quill extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let mut q = Quill::start(&["-O", "shutdown_grace 1", "127.0.0.1:{port}", &a.spec()]);
    let (_, mut open) = q.name_from("127.0.0.1");
    q.signal("TERM");
    assert_eq!(q.wait_exit(DEADLINE), Some(Some(0)), "{}", q.stderr());
    expect_closed(&mut open, Duration::from_secs(10));
    let log = q.stderr();
    assert!(
        log.contains("shutdown_grace (1 s) ran out: closing 1 open connection(s)"),
        "{log}"
    );
}
