#!/usr/bin/env python3
"""DSR benchmark on a network-namespace topology (root only; Python 3 stdlib only).

Topology (namespaces named qb<pid>-*, removed at exit):
    cli 10.77.0.10 --+
    lb  10.77.0.2  --+-- br0 (ns sw)      VIP 10.77.0.100 on lo of be1/be2 (arp_ignore/announce)
    be1 10.77.0.11 --+
    be2 10.77.0.12 --+

Scenarios:
  pps       UDP datagrams (18-byte payload) blasted from cli to VIP:9 for --duration s by
            --senders processes; the forwarding rate is what reaches the backends
            (sum of their b0 rx_packets), with the balancer's CPU seconds. Balancers:
            quill (dsr_if), pen (-O "dsr_if l0", if this Pen build has DSR), and the
            kernel's IPVS in direct-routing mode (ipvsadm -g) when the kernel has IPVS.
  download  sequential `curl` of a 1 MiB file for --duration s, via DSR (VIP:80) and via
            quill's normal proxy mode (10.77.0.2:8080): requests/s and requests per
            balancer CPU second; the ratio DSR / proxy is the figure of merit. --rounds N
            repeats the variants interleaved and reports medians.
  paths     the XDP fast path against the rest, in interleaved rounds (--rounds): a 300 MB
            TCP upload to VIP:9000 (every byte crosses the balancer; sinks on the backends)
            and the UDP blast, through Pen's DSR, quill `dsr_path packet`, quill `dsr_path
            xdp` (generic and native mode) and the trivial XDP_TX ceiling
            (bench/xdp_ceiling.bpf.c, generic and native): MB/s and forwarded packets/s,
            and the whole machine's CPU (all cores, /proc/stat: XDP work is softirq, charged
            to no balancer process) per GB and per million packets. Native XDP on a veth
            needs an XDP program on the peer (the bridge port gets an XDP_PASS one) and the
            client's checksums complete (`ethtool -K c0 tx off`, for every variant alike).
            Needs clang and libbpf-dev (the ceiling is built here) and ethtool.

Balancer CPU is the process's on-CPU time (schedstat), which on this kernel includes the
softirq work that runs in its context: on a veth topology, the bridge's and the peers' TCP
processing of every frame the balancer sends (see dsr_cpu_split.py). --perf records each
mode once more under `perf record -g` and prints that split.

Variants (diagnostic switches of quill's DSR plane): QUILL_DSR_RING=v3|off (TPACKET_V3
block ring, one recv per frame; default TPACKET_V2 frame ring), QUILL_DSR_TX=single (one
send per frame; default one sendmmsg per batch).

NOTE: timings on a shared, loaded machine are noisy; the ratios (measured interleaved in one
run) are what to read. The sender runs on the same cores as the balancer.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tcp_bench  # noqa: E402  (beside this file)

PID = os.getpid()
VIP = "10.77.0.100"
NS = {r: f"qb{PID}-{r}" for r in ("sw", "cli", "lb", "be1", "be2")}


def sh(*args, check=True, **kw):
    return subprocess.run(list(args), check=check, stdin=subprocess.DEVNULL, **kw)


def ip(ns, *args):
    sh("ip", "-n", NS[ns], *args)


def nsexec(ns, *args, **kw):
    return sh("ip", "netns", "exec", NS[ns], *args, **kw)


def popen(ns, *args, **kw):
    return subprocess.Popen(["ip", "netns", "exec", NS[ns], *args], stdin=subprocess.DEVNULL, **kw)


def topo_up(www):
    for n in NS.values():
        sh("ip", "netns", "add", n)
        sh("ip", "-n", n, "link", "set", "lo", "up")
    ip("sw", "link", "add", "br0", "type", "bridge")
    ip("sw", "link", "set", "br0", "type", "bridge", "stp_state", "0", "forward_delay", "0")
    ip("sw", "link", "set", "br0", "up")
    for role, ifname, addr in (("cli", "c0", "10.77.0.10"), ("lb", "l0", "10.77.0.2"),
                               ("be1", "b0", "10.77.0.11"), ("be2", "b0", "10.77.0.12")):
        port = f"p-{role}"
        sh("ip", "-n", NS[role], "link", "add", ifname, "type", "veth", "peer", "name", port,
           "netns", NS["sw"])
        ip("sw", "link", "set", port, "master", "br0", "up")
        ip(role, "link", "set", ifname, "up")
        ip(role, "addr", "add", f"{addr}/24", "dev", ifname)
    nsexec("lb", "sysctl", "-q", "-w", "net.ipv4.conf.all.forwarding=0", "net.ipv4.conf.l0.forwarding=0")
    for be in ("be1", "be2"):
        ip(be, "addr", "add", f"{VIP}/32", "dev", "lo")
        nsexec(be, "sysctl", "-q", "-w", "net.ipv4.conf.all.arp_ignore=1",
               "net.ipv4.conf.all.arp_announce=2", "net.ipv4.conf.b0.arp_ignore=1",
               "net.ipv4.conf.b0.arp_announce=2",
               # The blast goes to a closed port: no ICMP storm back to the sender.
               "net.ipv4.icmp_ratelimit=1000")
    servers = [popen(be, sys.executable, "-m", "http.server", "80", "--bind", "0.0.0.0",
                     "--directory", www, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
               for be in ("be1", "be2")]
    return servers


def topo_down():
    for n in NS.values():
        sh("ip", "netns", "del", n, check=False, stderr=subprocess.DEVNULL)


def stat(ns, ifname, what):
    out = nsexec(ns, "cat", f"/sys/class/net/{ifname}/statistics/{what}", capture_output=True)
    return int(out.stdout)


def cpu_seconds(pid):
    """CPU time of a process's threads, in seconds (schedstat: nanoseconds, not ticks)."""
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
    except OSError:
        return 0.0
    return total / 1e9


