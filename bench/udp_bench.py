#!/usr/bin/env python3
"""Comparative UDP (DNS) load-balancer benchmark: quill -U vs pen -U vs dnsdist (vs NGINX's
stream module) vs the backend alone.  Python 3.11, standard library only.  See bench/README.md ("UDP").

Layout of one benchmark:
  * one backend: NSD (server-count 1, response-rate limiting off) answering
    `www.example A` from a generated zone, pinned to core 1;
  * each balancer in turn on its own loopback port, pinned to core 0, started fresh for
    every measurement (with --held: once per scenario, kept through its rounds) and
    checked with one real DNS query (deadline, no fixed sleeps);
  * dnsperf pinned to core 1: `dnsperf -c 10 -l D` (dnsperf's default of 100 queries
    in flight); with --fresh-ports the paced scenarios use `quill-loadgen dns` instead
    (bench/loadgen: a new socket, so a new source port and a new flow, for every query,
    as real resolvers send them; ten senders, one query in flight each);
  * every process of the benchmark runs at nice -20, and so does its session's autogroup,
    so that a background job on a shared 2-core box (a compiler, a test suite) does not
    decide the figures; foreign CPU on each core is still measured and flagged;
  * rounds are interleaved (quill, pen, dnsdist, backend, quill, ...); medians, ratios.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from procs import raise_autogroup
import tcp_bench  # noqa: E402  (STEAL_LIMIT)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

ALL = ("quill", "pen", "dnsdist", "backend", "quill-nopoll", "quill-pbs", "quill-base",
       "quill-offload", "quill-responses", "quill-placed", "nginx")
# Measured only when named in --only: quill with busy polling off (QUILL_BUSY_POLL=off),
# quill polling 30 µs after each piece of work before it sleeps (`poll_before_sleep 30`),
# another quill binary (`--base-bin`) for an A/B of two builds in one run, quill
# handing answered flows to its kernel path (`udp_offload lo`; needs root), quill ending
# a flow once it has one answer per query (`udp_responses 1`), both (`quill-placed`: the
# kernel path then also places new flows itself), and NGINX's stream module
# (`proxy_responses 1`), an anchor.
OPTIONAL = ("quill-nopoll", "quill-pbs", "quill-base", "quill-offload", "quill-responses",
            "quill-placed", "nginx")
QUILLS = ("quill", "quill-nopoll", "quill-pbs", "quill-base", "quill-offload", "quill-responses",
          "quill-placed")
# The -O control commands that make each quill variant.
QUILL_COMMANDS = {"quill-pbs": ["poll_before_sleep 30"], "quill-offload": ["udp_offload lo"],
                  "quill-responses": ["udp_responses 1"],
                  "quill-placed": ["udp_offload lo", "udp_responses 1"]}
ANCHORS = ("pen", "dnsdist", "nginx")
BALANCER_CORE = "0"
LOAD_CORE = "1"  # dnsperf (or quill-loadgen) and nsd
CLIENTS = 10
NICE = ["nice", "-n", "-20"]
READY_TIMEOUT_S = 10.0
INTERFERENCE_FRAC = 0.10
CLK_TCK = os.sysconf("SC_CLK_TCK")
ENV = dict(os.environ)
ENV["PATH"] = ENV.get("PATH", "/usr/bin:/bin") + ":/usr/local/sbin:/usr/sbin:/sbin"
ENV["LC_ALL"] = "C"
TOOLS = {"dnsperf": "dnsperf", "nsd": "nsd", "dnsdist": "dnsdist", "pen": "pen",
         "taskset": "util-linux", "dig": "dnsutils", "nginx": "nginx-light"}
LOADGEN_DIR = BENCH_DIR / "loadgen"
# quill-loadgen dns: seconds to wait for each answer before it counts as lost.
FRESH_TIMEOUT_S = 1

ZONE = """$ORIGIN example.
$TTL 300
@ IN SOA ns.example. admin.example. 1 3600 600 86400 300
@ IN NS ns.example.
ns IN A 127.0.0.1
www IN A 192.0.2.1
"""


def log(msg: str = "") -> None:
    print(msg, flush=True)


def which(cmd: str) -> str | None:
    return shutil.which(cmd, path=ENV["PATH"])


def run_capture(argv: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout, check=False)
        return p.returncode, p.stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)


class Procs:
    """Every process started lives in its own session; stopped by its own id only."""

    def __init__(self) -> None:
        self.live: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as f:
            p = subprocess.Popen(argv, env=ENV, stdin=subprocess.DEVNULL, stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        self.live[p.pid] = p
        raise_autogroup(p.pid)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.live.pop(p.pid, None)

    def stop_all(self) -> None:
        for p in list(self.live.values())[::-1]:
            self.stop(p)


def ticks(pid: int) -> int:
    """utime+stime of a process (all its threads), in clock ticks."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    except (OSError, IndexError, ValueError):
        return 0


