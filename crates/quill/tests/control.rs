//! The control socket (`-C`), `quillctl` and Debian's `penctl`: every command against a
//! running quill, with its reply and its effect; errors that change nothing; the control
//! ACL; the Unix control socket; abuse of the control socket.
//!
//! Each test starts its own quill with `-C 127.0.0.1:{ctl}` (a free port) or a Unix socket
//! in its private directory, and `-u root` when the tests run as root (as Pen does, quill
//! refuses a control socket as root without it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::ctl::*;
use support::http_echo::{read_response, EchoServer};
use support::*;

/// Waits until quill reports no open client connection.
fn wait_no_open_connections(ctl: &str) {
    wait_until(
        Duration::from_secs(5),
        "quill reports 0 open connections",
        || status_json(ctl)["connections"]["open"] == 0,
    );
}

/// Connects, reads the backend's name, sends `msg` and reads its echo; returns the name.
fn echo_through(q: &Quill, src: &str, msg: &[u8]) -> String {
    let (name, mut s) = q.name_from(src);
    s.write_all(msg).unwrap();
    let mut back = vec![0u8; msg.len()];
    s.read_exact(&mut back).unwrap();
    assert_eq!(back, msg, "echo through quill");
    name
}

// ---------------------------------------------------------------------------
// Start-up rules
// ---------------------------------------------------------------------------

#[test]
fn control_socket_as_root_needs_u_root() {
    if !running_as_root() {
        eprintln!("SKIPPED: needs root (quill refuses -C only when running as root)");
        return;
    }
    if skip_on_pen("the check and its message are quill's") {
        return;
    }
    let a = IdentityBackend::start("a");
    let ctl = format!("127.0.0.1:{}", free_port());
    let (code, stderr) = Quill::start_expect_exit(&["-C", &ctl, "{port}", &a.spec()]);
    assert_eq!(
        code,
        Some(2),
        "quill -C as root without -u: stderr {stderr:?}"
    );
    assert!(
        stderr.contains("root") && stderr.contains("-u"),
        "the refusal must say that running as root needs -u: {stderr:?}"
    );
    // With -u root it starts and answers.
    let (_q, ctl) = start_with_tcp_control(&["{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "timeout"), "5\n");
}

// ---------------------------------------------------------------------------
// Reports
// ---------------------------------------------------------------------------

#[test]
fn servers_prints_pens_format_with_live_counters() {
    if skip_on_pen("quill's default weight is 1 (docs/COMPATIBILITY.md)") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) =
        start_with_tcp_control(&["127.0.0.1:{port}", &a.spec(), &b.spec_with("7:8:3:2")]);
    let expect = format!(
        "0 addr 127.0.0.1 port {} conn 0 max 0 hard 0 weight 1 prio 0 sx 0 rx 0 state up health unchecked\n\
         1 addr 127.0.0.1 port {} conn 0 max 7 hard 8 weight 3 prio 2 sx 0 rx 0 state up health unchecked\n",
        a.port(),
        b.port()
    );
    assert_eq!(ctl_ok(&ctl, "servers"), expect);

    // One open connection is counted on its server; its bytes when it is done.
    let (name, mut s) = q.name_from("127.0.0.2");
    let idx = if name == "a" { 0 } else { 1 };
    s.write_all(b"0123456789").unwrap();
    let mut back = [0u8; 10];
    s.read_exact(&mut back).unwrap();
    let servers = ctl_ok(&ctl, "servers");
    let line = servers.lines().nth(idx).unwrap().to_string();
    assert!(
        line.contains(" conn 1 "),
        "open connection not counted: {line}"
    );
    s.shutdown(Shutdown::Write).unwrap();
    let (rest, _) = expect_closed(&mut s, Duration::from_secs(5));
    assert!(rest.is_empty());
    let rx = name.len() + 1 + 10;
    let want = " conn 0 ".to_string();
    let want_bytes = format!(" sx 10 rx {rx}");
    wait_until(
        Duration::from_secs(5),
        format_args!("server {idx} shows conn 0 and `sx 10 rx {rx}`"),
        || {
            let servers = ctl_ok(&ctl, "servers");
            let line = servers.lines().nth(idx).unwrap_or_default().to_string();
            line.contains(&want) && line.contains(&format!("{want_bytes} "))
        },
    );
}

#[test]
fn status_html_and_status_json_report_the_same_counts() {
    if skip_on_pen("status json is quill's extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    // Four finished connections, two held open.
    for _ in 0..4 {
        let (_, s) = q.name_from("127.0.0.1");
        drop(s);
    }
    wait_until(Duration::from_secs(5), "backends closed", || {
        a.open() + b.open() == 0
    });
    let held: Vec<_> = (0..2).map(|_| q.name_from("127.0.0.1").1).collect();
    a.wait_accepted(3, Duration::from_secs(5));
    b.wait_accepted(3, Duration::from_secs(5));

    let mut json = Value::Null;
    wait_until(
        Duration::from_secs(5),
        "status json shows 2 open connections",
        || {
            json = status_json(&ctl);
            json["connections"]["open"] == 2
        },
    );
    assert_eq!(json["connections"]["accepted"], 6, "{json}");
    assert_eq!(json["pid"], q.pid(), "{json}");
    assert_eq!(json["control"], ctl.as_str(), "{json}");
    assert_eq!(json["mode"]["roundrobin"], true, "{json}");
    assert_eq!(json["mode"]["hash"], false, "{json}");
    let servers = json["servers"].as_array().expect("servers array");
    assert_eq!(servers.len(), 2, "{json}");
    for (i, be) in [&a, &b].iter().enumerate() {
        assert_eq!(servers[i]["index"], i, "{json}");
        assert_eq!(servers[i]["address"], "127.0.0.1", "{json}");
        assert_eq!(servers[i]["port"], be.port(), "{json}");
        assert_eq!(servers[i]["state"], "up", "{json}");
        assert_eq!(servers[i]["connections"], 1, "{json}");
        assert_eq!(servers[i]["total_connections"], 3, "{json}");
    }

    let html = ctl_ok(&ctl, "status");
    assert!(html.starts_with("<!DOCTYPE html>"), "{html}");
    assert!(html.trim_end().ends_with("</html>"), "{html}");
    assert!(
        html.contains("2 connections open, 6 accepted"),
        "HTML status disagrees with the JSON one: {html}"
    );
    for be in [&a, &b] {
        assert!(html.contains(&format!("<td>{}</td>", be.port())), "{html}");
    }
    // `status html` is the same report.
    assert!(ctl_ok(&ctl, "status html").starts_with("<!DOCTYPE html>"));
    drop(held);
}

#[test]
fn mode_follows_the_selection_commands() {
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec(), &b.spec()]);
    assert_eq!(
        ctl_ok(&ctl, "mode"),
        "no hash no roundrobin no stubborn no weight no prio\n"
    );
    // Client tracking (the default): the same client always gets the same server.
    let first = echo_through(&q, "127.0.0.2", b"x");
    for _ in 0..3 {
        assert_eq!(echo_through(&q, "127.0.0.2", b"x"), first, "tracking");
    }
    assert_eq!(ctl_ok(&ctl, "roundrobin"), "");
    assert_eq!(
        ctl_ok(&ctl, "mode"),
        "no hash roundrobin no stubborn no weight no prio\n"
    );
    // Round robin: the same client now alternates.
    let names: Vec<String> = (0..4)
        .map(|_| echo_through(&q, "127.0.0.2", b"x"))
        .collect();
    for pair in names.windows(2) {
        assert_ne!(pair[0], pair[1], "round robin did not alternate: {names:?}");
    }
    for word in ["hash", "stubborn", "weight", "prio"] {
        assert_eq!(ctl_ok(&ctl, word), "");
    }
    assert_eq!(
        ctl_ok(&ctl, "mode"),
        "hash roundrobin stubborn weight prio\n"
    );
    for word in ["hash", "roundrobin", "stubborn", "weight", "prio"] {
        assert_eq!(ctl_ok(&ctl, &format!("no {word}")), "");
    }
    assert_eq!(
        ctl_ok(&ctl, "mode"),
        "no hash no roundrobin no stubborn no weight no prio\n"
    );
}