def balancer_pid(proc):
    """The balancer's pid: `ip netns exec` execs it, so the Popen pid is the balancer's."""
    return proc.pid


def wait_for(cond, secs=20):
    end = time.time() + secs
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.1)  # a poll interval while waiting for readiness
    return False


SENDER = r"""
import socket, sys, time
end = time.time() + float(sys.argv[1])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[2], 9))
payload = b"x" * 18
n = 0
while True:
    for _ in range(1000):
        try:
            s.send(payload)
        except OSError:
            pass
    n += 1000
    if time.time() >= end:
        break
print(n)
"""


def run_pps(name, start, stop, duration, senders):
    """Starts a balancer (start() -> pid or None), blasts UDP, returns (sent, forwarded, cpu)."""
    pid = start()
    if pid is None:
        return None
    try:
        # Prime ARP (the client learns the VIP's MAC) and let the balancer find backends.
        ok = wait_for(lambda: nsexec("cli", sys.executable, "-c", PRIME, VIP, check=False).returncode == 0
                      and arp_known())
        if not ok:
            print(f"  {name}: the VIP never answered ARP")
            return None
        time.sleep(1.0)  # let the balancer learn its backends (ARP refresh)
        rx0 = stat("be1", "b0", "rx_packets") + stat("be2", "b0", "rx_packets")
        tx0 = stat("cli", "c0", "tx_packets")
        cpu0 = cpu_seconds(pid) if pid else 0.0
        procs = [popen("cli", sys.executable, "-c", SENDER, str(duration), VIP,
                       stdout=subprocess.PIPE) for _ in range(senders)]
        for p in procs:
            p.wait()
        time.sleep(0.2)  # let queued frames drain before reading the counters
        rx1 = stat("be1", "b0", "rx_packets") + stat("be2", "b0", "rx_packets")
        tx1 = stat("cli", "c0", "tx_packets")
        cpu1 = cpu_seconds(pid) if pid else 0.0
        return tx1 - tx0, rx1 - rx0, cpu1 - cpu0
    finally:
        stop()


# One datagram to the VIP: makes the client resolve the VIP's MAC address.
PRIME = "import socket, sys; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', (sys.argv[1], 9))"


def arp_known():
    out = nsexec("cli", "ip", "neigh", "show", VIP, capture_output=True, check=False)
    return b"lladdr" in out.stdout


# A client loop: fetches URL for DURATION seconds with curl (keep-alive off: one
# connection per request), prints how many succeeded.
FETCHER = r"""
import subprocess, sys, time
url, end, n = sys.argv[1], time.time() + float(sys.argv[2]), 0
while time.time() < end:
    n += subprocess.run(["curl", "-s", "-o", "/dev/null", "--max-time", "10", url]).returncode == 0
print(n)
"""


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def run_download(url, pid, duration, clients):
    cpu0 = cpu_seconds(pid)
    t0 = time.time()
    procs = [popen("cli", sys.executable, "-c", FETCHER, url, str(duration), stdout=subprocess.PIPE)
             for _ in range(clients)]
    n = sum(int(p.communicate()[0] or 0) for p in procs)
    elapsed = time.time() - t0
    return n / elapsed, n / max(cpu_seconds(pid) - cpu0, 1e-6)


