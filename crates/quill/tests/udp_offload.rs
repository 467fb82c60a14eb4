//! The kernel path for UDP flows (`udp_offload IF`): once a flow has been answered twice,
//! a TC program on the interface carries its datagrams and their answers, and quill keeps
//! the flow as its own (number, place on the server, idle expiry, answer timeout, bytes).
//!
//! What proves the kernel carries a flow, from outside: quill's process is stopped
//! (SIGSTOP) and its client is answered all the same; what proves quill took a flow back:
//! stopped again, the client is not. Needs root (CAP_BPF, CAP_NET_ADMIN) and Linux 6.6
//! (TCX links); skipped with a message elsewhere.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::{Ipv6Addr, SocketAddr};
use std::time::Duration;

use support::dns::*;
use support::hosts::NsQuill;
use support::netns::{self, veth, Netns};
use support::{ipv6_available, skip_on_pen, wait_until};

const WAIT: Duration = Duration::from_secs(3);
const SHORT: Duration = Duration::from_millis(500);

/// Whether this machine can run the kernel path; says why not when it cannot.
fn offload_possible() -> bool {
    if skip_on_pen("udp_offload is quill's own") {
        return false;
    }
    if !support::ctl::running_as_root() {
        eprintln!("SKIPPED: udp_offload needs root (CAP_BPF, CAP_NET_ADMIN)");
        return false;
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']);
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    if (major, minor) < (6, 6) {
        eprintln!("SKIPPED: udp_offload needs Linux 6.6 (TCX links); this is {release}");
        return false;
    }
    true
}

/// quill with the kernel path on the loopback interface, a control socket and `args`.
fn start(args: &[&str]) -> Option<(UdpQuill, u16)> {
    if !offload_possible() {
        return None;
    }
    let mut all = vec!["-O", "udp_offload lo"];
    all.extend_from_slice(args);
    with_control(&all)
}

/// Whether every thread of process `pid` is stopped.
fn stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
            // The state follows the command name, which is in parentheses.
            stat.rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('T') || rest.starts_with('t'))
        })
    })
}

/// Sends `signal` to process `pid`.
fn kill(pid: u32, signal: &str) {
    let done = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("kill");
    assert!(done.success(), "kill -{signal} {pid}");
}

/// While quill's process `pid` is stopped, whether `client`'s query is answered (and by
/// whom).
fn ask_while_pid_stopped(pid: u32, client: &UdpClient) -> Option<std::net::Ipv4Addr> {
    kill(pid, "STOP");
    // A stop takes effect as each thread next runs: on a busy machine a loop thread could
    // still take the query before it stops.
    wait_until(
        Duration::from_secs(5),
        "every thread of quill stopped",
        || stopped(pid),
    );
    let answer = client.ask(SHORT);
    kill(pid, "CONT");
    answer
}

fn ask_while_stopped(q: &UdpQuill, client: &UdpClient) -> Option<std::net::Ipv4Addr> {
    ask_while_pid_stopped(q.pid(), client)
}

/// Asks until `c`'s flow is handed over (its first two answers come through quill), then
/// checks that the kernel carries it: quill stopped, `c` is answered by `by`.
fn hand_over(q: &UdpQuill, c: &UdpClient, by: std::net::Ipv4Addr) {
    for _ in 0..3 {
        assert_eq!(c.ask(WAIT), Some(by));
    }
    assert_eq!(ask_while_stopped(q, c), Some(by), "carried by the kernel");
}