#[test]
fn recent_lists_the_clients_seen() {
    if skip_on_pen("quill's `recent` format (docs/COMPATIBILITY.md)") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "recent"), "", "no client yet");
    echo_through(&q, "127.0.0.2", b"x");
    echo_through(&q, "127.0.0.3", b"x");
    echo_through(&q, "127.0.0.3", b"x");
    for cmd in ["recent", "recent 60"] {
        let r = ctl_ok(&ctl, cmd);
        let mut lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines.len(), 2, "`{cmd}`: {r:?}");
        // Most recent first, but quill's clock counts milliseconds and both clients may
        // have been seen within the same one: compare as a set.
        lines.sort();
        assert!(
            lines[0].starts_with("127.0.0.2 server 0 connections 1 last "),
            "`{cmd}`: {r:?}"
        );
        assert!(
            lines[1].starts_with("127.0.0.3 server 0 connections 2 last "),
            "`{cmd}`: {r:?}"
        );
    }
    assert_one_line_error(&ctl_err(&ctl, "recent soon"), "recent soon");
}

#[test]
fn control_pid_and_listen_answer_queries() {
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "control"), format!("{ctl}\n"));
    assert_eq!(ctl_ok(&ctl, "pid"), format!("{}\n", q.pid()));
    assert_eq!(ctl_ok(&ctl, "listen"), format!("127.0.0.1:{}\n", q.port));
}

// ---------------------------------------------------------------------------
// Settings: set, ask, effect
// ---------------------------------------------------------------------------

#[test]
fn numeric_settings_are_set_and_read_back() {
    if skip_on_pen("quill's defaults and `write` (docs/COMPATIBILITY.md)") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (_q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "timeout"), "5\n");
    assert_eq!(ctl_ok(&ctl, "blacklist"), "30\n");
    assert_eq!(ctl_ok(&ctl, "tracking"), "0\n");
    assert_eq!(ctl_ok(&ctl, "clients_max"), "2048\n");
    assert_eq!(ctl_ok(&ctl, "debug"), "0\n");
    assert_eq!(ctl_ok(&ctl, "idle_timeout"), "0\n");
    assert_eq!(ctl_ok(&ctl, "client_acl"), "0\n");
    assert_eq!(ctl_ok(&ctl, "control_acl"), "0\n");
    for (cmd, value) in [
        ("timeout", "7"),
        ("idle_timeout", "300"),
        ("blacklist", "42"),
        ("tracking", "99"),
        ("conn_max", "123"),
        ("clients_max", "77"),
        ("debug", "2"),
        ("client_acl", "4"),
    ] {
        // The reply to a setting is checked in setting_commands_answer_with_the_new_value.
        ctl_ok(&ctl, &format!("{cmd} {value}"));
        assert_eq!(
            ctl_ok(&ctl, cmd),
            format!("{value}\n"),
            "{cmd} after setting it"
        );
    }
    // What `write` saves agrees.
    let dir = TempDir::new("numeric");
    let cfg = written_config(&ctl, dir.path(), "n");
    for line in [
        "timeout 7",
        "blacklist 42",
        "tracking 99",
        "conn_max 123",
        "clients_max 77",
        "debug 2",
    ] {
        assert!(
            cfg.lines().any(|l| l == line),
            "`write` lacks {line:?}:\n{cfg}"
        );
    }
}

