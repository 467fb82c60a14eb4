//! Direct Server Return (`dsr_if IF`) and the tarpit (`tarpit_acl N`), end to end on
//! virtual hosts: a client, the balancer and backends on one L2 segment (veth pairs into a
//! bridge in its own namespace). The backends hold the VIP on their loopback with
//! `arp_ignore=1`/`arp_announce=2`, as docs/DSR.md says. Root only; skipped otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use support::hosts::{curl, curl_status, Backend, NsQuill, BIG};
use support::netns::{self, bridge, plug, Netns};
use support::{poll_until, wait_until};

const VIP: &str = "10.77.0.100";
const CLIENT: &str = "10.77.0.10";
/// The two ways the DSR plane forwards (`dsr_path`); every DSR test runs on both. On these
/// veth interfaces the XDP program attaches in generic mode.
const PACKET: &str = "packet";
const XDP: &str = "xdp";

/// The DSR segment: `sw` (bridge br0), `cli` 10.77.0.10, `lb` 10.77.0.2 (interface l0),
/// backends `be1..` 10.77.0.11.. with the VIP on lo.
struct Segment {
    /// `dsr_path` of the quills started by [`Segment::quill`]: `packet` or `xdp`.
    path: &'static str,
    cli: Netns,
    lb: Netns,
    backends: Vec<Netns>,
    // Dropped last: the bridge's namespace.
    _sw: Netns,
}

impl Segment {
    fn new(backends: usize, path: &'static str) -> Segment {
        let sw = Netns::new("sw");
        bridge(&sw, "br0");
        let cli = Netns::new("cli");
        plug(&sw, "br0", "p-cli", &cli, "c0", "10.77.0.10/24");
        let lb = Netns::new("lb");
        plug(&sw, "br0", "p-lb", &lb, "l0", "10.77.0.2/24");
        // The balancer's kernel must not route VIP frames itself (it would send redirects
        // and unreachables): forwarding off, whatever the root namespace has.
        lb.sysctl(&[
            "net.ipv4.conf.all.forwarding=0",
            "net.ipv4.conf.l0.forwarding=0",
        ]);
        let backends = (1..=backends)
            .map(|i| {
                let be = Netns::new(&format!("be{i}"));
                plug(
                    &sw,
                    "br0",
                    &format!("p-be{i}"),
                    &be,
                    "b0",
                    &format!("10.77.0.{}/24", 10 + i),
                );
                be.ip(&["addr", "add", &format!("{VIP}/32"), "dev", "lo"]);
                be.sysctl(&[
                    "net.ipv4.conf.all.arp_ignore=1",
                    "net.ipv4.conf.all.arp_announce=2",
                    "net.ipv4.conf.b0.arp_ignore=1",
                    "net.ipv4.conf.b0.arp_announce=2",
                ]);
                be
            })
            .collect();
        Segment {
            path,
            cli,
            lb,
            backends,
            _sw: sw,
        }
    }

    /// HTTP on :80 and UDP on VIP:53 on every backend, named be1, be2, ...
    fn start_backends(&self) -> Vec<Backend> {
        self.backends
            .iter()
            .enumerate()
            .map(|(i, ns)| {
                Backend::start(
                    ns,
                    &format!("be{}", i + 1),
                    Some("0.0.0.0:80".parse().unwrap()),
                    // Bound to the VIP: the answer must come from the address asked.
                    Some(format!("{VIP}:53").parse().unwrap()),
                )
            })
            .collect()
    }

    fn backend_ips(&self) -> Vec<String> {
        (1..=self.backends.len())
            .map(|i| format!("10.77.0.{}", 10 + i))
            .collect()
    }

    fn quill(&self, options: &[&str], listen: &str) -> NsQuill {
        // -d: the start-up line says how frames are read.
        let mut args: Vec<&str> = vec!["-d"];
        args.extend(options);
        let path = format!("dsr_path {}", self.path);
        args.extend(["-O", "dsr_if l0", "-O", &path, listen]);
        let ips = self.backend_ips();
        args.extend(ips.iter().map(String::as_str));
        NsQuill::start(&self.lb, &args)
    }

    /// `curl http://VIP/` from the client: the backend's answer `NAME PEER`.
    fn get(&self) -> Option<(String, String)> {
        let body = curl(&self.cli, &format!("http://{VIP}/"), 3)?;
        let mut words = body.split_whitespace();
        Some((words.next()?.to_string(), words.next()?.to_string()))
    }
}