/// A flow's first two answers come through quill; from then on the kernel carries it:
/// quill stopped, its client is still answered, by the same server, and the bytes the
/// kernel carried are counted in the server's totals as if quill had relayed them.
#[test]
fn an_answered_flow_is_carried_while_quill_itself_is_stopped() {
    let a = DnsBackend::start(1);
    let Some((q, cport)) = start(&["-t", "1", "{port}", &a.spec()]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    hand_over(&q, &c, a.ip());
    assert_eq!(
        ask_while_stopped(&q, &c),
        Some(a.ip()),
        "carried by the kernel"
    );
    assert_eq!(a.answered(), 5);
    let status = control(cport, "status json").expect("control socket");
    assert!(
        status.contains("\"udp_offloaded\":1") && status.contains("\"udp_carried\":1"),
        "{status}"
    );

    // Five queries and five answers, whoever relayed them (added on the flow's timer).
    let asked = query(1, "who.example").len() * 5;
    let answered = reply_to(&query(1, "who.example"), a.ip())
        .expect("reply")
        .len()
        * 5;
    let totals = format!(" sx {asked} rx {answered} ");
    wait_until(Duration::from_secs(5), "the bytes counted", || {
        control(cport, "servers").is_ok_and(|s| s.contains(&totals))
    });
    let listed = control(cport, "connections").expect("control socket");
    assert!(
        listed.starts_with("connection 1 client 127.0.0.2:"),
        "{listed:?}"
    );
    assert_eq!(listed.lines().count(), 1, "{listed:?}");
}

/// `close N` and idle expiry end a carried flow as any other: the kernel lets go of it at
/// once (quill stopped, the client is not answered), and its next datagram is a new flow.
/// Datagrams the kernel carries keep a flow alive as quill's own would.
#[test]
fn close_and_expiry_take_a_carried_flow_back() {
    let a = DnsBackend::start(1);
    let Some((q, cport)) = start(&["-t", "1", "{port}", &a.spec()]) else {
        return;
    };
    let c = q.client("127.0.0.2");
    hand_over(&q, &c, a.ip());
    command(cport, "close 1");
    // The flow's event loop ends it (and takes it back from the kernel) just after.
    wait_until(
        Duration::from_secs(5),
        "the closed flow leaves the list",
        || control(cport, "connections").is_ok_and(|l| l.is_empty()),
    );
    assert_eq!(ask_while_stopped(&q, &c), None, "closed: no longer carried");
    // quill answers the query sent while it was stopped as soon as it runs again, then
    // the client's next one, on flow 2.
    assert_eq!(c.ask(WAIT), Some(a.ip()));
    let listed = control(cport, "connections").expect("control socket");
    assert!(
        listed.starts_with("connection 2 client 127.0.0.2:"),
        "{listed:?}"
    );

    // Idle expiry: the flows that start from now on expire after 2 s of silence.
    command(cport, "udp_idle_timeout 2");
    let d = q.client("127.0.0.3");
    hand_over(&q, &d, a.ip());
    // Four seconds of queries only the kernel sees, one every half second: still flow 3.
    for _ in 0..8 {
        assert_eq!(d.ask(WAIT), Some(a.ip()));
        std::thread::sleep(SHORT);
    }
    let listed = control(cport, "connections").expect("control socket");
    assert!(
        listed.contains("connection 3 client 127.0.0.3:"),
        "{listed:?}"
    );
    // Silent, it expires, and the kernel no longer carries it.
    wait_until(Duration::from_secs(10), "the silent flow expires", || {
        control(cport, "connections").is_ok_and(|l| !l.contains("connection 3 "))
    });
    assert_eq!(
        ask_while_stopped(&q, &d),
        None,
        "expired: no longer carried"
    );
}

/// Two servers, round robin, `-t 1`, and a client whose flow the kernel carries to the
/// first.
struct Carried {
    a: DnsBackend,
    b: DnsBackend,
    q: UdpQuill,
    cport: u16,
    c: UdpClient,
}

fn carried_on_the_first_of_two() -> Option<Carried> {
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let (q, cport) = start(&["-t", "1", "-r", "{port}", &a.spec(), &b.spec()])?;
    let c = q.client("127.0.0.2");
    hand_over(&q, &c, a.ip());
    Some(Carried { a, b, q, cport, c })
}

/// A carried flow whose server leaves use (here drained) is taken back within the answer
/// timeout, and its client's next datagram moves it to a server in use, as quill moves
/// any flow.
#[test]
fn a_carried_flow_moves_off_a_drained_server() {
    let Some(Carried {
        a: _a,
        b,
        q: _q,
        cport,
        c,
    }) = carried_on_the_first_of_two()
    else {
        return;
    };
    command(cport, "server 0 drain");
    wait_until(Duration::from_secs(5), "the flow moves to server 1", || {
        c.ask(SHORT) == Some(b.ip())
    });
}

/// At `conn_max`, the flow that makes room for a new client is the one silent longest,
/// counting the datagrams the kernel carried: a carried flow that keeps talking stays.
#[test]
fn a_full_table_counts_what_the_kernel_carried_when_it_makes_room() {
    // One event loop (each makes room among its own flows), and flow timers a minute
    // apart: nothing reads the kernel's counters on its own before the table is full.
    let a = DnsBackend::start(1);
    let args = [
        "-x",
        "2",
        "-t",
        "60",
        "-O",
        "workers 1",
        "{port}",
        &a.spec(),
    ];
    let Some((q, cport)) = start(&args) else {
        return;
    };
    let busy = q.client("127.0.0.2");
    // Handed over after its second answer; no third query meanwhile (one sent while the
    // entries go in would leave quill waiting for an answer only the kernel saw).
    for _ in 0..2 {
        assert_eq!(busy.ask(WAIT), Some(a.ip()));
    }
    wait_until(WAIT, "the flow handed over", || {
        control(cport, "status json").is_ok_and(|s| s.contains("\"udp_carried\":1"))
    });
    let quiet = q.client("127.0.0.3");
    assert_eq!(quiet.ask(WAIT), Some(a.ip()));
    // Later than the quiet flow's last datagram, the busy one talks through the kernel.
    std::thread::sleep(Duration::from_millis(20));
    for _ in 0..3 {
        assert_eq!(busy.ask(WAIT), Some(a.ip()));
    }
    let third = q.client("127.0.0.4");
    assert_eq!(third.ask(WAIT), Some(a.ip()));
    let listed = control(cport, "connections").expect("control socket");
    assert!(
        listed.contains("connection 1 client 127.0.0.2:")
            && listed.contains("connection 3 client 127.0.0.4:")
            && !listed.contains("connection 2 "),
        "the quiet flow made room: {listed}"
    );
    assert_eq!(ask_while_stopped(&q, &busy), Some(a.ip()), "still carried");
}

/// With nowhere to move (its only server drained), a flow taken back stays in quill, and
/// is carried again once its server is back in use.
#[test]
fn a_flow_taken_back_with_nowhere_to_move_is_carried_again_when_its_server_is_back() {
    let a = DnsBackend::start(1);
    let Some((q, cport)) = start(&["-t", "1", "{port}", &a.spec()]) else {
        return;
    };
    let carried = |n: u32| {
        control(cport, "status json").is_ok_and(|s| s.contains(&format!("\"udp_carried\":{n}")))
    };
    let c = q.client("127.0.0.2");
    hand_over(&q, &c, a.ip());
    command(cport, "server 0 drain");
    wait_until(Duration::from_secs(5), "the flow taken back", || carried(0));
    for _ in 0..3 {
        assert_eq!(c.ask(WAIT), Some(a.ip()), "answered through quill");
    }
    assert!(carried(0), "not carried while its server is drained");
    command(cport, "server 0 drain 0");
    wait_until(Duration::from_secs(5), "the flow carried again", || {
        assert_eq!(c.ask(WAIT), Some(a.ip()));
        carried(1)
    });
    assert_eq!(
        ask_while_stopped(&q, &c),
        Some(a.ip()),
        "carried by the kernel"
    );
    let connections = control(cport, "connections").expect("control socket");
    assert_eq!(
        connections.lines().count(),
        1,
        "the same flow: {connections}"
    );
}

/// A server that stops answering a carried flow is noticed as for any flow: after the
/// answer timeout quill blacklists it (it answers nobody else) and the client's next
/// datagram goes to the other server.
#[test]
fn a_server_that_stops_answering_a_carried_flow_is_blacklisted() {
    let Some(Carried {
        a,
        b,
        q: _q,
        cport,
        c,
    }) = carried_on_the_first_of_two()
    else {
        return;
    };
    a.set_silent(true);
    assert_eq!(c.ask(SHORT), None, "the silent server drops it");
    wait_until(
        Duration::from_secs(6),
        "the client is answered by server 1",
        || c.ask(SHORT) == Some(b.ip()),
    );
    let servers = control(cport, "servers").expect("control socket");
    let first = servers.lines().next().unwrap_or("");
    assert!(first.contains("blacklisted"), "{servers}");
}

/// IPv6 flows are carried as IPv4 ones are, and so are IPv4 clients of a dual-stack
/// listener; a flow that changes family on the way (an IPv6 client, an IPv4 server) is
/// relayed by quill, which translates, and never handed over.
#[test]
fn ipv6_flows_are_carried_and_a_flow_that_changes_family_is_not() {
    if !offload_possible() {
        return;
    }
    if !ipv6_available() {
        eprintln!("SKIPPED: no IPv6 loopback");
        return;
    }
    let v4 = DnsBackend::start_on(4, "127.0.0.1:0");
    let v6 = DnsBackend::start_on(6, "[::1]:0");
    for (listen, backend, client, carried) in [
        ("[::1]:{port}", &v6, "::1", true),
        (":::{port}", &v6, "::1", true),
        (":::{port}", &v4, "127.0.0.1", true),
        ("[::1]:{port}", &v4, "::1", false),
    ] {
        let (q, _) = start(&["-t", "1", listen, &backend.spec()]).expect("started");
        let to = match client.contains(':') {
            true => SocketAddr::from((Ipv6Addr::LOCALHOST, q.port)),
            false => SocketAddr::from(([127, 0, 0, 1], q.port)),
        };
        let c = UdpClient::new(client, to);
        for _ in 0..3 {
            assert_eq!(c.ask(WAIT), Some(backend.ip()), "{listen} {client}");
        }
        let expected = carried.then(|| backend.ip());
        assert_eq!(
            ask_while_stopped(&q, &c),
            expected,
            "listen {listen}, server {}, client {client}",
            backend.spec()
        );
        // Carried or not, the flow goes on (quill answers what came while it was stopped).
        assert_eq!(c.ask(WAIT), Some(backend.ip()), "{listen} {client}");
    }
}

/// An interface that does not exist stops quill at start, naming it.
#[test]
fn an_interface_that_does_not_exist_is_refused_at_start() {
    if !offload_possible() {
        return;
    }
    let a = DnsBackend::start(1);
    let Err(e) = UdpQuill::try_start(&["-O", "udp_offload nosuchif0", "{port}", &a.spec()]) else {
        panic!("quill started with udp_offload on a missing interface");
    };
    assert!(e.contains("udp_offload") && e.contains("nosuchif0"), "{e}");
}

/// Three hosts in namespaces named `tag`cli, `tag`lb and `tag`be: the client
/// 10.`net`.1.2 --- l1 10.`net`.1.1, the balancer, l2 10.`net`.2.1 --- the server
/// 10.`net`.2.2, forwarding on in the balancer (the program's route lookup needs it where
/// the datagrams come in), and a DNS server at 10.`net`.2.2:5300.
struct ThreeHosts {
    cli: Netns,
    lb: Netns,
    _be: Netns,
    backend: DnsBackend,
}

impl ThreeHosts {
    fn new(tag: &str, net: u8) -> ThreeHosts {
        let cli = Netns::new(&format!("{tag}cli"));
        let lb = Netns::new(&format!("{tag}lb"));
        let be = Netns::new(&format!("{tag}be"));
        veth(&cli, "c1", &lb, "l1");
        veth(&lb, "l2", &be, "b1");
        cli.ip(&["addr", "add", &format!("10.{net}.1.2/24"), "dev", "c1"]);
        lb.ip(&["addr", "add", &format!("10.{net}.1.1/24"), "dev", "l1"]);
        lb.ip(&["addr", "add", &format!("10.{net}.2.1/24"), "dev", "l2"]);
        be.ip(&["addr", "add", &format!("10.{net}.2.2/24"), "dev", "b1"]);
        lb.sysctl(&["net.ipv4.ip_forward=1"]);
        let at = format!("10.{net}.2.2:5300");
        let backend = be.run(move || DnsBackend::start_on(1, &at));
        ThreeHosts {
            cli,
            lb,
            _be: be,
            backend,
        }
    }
}

/// Client and server on other hosts (cli 10.78.1.2 --- l1 10.78.1.1, balancer, l2
/// 10.78.2.1 --- be 10.78.2.2): a carried flow's datagrams leave through the interface
/// the FIB names, its neighbour resolved by the kernel, and the answers come back the
/// same way.
#[test]
fn a_flow_between_other_hosts_is_carried_out_of_the_balancers_interfaces() {
    if !offload_possible() || netns::skip() {
        return;
    }
    let ThreeHosts {
        cli,
        lb,
        _be,
        backend,
    } = ThreeHosts::new("o", 78);
    let mut q = NsQuill::start(
        &lb,
        &[
            "-U",
            "-O",
            "udp_offload l1,l2",
            "-t",
            "1",
            "10.78.1.1:5300",
            "10.78.2.2:5300",
        ],
    );
    let client = cli.run(|| UdpClient::new("10.78.1.2", "10.78.1.1:5300".parse().unwrap()));
    // The first answer once quill listens.
    let first = client.ask_retrying(SHORT, Duration::from_secs(10));
    if let Some(status) = q.exited() {
        panic!("quill exited ({status}): {}", q.stderr());
    }
    assert_eq!(first, Some(backend.ip()), "{}", q.stderr());
    assert_eq!(client.ask(WAIT), Some(backend.ip()));
    assert_eq!(client.ask(WAIT), Some(backend.ip()));
    assert_eq!(
        ask_while_pid_stopped(q.pid(), &client),
        Some(backend.ip()),
        "carried by the kernel"
    );
}

// ---------------------------------------------------------------------------
// New flows placed by the kernel (round robin with `udp_responses`)
// ---------------------------------------------------------------------------

/// Two servers, round robin, one answer per query, `-t 1`; returns once the kernel places
/// new clients (a client that is new to quill is answered while quill is stopped).
fn placing(extra: &[&str]) -> Option<(DnsBackend, DnsBackend, UdpQuill, u16)> {
    let a = DnsBackend::start(1);
    let b = DnsBackend::start(2);
    let mut args = vec!["-t", "1", "-r", "-O", "udp_responses 1"];
    args.extend_from_slice(extra);
    let (a_spec, b_spec) = (a.spec(), b.spec());
    args.extend(["{port}", &a_spec, &b_spec]);
    let (q, cport) = start(&args)?;
    let placement = placement_when_decided(cport);
    assert_eq!(placement, "kernel");
    Some((a, b, q, cport))
}

fn connections(cport: u16) -> serde_json::Value {
    let status = control(cport, "status json").expect("control socket");
    let v: serde_json::Value = serde_json::from_str(&status).expect("status json");
    v["connections"].clone()
}

/// `status json`'s `udp_placed`.
fn placed(cport: u16) -> u64 {
    connections(cport)["udp_placed"]
        .as_u64()
        .expect("udp_placed")
}

/// Who places new flows, once quill has decided and written the kernel's tables:
/// "kernel", or "quill: " and why.
fn placement_when_decided(cport: u16) -> String {
    let mut word = String::new();
    wait_until(Duration::from_secs(5), "the placement decided", || {
        word = connections(cport)["udp_placement"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        !word.is_empty()
    });
    word
}

/// A client that takes a new port for every query (a DNS resolver) is a new flow each
/// time: the kernel places it on a server in use and carries the answer back, with quill
/// stopped. Both servers get queries; the ports quill holds for a server are freed by the
/// answers (far more queries than ports are answered); what the kernel placed is counted.
#[test]
fn a_client_with_a_port_per_query_is_placed_by_the_kernel_while_quill_is_stopped() {
    let Some((a, b, q, cport)) = placing(&[]) else {
        return;
    };
    let before = placed(cport);
    kill(q.pid(), "STOP");
    wait_until(Duration::from_secs(5), "quill stopped", || stopped(q.pid()));
    let mut by = std::collections::HashMap::new();
    let asked = 3 * 64;
    for _ in 0..asked {
        let answer = q.client("127.0.0.2").ask(WAIT);
        *by.entry(answer).or_insert(0) += 1;
        if answer.is_none() {
            break;
        }
    }
    kill(q.pid(), "CONT");
    assert_eq!(by.get(&None), None, "unanswered queries: {by:?}");
    assert!(
        by.contains_key(&Some(a.ip())) && by.contains_key(&Some(b.ip())),
        "both servers take new clients: {by:?}"
    );
    wait_until(Duration::from_secs(5), "the placed flows counted", || {
        placed(cport) >= before + asked
    });
    // Each server's total includes the flows placed on it.
    let servers = control(cport, "servers").expect("control socket");
    assert!(!servers.contains(" total 0 "), "{servers}");
}

/// A server out of use (drained here) gets no new flow from the kernel.
#[test]
fn a_drained_server_gets_no_placed_flow() {
    let Some((_a, b, q, cport)) = placing(&[]) else {
        return;
    };
    command(cport, "server 0 drain");
    only_server_takes_new_clients(&q, &b);
}

/// A placed query its server does not answer is ended after the answer timeout (`-t 1`)
/// and, as the server answered nothing since, the server is blacklisted: new clients go
/// to the other.
#[test]
fn a_server_that_does_not_answer_placed_flows_is_blacklisted() {
    let Some((a, b, q, cport)) = placing(&[]) else {
        return;
    };
    a.set_silent(true);
    // Some of these land on the silent server and wait for the timeout.
    for _ in 0..8 {
        let _ = q.client("127.0.0.2").ask(SHORT);
    }
    wait_until(Duration::from_secs(6), "server 0 blacklisted", || {
        control(cport, "servers")
            .is_ok_and(|s| s.lines().next().unwrap_or("").contains("blacklisted"))
    });
    only_server_takes_new_clients(&q, &b);
}

/// Waits until new clients all go to `b` (the tables follow quill's verdicts within a
/// tick), then checks it while quill is stopped.
fn only_server_takes_new_clients(q: &UdpQuill, b: &DnsBackend) {
    wait_until(
        Duration::from_secs(5),
        "only server 1 takes new clients",
        || (0..8).all(|_| q.client("127.0.0.2").ask(SHORT) == Some(b.ip())),
    );
    kill(q.pid(), "STOP");
    wait_until(Duration::from_secs(5), "quill stopped", || stopped(q.pid()));
    let answers: Vec<_> = (0..20)
        .map_while(|_| q.client("127.0.0.2").ask(WAIT))
        .collect();
    kill(q.pid(), "CONT");
    assert_eq!(
        answers.len(),
        20,
        "answered while quill was stopped: {answers:?}"
    );
    assert!(answers.iter().all(|a| *a == b.ip()), "{answers:?}");
}

/// A server whose port is closed refuses the queries placed on it (ICMP port
/// unreachable reaches the socket quill holds): blacklisted at once.
#[test]
fn a_server_that_refuses_placed_flows_is_blacklisted() {
    let Some((a, b, q, cport)) = placing(&[]) else {
        return;
    };
    a.stop();
    wait_until(Duration::from_secs(5), "server 0 blacklisted", || {
        let _ = q.client("127.0.0.2").ask(SHORT);
        control(cport, "servers")
            .is_ok_and(|s| s.lines().next().unwrap_or("").contains("blacklisted"))
    });
    only_server_takes_new_clients(&q, &b);
}

/// Where quill's rules need to see every new client (client tracking, Pen's default; an
/// access list), the kernel places nothing: a new client waits for quill.
#[test]
fn the_kernel_places_nothing_where_quill_must_see_each_client() {
    for args in [
        vec!["-O", "udp_responses 1"],
        vec![
            "-r",
            "-O",
            "udp_responses 1",
            "-O",
            "acl 1 deny 10.0.0.0 255.0.0.0",
            "-O",
            "client_acl 1",
        ],
        vec!["-r"],
    ] {
        let a = DnsBackend::start(1);
        let mut all = args.clone();
        let spec = a.spec();
        all.extend(["{port}", &spec]);
        let Some((q, cport)) = start(&all) else {
            return;
        };
        let placement = placement_when_decided(cport);
        assert!(placement.starts_with("quill: "), "{args:?}: {placement}");
        // quill serves new clients itself, and not while stopped.
        assert_eq!(q.client("127.0.0.2").ask(WAIT), Some(a.ip()), "{args:?}");
        assert_eq!(
            ask_while_stopped(&q, &q.client("127.0.0.2")),
            None,
            "{args:?}"
        );
        assert_eq!(placed(cport), 0, "{args:?}");
    }
}

/// IPv6 clients are placed as IPv4 ones are, and so are IPv4 clients of a dual-stack
/// listener; a client of one family whose server is of the other is left to quill, which
/// translates.
#[test]
fn ipv6_clients_are_placed_and_a_change_of_family_is_not() {
    if !offload_possible() {
        return;
    }
    if !ipv6_available() {
        eprintln!("SKIPPED: no IPv6 loopback");
        return;
    }
    let v4 = DnsBackend::start_on(4, "127.0.0.1:0");
    let v6 = DnsBackend::start_on(6, "[::1]:0");
    for (listen, backend, client, placed_by_kernel) in [
        ("[::1]:{port}", &v6, "::1", true),
        (":::{port}", &v6, "::1", true),
        (":::{port}", &v4, "127.0.0.1", true),
        ("[::1]:{port}", &v4, "::1", false),
    ] {
        let spec = backend.spec();
        let args = ["-t", "1", "-r", "-O", "udp_responses 1", listen, &spec];
        let (q, cport) = start(&args).expect("started");
        assert_eq!(placement_when_decided(cport), "kernel");
        let to = match client.contains(':') {
            true => SocketAddr::from((Ipv6Addr::LOCALHOST, q.port)),
            false => SocketAddr::from(([127, 0, 0, 1], q.port)),
        };
        assert_eq!(
            UdpClient::new(client, to).ask(WAIT),
            Some(backend.ip()),
            "{listen} {client}"
        );
        let expected = placed_by_kernel.then(|| backend.ip());
        assert_eq!(
            ask_while_stopped(&q, &UdpClient::new(client, to)),
            expected,
            "listen {listen}, server {spec}, client {client}"
        );
    }
}

/// Client and server on other hosts (as above): the kernel places a new client whose
/// answers come back through the balancer's interfaces. A client on the balancer itself
/// whose server is on another host is left to quill (its answers would come in on the
/// wire, where the program could not send them up to a local client): answered, but only
/// while quill runs.
#[test]
fn clients_of_other_hosts_are_placed_and_a_local_client_of_a_remote_server_is_not() {
    if !offload_possible() || netns::skip() {
        return;
    }
    let ThreeHosts {
        cli,
        lb,
        _be,
        backend,
    } = ThreeHosts::new("p", 79);
    let mut q = NsQuill::start(
        &lb,
        &[
            "-U",
            "-r",
            "-O",
            "udp_responses 1",
            "-O",
            "udp_offload l1,l2,lo",
            "-t",
            "1",
            "10.79.1.1:5300",
            "10.79.2.2:5300",
        ],
    );
    let vip: SocketAddr = "10.79.1.1:5300".parse().unwrap();
    let remote = move || UdpClient::new("10.79.1.2", vip);
    // The first answer once quill listens and has written its tables (a new client each
    // time, placed by the kernel while quill is stopped).
    wait_until(Duration::from_secs(10), "a remote client placed", || {
        if let Some(status) = q.exited() {
            panic!("quill exited ({status}): {}", q.stderr());
        }
        cli.run(move || remote().ask(SHORT)) == Some(backend.ip())
            && ask_while_pid_stopped(q.pid(), &cli.run(remote)) == Some(backend.ip())
    });
    for _ in 0..5 {
        let c = cli.run(remote);
        assert_eq!(ask_while_pid_stopped(q.pid(), &c), Some(backend.ip()));
    }

    let local = move || UdpClient::new("10.79.1.1", vip);
    assert_eq!(lb.run(move || local().ask(WAIT)), Some(backend.ip()));
    assert_eq!(ask_while_pid_stopped(q.pid(), &lb.run(local)), None);
    assert_eq!(lb.run(move || local().ask(WAIT)), Some(backend.ip()));
}

/// Placement follows the settings at run time: turning round robin on lets the kernel
/// place new clients, turning it off gives them back to quill.
#[test]
fn round_robin_turned_on_and_off_at_run_time_moves_placement() {
    let a = DnsBackend::start(1);
    let spec = a.spec();
    let Some((q, cport)) = start(&["-t", "1", "-O", "udp_responses 1", "{port}", &spec]) else {
        return;
    };
    assert!(placement_when_decided(cport).starts_with("quill: "));
    command(cport, "roundrobin");
    wait_until(Duration::from_secs(5), "the kernel places", || {
        connections(cport)["udp_placement"] == "kernel"
    });
    assert_eq!(ask_while_stopped(&q, &q.client("127.0.0.2")), Some(a.ip()));
    command(cport, "no roundrobin");
    wait_until(Duration::from_secs(5), "quill places", || {
        connections(cport)["udp_placement"]
            .as_str()
            .is_some_and(|p| p.starts_with("quill: "))
    });
    assert_eq!(ask_while_stopped(&q, &q.client("127.0.0.2")), None);
    assert_eq!(q.client("127.0.0.2").ask(WAIT), Some(a.ip()));
}