DSR_VARIANTS = (("DSR", None), ("DSR-single", {"QUILL_DSR_TX": "single"}),
                ("DSR-v3", {"QUILL_DSR_RING": "v3"}))


def download(a, quill, backends, spawn, kill):
    """1 MiB downloads via DSR (and its variants) and via the proxy, interleaved."""
    print(f"== 1 MiB download, {a.clients} concurrent curl loops, {a.duration:.0f} s each, "
          f"{a.rounds} round(s)")
    dsr_url, proxy_url = f"http://{VIP}/big", "http://10.77.0.2:8080/big"
    modes = [(name, [quill, "-f", "-r", "-O", "dsr_if l0", f"{VIP}:80", *backends], env, dsr_url)
             for name, env in DSR_VARIANTS]
    modes.append(("proxy", [quill, "-f", "-r", "10.77.0.2:8080", "10.77.0.11:80", "10.77.0.12:80"],
                  None, proxy_url))

    def start(args, env, url):
        pid = spawn(args, env)
        wait_for(lambda: nsexec("cli", "curl", "-s", "-o", "/dev/null", "--max-time", "2", url,
                                check=False).returncode == 0)
        return pid

    runs = {name: [] for name, *_ in modes}
    for _ in range(a.rounds):
        for name, args, env, url in modes:
            pid = start(args, env, url)
            runs[name].append(run_download(url, pid, a.duration, a.clients))
            kill()
    res = {name: (median([r[0] for r in rs]), median([r[1] for r in rs])) for name, rs in runs.items()}
    for name, (rps, per_cpu) in res.items():
        spread = ", ".join(f"{r[1]:.0f}" for r in runs[name])
        print(f"  {name:10} {rps:7.1f} req/s  {per_cpu:9.1f} req per balancer CPU second  (rounds: {spread})")
    dsr, proxy = res["DSR"], res["proxy"]
    print(f"  DSR / proxy: {dsr[0] / max(proxy[0], 1e-9):.2f}x req/s, "
          f"{dsr[1] / max(proxy[1], 1e-9):.2f}x req per balancer CPU second")
    if a.perf and shutil.which("perf"):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import dsr_cpu_split
        print("  CPU split (perf record -g on the balancer, separate runs; shares of its samples):")
        for name, args, env, url in (modes[0], modes[-1]):
            pid = start(args, env, url)
            data = tempfile.mktemp(prefix=f"qb-perf-{name}-")
            rec = subprocess.Popen(["perf", "record", "-q", "-g", "-o", data, "-p", str(pid), "--",
                                    "sleep", str(a.duration)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run_download(url, pid, a.duration, a.clients)
            rec.wait()
            kill()
            shares = dsr_cpu_split.split(data)
            os.unlink(data)
            print(f"    {name:6} " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in shares.items()))
            if name == "DSR":
                peers = sum(shares.get(k, 0) for k in ("softirq/TCP", "softirq/bridge", "softirq/other"))
                print(f"    DSR: {100 * peers:.0f} % of the balancer's CPU is the bridge's and the peers' "
                      f"network processing run in its softirq (quill's DSR path has no TCP socket)")


SINK = r"""
import socket, threading
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000))
s.listen(16)
def drain(c):
    while c.recv(1 << 20):
        pass
    c.close()
while True:
    c, _ = s.accept()
    threading.Thread(target=drain, args=(c,), daemon=True).start()
"""

# One upload of N MiB to VIP:9000; prints its duration (until the sink has read it all).
UPLOADER = r"""
import socket, sys, time
n, buf = int(sys.argv[2]), b"x" * (1 << 20)
s = socket.create_connection((sys.argv[1], 9000), timeout=30)
t = time.monotonic()
for _ in range(n):
    s.sendall(buf)
s.shutdown(socket.SHUT_WR)
s.recv(1)
print(time.monotonic() - t)
"""


machine_idle = tcp_bench.machine_idle
machine_busy_s = tcp_bench.machine_busy_s


def lb_mac():
    out = nsexec("lb", "cat", "/sys/class/net/l0/address", capture_output=True)
    return out.stdout.decode().strip()


def build_ceiling(backend_mac):
    """The ceiling program for `backend_mac`, built with clang; None without clang."""
    if not (shutil.which("clang") and os.path.exists("/usr/include/bpf/bpf_helpers.h")):
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    obj = tempfile.mktemp(prefix="qb-ceiling-", suffix=".o")
    mac = ",".join(f"0x{b}" for b in backend_mac.split(":"))
    sh("clang", "-O2", "-target", "bpf", "-I/usr/include/x86_64-linux-gnu", f"-DBACKEND_MAC={mac}",
       "-c", os.path.join(here, "xdp_ceiling.bpf.c"), "-o", obj)
    return obj


def paths(a, quill, backends, spawn, kill):
    """Upload MB/s and UDP forwarding rate, with the machine's CPU, for each forwarding path."""
    print(f"== forwarding paths: {a.upload_mb} MB upload to {VIP}:9000 and a {a.duration:.0f} s UDP blast "
          f"({a.senders} senders), {a.rounds} interleaved round(s)")
    if not shutil.which("ethtool"):
        print("  paths: SKIPPED, ethtool is missing (apt-get install ethtool)")
        return
    sinks = [popen(be, sys.executable, "-c", SINK, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for be in ("be1", "be2")]
    # Native XDP_TX on a veth loses the checksum state of locally sent frames: the client
    # computes its checksums itself, for every variant alike.
    if not a.client_offload:
        nsexec("cli", "ethtool", "-K", "c0", "tx", "off", stdout=subprocess.DEVNULL)
    # The ceiling answers no ARP: the client knows the balancer's MAC for the VIP.
    ip("cli", "neigh", "replace", VIP, "lladdr", lb_mac(), "dev", "c0", "nud", "permanent")
    be1_mac = nsexec("be1", "cat", "/sys/class/net/b0/address", capture_output=True).stdout.decode().strip()
    ceiling = build_ceiling(be1_mac)
    peer_pass = ceiling  # the same object's xdp_pass section

    def peer(on):
        if on:
            ip("sw", "link", "set", "dev", "p-lb", "xdpdrv", "obj", peer_pass, "sec", "xdp_pass")
        else:
            sh("ip", "-n", NS["sw"], "link", "set", "dev", "p-lb", "xdpdrv", "off", check=False)

    def balancer(args, env=None, native=False):
        def start(udp):
            peer(native)
            extra = ["-U"] if udp else []
            port = 9 if udp else 9000
            pid = spawn([*args[:1], "-f", *extra, *args[1:], f"{VIP}:{port}", *backends], env)
            time.sleep(1.0)  # the balancer resolves its backends (ARP, first tick)
            return pid

        def stop():
            kill()
            peer(False)
        return start, stop

    def xdp_prog(mode):
        def start(udp):
            peer(mode == "xdpdrv")
            ip("lb", "link", "set", "dev", "l0", mode, "obj", ceiling, "sec", "xdp")
            return 0

        def stop():
            sh("ip", "-n", NS["lb"], "link", "set", "dev", "l0", mode, "off", check=False)
            peer(False)
        return start, stop

    dsr = ["-r", "-O", "dsr_if l0"]
    variants = []
    if shutil.which("pen"):
        variants.append(("pen", *balancer(["pen", *dsr])))
    variants += [
        ("quill-packet", *balancer([quill, *dsr, "-O", "dsr_path packet"])),
        ("quill-xdp-generic", *balancer([quill, *dsr, "-O", "dsr_path xdp"], {"QUILL_XDP_MODE": "generic"})),
    ]
    if not a.client_offload:
        variants.append(("quill-xdp-native", *balancer([quill, *dsr, "-O", "dsr_path xdp"],
                                                       {"QUILL_XDP_MODE": "native"}, native=True)))
    if ceiling:
        variants.append(("ceiling-generic", *xdp_prog("xdpgeneric")))
        if not a.client_offload:
            variants.append(("ceiling-native", *xdp_prog("xdpdrv")))
    else:
        print("  ceiling: not measured (clang or libbpf-dev missing)")

    # Each measurement is steal-screened as bench/run's paced ones (tcp_bench.screened):
    # tried again once the hypervisor's spell is over; a run still disturbed is reported
    # with its steal and left out of the medians where undisturbed ones remain.
    def upload(name, start, stop):
        pid = start(False)
        if pid is None:
            return None
        try:
            out, before, after, steal = tcp_bench.screened(
                f"{name} upload", lambda: nsexec("cli", sys.executable, "-c", UPLOADER, VIP,
                                                 str(a.upload_mb), capture_output=True, check=False))
            if out.returncode != 0:
                return None
            secs = float(out.stdout)
            gb = a.upload_mb * (1 << 20) / 1e9
            return a.upload_mb * (1 << 20) / 1e6 / secs, machine_busy_s(before, after) / gb, steal
        finally:
            stop()

    def blast(name, start, stop):
        pid = start(True)
        if pid is None:
            return None
        try:
            def send():
                rx0 = stat("be1", "b0", "rx_packets") + stat("be2", "b0", "rx_packets")
                procs = [popen("cli", sys.executable, "-c", SENDER, str(a.duration), VIP,
                               stdout=subprocess.PIPE) for _ in range(a.senders)]
                for p in procs:
                    p.wait()
                return rx0
            rx0, before, after, steal = tcp_bench.screened(f"{name} blast", send)
            time.sleep(0.2)  # let queued frames drain before reading the counters
            fwd = stat("be1", "b0", "rx_packets") + stat("be2", "b0", "rx_packets") - rx0
            return fwd / a.duration, machine_busy_s(before, after) / max(fwd / 1e6, 1e-9), steal
        finally:
            stop()

    runs = {name: {"upload": [], "blast": []} for name, *_ in variants}
    try:
        for _ in range(a.rounds):
            for name, start, stop in variants:
                r = upload(name, start, stop)
                if r:
                    runs[name]["upload"].append(r)
                r = blast(name, start, stop)
                if r:
                    runs[name]["blast"].append(r)
    finally:
        for s in sinks:
            s.terminate()
        nsexec("cli", "ethtool", "-K", "c0", "tx", "on", stdout=subprocess.DEVNULL, check=False)
        ip("cli", "neigh", "del", VIP, "dev", "c0")
        if ceiling:
            os.unlink(ceiling)

    def med(name, what, i):
        done = runs.get(name, {}).get(what, [])
        clean = [r for r in done if not r[2].get("disturbed")] or done
        xs = [r[i] for r in clean]
        return median(xs) if xs else None

    print(f"  {'path':18} {'upload MB/s':>11} {'machine s/GB':>12} {'blast fwd pps':>14} {'machine s/Mpkt':>14}   "
          "(rounds: MB/s; pps; * = disturbed by steal, left out of the medians)")
    for name, *_ in variants:
        u, c, f, m = (med(name, "upload", 0), med(name, "upload", 1), med(name, "blast", 0), med(name, "blast", 1))
        fmt = lambda x, spec: format(x, spec) if x is not None else "-"
        mark = lambda r: "*" if r[2].get("disturbed") else ""
        spread = "; ".join([", ".join(f"{r[0]:.0f}{mark(r)}" for r in runs[name]["upload"]),
                            ", ".join(f"{r[0]:,.0f}{mark(r)}" for r in runs[name]["blast"])])
        print(f"  {name:18} {fmt(u, '11.1f')} {fmt(c, '12.2f')} {fmt(f, '14,.0f')} {fmt(m, '14.2f')}   ({spread})")

    def ratio(x, y, what, i):
        a_, b_ = med(x, what, i), med(y, what, i)
        return a_ / b_ if a_ and b_ else None

    for best in ("quill-xdp-native", "quill-xdp-generic"):
        for other, what, i, label in (("pen", "upload", 0, "upload MB/s"), ("pen", "upload", 1, "machine CPU per GB"),
                                      ("quill-packet", "upload", 0, "upload MB/s"),
                                      (best.replace("quill-xdp", "ceiling"), "blast", 0, "forwarded pps")):
            r = ratio(best, other, what, i)
            if r is not None:
                print(f"  {best} / {other}: {r:.2f}x {label}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs (3 s each)")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4, help="concurrent curl loops (download)")
    ap.add_argument("--only", choices=("pps", "download", "paths"), help="run one scenario")
    ap.add_argument("--upload-mb", type=int, default=300, help="upload size (paths)")
    ap.add_argument("--client-offload", action="store_true",
                    help="paths: keep the client's checksum offload and TSO (64 KiB frames) on; "
                         "native XDP is then not measured (it breaks those frames' checksums on a veth)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (download)")
    ap.add_argument("--perf", action="store_true",
                    help="also record DSR and proxy downloads with perf and split their CPU")
    ap.add_argument("--quill-bin", default=None)
    ap.add_argument("--no-build", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.duration = 3.0
    if os.geteuid() != 0:
        sys.exit("bench/dsr: needs root (network namespaces)")
    for tool in ("ip", "curl"):
        if not shutil.which(tool):
            sys.exit(f"bench/dsr: {tool} is missing")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    quill = a.quill_bin or os.path.join(root, "target", "release", "quill")
    if not a.quill_bin and not a.no_build:
        sh("cargo", "build", "--release", "-p", "quill", cwd=root)
    www = tempfile.mkdtemp(prefix="qb-www-")
    with open(os.path.join(www, "big"), "wb") as f:
        f.write(b"x" * (1 << 20))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    servers = []
    try:
        servers = topo_up(www)
        results = {}

        def spawn(args, env=None):
            p = popen("lb", *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                      env=dict(os.environ, **(env or {})))
            holder["p"] = p
            time.sleep(0.3)
            return p.pid if p.poll() is None else None

        def kill():
            p = holder.get("p")
            if p:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
            holder.clear()

        holder = {}
        backends = ["10.77.0.11", "10.77.0.12"]
        if a.only not in ("download", "paths"):
            print(f"== forwarding rate: UDP to {VIP}:9, {a.senders} sender(s), {a.duration:.0f} s")
            results["quill"] = run_pps("quill", lambda: spawn([quill, "-f", "-U", "-r", "-O", "dsr_if l0", f"{VIP}:9", *backends]),
                                       kill, a.duration, a.senders)
            # The same quill sending one frame per send(), reading from a TPACKET_V3 ring, and
            # reading one frame per recv().
            for variant, env in (("quill-single", {"QUILL_DSR_TX": "single"}),
                                 ("quill-v3", {"QUILL_DSR_RING": "v3"}),
                                 ("quill-recv", {"QUILL_DSR_RING": "off"})):
                results[variant] = run_pps(variant, lambda: spawn([quill, "-f", "-U", "-r", "-O", "dsr_if l0", f"{VIP}:9", *backends],
                                                                  env=env),
                                           kill, a.duration, a.senders)
            if shutil.which("pen"):
                results["pen"] = run_pps("pen", lambda: spawn(["pen", "-f", "-U", "-r", "-O", "dsr_if l0", f"{VIP}:9", *backends]),
                                         kill, a.duration, a.senders)
            if os.path.exists("/proc/net/ip_vs") and shutil.which("ipvsadm"):
                def ipvs_up():
                    ip("lb", "addr", "add", f"{VIP}/32", "dev", "l0")
                    nsexec("lb", "ipvsadm", "-A", "-u", f"{VIP}:9", "-s", "rr")
                    for b in backends:
                        nsexec("lb", "ipvsadm", "-a", "-u", f"{VIP}:9", "-r", b, "-g")
                    return 0

                def ipvs_down():
                    nsexec("lb", "ipvsadm", "-C", check=False)
                    ip("lb", "addr", "del", f"{VIP}/32", "dev", "l0")
                results["ipvs"] = run_pps("ipvs", ipvs_up, ipvs_down, a.duration, a.senders)
            else:
                print("  ipvs: not measured (this kernel has no IPVS: /proc/net/ip_vs is missing, or ipvsadm is not installed)")
            for name, r in results.items():
                if r is None:
                    print(f"  {name:10} did not forward (not supported by this build, or failed to start)")
                    continue
                sent, fwd, cpu = r
                cpu_note = f", {fwd / cpu:,.0f} packets per balancer CPU second" if cpu > 0 else ""
                print(f"  {name:10} sent {sent / a.duration:>10,.0f} pps  forwarded {fwd / a.duration:>10,.0f} pps"
                      f" ({100.0 * fwd / max(sent, 1):5.1f} %){cpu_note}")
            for other in ("quill-single", "quill-v3", "quill-recv"):
                if results.get("quill") and results.get(other):
                    print(f"  quill (V2 ring, sendmmsg) / {other}: {results['quill'][1] / max(results[other][1], 1):.2f} x forwarding rate, "
                          f"{(results['quill'][1] / max(results['quill'][2], 1e-9)) / (results[other][1] / max(results[other][2], 1e-9)):.2f} x per CPU second")
            if results.get("quill") and results.get("ipvs"):
                print(f"  quill / ipvs forwarding rate: {results['quill'][1] / max(results['ipvs'][1], 1):.2f}")

        if a.only not in ("pps", "paths"):
            download(a, quill, backends, spawn, kill)
        if a.only in (None, "paths"):
            paths(a, quill, backends, spawn, kill)
        print("NOTE: shared 2-core machine with other jobs running; read the ratios, not the absolute figures.")
    finally:
        for s in servers:
            s.terminate()
        topo_down()
        shutil.rmtree(www, ignore_errors=True)


if __name__ == "__main__":
    main()