#[test]
fn setting_commands_answer_with_the_new_value_as_pen_does() {
    if skip_on_pen("this compares quill with Pen") {
        return;
    }
    // Pen 0.34.1 answers `timeout 9` with "9" (and so for every `NAME [N]` setting), and
    // penctl prints it; quill is to give "Pen's replies where Pen has them".
    let a = IdentityBackend::start("a");
    let (_q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    let mut wrong = Vec::new();
    for (cmd, value) in [
        ("timeout", "9"),
        ("blacklist", "20"),
        ("tracking", "10"),
        ("clients_max", "3000"),
        ("conn_max", "100"),
        ("debug", "1"),
        ("control_acl", "1"),
        ("client_acl", "3"),
    ] {
        let reply = ctl_ok(&ctl, &format!("{cmd} {value}"));
        if reply != format!("{value}\n") {
            wrong.push(format!("`{cmd} {value}` -> {reply:?}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "Pen answers a setting with its new value; quill: {}",
        wrong.join(", ")
    );
}

#[test]
fn conn_max_takes_effect_at_once() {
    if skip_on_pen("status json is quill's extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    ctl_ok(&ctl, "conn_max 1");
    let (_, held) = q.name_from("127.0.0.2");
    // Left in the listen queue while the one place is taken...
    let mut waiting = q.connect_from("127.0.0.3");
    waiting
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    assert!(
        waiting.read(&mut [0u8; 1]).is_err(),
        "served or closed beyond conn_max 1"
    );
    let json = status_json(&ctl);
    assert_eq!(json["connections"]["max"], 1, "{json}");
    assert_eq!(json["connections"]["open"], 1, "{json}");
    // ... and served as soon as the limit is raised, with the place still taken.
    ctl_ok(&ctl, "conn_max 10");
    waiting.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    assert!(
        backend_name(&mut waiting).is_some(),
        "served after conn_max 10"
    );
    echo_through(&q, "127.0.0.4", b"now there is room");
    drop(held);
}

#[test]
fn debug_level_set_at_run_time_changes_the_logging() {
    if skip_on_pen("quill's log messages") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    // At the default level (warnings), a refused control command is not logged.
    ctl_err(&ctl, "frobnicate-quietly");
    ctl_ok(&ctl, "debug 1");
    ctl_err(&ctl, "frobnicate-loudly");
    wait_until(
        Duration::from_secs(3),
        "`debug 1` makes quill log at INFO level (a refused control command)",
        || q.stderr().contains("frobnicate-loudly"),
    );
    assert!(!q.stderr().contains("frobnicate-quietly"), "{}", q.stderr());
}

#[test]
fn server_blacklist_moves_traffic_away_and_zero_brings_it_back() {
    if skip_on_pen("status json is quill's extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let names: Vec<String> = (0..4)
        .map(|_| echo_through(&q, "127.0.0.2", b"x"))
        .collect();
    assert!(names.contains(&"a".to_string()), "{names:?}");

    assert_eq!(ctl_ok(&ctl, "server 0 blacklist 60"), "");
    let json = status_json(&ctl);
    assert_eq!(json["servers"][0]["state"], "blacklisted", "{json}");
    assert!(
        json["servers"][0]["blacklist_seconds_left"].as_u64() > Some(50),
        "{json}"
    );
    assert!(ctl_ok(&ctl, "status").contains("blacklisted"));
    for i in 0..6 {
        assert_eq!(
            echo_through(&q, "127.0.0.2", b"x"),
            "b",
            "connection #{} went to the blacklisted server",
            i + 1
        );
    }

    assert_eq!(ctl_ok(&ctl, "server 0 blacklist 0"), "");
    assert_eq!(status_json(&ctl)["servers"][0]["state"], "up");
    let names: Vec<String> = (0..4)
        .map(|_| echo_through(&q, "127.0.0.2", b"x"))
        .collect();
    assert!(
        names.contains(&"a".to_string()),
        "server 0 whitelisted but not used: {names:?}"
    );
    // A slot without a server cannot be blacklisted.
    assert_one_line_error(
        &ctl_err(&ctl, "server 5 blacklist 10"),
        "server 5 blacklist",
    );
}

#[test]
fn server_command_edits_and_extends_the_server_table() {
    if skip_on_pen("status json is quill's extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let c = IdentityBackend::start("c");
    let (q, ctl) = start_with_tcp_control(&["-r", "127.0.0.1:{port}", &a.spec()]);
    assert_eq!(echo_through(&q, "127.0.0.2", b"x"), "a");

    // Move server 0 to another port: new connections go there.
    assert_eq!(ctl_ok(&ctl, &format!("server 0 port {}", c.port())), "");
    for _ in 0..3 {
        assert_eq!(echo_through(&q, "127.0.0.2", b"x"), "c");
    }
    // Every field.
    assert_eq!(
        ctl_ok(
            &ctl,
            &format!(
                "server 1 address 127.0.0.1 port {} max 5 hard 6 weight 3 prio 2 acl 4",
                b.port()
            )
        ),
        ""
    );
    let servers = without_counters(&ctl_ok(&ctl, "servers"));
    assert_eq!(
        servers,
        vec![
            format!(
                "0 addr 127.0.0.1 port {} max 0 hard 0 weight 1 prio 0",
                c.port()
            ),
            format!(
                "1 addr 127.0.0.1 port {} max 5 hard 6 weight 3 prio 2",
                b.port()
            ),
        ]
    );
    assert_eq!(status_json(&ctl)["servers"][1]["acl"], 4);
    // Both are used now (acl 4 is empty, so it permits everyone).
    let names: Vec<String> = (0..4)
        .map(|_| echo_through(&q, "127.0.0.2", b"x"))
        .collect();
    assert!(
        names.contains(&"b".to_string()) && names.contains(&"c".to_string()),
        "{names:?}"
    );
    let cfg = written_config(&ctl, q.dir(), "servers");
    assert!(
        cfg.lines().any(|l| l
            == format!(
                "server 1 address 127.0.0.1 port {} max 5 hard 6 weight 3 prio 2 acl 4",
                b.port()
            )),
        "{cfg}"
    );
}

#[test]
fn pen_compatibility_words_are_accepted_and_do_nothing() {
    if skip_on_pen("quill's `write`") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    let servers = without_counters(&ctl_ok(&ctl, "servers"));
    let mode = ctl_ok(&ctl, "mode");
    for word in [
        "block",
        "no block",
        "delayed_forward",
        "no delayed_forward",
        "ascii",
        "no ascii",
        "epoll",
        "poll",
        "select",
        "kqueue",
        "abort_on_error",
        "no abort_on_error",
        "abort_on_error",
    ] {
        assert_eq!(ctl_ok(&ctl, word), "", "`{word}`");
    }
    assert_eq!(without_counters(&ctl_ok(&ctl, "servers")), servers);
    assert_eq!(ctl_ok(&ctl, "mode"), mode);
    echo_through(&q, "127.0.0.2", b"still balancing");
    let cfg = written_config(&ctl, q.dir(), "compat");
    assert!(cfg.lines().any(|l| l == "abort_on_error"), "{cfg}");
    assert!(cfg.lines().any(|l| l == "no ascii"), "{cfg}");
}

/// A quill whose resolver asks a nameserver of the test's that never answers: quill runs
/// in a mount namespace of its own whose resolv.conf names `nameserver` (on port 53; each
/// test its own address, as tests run at once), a query given up after `timeout` seconds. `args` follow `-f -u root -C {ctl}`; a file `quill.conf` in
/// the daemon's directory may be named with `{dir}`. `None` (with a message) where root, a
/// mount namespace or the nameserver's address is missing.
struct SilentResolver {
    quill: support::daemon::Daemon,
    /// The nameserver's socket: a query quill's resolver sent is waiting here.
    nameserver: std::net::UdpSocket,
    /// The control address.
    ctl: String,
}

impl SilentResolver {
    fn start(nameserver: &str, timeout: u32, args: &str) -> Option<SilentResolver> {
        if !running_as_root() {
            eprintln!("SKIPPED: needs root (a mount namespace for resolv.conf)");
            return None;
        }
        let dir = TempDir::new("resolver");
        let conf = dir.path().join("resolv.conf");
        fs::write(
            &conf,
            format!("nameserver {nameserver}\noptions timeout:{timeout} attempts:1\n"),
        )
        .unwrap();
        let Ok(nameserver) = std::net::UdpSocket::bind((nameserver, 53)) else {
            eprintln!("SKIPPED: cannot listen on {nameserver}:53");
            return None;
        };
        fs::write(dir.path().join("quill.conf"), "").unwrap();
        let namespaces = std::process::Command::new("unshare")
            .args(["-m", "true"])
            .status();
        if !namespaces.is_ok_and(|s| s.success()) {
            eprintln!("SKIPPED: no mount namespace here (unshare -m)");
            return None;
        }
        let (port, ctl_port) = (free_port(), free_port());
        let ctl = format!("127.0.0.1:{ctl_port}");
        let args = args
            .replace("{port}", &port.to_string())
            .replace("{dir}", &dir.path().display().to_string());
        let script = format!(
            "mount --bind {} /etc/resolv.conf && exec {} -f -u root -C {ctl} {args}",
            conf.display(),
            bin().display()
        );
        let args = ["-m", "sh", "-c", &script].map(String::from);
        let quill = support::daemon::Daemon::start("unshare", &args, port, dir)?;
        wait_until(
            Duration::from_secs(10),
            "the control socket answers",
            || quillctl(&ctl, &["pid"]).code == Some(0),
        );
        nameserver
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        Some(SilentResolver {
            quill,
            nameserver,
            ctl,
        })
    }

    /// Waits until quill's resolver has sent its query (and now waits for an answer).
    fn wait_for_query(&self) {
        let mut query = [0u8; 512];
        self.nameserver
            .recv_from(&mut query)
            .expect("quill's resolver asks the namespace's nameserver");
    }

    /// Sends TERM; quill must have exited, successfully, within 5 s.
    fn stops_at_once_on_term(&mut self) {
        self.quill.signal("TERM");
        let status = self.quill.wait_exit(Duration::from_secs(5));
        assert!(
            status.is_some_and(|s| s.success()),
            "quill did not stop within 5 s of TERM ({status:?}): {}",
            self.quill.stderr()
        );
    }

    /// `server 1 address slow.quill.test` on a thread of its own: it waits on the resolver.
    fn slow_command(&self) -> thread::JoinHandle<Exit> {
        let ctl = self.ctl.clone();
        thread::spawn(move || quillctl(&ctl, &["server", "1", "address", "slow.quill.test"]))
    }
}

#[test]
fn a_slow_resolver_does_not_stall_other_control_commands() {
    // `server N address HOST` resolves HOST when it is applied. With a resolver that
    // never answers, that command waits for it; `servers` on another connection must be
    // answered meanwhile.
    let Some(q) = SilentResolver::start("127.66.0.1", 3, "{port} 127.0.0.1:9") else {
        return;
    };
    let slow = q.slow_command();
    q.wait_for_query();
    let servers = ctl_ok(&q.ctl, "servers");
    assert!(servers.starts_with("0 addr 127.0.0.1 port 9"), "{servers}");
    assert!(
        !slow.is_finished(),
        "`servers` was answered only after the resolver gave up"
    );
    // Nothing ever answers: the command fails, naming the host, and changes nothing.
    let out = slow.join().unwrap();
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stdout.contains("slow.quill.test"), "{out:?}");
    assert!(!ctl_ok(&q.ctl, "servers").contains("\n1 addr"));
}

#[test]
fn a_stop_does_not_wait_for_a_command_stuck_on_the_resolver() {
    // The resolver would take 20 s to give up; TERM stops quill long before.
    let Some(mut q) = SilentResolver::start("127.66.0.2", 20, "{port} 127.0.0.1:9") else {
        return;
    };
    let _slow = q.slow_command();
    q.wait_for_query();
    q.stops_at_once_on_term();
}

#[test]
fn a_stop_does_not_wait_for_a_reload_stuck_on_the_resolver() {
    // SIGHUP rebuilds the settings from the file, which now names a host the resolver
    // never answers for; control commands are answered meanwhile, and TERM during that
    // reload stops quill at once.
    let args = "-F {dir}/quill.conf {port} 127.0.0.1:9";
    let Some(mut q) = SilentResolver::start("127.66.0.3", 20, args) else {
        return;
    };
    fs::write(
        q.quill.dir().join("quill.conf"),
        "server 1 address slow.quill.test port 80\n",
    )
    .unwrap();
    q.quill.signal("HUP");
    q.wait_for_query();
    // Still serving control commands while the reload waits.
    let servers = ctl_ok(&q.ctl, "servers");
    assert!(servers.starts_with("0 addr 127.0.0.1 port 9"), "{servers}");
    q.stops_at_once_on_term();
}

// ---------------------------------------------------------------------------
// Operations on connections, the listener, files
// ---------------------------------------------------------------------------

#[test]
fn connection_and_close_act_on_live_connections() {
    if skip_on_pen("quill numbers connections in accept order (docs/COMPATIBILITY.md)") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    // Connections are numbered from 1 in accept order.
    let (_, mut one) = q.name_from("127.0.0.2");
    let (_, mut two) = q.name_from("127.0.0.3");
    let reply = ctl_ok(&ctl, "connection 1");
    assert!(
        reply.starts_with(&format!(
            "connection 1 client {} upstream server 0 age ",
            one.local_addr().unwrap()
        )),
        "{reply:?}"
    );
    assert_eq!(reply.lines().count(), 1, "{reply:?}");
    let reply = ctl_ok(&ctl, "connection 2");
    assert!(
        reply.contains(&format!("client {} ", two.local_addr().unwrap())),
        "{reply:?}"
    );
    // `connections` lists them all, oldest first, as `connection N` shows each: the
    // numbers `close N` takes. The status page lists them too, as Pen's does.
    let listed = ctl_ok(&ctl, "connections");
    let lines: Vec<&str> = listed.lines().collect();
    assert_eq!(lines.len(), 2, "{listed:?}");
    assert!(lines[0].starts_with("connection 1 client "), "{listed:?}");
    let second = format!(
        "connection 2 client {} upstream server 0 age ",
        two.local_addr().unwrap()
    );
    assert!(lines[1].starts_with(&second), "{listed:?}");
    // `connections N`: the oldest N, and how many more (a table of 20,000 connections is
    // 1.3 MB of lines).
    let oldest = ctl_ok(&ctl, "connections 1");
    assert_eq!(oldest, format!("{}\nand 1 more\n", lines[0]));
    assert_eq!(ctl_ok(&ctl, "connections 5"), listed);
    let page = ctl_ok(&ctl, "status");
    assert!(
        page.contains("<h2>Connections</h2>") && page.contains(&second),
        "{page}"
    );

    assert_eq!(ctl_ok(&ctl, "close 1"), "");
    expect_closed(&mut one, Duration::from_secs(5));
    wait_until(
        Duration::from_secs(5),
        "the closed one leaves the list",
        || ctl_ok(&ctl, "connections").lines().count() == 1,
    );
    assert!(ctl_ok(&ctl, "connections").starts_with("connection 2 "));
    // The other one is untouched.
    two.write_all(b"still here").unwrap();
    let mut back = [0u8; 10];
    two.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"still here");

    assert_one_line_error(&ctl_err(&ctl, "connection 1"), "connection of a closed one");
    assert_one_line_error(&ctl_err(&ctl, "close 1"), "close of a closed one");
    assert_one_line_error(&ctl_err(&ctl, "connection 99"), "connection 99");
    assert_one_line_error(&ctl_err(&ctl, "close 99"), "close 99");
    a.wait_open(1, Duration::from_secs(5));
}

#[test]
fn connection_shows_the_server_of_each_request_of_an_http_client() {
    if skip_on_pen("quill numbers connections in accept order (docs/COMPATIBILITY.md)") {
        return;
    }
    let (a, b) = (EchoServer::start(), EchoServer::start());
    // `http` with its default pool: each request of a keep-alive client is sent to a server
    // chosen for it, here by round robin.
    let (q, ctl) = start_with_tcp_control(&["-H", "-r", "127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let mut client = q.connect();
    let upstream = |ctl: &str| {
        let reply = ctl_ok(ctl, "connection 1");
        let words: Vec<&str> = reply.split_whitespace().collect();
        let at = words.iter().position(|w| *w == "upstream").unwrap();
        words[at + 1..words.len() - 2].join(" ")
    };
    wait_until(
        Duration::from_secs(5),
        "quill registers the connection",
        || ask(&ctl, "connection 1").starts_with("connection 1 "),
    );
    assert_eq!(upstream(&ctl), "none", "before its first request");
    for server in ["server 0", "server 1", "server 0"] {
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: quill.test\r\n\r\n")
            .unwrap();
        let answer = read_response(&mut client).expect("an answer");
        assert_eq!(answer.status, 200);
        assert_eq!(
            upstream(&ctl),
            server,
            "after a request the round robin sent there"
        );
    }
    assert_eq!(a.requests() + b.requests(), 3);
}

#[test]
fn connection_shows_the_server_an_http2_clients_request_is_waiting_on() {
    if skip_on_pen("HTTP/2 is quill's") {
        return;
    }
    if std::process::Command::new("curl")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("SKIPPED: curl is not installed (.ci/run installs it)");
        return;
    }
    // A server that takes the request and answers only when told to.
    let server = TcpListener::bind("127.0.0.1:0").unwrap();
    server.set_nonblocking(true).unwrap();
    let spec = server.local_addr().unwrap().to_string();
    let (q, ctl) = start_with_tcp_control(&["-H", "-O", "h2c", "127.0.0.1:{port}", &spec]);
    let url = format!("http://{}/", q.addr());
    let curl = thread::spawn(move || {
        std::process::Command::new("curl")
            .args(["-sS", "--max-time", "20", "--http2-prior-knowledge", &url])
            .output()
    });
    let mut accepted = None;
    wait_until(
        Duration::from_secs(10),
        "quill sends the request on",
        || {
            accepted = server.accept().ok();
            accepted.is_some()
        },
    );
    let (mut held, _) = accepted.unwrap();
    held.set_nonblocking(false).unwrap();
    let mut head = [0u8; 1024];
    let _ = held.read(&mut head).unwrap();
    let reply = ctl_ok(&ctl, "connection 1");
    assert!(reply.contains(" upstream server 0 "), "{reply:?}");
    held.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
        .unwrap();
    let out = curl.join().unwrap().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "ok\n");
}

#[test]
fn listen_moves_the_listener_and_established_connections_stay() {
    if skip_on_pen("status json is quill's extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    let old = q.addr();
    let (_, mut before) = q.name_from("127.0.0.2");

    let new_port = free_port();
    let new = format!("127.0.0.1:{new_port}");
    assert_eq!(ctl_ok(&ctl, &format!("listen {new}")), "");
    assert_eq!(ctl_ok(&ctl, "listen"), format!("{new}\n"));
    let new_addr: std::net::SocketAddr = new.parse().unwrap();
    wait_until(
        Duration::from_secs(5),
        "the new address accepts",
        || match client_from("127.0.0.3", new_addr) {
            Ok(mut s) => backend_name(&mut s).as_deref() == Some("a"),
            Err(_) => false,
        },
    );
    wait_until(Duration::from_secs(5), "the old address refuses", || {
        try_connect(old).is_err()
    });
    // The connection made before the move still works both ways.
    before.write_all(b"after the move").unwrap();
    let mut back = [0u8; 14];
    before.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"after the move");
    let json = status_json(&ctl);
    assert_eq!(json["listen"], new.as_str(), "{json}");
}

#[test]
fn listen_to_an_address_in_use_is_an_error_and_changes_nothing() {
    if skip_on_pen("quill's error replies") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    let busy = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_addr = busy.local_addr().unwrap();
    let reply = quillctl(&ctl, &["listen", &busy_addr.to_string()]);
    assert_eq!(
        (reply.code, reply.stdout.starts_with("error: ")),
        (Some(1), true),
        "`listen {busy_addr}` (taken by another socket) must fail: {reply:?}"
    );
    assert_eq!(
        ctl_ok(&ctl, "listen"),
        format!("127.0.0.1:{}\n", q.port),
        "a failed listen must leave the listening address as it was"
    );
    echo_through(&q, "127.0.0.2", b"old address still serves");
    assert_one_line_error(&ctl_err(&ctl, "listen not/an:address:"), "listen garbage");
}

/// Settings a running quill cannot take up are refused, and serving goes on as before:
/// `conn_max 0` (every client refused), `dsr_if` (its packet socket is opened at start-up
/// only; before, it was taken silently and written by `write` for the next start to fail
/// on) and, without CAP_NET_ADMIN (quill runs as its `-u` user), `transparent` (before,
/// every connect then failed and every server was blacklisted).
#[test]
fn settings_a_running_quill_cannot_take_up_are_errors_and_change_nothing() {
    if skip_on_pen("quill's error replies") {
        return;
    }
    let a = IdentityBackend::start("a");
    let spec = a.spec();
    // As root, quill drops to `nobody`, which has no CAP_NET_ADMIN.
    let unprivileged = running_as_root();
    let mut args = vec!["-C", "127.0.0.1:{ctl}"];
    if unprivileged {
        args.extend(["-u", "nobody"]);
    }
    args.extend(["127.0.0.1:{port}", spec.as_str()]);
    let (q, ctl) = start_with_control(&args);
    let conn_max = ctl_ok(&ctl, "conn_max");
    assert_one_line_error(&ctl_err(&ctl, "conn_max 0"), "conn_max 0");
    assert_eq!(ctl_ok(&ctl, "conn_max"), conn_max);
    assert_one_line_error(&ctl_err(&ctl, "dsr_if lo"), "dsr_if lo");
    // Written where `nobody` may create a file.
    let tag = format!("refused-{}", q.port);
    let written = written_config(&ctl, &std::env::temp_dir(), &tag);
    let _ = fs::remove_file(std::env::temp_dir().join(format!("written-{tag}.cfg")));
    assert!(
        !written.contains("dsr_if"),
        "a refused dsr_if is not written: {written}"
    );
    if unprivileged {
        let reply = ctl_err(&ctl, "transparent");
        assert!(reply.contains("CAP_NET_ADMIN"), "{reply}");
        assert!(ctl_ok(&ctl, "mode")
            .lines()
            .all(|l| !l.contains("transparent")));
    } else {
        eprintln!("SKIPPED (transparent): not root, so no -u user to run as");
    }
    echo_through(&q, "127.0.0.2", b"still serving");
    assert_eq!(server_status(&ctl, 0)["blacklisted"], false);
}

#[test]
fn log_command_opens_and_closes_the_connection_log() {
    if skip_on_pen("status json is quill's extension") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "log").trim(), "", "no log at first");
    let log = q.dir().join("conn.log");
    assert_eq!(ctl_ok(&ctl, &format!("log {}", log.display())), "");
    assert_eq!(ctl_ok(&ctl, "log"), format!("{}\n", log.display()));

    let (_, mut s) = q.name_from("127.0.0.2");
    s.write_all(b"GET /logged HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    expect_closed(&mut s, Duration::from_secs(5));
    let mut text = String::new();
    wait_until(Duration::from_secs(5), "the connection is logged", || {
        text = fs::read_to_string(&log).unwrap_or_default();
        text.contains("127.0.0.2 ")
    });
    let line = text.lines().find(|l| l.starts_with("127.0.0.2 ")).unwrap();
    let fields: Vec<&str> = line.splitn(4, ' ').collect();
    assert_eq!(fields.len(), 4, "{line:?}");
    let t: u64 = fields[1]
        .parse()
        .unwrap_or_else(|_| panic!("time in {line:?}"));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(t <= now && now - t < 60, "{line:?}");
    assert_eq!(fields[2], "127.0.0.1", "{line:?}");
    assert_eq!(fields[3], "GET /logged HTTP/1.0", "{line:?}");

    assert_eq!(ctl_ok(&ctl, "no log"), "");
    assert_eq!(ctl_ok(&ctl, "log").trim(), "");
    echo_through(&q, "127.0.0.3", b"not logged");
    wait_no_open_connections(&ctl);
    let text = fs::read_to_string(&log).unwrap();
    assert!(!text.contains("127.0.0.3"), "logged after `no log`: {text}");
}

#[test]
fn web_stats_names_the_status_file_written_on_sigusr1() {
    if skip_on_pen("Pen 0.34.1 still names the file after `no web_stats`") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "web_stats").trim(), "");
    let file = q.dir().join("status.html");
    assert_eq!(ctl_ok(&ctl, &format!("web_stats {}", file.display())), "");
    assert_eq!(ctl_ok(&ctl, "web_stats"), format!("{}\n", file.display()));
    signal_when_handled(&q, "USR1");
    wait_until(
        Duration::from_secs(5),
        "SIGUSR1 writes the status file",
        || fs::read_to_string(&file).is_ok_and(|t| t.contains("</html>")),
    );
    let html = fs::read_to_string(&file).unwrap();
    assert!(html.contains(&format!("<td>{}</td>", a.port())), "{html}");

    assert_eq!(ctl_ok(&ctl, "no web_stats"), "");
    assert_eq!(ctl_ok(&ctl, "web_stats").trim(), "");
    fs::remove_file(&file).unwrap();
    let seen = q.stderr().matches("statistics").count();
    signal_when_handled(&q, "USR1");
    wait_until(Duration::from_secs(5), "SIGUSR1 is handled", || {
        q.stderr().matches("statistics").count() > seen
    });
    assert!(!file.exists(), "status file written after `no web_stats`");
}

#[test]
fn include_applies_a_file_and_a_bad_one_changes_nothing() {
    if skip_on_pen("quill's all-or-nothing include (docs/COMPATIBILITY.md)") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    let dir = q.dir();
    let good = dir.join("good.cfg");
    fs::write(
        &good,
        format!(
            "# applied at run time\n\nroundrobin\ntimeout 9\nserver 1 address 127.0.0.1 port {}\n",
            b.port()
        ),
    )
    .unwrap();
    assert_eq!(ctl_ok(&ctl, &format!("include {}", good.display())), "");
    assert_eq!(ctl_ok(&ctl, "timeout"), "9\n");
    assert!(ctl_ok(&ctl, "mode").contains("no hash roundrobin"));
    assert_eq!(ctl_ok(&ctl, "servers").lines().count(), 2);
    let names: Vec<String> = (0..4)
        .map(|_| echo_through(&q, "127.0.0.2", b"x"))
        .collect();
    assert!(names.contains(&"b".to_string()), "{names:?}");

    let before = written_config(&ctl, dir, "before");
    // A bad line (the third) after good ones: nothing of the file is applied.
    let bad = dir.join("bad.cfg");
    fs::write(&bad, "hash\ntimeout 11\nfrobnicate 3\n").unwrap();
    let reply = ctl_err(&ctl, &format!("include {}", bad.display()));
    assert_one_line_error(&reply, "bad include");
    assert!(
        reply.contains(&format!("{}:3:", bad.display())),
        "the error must name the file and the line: {reply:?}"
    );
    // A bad line in a nested include, a loop, a missing file, an operation.
    fs::write(dir.join("inner.cfg"), "stubborn\nserver 0 max lots\n").unwrap();
    fs::write(dir.join("outer.cfg"), "weight\ninclude inner.cfg\n").unwrap();
    let reply = ctl_err(
        &ctl,
        &format!("include {}", dir.join("outer.cfg").display()),
    );
    assert!(reply.contains("inner.cfg:2:"), "{reply:?}");
    fs::write(dir.join("loop1.cfg"), "prio\ninclude loop2.cfg\n").unwrap();
    fs::write(dir.join("loop2.cfg"), "include loop1.cfg\n").unwrap();
    let reply = ctl_err(
        &ctl,
        &format!("include {}", dir.join("loop1.cfg").display()),
    );
    assert!(reply.contains("loop"), "{reply:?}");
    let reply = ctl_err(
        &ctl,
        &format!("include {}", dir.join("missing.cfg").display()),
    );
    assert!(reply.contains("missing.cfg"), "{reply:?}");
    fs::write(dir.join("op.cfg"), "hash\nservers\n").unwrap();
    let reply = ctl_err(&ctl, &format!("include {}", dir.join("op.cfg").display()));
    assert!(reply.contains("op.cfg:2:"), "{reply:?}");

    assert_eq!(written_config(&ctl, dir, "after"), before);
    assert_eq!(ctl_ok(&ctl, "timeout"), "9\n");
    assert_eq!(
        ctl_ok(&ctl, "mode"),
        "no hash roundrobin no stubborn no weight no prio\n"
    );
}

#[test]
fn write_without_a_file_needs_f() {
    if skip_on_pen("quill's error replies") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (_q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_one_line_error(&ctl_err(&ctl, "write"), "write without -F");
    assert_one_line_error(
        &ctl_err(&ctl, "write /nonexistent-dir/quill.cfg"),
        "write to an impossible path",
    );
}

#[test]
fn exit_works_only_with_x() {
    if skip_on_pen("quill's error reply") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (mut q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    let reply = ctl_err(&ctl, "exit");
    assert_one_line_error(&reply, "exit without -X");
    assert!(reply.contains("-X"), "{reply:?}");
    q.assert_running();
    echo_through(&q, "127.0.0.2", b"still here");

    let (mut q, ctl) = start_with_tcp_control(&["-X", "127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "exit"), "");
    assert_eq!(
        q.wait_exit(Duration::from_secs(5)),
        Some(Some(0)),
        "`exit` with -X"
    );
}

// ---------------------------------------------------------------------------
// Access to the control socket
// ---------------------------------------------------------------------------

#[test]
fn control_acl_refuses_other_addresses_and_admits_the_permitted_one() {
    if skip_on_pen("quill answers a refused control client with an error line") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(ctl_ok(&ctl, "acl 1 permit 127.0.0.1"), "");
    ctl_ok(&ctl, "control_acl 1");
    let before = written_config(&ctl, q.dir(), "before");

    let reply = exchange_from("127.0.0.2", &ctl, b"timeout 9\n").unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert_one_line_error(&reply, "control client from 127.0.0.2");
    let reply = exchange_from("127.0.0.2", &ctl, b"servers\n").unwrap();
    assert_one_line_error(&String::from_utf8_lossy(&reply), "servers from 127.0.0.2");

    let reply = exchange_from("127.0.0.1", &ctl, b"timeout\n").unwrap();
    assert_eq!(String::from_utf8_lossy(&reply), "5\n", "nothing changed");
    assert_eq!(written_config(&ctl, q.dir(), "after"), before);
    assert!(before.lines().any(|l| l == "control_acl 1"), "{before}");
    // The control ACL does not restrict the balanced service.
    echo_through(&q, "127.0.0.2", b"clients are not affected");
}

/// quill in front of `server` with a Unix control socket in its directory (`-u root` when
/// root), started once it serves; the socket's path.
fn start_with_unix_control(server: &str) -> (Quill, std::path::PathBuf) {
    let mut args = vec!["-C", "{dir}/ctl.sock"];
    args.extend(run_as_args());
    args.extend(["127.0.0.1:{port}", server]);
    let q = Quill::start(&args);
    let sock = q.dir().join("ctl.sock");
    (q, sock)
}

#[test]
fn unix_control_socket_is_private_and_removed_at_exit() {
    if skip_on_pen("quill's control socket rules") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (mut q, sock) = start_with_unix_control(&a.spec());
    let path = sock.to_str().unwrap().to_string();
    let meta = fs::metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(
        meta.permissions().mode() & 0o777,
        0o600,
        "control socket mode {:o}",
        meta.permissions().mode() & 0o777
    );
    assert_eq!(meta.uid(), nix::unistd::geteuid().as_raw());
    ctl_ok(&path, "timeout 8");
    assert_eq!(ctl_ok(&path, "timeout"), "8\n");
    assert_eq!(ctl_ok(&path, "control"), format!("{path}\n"));
    if let Some(out) = penctl(&path, &["timeout"]) {
        assert_eq!(out.stdout, "8\n", "penctl over a Unix socket: {out:?}");
    }
    signal_when_handled(&q, "TERM");
    assert_eq!(q.wait_exit(Duration::from_secs(5)), Some(Some(0)));
    assert!(!exists(&sock), "the control socket is left behind");
}

#[test]
fn the_control_socket_is_open_before_the_port_and_gone_when_start_up_fails() {
    if skip_on_pen("quill's start-up order") {
        return;
    }
    let a = IdentityBackend::start("a");
    let spec = a.spec();
    // Whoever finds the port open finds the control socket too: a script (or a test) may
    // run quillctl as soon as quill serves. The control socket is bound first, so ...
    let (q, sock) = start_with_unix_control(&spec);
    assert!(
        exists(&sock),
        "quill serves, but without its control socket yet"
    );

    // ... and when the port then cannot be had, quill removes the socket it made.
    let dir = TempDir::new("ctl-start");
    let sock = dir.path().join("ctl.sock");
    let mut args = vec!["-f", "-C", sock.to_str().unwrap()];
    args.extend(run_as_args());
    let taken = q.addr().to_string();
    args.extend([taken.as_str(), spec.as_str()]);
    let exit = run(&args);
    assert_ne!(
        exit.code,
        Some(0),
        "a second quill on {taken} started: {exit:?}"
    );
    assert!(exit.stderr.contains("in use"), "{}", exit.stderr);
    assert!(
        !exists(&sock),
        "a failed start left its control socket: {}",
        exit.stderr
    );
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

#[test]
fn malformed_and_unknown_commands_get_one_line_errors_and_change_nothing() {
    if skip_on_pen("Pen answers `ignoring command` (docs/COMPATIBILITY.md)") {
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let dir = TempDir::new("malformed");
    let before = written_config(&ctl, dir.path(), "before");
    let servers = without_counters(&ctl_ok(&ctl, "servers"));
    let mode = ctl_ok(&ctl, "mode");
    let bad: &[(&str, &str)] = &[
        ("frobnicate", "frobnicate"),
        ("frobnicate 1 2 3", "frobnicate"),
        ("timeout abc", "abc"),
        ("timeout 0", "0"),
        ("timeout 5 6", "6"),
        ("tracking -1", "-1"),
        (
            "conn_max 99999999999999999999999",
            "99999999999999999999999",
        ),
        ("clients_max 0", "clients_max"),
        ("server", "server"),
        ("server 0", "server"),
        ("server x max 1", "x"),
        ("server 0 max lots", "lots"),
        ("server 0 colour blue", "colour"),
        ("server 0 port 70000", "70000"),
        ("server 0 address 300.1.1.1", "300.1.1.1"),
        ("server 9999 max 1", "9999"),
        ("server 7 blacklist 10", "7"),
        ("acl 10 deny 1.2.3.4", "10"),
        ("acl 1 frob 1.2.3.4", "frob"),
        ("acl 1 deny 1.2.3", "1.2.3"),
        ("acl 1 deny country FR", "geoip"),
        ("control_acl 12", "12"),
        ("no timeout", "timeout"),
        ("no", "no"),
        ("status xml", "xml"),
        ("connection x", "x"),
        ("close", "close"),
        ("include", "include"),
        ("log a b", "b"),
        ("mode please", "please"),
        ("roundrobin now", "now"),
        ("tcp_fastclose sometimes", "sometimes"),
        ("idle_timeout soon", "soon"),
    ];
    for (line, names) in bad {
        let words: Vec<&str> = line.split_whitespace().collect();
        let out = quillctl(&ctl, &words);
        assert_eq!(out.code, Some(1), "`{line}`: {out:?}");
        assert_one_line_error(&out.stdout, line);
        assert!(
            out.stdout.to_lowercase().contains(&names.to_lowercase()),
            "the error for `{line}` should name {names:?}: {:?}",
            out.stdout
        );
    }
    // Lines quillctl cannot send: empty, blank, a NUL, a CRLF-terminated one, no newline.
    for raw in [&b"\n"[..], b"   \t \n", b"time\0out 3\n", b"hash \x01\n"] {
        let reply = String::from_utf8_lossy(&exchange(&ctl, raw).unwrap()).into_owned();
        assert_one_line_error(&reply, &format!("{raw:?}"));
    }
    assert_eq!(
        String::from_utf8_lossy(&exchange(&ctl, b"timeout\r\n").unwrap()),
        "5\n",
        "a CRLF line works as a LF line"
    );
    // `printf timeout | nc` keeps its side open and never sends a newline: Pen takes what
    // came as the command, and so does quill once nothing more comes.
    assert_eq!(
        String::from_utf8_lossy(&exchange(&ctl, b"timeout").unwrap()),
        "5\n",
        "a command without a newline is answered"
    );
    assert_eq!(written_config(&ctl, dir.path(), "after"), before);
    assert_eq!(without_counters(&ctl_ok(&ctl, "servers")), servers);
    assert_eq!(ctl_ok(&ctl, "mode"), mode);
    echo_through(&q, "127.0.0.2", b"still balancing");
}

#[test]
fn quillctl_exit_status_tells_errors_from_connection_failures() {
    if skip_on_pen("quill's error replies") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (_q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);
    assert_eq!(quillctl(&ctl, &["timeout"]).code, Some(0));
    assert_eq!(quillctl(&ctl, &["no-such-command"]).code, Some(1));
    // Nobody listens there.
    let closed = format!("127.0.0.1:{}", free_port());
    let out = quillctl(&closed, &["servers"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains(&closed), "{out:?}");
    let out = quillctl("/nonexistent/quill.ctl", &["servers"]);
    assert_eq!(out.code, Some(2), "{out:?}");
    // Usage.
    let out = quillctl(&ctl, &[]);
    assert_eq!(out.code, Some(2), "{out:?}");
    assert!(out.stderr.contains("usage"), "{out:?}");
}

// ---------------------------------------------------------------------------
// Debian's penctl
// ---------------------------------------------------------------------------

#[test]
fn penctl_drives_quill() {
    if skip_on_pen("this checks penctl against quill") {
        return;
    }
    if penctl_bin().is_none() {
        eprintln!("SKIPPED: penctl is not installed (Debian package pen)");
        return;
    }
    let a = IdentityBackend::start("a");
    let b = IdentityBackend::start("b");
    let (q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec(), &b.spec()]);
    let pen = |words: &[&str]| {
        let out = penctl(&ctl, words).unwrap();
        assert_eq!(out.code, Some(0), "penctl {words:?}: {out:?}");
        out.stdout
    };
    assert_eq!(pen(&["servers"]), ctl_ok(&ctl, "servers"));
    assert_eq!(
        pen(&["mode"]),
        "no hash no roundrobin no stubborn no weight no prio\n"
    );
    pen(&["timeout", "9"]);
    assert_eq!(pen(&["timeout"]), "9\n");
    assert_eq!(ctl_ok(&ctl, "timeout"), "9\n");
    assert_eq!(pen(&["roundrobin"]), "");
    assert!(pen(&["mode"]).contains("no hash roundrobin"));
    assert_eq!(pen(&["server", "0", "blacklist", "60"]), "");
    for _ in 0..4 {
        assert_eq!(echo_through(&q, "127.0.0.2", b"x"), "b");
    }
    assert_eq!(pen(&["server", "0", "blacklist", "0"]), "");
    assert_eq!(status_json(&ctl)["servers"][0]["state"], "up");
    assert!(pen(&["status"]).contains("</html>"));
    assert_eq!(pen(&["pid"]), format!("{}\n", q.pid()));
    assert_eq!(pen(&["control"]), format!("{ctl}\n"));
    assert!(pen(&["frobnicate"]).starts_with("error: "));
}

// ---------------------------------------------------------------------------
// Abuse
// ---------------------------------------------------------------------------

#[test]
fn control_socket_survives_abuse() {
    if skip_on_pen("quill's error replies") {
        return;
    }
    let a = IdentityBackend::start("a");
    let (mut q, ctl) = start_with_tcp_control(&["127.0.0.1:{port}", &a.spec()]);

    // A client that connects and says nothing does not hold the others up.
    let idle = std::net::TcpStream::connect(&ctl).unwrap();
    assert_eq!(ctl_ok(&ctl, "timeout"), "5\n");

    // A 1 MiB line: an error (or a closed connection), never a crash.
    let mut huge = vec![b'x'; 1 << 20];
    huge.extend_from_slice(b"\n");
    let reply = exchange(&ctl, &huge).unwrap();
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.is_empty() || reply.starts_with("error: "),
        "reply to a 1 MiB line: {:?}",
        &reply[..reply.len().min(200)]
    );
    if !reply.is_empty() {
        assert_one_line_error(&reply, "1 MiB line");
    }
    // Binary garbage.
    let mut rng = Rng::new(7);
    for len in [1usize, 17, 4096, 70_000] {
        let mut junk = vec![0u8; len];
        rng.fill(&mut junk);
        for b in junk.iter_mut() {
            if *b == b'\n' {
                *b = 0xff;
            }
        }
        junk[0] = 0xff; // not UTF-8, whatever follows
        junk.push(b'\n');
        let reply = exchange(&ctl, &junk).unwrap();
        let reply = String::from_utf8_lossy(&reply);
        assert!(
            reply.is_empty() || reply.starts_with("error: "),
            "reply to {len} bytes of garbage: {reply:?}"
        );
    }
    // A client that sends half a line and hangs up.
    {
        let mut s = std::net::TcpStream::connect(&ctl).unwrap();
        s.write_all(b"serv").unwrap();
    }

    // 200 clients at once, each with its own question.
    let n = 200;
    let barrier = Arc::new(Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let ctl = ctl.clone();
            let barrier = Arc::clone(&barrier);
            thread::spawn(move || {
                let line = match i % 4 {
                    0 => "servers\n",
                    1 => "timeout\n",
                    2 => "mode\n",
                    _ => "frobnicate\n",
                };
                barrier.wait();
                (i, exchange(&ctl, line.as_bytes()))
            })
        })
        .collect();
    // quill adds its own `state` and `health` pairs after Pen's fields.
    let tail = if is_pen() {
        ""
    } else {
        " state up health unchecked"
    };
    let servers = format!(
        "0 addr 127.0.0.1 port {} conn 0 max 0 hard 0 weight 1 prio 0 sx 0 rx 0{tail}\n",
        a.port()
    );
    let start = Instant::now();
    for t in threads {
        let (i, reply) = t.join().unwrap();
        let reply = reply.unwrap_or_else(|e| panic!("parallel client #{i}: {e}"));
        let reply = String::from_utf8_lossy(&reply);
        match i % 4 {
            0 => assert_eq!(reply, servers, "#{i}"),
            1 => assert_eq!(reply, "5\n", "#{i}"),
            2 => assert_eq!(
                reply, "no hash no roundrobin no stubborn no weight no prio\n",
                "#{i}"
            ),
            _ => assert_one_line_error(&reply, &format!("#{i}")),
        }
    }
    assert!(start.elapsed() < Duration::from_secs(20));
    drop(idle);
    q.assert_running();
    assert_eq!(ctl_ok(&ctl, "timeout"), "5\n");
    echo_through(&q, "127.0.0.2", b"still balancing");
}