def core_busy() -> dict[str, int]:
    """Ticks each core spent running processes (user, nice, system) from /proc/stat.
    Interrupt and softirq time are left out: on loopback that is the packet processing of
    the benchmark's own traffic, which no process is charged for."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            f = line.split()
            v = [int(x) for x in f[1:]]
            out[f[0][3:]] = v[0] + v[1] + v[2]
    return out


def core_times() -> dict[str, list[int]]:
    """Per-core tick counters from /proc/stat (user nice system idle iowait irq softirq steal)."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            f = line.split()
            out[f[0][3:]] = [int(x) for x in f[1:9]]
    return out


def core_load(t0: dict[str, list[int]], t1: dict[str, list[int]], wall: float) -> dict[str, float]:
    """Fraction of each core's time not idle over `wall` seconds (softirq included: on
    loopback it is the packet delivery of the benchmark's own traffic). A core near 1.0
    limits the run. Wall time minus idle, not the sum of the busy fields: those are
    sampled by the scheduler tick, which a tickless kernel stops on an idle core, so the
    short bursts of a paced load were mostly not counted (a balancer whose own runtime
    said 23 % of core 0 showed as 1 %). Idle time is measured exactly."""
    out = {}
    for c in t1:
        d = [b - a for a, b in zip(t0.get(c, t1[c]), t1[c])]
        out[c] = min(1.0, max(0.0, 1.0 - (d[3] + d[4]) / (wall * CLK_TCK))) if wall > 0 else 0.0
    return out


def free_port() -> int:
    """A UDP port free on 127.0.0.1 and outside the ephemeral range."""
    lo, hi = 20000, 32000
    for _ in range(200):
        port = random.randint(lo, hi)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.bind(("127.0.0.1", port))
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


def dns_query(qid: int) -> bytes:
    q = struct.pack(">HHHHHH", qid, 0x0100, 1, 0, 0, 0)
    for label in ("www", "example"):
        q += bytes([len(label)]) + label.encode()
    return q + b"\x00\x00\x01\x00\x01"


