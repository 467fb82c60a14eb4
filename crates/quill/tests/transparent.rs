//! Transparent reverse proxy (`transparent`), end to end on virtual hosts: a client subnet
//! and a server subnet routed through the balancer, which runs the shipped
//! `contrib/transparent/quill-transparent-routing` script. The backends report the peer
//! address they see. Root only; skipped otherwise.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

use support::hosts::{curl, Backend, NsQuill};
use support::netns::{self, bridge, plug, veth, Netns};
use support::{poll_until, wait_until};

const CLIENT: &str = "10.77.1.10";
const BALANCER_BACK: &str = "10.77.2.1";
const FRONT: &str = "10.77.1.1:8080";

/// cli 10.77.1.10 --- lb 10.77.1.1 | lb 10.77.2.1 --- br1 --- be1 10.77.2.11, be2 10.77.2.12
struct Routed {
    cli: Netns,
    lb: Netns,
    _backends: Vec<Netns>,
    servers: Vec<Backend>,
    _sw: Netns,
}

fn routing_script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../contrib/transparent/quill-transparent-routing")
}

impl Routed {
    fn new() -> Routed {
        let sw = Netns::new("tsw");
        bridge(&sw, "br1");
        let cli = Netns::new("tcli");
        let lb = Netns::new("tlb");
        veth(&cli, "c1", &lb, "l1");
        cli.ip(&["addr", "add", "10.77.1.10/24", "dev", "c1"]);
        lb.ip(&["addr", "add", "10.77.1.1/24", "dev", "l1"]);
        plug(&sw, "br1", "p-lb", &lb, "l2", "10.77.2.1/24");
        let mut backends = Vec::new();
        let mut servers = Vec::new();
        for i in 1..=2 {
            let be = Netns::new(&format!("tbe{i}"));
            let ip = format!("10.77.2.{}", 10 + i);
            plug(
                &sw,
                "br1",
                &format!("p-be{i}"),
                &be,
                "b1",
                &format!("{ip}/24"),
            );
            // The replies must come back through the balancer, by design.
            be.ip(&["route", "add", "default", "via", BALANCER_BACK]);
            let addr: SocketAddr = "0.0.0.0:8000".parse().unwrap();
            servers.push(Backend::start(
                &be,
                &format!("be{i}"),
                Some(addr),
                Some(addr),
            ));
            backends.push(be);
        }
        lb.exec(&["sh", &routing_script().to_string_lossy(), "up"]);
        Routed {
            cli,
            lb,
            _backends: backends,
            servers,
            _sw: sw,
        }
    }

    fn quill(&self, options: &[&str]) -> NsQuill {
        let mut args: Vec<&str> = options.to_vec();
        args.extend([FRONT, "10.77.2.11:8000", "10.77.2.12:8000"]);
        NsQuill::start(&self.lb, &args)
    }

    /// The peer address a backend saw for one HTTP request.
    fn tcp_peer(&self, q: &mut NsQuill) -> SocketAddr {
        let mut seen = None;
        wait_until(
            Duration::from_secs(20),
            "an HTTP request through quill",
            || {
                if let Some(status) = q.exited() {
                    panic!("quill exited ({status}): {}", q.stderr());
                }
                seen = curl(&self.cli, &format!("http://{FRONT}/"), 3);
                seen.is_some()
            },
        );
        let body = seen.unwrap();
        body.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// The peer a backend saw for one datagram, and the client's own address.
    fn udp_peer(&self, q: &mut NsQuill) -> (SocketAddr, SocketAddr) {
        let sock = self.cli.run(|| {
            let u = UdpSocket::bind("10.77.1.10:0").unwrap();
            u.connect(FRONT).unwrap();
            u.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            u
        });
        let mut answer = None;
        wait_until(
            Duration::from_secs(20),
            "a UDP answer through quill",
            || {
                if let Some(status) = q.exited() {
                    panic!("quill exited ({status}): {}", q.stderr());
                }
                let mut buf = [0u8; 256];
                answer = sock
                    .send(b"q")
                    .and_then(|_| sock.recv(&mut buf))
                    .ok()
                    .map(|n| String::from_utf8_lossy(&buf[..n]).into_owned());
                answer.is_some()
            },
        );
        let peer = answer
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        (peer, sock.local_addr().unwrap())
    }
}

impl Drop for Routed {
    fn drop(&mut self) {
        self.servers.clear();
    }
}

#[test]
fn transparent_tcp_and_udp_backends_see_the_client() {
    if netns::skip() {
        return;
    }
    let r = Routed::new();
    let mut q = r.quill(&["-r", "-O", "transparent"]);
    let peer = r.tcp_peer(&mut q);
    assert_eq!(
        peer.ip().to_string(),
        CLIENT,
        "TCP: the backend sees the client"
    );
    drop(q);

    let mut q = r.quill(&["-U", "-r", "-O", "transparent"]);
    let (peer, client) = r.udp_peer(&mut q);
    assert_eq!(
        peer, client,
        "UDP: the backend sees the client's address and port"
    );
}

#[test]
fn without_transparent_backends_see_the_balancer() {
    if netns::skip() {
        return;
    }
    let r = Routed::new();
    let mut q = r.quill(&["-r"]);
    assert_eq!(r.tcp_peer(&mut q).ip().to_string(), BALANCER_BACK);
    drop(q);
    let mut q = r.quill(&["-U", "-r"]);
    assert_eq!(r.udp_peer(&mut q).0.ip().to_string(), BALANCER_BACK);
}

#[test]
fn transparent_without_cap_net_admin_fails_at_start_up() {
    if netns::skip() {
        return;
    }
    let lb = Netns::new("tcap");
    // Dropping to an unprivileged user takes CAP_NET_ADMIN away.
    let mut q = NsQuill::start(
        &lb,
        &[
            "-u",
            "nobody",
            "-O",
            "transparent",
            "127.0.0.1:8080",
            "127.0.0.1:9",
        ],
    );
    assert!(poll_until(Duration::from_secs(10), || q.exited().is_some()));
    assert_ne!(q.exited().and_then(|s| s.code()), Some(0));
    let err = q.stderr();
    assert!(
        err.contains("CAP_NET_ADMIN") && err.contains("transparent"),
        "{err}"
    );
}
