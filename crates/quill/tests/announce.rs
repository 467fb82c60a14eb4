//! Scale-out hooks: `announce_table N` keeps a route for the service address in kernel table
//! N (for BIRD or FRR to announce) exactly while the node can serve it, and withdraws it
//! first when quill stops, serving on for `announce_grace`; `health` answers keepalived's
//! question. Each test runs quill in a network namespace of its own (root; skipped with the
//! reason elsewhere, run by CI), where the routes it writes are checked with `ip route`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use support::ctl::{ctl_ok, quillctl};
use support::netns::{self, Netns};
use support::*;

const VIP: &str = "10.99.0.1";
const TABLE: &str = "100";

/// A namespace with the service address on `lo`, two dummy web servers, and quill in front
/// of them announcing into table 100; its control socket is a file the test can reach.
struct Node {
    ns: Netns,
    quill: Child,
    backends: Vec<Child>,
    dir: TempDir,
}

impl Node {
    /// A node announcing `VIP` (on its `lo`) into table 100, with `announce_grace 2`.
    fn start(extra: &[&str]) -> Node {
        let mut args = vec!["-O", "announce_table 100", "-O", "announce_grace 2"];
        args.extend_from_slice(extra);
        let ns = Netns::new("announce");
        ns.ip(&["addr", "add", &format!("{VIP}/32"), "dev", "lo"]);
        Node::launch(ns, &format!("{VIP}:80"), &args)
    }