def answers(port: int, deadline: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    """Polls with real queries until one is answered (NOERROR, one answer) or deadline,
    or until `proc`, the process that should answer, has exited."""
    qid = random.randint(1, 65535)
    while time.monotonic() < deadline and (proc is None or proc.poll() is None):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(0.2)
            try:
                s.sendto(dns_query(qid), ("127.0.0.1", port))
                data, _ = s.recvfrom(4096)
                if data[:2] == struct.pack(">H", qid) and data[3] & 0x0F == 0 and data[6:8] != b"\0\0":
                    return True
            except OSError:
                pass
        time.sleep(0.05)  # poll interval of a condition with a deadline
    return False


def loadgen_bin() -> Path:
    """Where cargo puts quill-loadgen (CARGO_TARGET_DIR honoured, relative to the crate)."""
    return LOADGEN_DIR / os.environ.get("CARGO_TARGET_DIR", "target") / "release" / "quill-loadgen"


def ensure_tools(need: set[str]) -> None:
    missing = [TOOLS[t] for t in sorted(need) if not which(t)]
    if "nginx" in need and not tcp_bench.NGINX_STREAM_MODULE.exists():
        missing.append("libnginx-mod-stream")
    if missing:
        log(f"== installing: {' '.join(missing)}")
        run_capture(["apt-get", "update", "-qq"], timeout=600)
        rc, out = run_capture(["apt-get", "install", "-y", "-qq", *missing], timeout=900)
        if rc != 0:
            raise SystemExit(f"apt-get install failed:\n{out[-2000:]}")
    # Debian starts the packaged services; the benchmark runs its own.
    for svc in ("nsd", "dnsdist", "pen"):
        run_capture(["systemctl", "stop", svc], timeout=30)


def parse_dnsperf(out: str) -> dict[str, float]:
    def num(pattern: str) -> float:
        m = re.search(pattern, out)
        return float(m.group(1)) if m else float("nan")
    return {
        "qps": num(r"Queries per second:\s+([\d.]+)"),
        "sent": num(r"Queries sent:\s+(\d+)"),
        "completed": num(r"Queries completed:\s+(\d+)"),
        "lost": num(r"Queries lost:\s+(\d+)"),
        "latency_s": num(r"Average Latency \(s\):\s+([\d.]+)"),
    }


def parse_loadgen(rc: int, out: str) -> dict[str, Any]:
    """The figures of `quill-loadgen dns` under dnsperf's names (qps, completed, lost,
    latency_s: the mean), with its percentiles, errors and late sends besides."""
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        raise RuntimeError(f"quill-loadgen dns failed (exit {rc}): {out[-500:]}")
    j = json.loads(lines[-1])
    return {"qps": j["achieved_rate"], "sent": j["sent"], "completed": j["ok"], "lost": j["lost"],
            "errors": j["errors"], "late_sends": j["late_sends"], "latency_s": j["mean_us"] / 1e6,
            **{k: j[k] for k in ("p50_us", "p90_us", "p99_us", "p999_us", "max_us")}}


def nginx_conf(work: Path, port: int, backend: str) -> Path:
    """NGINX's stream module as a UDP balancer: one process (no master), each session
    ended by the answer to its one query, as a DNS proxy should."""
    conf = work / f"nginx-{port}.conf"
    conf.write_text(f"""# generated by bench/udp_bench.py
load_module {tcp_bench.NGINX_STREAM_MODULE};
worker_processes 1;
master_process off;
daemon off;
worker_rlimit_nofile 20000;
pid {work}/nginx-{port}.pid;
error_log stderr warn;
events {{
    worker_connections 8192;
}}
stream {{
    upstream dns {{
        server {backend};
    }}
    server {{
        listen 127.0.0.1:{port} udp reuseport;
        proxy_pass dns;
        proxy_responses 1;
        proxy_timeout 5s;
    }}
}}
""")
    return conf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of 3 s runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=10, help="seconds per dnsperf run")
    ap.add_argument("--only", default=",".join(b for b in ALL if b not in OPTIONAL))
    ap.add_argument("--paced", default="",
                    help="comma list of query rates (dnsperf -Q): the efficiency yardstick, machine CPU "
                         "per query over the backend alone at each rate (e.g. 5000,20000)")
    ap.add_argument("--efficiency", action="store_true",
                    help="only the paced scenarios (default rates 5000,20000 unless --paced)")
    ap.add_argument("--fresh-ports", action="store_true",
                    help="load the paced scenarios with `quill-loadgen dns` instead of dnsperf: a new "
                         "source port (a new flow) for every query, as real resolvers send them "
                         "(scenarios paced-fresh-RATE; default rates 5000,20000 unless --paced)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="seconds of the same rate before each paced measurement, unmeasured "
                         "(default 3, --quick: 1; 0: none)")
    ap.add_argument("--quill-bin")
    ap.add_argument("--base-bin",
                    help="the binary of the quill-base variant (another build), for an A/B in one "
                         "run; measured when --only names quill-base")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--held", action="store_true",
                    help="start each balancer once per scenario and keep it through all its rounds "
                         "(as bench/run --held: many short rounds spread the host's spells of steal "
                         "over every balancer alike)")
    ap.add_argument("--all-cores", action="store_true",
                    help="also run every balancer unpinned (all cores, default threads)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.duration = 1, 3
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    only = [b for b in ALL if b in args.only.split(",")]
    paced = [int(x) for x in args.paced.split(",") if x.strip()]
    if (args.efficiency or args.fresh_ports) and not paced:
        paced = [5000, 20000]

    ensure_tools({"dnsperf", "nsd", "taskset"} | ({"pen", "dnsdist", "nginx"} & set(only)))
    quill_bin = Path(args.quill_bin) if args.quill_bin else REPO_ROOT / "target" / "release" / "quill"
    if "quill-base" in only and not args.base_bin:
        raise SystemExit("--only names quill-base: give its binary with --base-bin")
    if args.fresh_ports:
        if not args.no_build:
            reason = tcp_bench.cargo_build("the load generator", LOADGEN_DIR, [])
            if reason:
                raise SystemExit(reason)
        if not loadgen_bin().is_file():
            raise SystemExit(f"load generator missing: {loadgen_bin()} (run without --no-build)")
    if (set(QUILLS) - {"quill-base"}) & set(only) and not args.quill_bin and not args.no_build:
        log("== cargo build --release -p quill")
        rc, out = run_capture(["cargo", "build", "--release", "-p", "quill"], timeout=1800)
        if rc != 0:
            raise SystemExit(out[-3000:])
        target = os.environ.get("CARGO_TARGET_DIR")
        if target:
            quill_bin = Path(target) / "release" / "quill"

    raise_autogroup("self")  # dnsperf runs in our own session
    work = Path(tempfile.mkdtemp(prefix="quill-udp-bench-"))
    procs = Procs()

    def on_signal(signum: int, _frame: Any) -> None:
        procs.stop_all()
        raise SystemExit(130)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    results: list[dict[str, Any]] = []
    try:
        backend_port = free_port()
        (work / "example.zone").write_text(ZONE)
        (work / "nsd.conf").write_text(f"""server:
    ip-address: 127.0.0.1@{backend_port}
    server-count: 1
    username: ""
    chroot: ""
    zonesdir: "{work}"
    database: ""
    zonelistfile: "{work}/zone.list"
    pidfile: "{work}/nsd.pid"
    xfrdfile: "{work}/xfrd.state"
    xfrdir: "{work}"
    logfile: "{work}/nsd.log"
    verbosity: 0
    do-ip6: no
    rrl-ratelimit: 0
    rrl-whitelist-ratelimit: 0
remote-control:
    control-enable: no
zone:
    name: example.
    zonefile: example.zone
""")
        (work / "queries.txt").write_text("www.example A\n" * 100)
        nsd = procs.start([*NICE, "taskset", "-c", LOAD_CORE, "nsd", "-d", "-c", str(work / "nsd.conf")],
                          work / "nsd.out")
        if not answers(backend_port, time.monotonic() + READY_TIMEOUT_S):
            raise SystemExit(f"nsd did not answer on {backend_port}:\n{(work / 'nsd.out').read_text()}")

        # (name, balancer cores, load cores, dnsperf -Q rate or None for as fast as it can)
        scenarios: list[tuple[str, str, str, int | None]] = []
        if not args.efficiency:
            scenarios.append(("one-core", BALANCER_CORE, LOAD_CORE, None))
        paced_name = "paced-fresh" if args.fresh_ports else "paced"
        scenarios += [(f"{paced_name}-{q}", BALANCER_CORE, LOAD_CORE, q) for q in paced]
        if args.all_cores:
            scenarios.append(("all-cores", "0,1", "0,1", None))

        def command(name: str, port: int, cores: str) -> list[str] | None:
            pin = [*NICE, "taskset", "-c", cores]
            be = f"127.0.0.1:{backend_port}"
            if name in QUILLS:
                env = ["env", "QUILL_BUSY_POLL=off"] if name == "quill-nopoll" else []
                extra = [a for c in QUILL_COMMANDS.get(name, []) for a in ("-O", c)]
                binary = args.base_bin if name == "quill-base" else str(quill_bin)
                return [*env, *pin, binary, "-f", "-U", *extra, "-r", f"127.0.0.1:{port}", be]
            if name == "pen":
                return [*pin, "pen", "-f", "-U", "-r", f"127.0.0.1:{port}", be]
            if name == "dnsdist":
                conf = work / f"dnsdist-{port}.conf"
                conf.write_text(f"setLocal('127.0.0.1:{port}')\n"
                                f"newServer({{address='{be}'}})\n"
                                "setSecurityPollSuffix('')\n")
                return [*pin, "dnsdist", "--supervised", "--disable-syslog", "-C", str(conf)]
            if name == "nginx":
                return [*pin, "nginx", "-c", str(nginx_conf(work, port, be)), "-p", f"{work}/", "-e", "stderr"]
            return None

        def load(port: int, rate: int | None, seconds: int, cores: str) -> list[str]:
            """The load of one run: dnsperf, or with --fresh-ports at a paced rate
            quill-loadgen dns (a new source port per query)."""
            pin = [*NICE, "taskset", "-c", cores]
            if rate and args.fresh_ports:
                return [*pin, str(loadgen_bin()), "dns", "--addr", f"127.0.0.1:{port}", "--rate", str(rate),
                        "--connections", str(CLIENTS), "--duration", str(seconds), "--warmup", "0",
                        "--name", "www.example.", "--timeout", str(FRESH_TIMEOUT_S)]
            return [*pin, "dnsperf", "-s", "127.0.0.1", "-p", str(port), "-d", str(work / "queries.txt"),
                    "-c", str(CLIENTS), "-l", str(seconds), *(["-Q", str(rate)] if rate else [])]

        for scenario, bal_cores, load_cores, rate in scenarios:
            # --held: the balancers started for this scenario (process, port).
            held = tcp_bench.Held(procs.stop)
            for rnd in range(1, args.rounds + 1):
                # Each round starts one balancer further along (see tcp_bench.in_turn).
                shift = (rnd - 1) % max(len(only), 1)
                for name in only[shift:] + only[:shift]:
                    kept = held.get(name)
                    port = backend_port if name == "backend" else (kept[1] if kept else free_port())
                    argv = command(name, port, bal_cores)
                    rec: dict[str, Any] = {"scenario": scenario, "round": rnd, "balancer": name,
                                           "command": argv}
                    if args.held:
                        rec["held"] = True
                    p = None
                    try:
                        if kept is not None:
                            p = kept[0]
                        elif argv is not None:
                            p = procs.start(argv, work / f"{name}.out")
                            if args.held:
                                held.keep(name, p, port)
                            if not answers(port, time.monotonic() + READY_TIMEOUT_S, p):
                                exited = p.poll()
                                raise RuntimeError("did not answer a query" + (
                                    f" (exited with code {exited})" if exited is not None else ""))
                        fresh = bool(rate and args.fresh_ports)
                        perf = load(port, rate, args.duration, load_cores)
                        rec["loadgen" if fresh else "dnsperf"] = perf
                        if rate and args.warmup > 0:
                            # The same rate first, unmeasured: a steady state (a quill event
                            # loop's trial of busy polling over) is what the figure describes.
                            run_capture(load(port, rate, args.warmup, load_cores), timeout=args.warmup + 60)
                        if p is not None:
                            rec["pid"] = p.pid
                        own = [nsd.pid] + ([p.pid] if p else [])
                        t0 = {pid: ticks(pid) for pid in own}
                        c0 = core_busy()
                        l0 = core_times()
                        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                        w0 = time.monotonic()
                        rc, out = run_capture(perf, timeout=args.duration + 60)
                        wall = time.monotonic() - w0
                        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                        c1 = core_busy()
                        l1 = core_times()
                        rec["core_load"] = core_load(l0, l1, wall)
                        # The hypervisor's steal counts as busy in the machine figure below
                        # (tcp_bench.STEAL_LIMIT): a disturbed run is left out of its median,
                        # not repeated (dnsperf runs are in a loop of their own here).
                        stolen = sum(l1[c][7] - l0.get(c, l1[c])[7] for c in l1) / CLK_TCK
                        rec["steal_share"] = round(stolen / (wall * len(l1)), 4) if wall > 0 else 0.0
                        if rec["steal_share"] > tcp_bench.STEAL_LIMIT:
                            rec["disturbed"] = True
                        t1 = {pid: ticks(pid) for pid in own}
                        if fresh:
                            rec["loadgen_rc"] = rc
                            rec.update(parse_loadgen(rc, out))
                        else:
                            rec.update(parse_dnsperf(out))
                            rec["dnsperf_rc"] = rc
                        if p is not None:
                            rec["balancer_cpu_s"] = (t1[p.pid] - t0[p.pid]) / CLK_TCK
                            rec["cpu_us_per_query"] = (rec["balancer_cpu_s"] * 1e6 / rec["completed"]
                                                       if rec["completed"] else None)
                        # The load tool's own CPU (dnsperf or quill-loadgen, our child).
                        load_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
                        ours = sum(t1[x] - t0[x] for x in own) / CLK_TCK + load_cpu
                        busy = sum(c1[c] - c0[c] for c in c1) / CLK_TCK
                        # CPU used on the two cores by anything but nsd, the load and the
                        # balancer (approximate: softirq work is charged to whoever runs).
                        rec["foreign_frac"] = max(0.0, busy - ours) / (wall * len(c1))
                        rec["busy_cpu_s"] = busy
                        # The whole machine's busy time, softirq included (the efficiency
                        # yardstick: what a query costs every core, wake-ups included).
                        loads = rec["core_load"]
                        rec["machine_us_per_query"] = (sum(loads.values()) * wall * 1e6 / rec["completed"]
                                                       if rec["completed"] else None)
                        rec["our_cpu_s"] = ours
                        rec["raw"] = out[-1500:]
                    except Exception as e:  # noqa: BLE001 - a balancer failure is a result
                        rec["error"] = str(e)
                        out_file = work / f"{name}.out"
                        rec["log_tail"] = out_file.read_text()[-1500:] if out_file.exists() else ""
                    finally:
                        # A held balancer is kept for the next round unless it failed.
                        if p is not None and (not args.held or "error" in rec):
                            held.forget(name)
                            procs.stop(p)
                    results.append(rec)
                    if "error" in rec:
                        log(f"[{scenario} r{rnd}] {name:8} FAILED: {rec['error']}")
                    else:
                        cpu = rec.get("cpu_us_per_query")
                        log(f"[{scenario} r{rnd}] {name:8} {rec['qps']:>10.0f} q/s  lost {rec['lost']:.0f}"
                            + (f"  errors {rec['errors']}" if rec.get("errors") else "")
                            + f"  latency {rec['latency_s'] * 1e3:.2f} ms"
                            + (f" (p99 {rec['p99_us'] / 1e3:.2f} ms)" if "p99_us" in rec else "")
                            + (f"  CPU {cpu:.2f} us/q" if cpu else "")
                            + "  cores busy " + "/".join(f"{100 * v:.0f}%" for v in rec["core_load"].values())
                            + (f"  [foreign CPU {100 * rec['foreign_frac']:.0f}%: noisy]"
                               if rec["foreign_frac"] > INTERFERENCE_FRAC else "")
                            + f"  steal {rec['steal_share']:.1%}"
                            + (" DISTURBED" if rec.get("disturbed") else ""))
            held.release()
    finally:
        procs.stop_all()

    summary = report(results, only)
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
    meta = machine_info(quill_bin)
    path = RESULTS_DIR / f"udp-{stamp}.json"
    path.write_text(json.dumps({"kind": "udp", "args": vars(args), "machine": meta, "runs": results,
                                "summary": summary}, indent=2, default=str))
    log(f"\nresults: {path.relative_to(REPO_ROOT)}")
    shutil.rmtree(work, ignore_errors=True)
    return 3 if any("error" in r for r in results) else 0


def report(results: list[dict[str, Any]], only: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for scenario in sorted({r["scenario"] for r in results}, reverse=True):
        fresh = scenario.startswith("paced-fresh-")
        tool = "quill-loadgen" if fresh else "dnsperf"
        log(f"\n== {scenario}: " + (f"quill-loadgen dns, {CLIENTS} senders, a new source port per query"
                                     if fresh else f"dnsperf -c {CLIENTS} (100 queries in flight)")
            + ", medians over rounds")
        log(f"{'balancer':9} {'median q/s':>11} {'min-max q/s':>19} {'lost':>6} {'CPU us/q':>9} {'% backend':>9}"
            f"  (cores busy: core {BALANCER_CORE} = balancer, core {LOAD_CORE} = {tool} + NSD)")
        med: dict[str, float] = {}
        rows: dict[str, Any] = {}
        for name in only:
            ok = [r for r in results if r["scenario"] == scenario and r["balancer"] == name and "error" not in r]
            if not ok:
                log(f"{name:9} {'FAILED':>11}")
                continue
            q = [r["qps"] for r in ok]
            cpu = [r["cpu_us_per_query"] for r in ok if r.get("cpu_us_per_query")]
            med[name] = statistics.median(q)
            noisy = sum(1 for r in ok if r.get("foreign_frac", 0) > INTERFERENCE_FRAC)
            rows[name] = {"median_qps": med[name], "min_qps": min(q), "max_qps": max(q), "noisy_runs": noisy,
                          "lost": sum(r["lost"] for r in ok),
                          "errors": sum(r.get("errors", 0) for r in ok),
                          "cpu_us_per_query": statistics.median(cpu) if cpu else None,
                          "core_load": {c: statistics.median(r["core_load"][c] for r in ok)
                                        for c in ok[0].get("core_load", {})}}
        for name, row in rows.items():
            pct = 100 * row["median_qps"] / med["backend"] if "backend" in med else float("nan")
            cpu = f"{row['cpu_us_per_query']:.2f}" if row["cpu_us_per_query"] else "-"
            log(f"{name:9} {row['median_qps']:>11.0f} {row['min_qps']:>9.0f}-{row['max_qps']:<9.0f} "
                f"{row['lost']:>6.0f} {cpu:>9} {pct:>8.0f}%"
                + "  cores busy " + "/".join(f"{100 * v:.0f}%" for v in row["core_load"].values())
                + (f"  ({row['noisy_runs']} noisy run(s))" if row["noisy_runs"] else "")
                + (f"  ({row['errors']} errors)" if row["errors"] else ""))
        if scenario.startswith("paced-"):
            machine = {}
            for name in rows:
                measured = [r for r in results if r["scenario"] == scenario
                            and r["balancer"] == name and r.get("machine_us_per_query")]
                xs = [r["machine_us_per_query"] for r in
                      ([r for r in measured if not r.get("disturbed")] or measured)]
                if xs:
                    machine[name] = statistics.median(xs)
                    rows[name]["machine_us_per_query"] = machine[name]
            base = machine.get("backend")
            if base is not None:
                log("machine CPU per query over the backend alone (lower is better): " + "  ".join(
                    f"{n} {machine[n] - base:.2f} us" for n in machine if n != "backend"))
                for n in machine:
                    rows[n]["overhead_us_per_query"] = machine[n] - base
                for quill in ("quill", "quill-offload", "quill-responses", "quill-placed"):
                    q = rows.get(quill, {}).get("overhead_us_per_query")
                    for a in ANCHORS:
                        o = rows.get(a, {}).get("overhead_us_per_query")
                        if q is not None and o:
                            log(f"  overhead {quill}/{a}: {q / o:.2f}x")
        ratios = {f"quill/{a}": med["quill"] / med[a] for a in (*ANCHORS, "backend") if "quill" in med and a in med}
        if ratios:
            log("throughput ratios: " + "  ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        cpu_ratios = {f"quill/{a}": rows["quill"]["cpu_us_per_query"] / rows[a]["cpu_us_per_query"]
                      for a in ANCHORS if "quill" in rows and a in rows
                      and rows["quill"]["cpu_us_per_query"] and rows[a]["cpu_us_per_query"]}
        if cpu_ratios:
            log("CPU-per-query ratios (lower is better for quill): "
                + "  ".join(f"{k} {v:.2f}x" for k, v in cpu_ratios.items()))
        summary[scenario] = {"rows": rows, "ratios": ratios, "cpu_ratios": cpu_ratios}
    return summary


def machine_info(quill_bin: Path) -> dict[str, Any]:
    def out(argv: list[str]) -> str:
        return run_capture(argv, timeout=10)[1].strip().splitlines()[0:1][0] if which(argv[0]) else ""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "uname": os.uname().release,
        "loadavg": Path("/proc/loadavg").read_text().strip(),
        "dnsperf": out(["dnsperf", "-h"]) if which("dnsperf") else "",
        "versions": run_capture(["dpkg-query", "-W", "pen", "dnsdist", "nsd", "dnsperf", "nginx",
                                 "libnginx-mod-stream"])[1].strip(),
        "git": run_capture(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"])[1].strip(),
        "dirty": bool(run_capture(["git", "-C", str(REPO_ROOT), "status", "--porcelain"])[1].strip()),
    }
    if loadgen_bin().exists():
        info["loadgen_sha256"] = hashlib.sha256(loadgen_bin().read_bytes()).hexdigest()
    if quill_bin.exists():
        info["quill_bin"] = str(quill_bin)
        info["quill_sha256"] = hashlib.sha256(quill_bin.read_bytes()).hexdigest()
    return info


if __name__ == "__main__":
    sys.exit(main())