fn wait_started(q: &mut NsQuill, s: &Segment) {
    wait_until(
        Duration::from_secs(20),
        "a request through DSR succeeds",
        || {
            if let Some(status) = q.exited() {
                panic!("quill exited ({status}): {}", q.stderr());
            }
            s.get().is_some()
        },
    );
}

#[test]
fn tcp_through_dsr_spreads_over_backends_and_replies_bypass_the_balancer_packet() {
    tcp_through_dsr_spreads_over_backends_and_replies_bypass_the_balancer(PACKET);
}

#[test]
fn tcp_through_dsr_spreads_over_backends_and_replies_bypass_the_balancer_xdp() {
    tcp_through_dsr_spreads_over_backends_and_replies_bypass_the_balancer(XDP);
}

fn tcp_through_dsr_spreads_over_backends_and_replies_bypass_the_balancer(path: &'static str) {
    if netns::skip() {
        return;
    }
    let s = Segment::new(2, path);
    let _backends = s.start_backends();
    let mut q = s.quill(
        &["-r", "-O", "metrics_listen 127.0.0.1:9100"],
        &format!("{VIP}:80"),
    );
    wait_started(&mut q, &s);
    // Frames come from the TPACKET_V2 ring, unless the test run asked for another reader.
    let how = match std::env::var("QUILL_DSR_RING").unwrap_or_default().as_str() {
        "v3" => "TPACKET_V3 receive ring",
        "off" => "one frame per recv",
        _ => "TPACKET_V2 receive ring",
    };
    assert!(q.stderr().contains(how), "{}", q.stderr());
    // A ring's frames are sent a batch per sendmmsg, unless the run asked for one send each.
    let ring = how != "one frame per recv";
    let single = std::env::var("QUILL_DSR_TX").as_deref() == Ok("single");
    let sends = if ring && !single {
        "one sendmmsg per batch"
    } else {
        "one send per frame"
    };
    assert!(q.stderr().contains(sends), "{}", q.stderr());
    let xdp_on_l0 = || {
        let out = s.lb.ip(&["link", "show", "l0"]);
        String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
    };
    if path == XDP {
        assert!(q.stderr().contains("XDP generic"), "{}", q.stderr());
        assert!(xdp_on_l0(), "no XDP program on l0");
    } else {
        assert!(q.stderr().contains("no XDP"), "{}", q.stderr());
        assert!(!xdp_on_l0());
    }

    // Flows are spread (hash of client address and port) and the backend sees the client.
    let mut seen = HashSet::new();
    for _ in 0..24 {
        let (name, peer) = s.get().expect("request through DSR");
        let peer: SocketAddr = peer.parse().unwrap();
        assert_eq!(
            peer.ip().to_string(),
            CLIENT,
            "the backend sees the real client"
        );
        seen.insert(name);
    }
    assert_eq!(seen.len(), 2, "both backends served: {seen:?}");

    // A 1 MiB download: the reply goes from the backend to the client directly, so the
    // balancer's interface moves only the request and the client's ACKs.
    let (rx0, tx0) = (
        s.lb.if_stat("l0", "rx_bytes"),
        s.lb.if_stat("l0", "tx_bytes"),
    );
    let body = curl(&s.cli, &format!("http://{VIP}/big"), 20).expect("1 MiB download");
    assert_eq!(body.len(), BIG);
    let (rx1, tx1) = (
        s.lb.if_stat("l0", "rx_bytes"),
        s.lb.if_stat("l0", "tx_bytes"),
    );
    eprintln!(
        "balancer l0 during a 1 MiB download: rx {} B, tx {} B",
        rx1 - rx0,
        tx1 - tx0
    );
    assert!(
        rx1 - rx0 < 64 * 1024 && tx1 - tx0 < 64 * 1024,
        "the balancer moved {} bytes in and {} out for a 1 MiB download",
        rx1 - rx0,
        tx1 - tx0
    );

    // The path that moved the frames: the XDP program, or the packet socket.
    let metric = |name: &str| -> u64 {
        let text = curl(&s.lb, "http://127.0.0.1:9100/metrics", 3).expect("metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    };
    let (all, by_xdp) = (
        metric("quill_dsr_forwarded_frames_total "),
        metric("quill_dsr_xdp_forwarded_frames_total "),
    );
    eprintln!("{path}: {all} frames forwarded, {by_xdp} by XDP");
    let status: serde_json::Value = serde_json::from_str(
        &curl(&s.lb, "http://127.0.0.1:9100/status.json", 3).expect("status.json"),
    )
    .unwrap();
    let dsr = &status["dsr"];
    assert_eq!(dsr["interface"], "l0");
    assert_eq!(dsr["servers_up"], 2);
    assert!(dsr["forwarded"].as_u64().unwrap() >= all, "{dsr}");
    assert_eq!(
        dsr["path"],
        if path == XDP { "xdp-generic" } else { "packet" }
    );
    if path == XDP {
        assert!(
            by_xdp >= 20 && by_xdp + 5 >= all,
            "{all} forwarded, {by_xdp} by XDP"
        );
        assert_eq!(metric("quill_dsr_xdp_mode "), 1);
    } else {
        assert_eq!(by_xdp, 0);
        assert!(all >= 20);
    }

    // A backend whose host goes down (no more ARP answers) is skipped, and comes back.
    s.backends[0].ip(&["link", "set", "b0", "down"]);
    wait_until(Duration::from_secs(20), "be1 is skipped", || {
        (0..8).all(|_| s.get().is_some_and(|(n, _)| n == "be2"))
    });
    s.backends[0].ip(&["link", "set", "b0", "up"]);
    wait_until(Duration::from_secs(20), "be1 serves again", || {
        s.get().is_some_and(|(n, _)| n == "be1")
    });
    // The program goes with the process, even one killed with SIGKILL: nothing is left on
    // the interface (the BPF link is the process's).
    drop(q);
    wait_until(Duration::from_secs(5), "no XDP program left on l0", || {
        !xdp_on_l0()
    });
}

/// UDP clients (one socket each) in the client namespace, connected to VIP:53.
fn udp_clients(s: &Segment, n: usize) -> Vec<UdpSocket> {
    s.cli.run(move || {
        (0..n)
            .map(|_| {
                let u = UdpSocket::bind("10.77.0.10:0").unwrap();
                u.connect(format!("{VIP}:53")).unwrap();
                u.set_read_timeout(Some(Duration::from_millis(500)))
                    .unwrap();
                u
            })
            .collect()
    })
}

/// Asks once on a connected socket; the backend's name if answered. A connected socket
/// only takes answers from the VIP, so an answer proves it came "from" the VIP.
fn ask(u: &UdpSocket) -> Option<String> {
    u.send(b"q").ok()?;
    let mut buf = [0u8; 256];
    let n = u.recv(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    let mut words = text.split_whitespace();
    let name = words.next()?.to_string();
    let peer: SocketAddr = words.next()?.parse().ok()?;
    assert_eq!(
        peer,
        u.local_addr().ok()?,
        "the backend sees the real client"
    );
    Some(name)
}

/// Where each client's flow goes now (every client answered).
fn mapping(clients: &[UdpSocket]) -> Option<Vec<String>> {
    clients.iter().map(ask).collect()
}

#[test]
fn udp_through_dsr_balances_and_only_a_leaving_backends_flows_move_packet() {
    udp_through_dsr_balances_and_only_a_leaving_backends_flows_move(PACKET);
}

#[test]
fn udp_through_dsr_balances_and_only_a_leaving_backends_flows_move_xdp() {
    udp_through_dsr_balances_and_only_a_leaving_backends_flows_move(XDP);
}

fn udp_through_dsr_balances_and_only_a_leaving_backends_flows_move(path: &'static str) {
    if netns::skip() {
        return;
    }
    let s = Segment::new(3, path);
    let _backends = s.start_backends();
    let mut q = s.quill(&["-U", "-r"], &format!("{VIP}:53"));
    let clients = udp_clients(&s, 24);
    let mut before = None;
    wait_until(
        Duration::from_secs(20),
        "every UDP client is answered",
        || {
            if let Some(status) = q.exited() {
                panic!("quill exited ({status}): {}", q.stderr());
            }
            before = mapping(&clients);
            before.is_some()
        },
    );
    let before = before.unwrap();
    let used: HashSet<&String> = before.iter().collect();
    assert!(used.len() >= 2, "flows spread over backends: {before:?}");
    // Stickiness: every datagram of a flow goes to the same backend.
    assert_eq!(mapping(&clients).as_ref(), Some(&before));

    // be1 leaves: its flows move, every other flow stays where it was.
    s.backends[0].ip(&["link", "set", "b0", "down"]);
    let mut during = None;
    wait_until(Duration::from_secs(20), "be1's flows moved", || {
        during = mapping(&clients);
        during
            .as_ref()
            .is_some_and(|m| m.iter().all(|n| n != "be1"))
    });
    let during = during.unwrap();
    for (i, (b, d)) in before.iter().zip(&during).enumerate() {
        if b != "be1" {
            assert_eq!(b, d, "flow {i} of {b} moved to {d} when be1 left");
        }
    }
    // be1 comes back: new flows reach it again, and no flow in progress moves (the flow
    // table keeps each on the backend it is on).
    s.backends[0].ip(&["link", "set", "b0", "up"]);
    wait_until(Duration::from_secs(20), "new flows reach be1 again", || {
        mapping(&udp_clients(&s, 24)).is_some_and(|m| m.iter().any(|n| n == "be1"))
    });
    assert_eq!(mapping(&clients).as_ref(), Some(&during));
}

#[test]
fn tracking_mode_keeps_a_client_on_one_backend_packet() {
    tracking_mode_keeps_a_client_on_one_backend(PACKET);
}

#[test]
fn tracking_mode_keeps_a_client_on_one_backend_xdp() {
    tracking_mode_keeps_a_client_on_one_backend(XDP);
}

fn tracking_mode_keeps_a_client_on_one_backend(path: &'static str) {
    if netns::skip() {
        return;
    }
    let s = Segment::new(2, path);
    let _backends = s.start_backends();
    // No -r: Pen's client tracking, so DSR hashes the client address only.
    let mut q = s.quill(&[], &format!("{VIP}:80"));
    wait_started(&mut q, &s);
    let names: HashSet<String> = (0..12).filter_map(|_| s.get().map(|(n, _)| n)).collect();
    assert_eq!(names.len(), 1, "one client, one backend: {names:?}");
}

#[test]
fn tarpit_answers_syns_for_listed_addresses_only_packet() {
    tarpit_answers_syns_for_listed_addresses_only(PACKET);
}

#[test]
fn tarpit_answers_syns_for_listed_addresses_only_xdp() {
    tarpit_answers_syns_for_listed_addresses_only(XDP);
}

fn tarpit_answers_syns_for_listed_addresses_only(path: &'static str) {
    if netns::skip() {
        return;
    }
    let s = Segment::new(2, path);
    let _backends = s.start_backends();
    let mut q = s.quill(
        &[
            "-r",
            "-O",
            "acl 1 permit 10.77.0.200 255.255.255.248",
            "-O",
            "tarpit_acl 1",
        ],
        &format!("{VIP}:80"),
    );
    wait_started(&mut q, &s);

    // A tarpitted address accepts connections on any port, then never answers.
    let results = s.cli.run(|| {
        let mut out = HashMap::new();
        for port in [22u16, 80, 443, 8080] {
            let addr: SocketAddr = format!("10.77.0.201:{port}").parse().unwrap();
            out.insert(port, TcpStream::connect_timeout(&addr, Duration::from_secs(5)).is_ok());
        }
        let addr: SocketAddr = "10.77.0.203:80".parse().unwrap();
        let mut conn = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).expect("connect to the tarpit");
        conn.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        conn.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
        let mut buf = [0u8; 64];
        let read = conn.read(&mut buf);
        let hung = matches!(&read, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut));
        // An address outside the list: nobody answers ARP for it.
        let outside: SocketAddr = "10.77.0.220:80".parse().unwrap();
        let outside_ok = TcpStream::connect_timeout(&outside, Duration::from_secs(2)).is_ok();
        (out, hung, outside_ok)
    });
    let (ports, hung, outside_ok) = results;
    assert!(
        ports.values().all(|ok| *ok),
        "every port looks open: {ports:?}"
    );
    assert!(hung, "a request to the tarpit hangs");
    assert!(!outside_ok, "an address outside the list gets no answer");
    assert_eq!(
        curl_status(&s.cli, "http://10.77.0.201/", 2),
        Some(28),
        "curl times out"
    );
    // The VIP keeps working meanwhile.
    assert!(s.get().is_some());
}

#[test]
fn dsr_start_errors_name_the_problem() {
    if netns::skip() {
        return;
    }
    let s = Segment::new(1, PACKET);
    // No such interface.
    let mut q = NsQuill::start(
        &s.lb,
        &["-O", "dsr_if nosuch0", &format!("{VIP}:80"), "10.77.0.11"],
    );
    assert!(poll_until(Duration::from_secs(10), || q.exited().is_some()));
    assert!(q.stderr().contains("nosuch0"), "{}", q.stderr());
    // A wildcard listening address is no VIP.
    let mut q = NsQuill::start(&s.lb, &["-O", "dsr_if l0", "80", "10.77.0.11"]);
    assert!(poll_until(Duration::from_secs(10), || q.exited().is_some()));
    assert_eq!(q.exited().and_then(|s| s.code()), Some(2));
    assert!(q.stderr().contains("VIP"), "{}", q.stderr());
    // DSR cannot change ports.
    let mut q = NsQuill::start(
        &s.lb,
        &["-O", "dsr_if l0", &format!("{VIP}:80"), "10.77.0.11:81"],
    );
    assert!(poll_until(Duration::from_secs(10), || q.exited().is_some()));
    assert_eq!(q.exited().and_then(|s| s.code()), Some(2));
    assert!(q.stderr().contains("port 80"), "{}", q.stderr());
}

/// A download of `/big` from the client through the VIP, opened and read in part: the
/// client's receive buffer is small, so the backend is still sending when it pauses.
fn open_download(s: &Segment) -> (TcpStream, usize) {
    s.cli
        .run(|| {
            let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
            sock.set_recv_buffer_size(16 << 10)?;
            let vip: SocketAddr = format!("{VIP}:80").parse().unwrap();
            sock.connect_timeout(&vip.into(), Duration::from_secs(3))?;
            let mut stream = TcpStream::from(sock);
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(b"GET /big HTTP/1.0\r\n\r\n")?;
            let mut first = vec![0u8; 32 << 10];
            let mut got = 0;
            while got < first.len() {
                match stream.read(&mut first[got..])? {
                    0 => break,
                    n => got += n,
                }
            }
            Ok::<_, std::io::Error>((stream, got))
        })
        .expect("a download through the VIP")
}

/// A server added while DSR flows are in the middle of downloads: each flow stays on the
/// backend it started on (the flow table), so every download completes; new flows reach
/// the new server too.
#[test]
fn existing_flows_keep_their_backend_when_a_server_is_added_packet() {
    existing_flows_keep_their_backend_when_a_server_is_added(PACKET);
}

#[test]
fn existing_flows_keep_their_backend_when_a_server_is_added_xdp() {
    existing_flows_keep_their_backend_when_a_server_is_added(XDP);
}

fn existing_flows_keep_their_backend_when_a_server_is_added(path: &'static str) {
    if netns::skip() {
        return;
    }
    let s = Segment::new(3, path);
    let _backends = s.start_backends();
    let dir = std::env::temp_dir().join(format!("quill-dsr-flows-{}-{path}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ctl = dir.join("ctl").to_string_lossy().into_owned();
    // Round robin: the flows of the one client spread over the servers by port.
    let mut q = NsQuill::start(
        &s.lb,
        &[
            "-d",
            "-r",
            "-C",
            &ctl,
            "-u",
            "root",
            "-S",
            "3",
            "-O",
            "dsr_if l0",
            "-O",
            &format!("dsr_path {path}"),
            &format!("{VIP}:80"),
            "10.77.0.11",
            "10.77.0.12",
        ],
    );
    wait_started(&mut q, &s);

    let mut downloads: Vec<(TcpStream, usize)> = (0..16).map(|_| open_download(&s)).collect();
    support::ctl::ctl_ok(&ctl, "server 2 address 10.77.0.13 port 80");
    wait_until(
        Duration::from_secs(10),
        "quill forwards to the new server",
        || {
            q.stderr()
                .contains("backends up: [10.77.0.11, 10.77.0.12, 10.77.0.13]")
        },
    );
    // The ACKs of every download now cross the new table: each must still reach the
    // backend that is sending, or that backend's peer answers with a reset.
    let mut broken = Vec::new();
    for (i, (stream, first)) in downloads.iter_mut().enumerate() {
        let mut rest = Vec::new();
        match stream.read_to_end(&mut rest) {
            Ok(_) => {
                let reply = *first + rest.len();
                let head = reply.saturating_sub(BIG);
                if reply <= BIG || head > 200 || rest.iter().any(|&b| b != b'x') {
                    broken.push(format!("#{i}: {reply} bytes"));
                }
            }
            Err(e) => broken.push(format!("#{i}: {e}")),
        }
    }
    assert!(
        broken.is_empty(),
        "{} of 16 downloads broke when the server was added: {broken:?}",
        broken.len()
    );
    // New flows: the new server gets its share.
    let mut names = HashSet::new();
    for _ in 0..30 {
        if let Some((name, _)) = s.get() {
            names.insert(name);
        }
    }
    assert!(names.contains("be3"), "no new flow reached be3: {names:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A second quill started on the interface while the first one's XDP program holds it
/// (a restart that starts the new process first; a binary upgrade does not apply to DSR,
/// which has no listening socket to pass on): it forwards through its packet socket, which
/// sees no frame while the first program forwards them, and attaches its own program as
/// soon as the first quill is gone. Requests succeed throughout.
#[test]
fn a_second_quill_takes_the_xdp_path_over_when_the_first_stops() {
    if netns::skip() {
        return;
    }
    let s = Segment::new(2, XDP);
    let _backends = s.start_backends();
    let listen = format!("{VIP}:80");
    let args = [
        "-d",
        "-r",
        "-O",
        "dsr_if l0",
        "-O",
        "dsr_path xdp",
        &listen,
        "10.77.0.11",
        "10.77.0.12",
    ];
    let mut first = NsQuill::start(&s.lb, &args);
    wait_started(&mut first, &s);
    assert!(first.stderr().contains("XDP generic"), "{}", first.stderr());

    let mut second = NsQuill::start_as(&s.lb, "second", &args);
    wait_until(Duration::from_secs(10), "the second quill waits", || {
        second
            .stderr()
            .contains("another XDP program holds the interface")
    });
    assert!(s.get().is_some());
    std::process::Command::new("kill")
        .args(["-TERM", &first.pid().to_string()])
        .status()
        .unwrap();
    let mut requests = 0;
    wait_until(
        Duration::from_secs(10),
        "the second quill attaches its program",
        || {
            assert!(s.get().is_some(), "a request failed during the hand-over");
            requests += 1;
            second.stderr().contains("XDP program attached")
        },
    );
    assert!(first.exited().is_some());
    assert!(second.exited().is_none(), "{}", second.stderr());
    for _ in 0..5 {
        assert!(s.get().is_some(), "a request failed after the hand-over");
    }
    eprintln!("{requests} requests during the hand-over, none failed");
}

/// The XDP program and the packet socket place a new flow on the same backend (the same
/// key, mixing function and Maglev table), so switching paths, or a flow moving between a
/// node on one path and a node on the other, keeps it there. Tracking mode: the key is the
/// client's address; 24 client addresses.
#[test]
fn both_paths_place_a_flow_on_the_same_backend() {
    if netns::skip() {
        return;
    }
    let s = Segment::new(3, PACKET);
    let _backends = s.start_backends();
    let clients: Vec<String> = (20..44).map(|i| format!("10.77.0.{i}")).collect();
    for c in &clients {
        s.cli.ip(&["addr", "add", &format!("{c}/24"), "dev", "c0"]);
    }
    let placement = |path: &str| -> Vec<String> {
        let option = format!("dsr_path {path}");
        let mut q = NsQuill::start(
            &s.lb,
            &[
                "-d",
                "-O",
                "dsr_if l0",
                "-O",
                &option,
                &format!("{VIP}:80"),
                "10.77.0.11",
                "10.77.0.12",
                "10.77.0.13",
            ],
        );
        wait_started(&mut q, &s);
        wait_until(Duration::from_secs(10), "all three backends up", || {
            q.stderr()
                .contains("backends up: [10.77.0.11, 10.77.0.12, 10.77.0.13]")
        });
        clients
            .iter()
            .map(|c| {
                let out = s
                    .cli
                    .cmd("curl")
                    .args(["-s", "--max-time", "3", "--interface", c])
                    .arg(format!("http://{VIP}/"))
                    .output()
                    .unwrap();
                let body = String::from_utf8_lossy(&out.stdout).into_owned();
                body.split_whitespace().next().unwrap_or("none").to_string()
            })
            .collect()
    };
    let by_packet = placement(PACKET);
    let by_xdp = placement(XDP);
    let used: HashSet<&String> = by_packet.iter().collect();
    assert!(used.len() >= 2, "flows spread: {by_packet:?}");
    assert!(!by_packet.iter().any(|n| n == "none"), "{by_packet:?}");
    assert_eq!(
        by_packet, by_xdp,
        "the two paths placed the clients differently"
    );
}