    /// quill in `ns` listening on `listen` in front of two dummy servers of its own.
    fn launch(ns: Netns, listen: &str, extra: &[&str]) -> Node {
        let backends = ["127.0.0.1:8001", "127.0.0.1:8002"]
            .iter()
            .map(|addr| {
                ns.cmd(bin().to_str().unwrap())
                    .args(["-f", "-O", "dummy", addr])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let dir = TempDir::new("announce");
        let ctl = dir.path().join("ctl");
        let mut args: Vec<String> = ["-f", "-r", "-C", ctl.to_str().unwrap(), "-u", "root"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend([
            listen.to_string(),
            "127.0.0.1:8001".into(),
            "127.0.0.1:8002".into(),
        ]);
        let quill = ns
            .cmd(bin().to_str().unwrap())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("stderr")).unwrap())
            .spawn()
            .unwrap();
        let node = Node {
            ns,
            quill,
            backends,
            dir,
        };
        wait_until(START_DEADLINE, "the control socket", || ctl.exists());
        node
    }

    fn ctl(&self) -> String {
        self.dir.path().join("ctl").to_string_lossy().into_owned()
    }

    /// quill's routes in table 100 of the namespace, as `ip route` prints them (nothing
    /// when the table does not exist: the kernel drops an empty table).
    fn routes(&self) -> String {
        let out = std::process::Command::new("ip")
            .args([
                "-n",
                &self.ns.name,
                "route",
                "show",
                "table",
                TABLE,
                "proto",
                "250",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn announced(&self) -> bool {
        self.routes().contains(VIP)
    }

    /// One HTTP request to the service address from inside the namespace.
    fn request(&self) -> std::io::Result<String> {
        request_from(&self.ns, &format!("{VIP}:80"), Duration::from_secs(2))
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for c in self
            .backends
            .iter_mut()
            .chain(std::iter::once(&mut self.quill))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn the_route_follows_whether_any_server_can_serve() {
    if netns::skip() {
        return;
    }
    let node = Node::start(&["-d"]);
    wait_until(IO_TIMEOUT, "the route in table 100", || node.announced());
    let route = node.routes();
    assert!(
        route.contains(&format!("{VIP} dev lo")),
        "ip route show table 100: {route}"
    );
    assert_eq!(quillctl(&node.ctl(), &["health"]).code, Some(0));
    let status: serde_json::Value =
        serde_json::from_str(&ctl_ok(&node.ctl(), "status json")).unwrap();
    assert_eq!(status["announce"]["table"], 100);
    assert_eq!(status["announce"]["announced"], true);

    // One server out: still servable, still announced.
    ctl_ok(&node.ctl(), "server 0 blacklist 600");
    assert!(node.request().unwrap().contains("200"));
    assert!(node.announced());
    // Both out: withdrawn, and health says why (quillctl exits 1, as track_script reads).
    ctl_ok(&node.ctl(), "server 1 drain");
    wait_until(IO_TIMEOUT, "the route withdrawn", || !node.announced());
    let health = quillctl(&node.ctl(), &["health"]);
    assert_eq!(health.code, Some(1), "{health:?}");
    assert!(health.stdout.contains("cannot serve"), "{health:?}");
    // One back: announced again.
    ctl_ok(&node.ctl(), "server 0 blacklist 0");
    wait_until(IO_TIMEOUT, "the route back", || node.announced());
    assert_eq!(quillctl(&node.ctl(), &["health"]).code, Some(0));
    // The whole node drained: withdrawn and unhealthy, yet still serving what arrives.
    ctl_ok(&node.ctl(), "drain");
    wait_until(IO_TIMEOUT, "the route withdrawn", || !node.announced());
    let health = quillctl(&node.ctl(), &["health"]);
    assert_eq!(health.code, Some(1), "{health:?}");
    assert!(health.stdout.contains("draining"), "{health:?}");
    assert!(node.request().unwrap().contains("200"));
    ctl_ok(&node.ctl(), "drain 0");
    wait_until(IO_TIMEOUT, "the route back", || node.announced());
    // Turned off at run time: withdrawn.
    ctl_ok(&node.ctl(), "no announce_table");
    wait_until(IO_TIMEOUT, "the route withdrawn", || !node.announced());
    assert!(
        node.stderr().contains("announce: announcing"),
        "{}",
        node.stderr()
    );
}

#[test]
fn a_stopping_node_withdraws_first_and_serves_on_for_the_grace() {
    if netns::skip() {
        return;
    }
    let mut node = Node::start(&[]);
    wait_until(IO_TIMEOUT, "the route in table 100", || node.announced());
    let pid = node.quill.id();
    let term = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    wait_until(IO_TIMEOUT, "the route withdrawn", || !node.announced());
    let withdrawn = term.elapsed();
    // The route is gone, the listener is not: what still arrives is served.
    assert!(
        node.request().unwrap().contains("200"),
        "a request after the withdrawal, during announce_grace, failed"
    );
    let status = node.quill.wait().unwrap();
    let stopped = term.elapsed();
    assert!(status.success(), "{status}: {}", node.stderr());
    assert!(
        stopped >= Duration::from_secs(2),
        "quill stopped {stopped:?} after TERM, before announce_grace (2 s) ran out"
    );
    assert!(
        withdrawn < Duration::from_secs(1),
        "the withdrawal took {withdrawn:?}"
    );
}

#[test]
fn a_route_left_by_a_killed_quill_is_taken_over_and_cleared() {
    if netns::skip() {
        return;
    }
    let mut node = Node::start(&[]);
    wait_until(IO_TIMEOUT, "the route in table 100", || node.announced());
    // SIGKILL leaves the route behind (nothing runs to remove it): the next quill finds it.
    node.quill.kill().unwrap();
    node.quill.wait().unwrap();
    assert!(
        node.announced(),
        "the kernel keeps the route of a killed process"
    );
    // The next quill announces (replacing it, no error) and, stopping, removes it.
    let ctl = node.ctl();
    let _ = std::fs::remove_file(&ctl);
    let args = [
        "-f",
        "-C",
        &ctl,
        "-u",
        "root",
        "-O",
        "announce_table 100",
        "-O",
        "announce_grace 0",
        &format!("{VIP}:80"),
        "127.0.0.1:8001",
    ];
    node.quill = node
        .ns
        .cmd(bin().to_str().unwrap())
        .args(args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(node.dir.path().join("stderr")).unwrap())
        .spawn()
        .unwrap();
    wait_until(START_DEADLINE, "the control socket", || {
        std::path::Path::new(&ctl).exists()
    });
    wait_until(IO_TIMEOUT, "the status", || {
        ctl_ok(&ctl, "status json").contains("\"announced\":true")
    });
    assert_eq!(node.routes().lines().count(), 1, "{}", node.routes());
    ctl_ok(&ctl, "server 0 drain");
    wait_until(IO_TIMEOUT, "the route withdrawn", || !node.announced());
    assert!(!node.stderr().contains("cannot add"), "{}", node.stderr());
}

#[test]
fn announce_table_refuses_the_kernels_own_tables() {
    let (code, stderr) =
        Quill::start_expect_exit(&["-O", "announce_table 254", "{port}", "127.0.0.1:1"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("routing table"), "{stderr}");
    let dir = TempDir::new("announce-write");
    let cfg = dir.path().join("q.cfg");
    std::fs::write(
        &cfg,
        "announce_table 100\nannounce_grace 7\nlisten 127.0.0.1:1\n",
    )
    .unwrap();
    let out = std::process::Command::new(bin())
        .args(["--check", "-F", cfg.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A BIRD daemon in a namespace, stopped on drop.
struct Bird(Child);

impl Bird {
    fn start(ns: &Netns, dir: &std::path::Path, name: &str, config: &str) -> Bird {
        let conf = dir.join(format!("{name}.conf"));
        std::fs::write(&conf, config).unwrap();
        let child = ns
            .cmd("bird")
            .args(["-f", "-c", conf.to_str().unwrap(), "-s"])
            .arg(dir.join(format!("{name}.sock")))
            .args(["-P"])
            .arg(dir.join(format!("{name}.pid")))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
            .spawn()
            .unwrap();
        Bird(child)
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bird_missing() -> bool {
    let found = std::process::Command::new("bird")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIPPED: bird not installed (Debian package bird2)");
    }
    !found
}

/// BIRD on a balancer node: learn quill's routes (protocol 250) from kernel table 100 and
/// announce them to the router over eBGP.
fn node_bird(me: &str, router: &str) -> String {
    format!(
        "router id {me};\nipv4 table quill_routes;\nprotocol device {{}}\n\
         protocol kernel quill_kernel {{\n  kernel table 100;\n  learn;\n  scan time 1;\n\
         ipv4 {{ table quill_routes; import where krt_source = 250; export none; }};\n}}\n\
         protocol bgp router1 {{\n  local {me} as 65010;\n  neighbor {router} as 65000;\n\
         hold time 3;\n  connect retry time 1;\n\
         ipv4 {{ table quill_routes; import none; export all; }};\n}}\n"
    )
}

/// BIRD on the router: one eBGP session per node, the routes merged into one multipath
/// (ECMP) kernel route.
fn router_bird(nodes: &[&str]) -> String {
    let mut conf = String::from(
        "router id 10.0.0.1;\nprotocol device {}\n\
         protocol kernel {\n  merge paths on;\n  ipv4 { import none; export all; };\n}\n",
    );
    for (i, node) in nodes.iter().enumerate() {
        let local = node.rsplit_once('.').map_or("", |(net, _)| net);
        conf.push_str(&format!(
            "protocol bgp lb{i} {{\n  local {local}.1 as 65000;\n  neighbor {node} as 65010;\n\
             hold time 3;\n  connect retry time 1;\n  ipv4 {{ import all; export none; }};\n}}\n"
        ));
    }
    conf
}

/// One HTTP/1.0 request to `addr` on a new connection, from the calling thread's network
/// namespace; the whole reply.
fn http_get(addr: &str, connect_timeout: Duration) -> std::io::Result<String> {
    let addr: SocketAddr = addr.parse().unwrap();
    let mut s = TcpStream::connect_timeout(&addr, connect_timeout)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    let mut reply = String::new();
    s.read_to_string(&mut reply)?;
    Ok(reply)
}

/// [`http_get`] from inside `ns`.
fn request_from(ns: &Netns, addr: &str, connect_timeout: Duration) -> std::io::Result<String> {
    let addr = addr.to_string();
    ns.run(move || http_get(&addr, connect_timeout))
}

/// How long `cond` took to become true (panics after the deadline).
fn time_until(what: &str, cond: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    wait_until(IO_TIMEOUT, what, cond);
    start.elapsed()
}

/// BIRD on the balancer node learns quill's route from table 100 and announces it over BGP
/// to BIRD on a router, which installs it: clients beyond the router reach quill through
/// it. The router forgets the route as soon as quill cannot serve or stops.
#[test]
fn bird_carries_quills_announcement_to_the_router() {
    if netns::skip() || bird_missing() {
        return;
    }
    let mut node = Node::start(&[]);
    let router = Netns::new("router");
    netns::veth(&router, "r0", &node.ns, "l0");
    router.ip(&["addr", "add", "10.0.0.1/24", "dev", "r0"]);
    node.ns.ip(&["addr", "add", "10.0.0.2/24", "dev", "l0"]);
    let dir = node.dir.path().to_path_buf();
    let _node_bird = Bird::start(&node.ns, &dir, "node", &node_bird("10.0.0.2", "10.0.0.1"));
    let _router_bird = Bird::start(&router, &dir, "router", &router_bird(&["10.0.0.2"]));
    let router_has_route = || {
        let out = std::process::Command::new("ip")
            .args(["-n", &router.name, "route", "show", VIP])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("via 10.0.0.2")
    };
    // BGP comes up within a few seconds (connect retry 1 s).
    wait_until(
        Duration::from_secs(30),
        "the router's BGP route",
        router_has_route,
    );
    // A client on the router's side reaches quill through the announced route.
    assert!(
        request_from(&router, &format!("{VIP}:80"), Duration::from_secs(2))
            .unwrap()
            .contains("200")
    );

    // No server left: the router forgets the route.
    ctl_ok(&node.ctl(), "server 0 drain");
    ctl_ok(&node.ctl(), "server 1 drain");
    let withdrawn = time_until("the router forgets the route", || !router_has_route());
    ctl_ok(&node.ctl(), "server 0 drain 0");
    let back = time_until("the router learns the route again", router_has_route);

    // quill stops: the router forgets the route before quill has stopped serving.
    let term = Instant::now();
    std::process::Command::new("kill")
        .args(["-TERM", &node.quill.id().to_string()])
        .status()
        .unwrap();
    let on_stop = time_until("the router forgets the route on stop", || {
        !router_has_route()
    });
    assert!(
        node.quill.try_wait().unwrap().is_none(),
        "quill had stopped before the router forgot its route"
    );
    let _ = node.quill.wait();
    eprintln!(
        "router: route withdrawn {withdrawn:?} after the last server drained, back {back:?} \
         after one returned, withdrawn {on_stop:?} after SIGTERM (quill stopped after {:?})",
        term.elapsed()
    );
}

/// Two balancer nodes announce the same service address; the router spreads flows over
/// both (ECMP, hashing on the 4-tuple). One node stops under a steady loop of requests: it
/// withdraws first, the router moves new flows to the other, and not one request fails.
#[test]
fn two_nodes_share_the_flows_and_one_stops_without_a_failed_request() {
    if netns::skip() || bird_missing() {
        return;
    }
    let mut a = Node::start(&[]);
    let b = Node::start(&[]);
    let router = Netns::new("router");
    router.sysctl(&["net.ipv4.fib_multipath_hash_policy=1"]);
    netns::veth(&router, "r0", &a.ns, "l0");
    netns::veth(&router, "r1", &b.ns, "l0");
    router.ip(&["addr", "add", "10.0.0.1/24", "dev", "r0"]);
    router.ip(&["addr", "add", "10.0.1.1/24", "dev", "r1"]);
    a.ns.ip(&["addr", "add", "10.0.0.2/24", "dev", "l0"]);
    b.ns.ip(&["addr", "add", "10.0.1.2/24", "dev", "l0"]);
    let dir = a.dir.path().to_path_buf();
    let _bird_a = Bird::start(&a.ns, &dir, "a", &node_bird("10.0.0.2", "10.0.0.1"));
    let _bird_b = Bird::start(&b.ns, &dir, "b", &node_bird("10.0.1.2", "10.0.1.1"));
    let _bird_r = Bird::start(
        &router,
        &dir,
        "router",
        &router_bird(&["10.0.0.2", "10.0.1.2"]),
    );
    let nexthops = || {
        let out = std::process::Command::new("ip")
            .args(["-n", &router.name, "route", "show", VIP])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        ["via 10.0.0.2", "via 10.0.1.2"]
            .iter()
            .filter(|v| text.contains(*v))
            .count()
    };
    wait_until(
        Duration::from_secs(30),
        "two nexthops on the router",
        || nexthops() == 2,
    );

    // Flows spread over both nodes.
    let accepted = |n: &Node| {
        let status: serde_json::Value =
            serde_json::from_str(&ctl_ok(&n.ctl(), "status json")).unwrap();
        status["connections"]["accepted"].as_u64().unwrap()
    };
    for _ in 0..40 {
        assert!(
            request_from(&router, &format!("{VIP}:80"), Duration::from_secs(2))
                .unwrap()
                .contains("200")
        );
    }
    let (on_a, on_b) = (accepted(&a), accepted(&b));
    assert_eq!(on_a + on_b, 40);
    assert!(
        on_a >= 5 && on_b >= 5,
        "flows not spread: {on_a} on a, {on_b} on b"
    );

    // A steady loop of requests while node a stops.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looping = {
        let stop = std::sync::Arc::clone(&stop);
        let path = format!("/run/netns/{}", router.name);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).unwrap();
            nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match http_get(&format!("{VIP}:80"), Duration::from_secs(2)) {
                    Ok(r) if r.contains("200") => ok += 1,
                    other => failed.push(format!("{other:?}")),
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            (ok, failed)
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let before = accepted(&b);
    std::process::Command::new("kill")
        .args(["-TERM", &a.quill.id().to_string()])
        .status()
        .unwrap();
    let moved = time_until("one nexthop left", || nexthops() == 1);
    let status = a.quill.wait().unwrap();
    assert!(status.success(), "{status}");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = looping.join().unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {failed:?}",
        failed.len(),
        ok as usize + failed.len()
    );
    assert!(accepted(&b) > before, "node b took no flow over");
    eprintln!("ecmp: {on_a}/{on_b} of 40 flows on a/b; node a stopped: router down to one nexthop after {moved:?}; {ok} requests in the loop, none failed");
}

/// keepalived in a namespace, stopped on drop.
struct Keepalived(Child);

impl Drop for Keepalived {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Keepalived {
    /// A VRRP instance on `l0` holding `vip`, its priority lowered to fault when
    /// `quillctl CTL health` fails (keepalived's track_script).
    fn start(node: &Node, name: &str, priority: u32, vip: &str) -> Keepalived {
        let dir = node.dir.path();
        let conf = dir.join(format!("keepalived-{name}.conf"));
        let quillctl = support::ctl::quillctl_bin();
        std::fs::write(
            &conf,
            format!(
                "global_defs {{\n  router_id {name}\n  script_user root\n  enable_script_security\n}}\n\
                 vrrp_script quill_health {{\n  script \"{} {} health\"\n  interval 1\n  timeout 1\n  fall 1\n  rise 1\n}}\n\
                 vrrp_instance web {{\n  state BACKUP\n  interface l0\n  virtual_router_id 51\n  priority {priority}\n\
                   advert_int 1\n  virtual_ipaddress {{\n    {vip}/24 dev l0\n  }}\n  track_script {{\n    quill_health\n  }}\n}}\n",
                quillctl.display(),
                node.ctl()
            ),
        )
        .unwrap();
        let pid = |what: &str| dir.join(format!("keepalived-{name}-{what}.pid"));
        let child = node
            .ns
            .cmd("keepalived")
            .args(["-n", "-l", "-P", "-f", conf.to_str().unwrap()])
            .arg("-p")
            .arg(pid("main"))
            .arg("-r")
            .arg(pid("vrrp"))
            .stdout(std::fs::File::create(dir.join(format!("keepalived-{name}.log"))).unwrap())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Keepalived(child)
    }
}

fn keepalived_missing() -> bool {
    let found = std::process::Command::new("keepalived")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIPPED: keepalived not installed (Debian package keepalived)");
    }
    !found
}

/// An active/standby pair: keepalived holds the VIP on the node whose quill is healthy.
/// quill on the master dies; its `health` fails, keepalived there gives the VIP up, the
/// standby takes it, and new connections succeed again within seconds.
#[test]
fn keepalived_moves_the_vip_when_quill_on_the_master_dies() {
    if netns::skip() || keepalived_missing() {
        return;
    }
    const KA_VIP: &str = "10.0.2.100";
    let sw = Netns::new("sw");
    netns::bridge(&sw, "br0");
    let client = Netns::new("client");
    netns::plug(&sw, "br0", "p-c", &client, "c0", "10.0.2.10/24");
    let make = |role: &str, port: &str, cidr: &str| {
        let ns = Netns::new(role);
        netns::plug(&sw, "br0", port, &ns, "l0", cidr);
        // The standby listens on the VIP before it holds it.
        ns.sysctl(&["net.ipv4.ip_nonlocal_bind=1"]);
        Node::launch(ns, &format!("{KA_VIP}:80"), &[])
    };
    let mut a = make("ka-a", "p-a", "10.0.2.2/24");
    let b = make("ka-b", "p-b", "10.0.2.3/24");
    let _ka_a = Keepalived::start(&a, "a", 100, KA_VIP);
    let _ka_b = Keepalived::start(&b, "b", 90, KA_VIP);
    let holds_vip = |n: &Node| {
        let out = std::process::Command::new("ip")
            .args(["-n", &n.ns.name, "-4", "addr", "show", "dev", "l0"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains(KA_VIP)
    };
    wait_until(Duration::from_secs(20), "node a holds the VIP", || {
        holds_vip(&a)
    });
    let request = || {
        request_from(&client, &format!("{KA_VIP}:80"), Duration::from_millis(500))
            .map(|reply| reply.contains("200"))
    };
    assert!(request().unwrap());

    a.quill.kill().unwrap();
    let killed = Instant::now();
    let _ = a.quill.wait();
    let mut failures = 0;
    loop {
        if request().unwrap_or(false) {
            break;
        }
        failures += 1;
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "no answer on the VIP 20 s after quill on the master died"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let gap = killed.elapsed();
    assert!(
        holds_vip(&b) && !holds_vip(&a),
        "the VIP did not move to node b"
    );
    eprintln!("keepalived: answers again {gap:?} after quill on the master was killed ({failures} failed attempts)");
}
