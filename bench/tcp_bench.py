#!/usr/bin/env python3
"""Comparative TCP load-balancer benchmark: quill vs Pen vs HAProxy vs NGINX (stream)
vs the backend alone.  Python 3.11, standard library only.  See bench/README.md.

Layout of one benchmark:
  * one backend: nginx (worker_processes 1) serving a 1 KiB file at /1k and a 1 MiB file
    at /1m, pinned to core 1 (config generated in a temp dir);
  * each balancer in turn on its own loopback port, pinned to core 0 ("one-core" layout)
    or free to use both cores ("all-cores" layout), started fresh for every measurement,
    waited for (connect poll with a deadline) and verified with one request that must
    return the exact 1 KiB body;
  * the load on core 1: wrk (throughput scenarios) or quill-loadgen (bench/loadgen:
    constant-rate latency, fixed-count requests for the system-call count, idle connections);
  * rounds are interleaved (A B C D A B C D ...), medians and spreads are reported, with
    the ratio quill / each anchor.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import html
import http.client
import json
import os
import random
import resource
import re
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from procs import (proc_tree, proc_tree_ticks, raise_autogroup, settled_fds, tree_fds,
                   tree_rss_bytes)

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
LOADGEN_DIR = BENCH_DIR / "loadgen"

ALL_BALANCERS = ("quill", "pen", "haproxy", "nginx", "backend", "quill-nopoll", "quill-poll",
                 "quill-defer", "quill-pbs", "quill-base")
# Measured only when named in --only: quill with busy polling off (QUILL_BUSY_POLL=off) and
# quill polling whenever busy, without trying whether it pays (QUILL_BUSY_POLL=always): the
# A/B of what polling costs or saves, and of the default that tries both; quill-defer is
# the raw relay told that its clients speak first (`defer_accept 1`, off by default there);
# quill-pbs polls for 30 µs after each piece of work before it sleeps (`poll_before_sleep
# 30`, off by default: lower latency for more CPU); quill-base is another quill binary
# (`--base-bin`, maybe a script adding options), for an A/B of two builds in one run.
OPTIONAL_BALANCERS = ("quill-nopoll", "quill-poll", "quill-defer", "quill-pbs", "quill-base")
# The environment each quill variant runs with, and its own arguments.
QUILL_VARIANTS = {"quill": [], "quill-nopoll": ["env", "QUILL_BUSY_POLL=off"],
                  "quill-poll": ["env", "QUILL_BUSY_POLL=always"], "quill-defer": [], "quill-pbs": [],
                  "quill-base": []}
QUILL_VARIANT_ARGS = {"quill-defer": ["-O", "defer_accept 1"], "quill-pbs": ["-O", "poll_before_sleep 30"]}
ANCHORS = ("pen", "haproxy", "nginx")


@dataclass(frozen=True)
class Scenario:
    """One measurement, run for every balancer it applies to, in every round."""
    name: str
    kind: str  # "wrk" | "latency" | "idle" | "syscalls"
    desc: str
    metric: str  # the key in Run.metrics that the table ranks and the ratios compare
    unit: str
    higher_is_better: bool = True
    layout: str = "one-core"  # or "all-cores"
    path: str = "/1k"
    wrk_extra: tuple[str, ...] = ()
    idle_conns: int = 0
    with_backend: bool = True  # does "backend alone" make sense as a row?
    once: bool = False  # measured in round 1 only (slow and not noisy)
    # Anchors left out of "best anchor" here, with the reason printed under the table.
    not_best: tuple[str, ...] = ()
    not_best_why: str = ""
    # "paced": each wrk connection waits this long after every answer (a delay() script).
    pace_ms: int = 0
    connections: int = 0  # wrk connections when not the default
    # The balancers terminate TLS (TLS 1.3, ECDSA P-256) and relay plain TCP to the backend;
    # the load speaks HTTPS to them (the backend alone is still measured over plain HTTP).
    tls: bool = False


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    close = ("-H", "Connection: close")
    s = [
        Scenario("keepalive", "wrk", "keep-alive, 1 KiB responses", "rps", "req/s"),
        Scenario("close", "wrk", "connection per request (Connection: close), 1 KiB", "rps", "req/s",
                 wrk_extra=close),
        Scenario("bulk", "wrk", "1 MiB responses, keep-alive", "mb_per_s", "MB/s", path="/1m"),
        Scenario("latency", "latency",
                 f"latency at a constant {args.latency_rate:,} req/s, keep-alive 1 KiB (p99)",
                 "p99_ms", "ms", higher_is_better=False),
    ]
    for n in (1000,) if args.quick else (1000, 9000):
        s.append(Scenario(f"idle{n // 1000}k", "idle", f"RSS per idle proxied connection, {n:,} held",
                          "bytes_per_conn", "B/conn", higher_is_better=False, idle_conns=n,
                          with_backend=False, once=True, not_best=("pen",),
                          not_best_why="Pen allocates its connection table (-x slots) at start, so "
                                       "holding connections costs it no new memory"))
    s.append(Scenario("syscalls", "syscalls",
                      f"system calls per request (perf stat, {args.syscall_requests:,} keep-alive requests)",
                      "syscalls_per_req", "calls/req", higher_is_better=False, with_backend=False,
                      once=True))
    # A balancer's reads of a new connection find nothing when they come before the
    # client's request: only a connection-per-request load shows them.
    s.append(Scenario("syscalls-close", "syscalls",
                      "system calls per request, a new connection per request (Connection: close) "
                      "paced 5 ms (perf stat)",
                      "syscalls_per_req", "calls/req", higher_is_better=False, with_backend=False,
                      once=True, pace_ms=5, wrk_extra=close))
    s += efficiency_scenarios(args)
    if args.efficiency:
        return [x for x in s if x.kind == "paced"]
    if not (args.no_all_cores or args.quick):
        s += [
            Scenario("keepalive-all", "wrk", "keep-alive 1 KiB, balancer on both cores", "rps", "req/s",
                     layout="all-cores"),
            Scenario("close-all", "wrk", "connection per request, balancer on both cores", "rps",
                     "req/s", layout="all-cores", wrk_extra=close),
        ]
    return s


BALANCER_CORE = "0"
LOAD_CORE = "1"  # wrk / loadgen and the backend nginx
WRK_THREADS = 1
WRK_CONNECTIONS = 50
MAX_CONNS = "10000"  # -x for quill and pen
HAPROXY_MAXCONN = 9800  # 2*maxconn + overhead must fit in the 20,000 fd limit
NGINX_CONNECTIONS = 19500  # worker_connections: 2 per proxied connection, under 20,000 fds
READY_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
IDLE_CLIENT_PROCS = 3
IDLE_SOURCES = [f"127.0.0.{i}" for i in range(2, 11)]
IDLE_DEADLINE_S = 60.0
# Seconds an idle connection is held before its memory is read (see measure_idle).
IDLE_SETTLE_S = 3.0
GIVE_UP_AFTER_START_FAILURES = 2
# A run is flagged when processes other than balancer/nginx/load used more than this
# fraction of core 0 or core 1 (user+system time from /proc/stat; approximate).
INTERFERENCE_FRAC = 0.10

# Deterministic, non-compressible-looking 1 KiB body.
BODY = bytes((i * 37 + 11) % 94 + 33 for i in range(1024))
BULK_SIZE = 1 << 20

# Every process of the benchmark runs at the highest priority (root only), so that other
# work on the machine disturbs it as little as possible; see raise_autogroup.
NICE = ["nice", "-n", "-20"] if os.geteuid() == 0 else []

CLK_TCK = os.sysconf("SC_CLK_TCK")

ENV = dict(os.environ)
ENV["PATH"] = ENV.get("PATH", "/usr/bin:/bin") + ":/usr/local/sbin:/usr/sbin:/sbin"
ENV["LC_ALL"] = "C"

# tool command -> Debian package
TOOL_PACKAGES = {"pen": "pen", "haproxy": "haproxy", "nginx": "nginx-light", "wrk": "wrk",
                 "taskset": "util-linux", "perf": "linux-perf", "openssl": "openssl"}
NGINX_STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")
# Services the packages start on installation; the benchmark starts its own processes.
AUTOSTARTED = ("pen", "haproxy", "nginx", "dnsdist", "nsd")


class Interrupted(Exception):
    """Raised from SIGTERM/SIGHUP handlers so that `finally` blocks clean up."""


class BenchError(Exception):
    """A fatal problem of the harness itself (not of one balancer)."""


class StartError(Exception):
    """A balancer did not start, did not accept, or did not serve the body."""


def log(msg: str = "") -> None:
    print(msg, flush=True)


def warn(msg: str) -> None:
    print(f"WARNING: {msg}", file=sys.stderr, flush=True)


def which(cmd: str) -> str | None:
    return shutil.which(cmd, path=ENV["PATH"])


def run_capture(argv: list[str], cwd: Path | None = None, timeout: float = 30) -> tuple[int, str]:
    """Run a short command, return (rc, stdout+stderr). Never raises for a missing command."""
    try:
        p = subprocess.run(argv, cwd=cwd, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=timeout, check=False)
        return p.returncode, p.stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        return 127, str(e)


def first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


def tail(path: Path, lines: int = 15) -> str:
    try:
        data = path.read_text("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return "\n".join(data[-lines:])


# --------------------------------------------------------------------------- processes


class Held:
    """The balancers `--held` keeps running through a scenario's rounds (bench/run,
    bench/https, bench/run --udp), by name: each process with what its caller needs to
    use it again (its port, its log...). One that exited is forgotten by `get`, one whose
    measurement failed by the caller (`forget`), and the caller then starts it afresh."""

    def __init__(self, stop: Any) -> None:
        self._stop = stop  # the starter's Procs.stop
        self._kept: dict[str, tuple[Any, ...]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, name: str) -> tuple[Any, ...] | None:
        """(process, what was kept with it) for `name`, if it still runs."""
        kept = self._kept.get(name)
        if kept is not None and kept[0].poll() is not None:
            del self._kept[name]
            return None
        return kept

    def keep(self, name: str, proc: Any, *extra: Any) -> None:
        self._kept[name] = (proc, *extra)

    def forget(self, name: str) -> None:
        """No longer kept (the caller stops it)."""
        self._kept.pop(name, None)

    def release(self) -> None:
        """Stops every kept balancer (a scenario's end)."""
        for proc, *_ in self._kept.values():
            self._stop(proc)
        self._kept.clear()


class Procs:
    """Every process we start lives in its own session (pgid == pid), so we can stop
    it and its children by id without touching anything else."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}

    def start(self, name: str, argv: list[str], log_path: Path | None,
              stdout_pipe: bool = False) -> subprocess.Popen[bytes]:
        if stdout_pipe:
            out: Any = subprocess.PIPE
            err: Any = subprocess.STDOUT
            f = None
        else:
            assert log_path is not None
            f = open(log_path, "ab")  # noqa: SIM115 - handed to the child
            out, err = f, subprocess.STDOUT
        try:
            p = subprocess.Popen(NICE + argv, env=ENV, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True)
        finally:
            if f is not None:
                f.close()
        raise_autogroup(p.pid)
        self.live[p.pid] = (name, p)
        return p

    def stop(self, p: subprocess.Popen[bytes], grace: float = STOP_GRACE_S) -> None:
        pid = p.pid
        if p.poll() is None:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    warn(f"process {pid} did not die after SIGKILL")
        # Leftover members of the group (e.g. nginx worker whose master died).
        # A pgid cannot be reused while any member is alive, so this only hits ours.
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.live.pop(pid, None)

    def stop_all(self) -> None:
        for pid in list(self.live)[::-1]:
            name, p = self.live[pid]
            self.stop(p, grace=2.0)


def cpu_core_ticks() -> dict[str, tuple[int, int]]:
    """Per-core (user+nice+system, total) from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            parts = line.split()
            v = [int(x) for x in parts[1:]]
            usersys = v[0] + v[1] + v[2]
            total = sum(v[:8])  # user nice system idle iowait irq softirq steal
            out[parts[0]] = (usersys, total)
    return out


def cpus_allowed(pid: int) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def run_load(procs: Procs, argv: list[str], timeout: float) -> str:
    """Runs a load generator to completion, at the priority of the benchmark's other
    processes; returns its stdout+stderr. It is reaped here, so RUSAGE_CHILDREN counts it."""
    p = procs.start("load", argv, None, stdout_pipe=True)
    try:
        out_b, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        procs.stop(p)
        raise StartError(f"{argv[0] if argv[0] != 'taskset' else argv[3]} did not finish in time") from None
    except BaseException:
        procs.stop(p)
        raise
    procs.live.pop(p.pid, None)
    out = out_b.decode("utf-8", "replace")
    if p.returncode != 0:
        raise StartError(f"{' '.join(argv)} exited with code {p.returncode}: {out.strip()[-500:]}")
    return out


# --------------------------------------------------------------------------- network


def local_port_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


_used_ports: set[int] = set()


def free_port() -> int:
    """A free loopback port outside the ephemeral range, so that wrk's and the balancers'
    outgoing connections can never collide with a listener we are about to start.
    Bound without SO_REUSEADDR: a port with leftover TIME_WAIT sockets is refused."""
    lo, hi = local_port_range()
    if lo > 11000:
        a, b = 10000, lo - 1
    elif hi < 64000:
        a, b = hi + 1, 65535
    else:
        a, b = 1025, 65535
    for _ in range(500):
        port = random.randint(a, b)
        if port in _used_ports:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            s.close()
        _used_ports.add(port)
        return port
    raise BenchError("could not find a free loopback port")


def wait_accepting(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while True:
        rc = proc.poll()
        if rc is not None:
            raise StartError(f"process exited with code {rc} before accepting on port {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise StartError(f"port {port} not accepting after {READY_TIMEOUT_S:.0f}s ({e})") from None
        time.sleep(0.02)


def http_get_1k(port: int, timeout: float, tls: bool = False) -> None:
    if tls:
        # The benchmark's own certificate: what is checked here is the body, not the chain.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=timeout, context=ctx)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/1k")
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise StartError(f"GET /1k returned HTTP {resp.status}")
    if body != BODY:
        raise StartError(f"GET /1k returned {len(body)} bytes, not the expected 1024-byte body")


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = READY_TIMEOUT_S,
               tls: bool = False) -> float:
    """Poll connect until it accepts, then verify one HTTP (HTTPS with `tls`) request returns
    the 1 KiB body. Returns seconds taken."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    wait_accepting(port, proc, deadline)
    last: Exception | None = None
    while True:
        if proc.poll() is not None:
            raise StartError(f"process exited with code {proc.returncode} during verification")
        try:
            http_get_1k(port, timeout=max(0.5, min(5.0, deadline - time.monotonic())), tls=tls)
            return time.monotonic() - t0
        except (OSError, http.client.HTTPException, ssl.SSLError, StartError) as e:
            last = e
        if time.monotonic() >= deadline:
            raise StartError(f"accepts on port {port} but does not serve /1k correctly: "
                             f"{type(last).__name__}: {last}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- wrk


@dataclass
class WrkResult:
    rps: float
    requests: int
    seconds: float
    bytes_per_s: float | None = None
    errors_connect: int = 0
    errors_read: int = 0
    errors_write: int = 0
    errors_timeout: int = 0
    non2xx: int = 0
    latency_avg: str | None = None

    @property
    def socket_errors(self) -> int:
        return self.errors_connect + self.errors_read + self.errors_write + self.errors_timeout

    @property
    def errors(self) -> int:
        return self.socket_errors + self.non2xx


_UNIT_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_UNIT_B = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def parse_wrk(out: str) -> WrkResult:
    m = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    n = re.search(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", out, re.M)
    if not m or not n:
        raise ValueError("could not find 'Requests/sec' in wrk output")
    r = WrkResult(rps=float(m.group(1)), requests=int(n.group(1)),
                  seconds=float(n.group(2)) * _UNIT_S[n.group(3)])
    t = re.search(r"^Transfer/sec:\s+([\d.]+)(B|KB|MB|GB|TB)", out, re.M)
    if t:
        r.bytes_per_s = float(t.group(1)) * _UNIT_B[t.group(2)]
    se = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if se:
        r.errors_connect, r.errors_read, r.errors_write, r.errors_timeout = (int(x) for x in se.groups())
    nx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if nx:
        r.non2xx = int(nx.group(1))
    lat = re.search(r"^\s*Latency\s+(\S+)", out, re.M)
    if lat:
        r.latency_avg = lat.group(1)
    return r


# What `perf stat` counts for the syscalls scenario: every system call, the calls a relay
# makes most (each its own tracepoint, so the count does not depend on the event loop's
# kind), reads that found nothing, and the process's context switches. Counted on the
# tracepoints because strace slows the traced process enough that its reads find more
# bytes each and its event loop more events per wake-up (at a paced load strace showed
# 0.001 empty reads a connection where the tracepoints count 1.96: bench/RESULTS.md).
SYSCALL_NAMES = ("read", "recvfrom", "readv", "recvmsg", "write", "writev", "sendto", "sendmsg",
                 "epoll_wait", "epoll_pwait", "epoll_ctl", "accept4", "connect", "close",
                 "shutdown", "setsockopt", "getsockopt", "splice", "clock_gettime", "futex")
PERF_EVENTS: tuple[tuple[str, str, str | None], ...] = (
    ("calls", "raw_syscalls:sys_enter", None),
    *((name, f"syscalls:sys_enter_{name}", None) for name in SYSCALL_NAMES),
    ("empty_read", "syscalls:sys_exit_read", "ret == -11"),
    ("empty_recvfrom", "syscalls:sys_exit_recvfrom", "ret == -11"),
    ("context_switches", "context-switches", None),
)


def perf_stat_argv(pid: int, out: Path) -> list[str]:
    """perf stat of every event of PERF_EVENTS on process PID (all its threads), CSV into OUT."""
    argv = ["perf", "stat", "-x", ",", "-o", str(out), "-p", str(pid)]
    for _, event, filt in PERF_EVENTS:
        argv += ["-e", event] + (["--filter", filt] if filt else [])
    return argv


def parse_perf_stat(out: str) -> dict[str, int]:
    """perf stat's CSV (`-x ,`: count, unit, event, ...) as {PERF_EVENTS name: count}, in
    PERF_EVENTS' order (perf prints them in the order given). Events perf could not count
    (`<not supported>`, `<not counted>`) are left out."""
    rows = [line.split(",") for line in out.splitlines() if line and not line.startswith("#")]
    counts = {}
    for (name, event, _), row in zip(PERF_EVENTS, rows):
        if len(row) >= 3 and row[2] == event and row[0].isdigit():
            counts[name] = int(row[0])
    return counts


def perf_events_open(pid: int) -> int:
    """How many perf events process PID holds open (perf stat has attached when it holds all)."""
    try:
        return sum(1 for fd in Path(f"/proc/{pid}/fd").iterdir()
                   if os.readlink(fd) == "anon_inode:[perf_event]")
    except OSError:
        return 0


# --------------------------------------------------------------------------- configs


def write_backend(tmp: Path, port: int) -> Path:
    www = tmp / "www"
    www.mkdir()
    (www / "1k").write_bytes(BODY)
    (www / "1m").write_bytes((BODY * (BULK_SIZE // len(BODY)))[:BULK_SIZE])
    os.chmod(www, 0o755)
    for f in ("1k", "1m"):
        os.chmod(www / f, 0o644)
    cfg = tmp / "nginx.conf"
    cfg.write_text(f"""# generated by bench/tcp_bench.py
worker_processes 1;
worker_rlimit_nofile 19900;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{
    worker_connections {NGINX_CONNECTIONS};
}}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    # sendfile off (nginx's default): headers and body leave in ONE writev.  With
    # sendfile on they leave as two segments, and a balancer without TCP_NODELAY
    # (pen 0.34) then hits Nagle + delayed-ACK stalls (~12 ms latency, -60% req/s),
    # which would measure a backend artefact rather than the balancer.
    sendfile off;
    tcp_nodelay on;
    client_body_temp_path {tmp}/nginx-body;
    proxy_temp_path {tmp}/nginx-proxy;
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        root {www};
        location ~ ^/1[km]$ {{
            default_type application/octet-stream;
        }}
    }}
}}
""")
    return cfg


@dataclass(frozen=True)
class Certificate:
    """The balancers' certificate for the TLS scenarios: ECDSA P-256, self-signed."""
    cert: Path
    key: Path
    combined: Path  # certificate then key, for HAProxy's `crt`


P256 = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]


def make_certificate(tmp: Path, name: str = "tls", newkey: list[str] = P256) -> Certificate:
    """A self-signed certificate for localhost and 127.0.0.1 (tmp/NAME.crt, .key, .pem)."""
    cert, key, combined = tmp / f"{name}.crt", tmp / f"{name}.key", tmp / f"{name}.pem"
    rc, text = run_capture(["openssl", "req", "-x509", *newkey, "-nodes", "-keyout", str(key),
                            "-out", str(cert), "-subj", "/CN=localhost", "-days", "2",
                            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
    if rc != 0:
        raise BenchError(f"openssl req failed: {text}")
    combined.write_text(cert.read_text() + key.read_text())
    return Certificate(cert, key, combined)


def write_haproxy(tmp: Path, port: int, backend_port: int, threads: int,
                  tls: Certificate | None = None) -> Path:
    cfg = tmp / f"haproxy-{port}.cfg"
    ssl_bind = "" if tls is None else f" ssl crt {tls.combined} ssl-min-ver TLSv1.3"
    cfg.write_text(f"""# generated by bench/tcp_bench.py
global
    nbthread {threads}
    maxconn {HAPROXY_MAXCONN}

defaults
    mode tcp
    timeout connect 30s
    timeout client 300s
    timeout server 300s

frontend fe
    bind 127.0.0.1:{port}{ssl_bind}
    default_backend be

backend be
    server s1 127.0.0.1:{backend_port}
""")
    return cfg


def write_nginx_stream(tmp: Path, port: int, backend_port: int, workers: int,
                       tls: Certificate | None = None) -> Path:
    cfg = tmp / f"nginx-stream-{port}.conf"
    ssl_server = "" if tls is None else f"""
        ssl_certificate {tls.cert};
        ssl_certificate_key {tls.key};
        ssl_protocols TLSv1.3;"""
    cfg.write_text(f"""# generated by bench/tcp_bench.py: NGINX as an L4 (stream) balancer
load_module {NGINX_STREAM_MODULE};
worker_processes {workers};
worker_rlimit_nofile 19900;
daemon off;
pid {tmp}/nginx-stream-{port}.pid;
error_log {tmp}/nginx-stream-{port}-error.log warn;
events {{
    worker_connections {NGINX_CONNECTIONS};
}}
stream {{
    upstream be {{
        server 127.0.0.1:{backend_port};
    }}
    server {{
        listen 127.0.0.1:{port}{" ssl" if tls else ""} backlog=4096;{ssl_server}
        proxy_pass be;
        proxy_timeout 300s;
    }}
}}
""")
    return cfg


def in_turn(balancers: list[str], rnd: int) -> list[str]:
    """The order of a round: each round starts one balancer further along, so that what the
    host does to the first run after a pause (or the last before one) falls on each in turn
    (with a fixed order quill always ran first, and looked 17 % slower for it)."""
    if not balancers:
        return []
    shift = (rnd - 1) % len(balancers)
    return balancers[shift:] + balancers[:shift]


def balancer_argv(name: str, port: int, backend_port: int, tmp: Path, quill_bin: Path,
                  layout: str, tls: Certificate | None = None, base_bin: Path | None = None) -> list[str]:
    """How each balancer is started; with `tls` it terminates TLS with that certificate
    (TLS 1.3 only where it can be said) and relays plain TCP to the backend. `quill-base`
    runs `base_bin` instead of `quill_bin`."""
    listen, target = f"127.0.0.1:{port}", f"127.0.0.1:{backend_port}"
    # quill and Pen: -E certificate, -K key (Pen negotiates TLS 1.3 through OpenSSL).
    tls_args = [] if tls is None else ["-E", str(tls.cert), "-K", str(tls.key)]
    one = layout == "one-core"
    pin = ["taskset", "-c", BALANCER_CORE] if one else []
    cores = 1 if one else len(os.sched_getaffinity(0))
    if name in QUILL_VARIANTS:
        # No worker-count option: quill sizes itself from the cores it may use.
        binary = base_bin if name == "quill-base" and base_bin is not None else quill_bin
        return QUILL_VARIANTS[name] + pin + [str(binary), "-f", "-r", "-x", MAX_CONNS, *tls_args,
                                             *QUILL_VARIANT_ARGS.get(name, []), listen, target]
    if name == "pen":
        return pin + ["pen", "-f", "-r", "-x", MAX_CONNS, *tls_args, listen, target]
    if name == "haproxy":
        return pin + ["haproxy", "-f", str(write_haproxy(tmp, port, backend_port, cores, tls)), "-db"]
    if name == "nginx":
        cfg = write_nginx_stream(tmp, port, backend_port, cores, tls)
        return pin + ["nginx", "-c", str(cfg), "-p", f"{tmp}/", "-e", str(tmp / f"nginx-stream-{port}-error.log")]
    raise ValueError(name)


# --------------------------------------------------------------------------- setup


def apt_install(pkgs: list[str]) -> None:
    log(f"apt-get install -y {' '.join(pkgs)}")
    if os.geteuid() != 0:
        raise BenchError(f"missing packages and not root; install: apt-get install -y {' '.join(pkgs)}")
    env = dict(ENV, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", *pkgs]
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        log("apt-get install failed; running apt-get update and retrying")
        subprocess.run(["apt-get", "update"], env=env, check=False)
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            raise BenchError(f"apt-get install -y {' '.join(pkgs)} failed")
    # The packages start their services; the benchmark runs its own processes only.
    if which("systemctl"):
        for svc in AUTOSTARTED:
            run_capture(["systemctl", "stop", svc])


def ensure_tools(selected: list[str], needs_perf: bool) -> None:
    needed = ["taskset", "nginx", "wrk", "openssl"] + [b for b in ("pen", "haproxy") if b in selected]
    if needs_perf:
        needed.append("perf")
    pkgs = sorted({TOOL_PACKAGES[t] for t in needed if which(t) is None})
    if "nginx" in selected and not NGINX_STREAM_MODULE.exists():
        pkgs.append("libnginx-mod-stream")
    if pkgs:
        apt_install(pkgs)
    still = [t for t in needed if which(t) is None]
    if still:
        raise BenchError(f"still missing after install: {still}")
    if "nginx" in selected and not NGINX_STREAM_MODULE.exists():
        raise BenchError(f"{NGINX_STREAM_MODULE} missing after installing libnginx-mod-stream")


def check_cores() -> None:
    try:
        aff = os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover
        aff = set(range(os.cpu_count() or 1))
    need = {int(BALANCER_CORE), int(LOAD_CORE)}
    if not need <= aff:
        raise BenchError(f"need CPU cores {sorted(need)} available (have {sorted(aff)})")
    if len(aff) > 2:
        warn(f"{len(aff)} cores available; the one-core layout uses only cores 0 and 1")


def cargo_build(what: str, cwd: Path, extra: list[str]) -> str | None:
    """Returns None on success, else a failure reason."""
    cargo = which("cargo")
    if cargo is None:
        return f"cargo not found; cannot build {what}"
    argv = [cargo, "build", "--release", *extra]
    log(f"building {what}: (cd {cwd} && {' '.join(argv[1:])})")
    rc = subprocess.run([cargo, "build", "--release", *extra], cwd=cwd, env=ENV,
                        stdin=subprocess.DEVNULL, check=False).returncode
    if rc != 0:
        return f"cargo build of {what} failed with exit code {rc} (see output above)"
    return None


def loadgen_bin() -> Path:
    return LOADGEN_DIR / "target" / "release" / "quill-loadgen"


def sha256_file(path: Path) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def describe_machine() -> dict[str, Any]:
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = line.split(":", 1)[1].strip()
    except OSError:
        pass
    sysctls = {}
    # The congestion control and qdisc shape latency tails over loopback: BBR paces from
    # timers, so a relay on another core than its peers sees segments reordered (see
    # bench/RESULTS.md, 1 MiB p99).
    for k in ("net/ipv4/ip_local_port_range", "net/ipv4/tcp_tw_reuse", "net/ipv4/tcp_max_tw_buckets",
              "net/core/somaxconn", "net/ipv4/tcp_max_syn_backlog",
              "net/ipv4/tcp_congestion_control", "net/core/default_qdisc"):
        try:
            sysctls[k.replace("/", ".")] = " ".join(Path(f"/proc/sys/{k}").read_text().split())
        except OSError:
            pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return {
        "nproc": first_line(run_capture(["nproc"])[1]),
        "kernel": first_line(run_capture(["uname", "-r"])[1]),
        "cpu_model": cpu_model,
        "mem_total": mem,
        "nofile_limit": [soft, hard],
        "loadavg_at_start": Path("/proc/loadavg").read_text().strip(),
        "sysctl": sysctls,
        "python": sys.version.split()[0],
    }


def describe_versions(quill_bin: Path, selected: list[str]) -> dict[str, Any]:
    v: dict[str, Any] = {}
    rc, out = run_capture(["dpkg-query", "-W", "pen"])
    v["pen"] = first_line(out).replace("\t", " ") if rc == 0 else None
    rc, out = run_capture(["haproxy", "-v"])
    v["haproxy"] = first_line(out) if which("haproxy") else None
    rc, out = run_capture(["nginx", "-v"])
    v["nginx"] = first_line(out)
    v["nginx_stream_module"] = str(NGINX_STREAM_MODULE) if NGINX_STREAM_MODULE.exists() else None
    rc, out = run_capture(["wrk", "--version"])
    v["wrk"] = first_line(out)
    rc, out = run_capture(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT)
    v["quill_commit"] = first_line(out) if rc == 0 else None
    rc, out = run_capture(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT)
    v["quill_worktree_dirty"] = bool(out.strip()) if rc == 0 and v["quill_commit"] else None
    if "quill" in selected:
        v["quill_bin"] = str(quill_bin)
        v["quill_bin_sha256"] = sha256_file(quill_bin)
        try:
            v["quill_bin_mtime"] = dt.datetime.fromtimestamp(quill_bin.stat().st_mtime).isoformat(
                timespec="seconds")
        except OSError:
            v["quill_bin_mtime"] = None
    return v


# --------------------------------------------------------------------------- benchmark


# The efficiency yardstick: what a balancer costs the whole machine per request at a load
# that is paced, not saturated (where balancers live). wrk's connections each wait
# `pace_ms` after every answer; the figure is the busy CPU of all cores from /proc/stat
# (user + nice + system + irq + softirq + steal) per request, minus the same figure for the
# backend alone in the same round: the balancer's own cost, with the wake-ups, softirq
# work and scheduling it causes on the other core included. Busy = wall time of all cores
# minus their idle time (see machine_idle: the tick-sampled busy fields miss short bursts).
PACES_MS = (1, 5, 20)
BULK_PACE = (20, 10)  # (delay ms, connections): about 500 MB/s of 1 MiB bodies


def efficiency_scenarios(args: argparse.Namespace) -> list[Scenario]:
    close = ("-H", "Connection: close")
    paces = (5,) if args.quick else PACES_MS
    s = []
    for ms in paces:
        s.append(Scenario(f"paced{ms}-keepalive", "paced",
                          f"machine CPU per request over the backend alone, keep-alive 1 KiB, "
                          f"each connection paced {ms} ms", "overhead_us_per_req", "us/req",
                          higher_is_better=False, pace_ms=ms))
    s.append(Scenario("paced5-close", "paced",
                      "machine CPU per request over the backend alone, a new connection per "
                      "request (Connection: close) paced 5 ms", "overhead_us_per_req", "us/req",
                      higher_is_better=False, pace_ms=5, wrk_extra=close))
    s.append(Scenario("paced5-tls", "paced",
                      "machine CPU per request over the (plain HTTP) backend alone, HTTPS keep-alive "
                      "1 KiB (TLS 1.3, ECDSA P-256) terminated by the balancer, each connection "
                      "paced 5 ms", "overhead_us_per_req", "us/req",
                      higher_is_better=False, pace_ms=5, tls=True))
    ms, conns = BULK_PACE
    s.append(Scenario(f"paced{ms}-bulk", "paced",
                      f"machine CPU per 1 MiB response over the backend alone, {conns} keep-alive "
                      f"connections paced {ms} ms", "overhead_us_per_req", "us/req",
                      higher_is_better=False, pace_ms=ms, connections=conns, path="/1m"))
    return s


def machine_idle() -> tuple[float, int, float, float]:
    """(monotonic time, cores, idle + iowait seconds of all cores, steal seconds of all
    cores) from /proc/stat.

    Busy time is the wall time of all cores minus this, not the sum of /proc/stat's busy
    fields: those are sampled by the scheduler tick, which a tickless kernel stops while a
    core is idle, so the short bursts of work between idle periods that make up a paced
    load are mostly never sampled (seen here: a UDP balancer that its own precise runtime
    says kept core 0 23 % busy showed as 1 %). Idle time is measured exactly on idle entry
    and exit.

    Steal is the time the hypervisor ran something else while a core of ours wanted to
    run: not work of this machine, but counted busy here (and partly idle, where it fell
    while the guest idled), so a run it disturbs is repeated (`steal_share`)."""
    idle, steal, cores = 0, 0, 0
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            v = [int(x) for x in line.split()[1:9]]
            idle += v[3] + v[4]
            steal += v[7]
            cores += 1
    return time.monotonic(), cores, idle / CLK_TCK, steal / CLK_TCK


def machine_busy_s(before: tuple[float, ...], after: tuple[float, ...]) -> float:
    return max(0.0, (after[0] - before[0]) * after[1] - (after[2] - before[2]))


# A measurement during which the hypervisor took more than this share of the machine's
# time (steal) is repeated, up to STEAL_RETRIES times: on these shared hosts steal comes in
# spells of tens of seconds, and in one it was 17-36 % of each core, a balancer's machine
# CPU a request 1.5-2.5x its figure a minute before (its own CPU 1.3x: the host's other
# guests slow each instruction too), whichever balancer it fell on. 1-4 % is the usual.
STEAL_LIMIT = 0.05
STEAL_RETRIES = 2


def steal_share(before: tuple[float, ...], after: tuple[float, ...]) -> float:
    """The share of the machine's time (all cores) the hypervisor took between the two."""
    wall = (after[0] - before[0]) * after[1]
    return max(0.0, after[3] - before[3]) / wall if wall > 0 else 0.0


# Before a disturbed measurement is tried again, the spell is waited out (QUIET_WAIT_S at
# most): steal shows only while our cores want to run, so a probe spins every core for
# QUIET_PROBE_S and reads the steal that fell meanwhile. Measuring again at once mostly
# fell into the same spell.
QUIET_PROBE_S = 1.0
QUIET_WAIT_S = 45.0


def spun_steal_share(seconds: float) -> float:
    """The steal share of the machine while every core spins for `seconds`."""
    before = machine_idle()
    spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(before[1])]
    for p in spinners:
        p.wait()
    return steal_share(before, machine_idle())


def wait_for_quiet(label: str) -> float:
    """Waits until a probe sees the steal under STEAL_LIMIT, or QUIET_WAIT_S passed; returns
    the seconds waited."""
    start = time.monotonic()
    while True:
        stolen = spun_steal_share(QUIET_PROBE_S)
        waited = time.monotonic() - start
        if stolen <= STEAL_LIMIT:
            return waited
        if waited >= QUIET_WAIT_S:
            warn(f"{label}: steal still {stolen:.0%} after {waited:.0f} s of waiting")
            return waited
        time.sleep(QUIET_PROBE_S)


def screened(label: str, measure: Any) -> tuple[Any, tuple[float, ...], tuple[float, ...], dict[str, Any]]:
    """Runs `measure()` between two `machine_idle()` readings, again (STEAL_RETRIES times at
    most, each after `wait_for_quiet`) while the hypervisor's steal exceeds STEAL_LIMIT.
    Returns the result of the least disturbed try, its two readings, and what to record of
    the steal (`steal_share`, `steal_retries`, `steal_waited_s`, and `disturbed` when even
    that try was above the limit)."""
    best: tuple[float, Any, tuple[float, ...], tuple[float, ...]] | None = None
    waited = 0.0
    for attempt in range(STEAL_RETRIES + 1):
        if attempt:
            waited += wait_for_quiet(label)
        before = machine_idle()
        result = measure()
        after = machine_idle()
        stolen = steal_share(before, after)
        if best is None or stolen < best[0]:
            best = (stolen, result, before, after)
        if stolen <= STEAL_LIMIT:
            break
        warn(f"{label}: the hypervisor took {stolen:.0%} of the machine"
             + (", measured again once it is quiet" if attempt < STEAL_RETRIES
                else ", the least disturbed try kept (marked disturbed)"))
    assert best is not None
    stolen, result, before, after = best
    record: dict[str, Any] = {"steal_share": round(stolen, 4), "steal_retries": attempt}
    if waited:
        record["steal_waited_s"] = round(waited, 1)
    if stolen > STEAL_LIMIT:
        record["disturbed"] = True
    return result, before, after, record


def parse_wrk_percentile(out: str, pct: str) -> float | None:
    """A latency percentile of `wrk --latency` ("99%"), in ms."""
    m = re.search(rf"^\s*{re.escape(pct)}\s+([\d.]+)(us|ms|s|m)\s*$", out, re.M)
    return round(float(m.group(1)) * _UNIT_S[m.group(2)] * 1000, 3) if m else None


def add_overheads(runs: list[Run], scs: list[Scenario]) -> None:
    """Per round, each balancer's machine CPU per request minus the backend alone's."""
    for sc in scs:
        if sc.kind != "paced":
            continue
        for r in runs:
            if r.scenario != sc.name or not r.ok:
                continue
            base = [b for b in runs if b.scenario == sc.name and b.balancer == "backend" and b.ok
                    and b.round == r.round]
            if base and "machine_us_per_req" in r.metrics:
                r.metrics["overhead_us_per_req"] = round(
                    r.metrics["machine_us_per_req"] - base[0].metrics["machine_us_per_req"], 2)
                if base[0].metrics.get("disturbed"):
                    r.metrics["base_disturbed"] = True


def undisturbed(runs: list[Run]) -> list[Run]:
    """The runs (or, for a paced one, its round's backend run) the hypervisor's steal did
    not disturb, if there is one; else all of them (see STEAL_LIMIT)."""
    clean = [r for r in runs if not (r.metrics.get("disturbed") or r.metrics.get("base_disturbed"))]
    return clean or runs


@dataclass
class Run:
    round: int
    scenario: str
    balancer: str
    ok: bool = False
    error: str | None = None
    port: int | None = None
    command: list[str] | None = None
    load_command: list[str] | None = None
    ready_s: float | None = None
    cpus_allowed: str | None = None
    wrk: WrkResult | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    balancer_cpu_s: float | None = None
    backend_cpu_s: float | None = None
    core0_other_cpu_s: float | None = None
    core1_other_cpu_s: float | None = None
    load_output: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "round": self.round, "scenario": self.scenario, "balancer": self.balancer, "ok": self.ok,
            "error": self.error, "port": self.port, "command": self.command,
            "load_command": self.load_command, "ready_s": _r(self.ready_s, 3),
            "balancer_cpus_allowed": self.cpus_allowed,
            "balancer_cpu_s": _r(self.balancer_cpu_s, 3), "backend_cpu_s": _r(self.backend_cpu_s, 3),
            "core0_other_user_sys_s": _r(self.core0_other_cpu_s, 3),
            "core1_other_user_sys_s": _r(self.core1_other_cpu_s, 3),
            "metrics": self.metrics,
        }
        if self.wrk:
            w = self.wrk
            d["wrk"] = {
                "rps": w.rps, "requests": w.requests, "seconds": w.seconds, "bytes_per_s": w.bytes_per_s,
                "latency_avg": w.latency_avg,
                "errors": {"connect": w.errors_connect, "read": w.errors_read, "write": w.errors_write,
                           "timeout": w.errors_timeout, "non2xx": w.non2xx, "total": w.errors},
            }
        d["load_output"] = self.load_output
        return d


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None else round(x, nd)


class Bench:
    def __init__(self, args: argparse.Namespace, selected: list[str], quill_bin: Path,
                 fatal: dict[str, str]) -> None:
        self.args = args
        self.selected = selected
        self.quill_bin = quill_bin
        self.fatal = fatal  # balancer -> reason it is not measured at all
        self.start_failures: dict[str, int] = {}
        self.procs = Procs()
        self.tmp = Path(tempfile.mkdtemp(prefix="quill-bench-"))
        os.chmod(self.tmp, 0o755)  # nginx worker may run as another user
        self.backend_port = 0
        self.backend: subprocess.Popen[bytes] | None = None
        self.backend_argv: list[str] = []
        self.runs: list[Run] = []
        self.certificate: Certificate | None = None  # made for the first TLS scenario
        # --held: the balancers of the paced scenario being measured, started once.
        self.held = Held(self.procs.stop)

    def close(self) -> None:
        self.procs.stop_all()
        if self.args.keep_tmp:
            log(f"temp dir kept: {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def start_backend(self) -> None:
        self.backend_port = free_port()
        cfg = write_backend(self.tmp, self.backend_port)
        argv = ["taskset", "-c", LOAD_CORE, "nginx", "-c", str(cfg), "-p", f"{self.tmp}/",
                "-e", str(self.tmp / "nginx-error.log")]
        self.backend_argv = argv
        self.backend = self.procs.start("nginx", argv, self.tmp / "nginx.out")
        try:
            wait_ready(self.backend_port, self.backend)
        except StartError as e:
            raise BenchError(f"backend nginx failed: {e}\n{tail(self.tmp / 'nginx-error.log')}"
                             f"\n{tail(self.tmp / 'nginx.out')}") from None
        log(f"backend nginx (pid {self.backend.pid}, core {LOAD_CORE}) serving 1 KiB at "
            f"http://127.0.0.1:{self.backend_port}/1k and 1 MiB at /1m")

    def load_pin(self, sc: Scenario) -> list[str]:
        return ["taskset", "-c", LOAD_CORE] if sc.layout == "one-core" else []

    def measure(self, rnd: int, sc: Scenario, bal: str) -> Run:
        run = Run(round=rnd, scenario=sc.name, balancer=bal)
        if bal in self.fatal:
            run.error = self.fatal[bal]
            return run
        assert self.backend is not None
        if self.backend.poll() is not None:
            raise BenchError(f"backend nginx died (exit {self.backend.returncode}):\n"
                             f"{tail(self.tmp / 'nginx-error.log')}")
        proc = None
        logf = None
        hold = self.args.held and sc.kind == "paced"
        try:
            if bal == "backend":
                port = self.backend_port
                run.command = self.backend_argv
                http_get_1k(port, 5.0)
            elif hold and (kept := self.held.get(bal)):
                proc, port, logf, run.ready_s, run.command = kept
                run.cpus_allowed = cpus_allowed(proc.pid)
                run.metrics["held"] = True
            else:
                port = free_port()
                if sc.tls and self.certificate is None:
                    self.certificate = make_certificate(self.tmp)
                argv = balancer_argv(bal, port, self.backend_port, self.tmp, self.quill_bin, sc.layout,
                                     self.certificate if sc.tls else None, self.args.base_bin)
                run.command = argv
                logf = self.tmp / f"{bal}-{port}.log"
                try:
                    proc = self.procs.start(bal, argv, logf)
                except OSError as e:
                    raise StartError(f"cannot execute {argv[0]}: {e}") from None
                try:
                    run.ready_s = wait_ready(port, proc, tls=sc.tls)
                except StartError as e:
                    t = tail(logf)
                    raise StartError(f"{e}" + (f"\n--- {bal} output (tail) ---\n{t}" if t else "")) from None
                run.cpus_allowed = cpus_allowed(proc.pid)
                if sc.layout == "one-core" and run.cpus_allowed != BALANCER_CORE:
                    warn(f"{bal} pid {proc.pid} allowed on CPUs {run.cpus_allowed}, expected {BALANCER_CORE}")
                if hold:
                    self.held.keep(bal, proc, port, logf, run.ready_s, argv)
                    run.metrics["held"] = True
            run.port = port
            measure = {"wrk": self.measure_wrk, "paced": self.measure_paced,
                       "latency": self.measure_latency,
                       "idle": self.measure_idle, "syscalls": self.measure_syscalls}[sc.kind]
            measure(run, sc, port, proc)
            if proc is not None and proc.poll() is not None:
                raise StartError(f"{bal} exited with code {proc.returncode} during the run"
                                 + (f"\n{tail(logf)}" if logf else ""))
            run.ok = True
            self.start_failures[bal] = 0
        except StartError as e:
            run.error = str(e)
            if run.ready_s is None and bal != "backend":
                n = self.start_failures.get(bal, 0) + 1
                self.start_failures[bal] = n
                if n >= GIVE_UP_AFTER_START_FAILURES:
                    self.fatal[bal] = (f"gave up after {n} failed starts; last error: "
                                       f"{str(e).splitlines()[0]}")
        finally:
            # A held balancer stays for the next round unless this one failed.
            if proc is not None and not (hold and run.ok):
                self.held.forget(bal)
                self.procs.stop(proc)
        return run

    def cpu_accounting(self, run: Run, proc: subprocess.Popen[bytes] | None, body: Any) -> Any:
        """Runs body() and records the CPU the balancer, the backend and others used."""
        assert self.backend is not None
        cores0 = cpu_core_ticks()
        b0 = proc_tree_ticks(proc.pid) if proc else None
        n0 = proc_tree_ticks(self.backend.pid)
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        result = body()
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # the load generator is reaped here
        b1 = proc_tree_ticks(proc.pid) if proc else None
        n1 = proc_tree_ticks(self.backend.pid)
        cores1 = cpu_core_ticks()
        if b0 is not None and b1 is not None:
            run.balancer_cpu_s = (b1 - b0) / CLK_TCK
        if n0 is not None and n1 is not None:
            run.backend_cpu_s = (n1 - n0) / CLK_TCK
        load_cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        c0, c1 = f"cpu{BALANCER_CORE}", f"cpu{LOAD_CORE}"
        if c0 in cores0 and c0 in cores1 and c1 in cores0 and c1 in cores1:
            busy0 = (cores1[c0][0] - cores0[c0][0]) / CLK_TCK
            busy1 = (cores1[c1][0] - cores0[c1][0]) / CLK_TCK
            ours = (run.balancer_cpu_s or 0.0) + (run.backend_cpu_s or 0.0) + load_cpu
            # Only meaningful for the one-core layout, where each process has its core.
            # Without a balancer core 0 is free for anything: nothing to flag there.
            run.core0_other_cpu_s = None if proc is None else max(0.0, busy0 - (run.balancer_cpu_s or 0.0))
            run.core1_other_cpu_s = max(0.0, busy1 - load_cpu - (run.backend_cpu_s or 0.0))
            run.metrics["foreign_cpu_s"] = round(max(0.0, busy0 + busy1 - ours), 3)
        return result

    def measure_wrk(self, run: Run, sc: Scenario, port: int, proc: subprocess.Popen[bytes] | None) -> None:
        url = f"http://127.0.0.1:{port}{sc.path}"

        def wrk(seconds: int) -> list[str]:
            return self.load_pin(sc) + ["wrk", f"-t{WRK_THREADS}", f"-c{self.args.connections}",
                                        f"-d{seconds}s", *sc.wrk_extra, url]

        if self.args.warmup > 0:
            # As before a paced run (see measure_paced): a fresh quill's first trial of busy
            # polling would otherwise fall into the measured seconds.
            run_load(self.procs, wrk(self.args.warmup), self.args.warmup + 60)
        w = self.run_wrk(run, proc, wrk(self.args.duration))
        m = run.metrics
        if sc.path == "/1m":
            mb = w.requests * BULK_SIZE / 1e6  # the body only, as the figure of merit
            m["mb_per_s"] = round(mb / w.seconds, 1)
            if run.balancer_cpu_s is not None:
                m["cpu_s_per_gb"] = round(run.balancer_cpu_s / (mb / 1000), 3)

    def run_wrk(self, run: Run, proc: subprocess.Popen[bytes] | None, argv: list[str]) -> WrkResult:
        """Runs wrk under CPU accounting; records its output, requests/s, errors and the
        balancer's CPU per request."""
        run.load_command = argv
        out = self.cpu_accounting(run, proc, lambda: run_load(self.procs, argv, self.args.duration + 60))
        run.load_output = out
        try:
            w = parse_wrk(out)
        except ValueError as e:
            raise StartError(f"{e}: {out.strip()[-500:]}") from None
        run.wrk = w
        if w.requests == 0:
            raise StartError("wrk completed 0 requests")
        m = run.metrics
        m["rps"] = w.rps
        m["errors"] = w.errors
        if run.balancer_cpu_s is not None:
            m["cpu_us_per_req"] = round(run.balancer_cpu_s * 1e6 / w.requests, 3)
        return w

    def pace_script(self, sc: Scenario) -> Path:
        """A wrk script that makes each connection wait sc.pace_ms after every answer."""
        script = self.tmp / f"pace{sc.pace_ms}.lua"
        script.write_text(f"function delay() return {sc.pace_ms} end\n")
        return script

    def measure_paced(self, run: Run, sc: Scenario, port: int, proc: subprocess.Popen[bytes] | None) -> None:
        script = self.pace_script(sc)
        # The backend alone is plain HTTP whatever the scenario.
        scheme = "https" if sc.tls and run.balancer != "backend" else "http"
        url = f"{scheme}://127.0.0.1:{port}{sc.path}"
        conns = sc.connections or self.args.connections

        def wrk(seconds: int, *extra: str) -> list[str]:
            return self.load_pin(sc) + ["wrk", f"-t{WRK_THREADS}", f"-c{conns}", f"-d{seconds}s", *extra,
                                        "-s", str(script), *sc.wrk_extra, url]

        if self.args.warmup > 0:
            # The same load first, unmeasured, so that the figure is a steady state: quill's
            # event loops try busy polling (a trial of 0.6-2 s) when a load starts, server
            # pools fill, TLS sessions are made; in a run of a few seconds that start-up
            # would be a fifth of the figure for one balancer and not for another.
            run_load(self.procs, wrk(self.args.warmup), self.args.warmup + 60)
        argv = wrk(self.args.duration, "--latency")
        w, idle0, idle1, steal = screened(f"{run.balancer} {sc.name}",
                                          lambda: self.run_wrk(run, proc, argv))
        busy = machine_busy_s(idle0, idle1)
        out = run.load_output or ""
        m = run.metrics
        m.update(steal)
        m["achieved_rate"] = w.rps
        m["machine_cpu_s"] = round(busy, 3)
        m["machine_us_per_req"] = round(busy * 1e6 / w.requests, 2)
        m["p50_ms"] = parse_wrk_percentile(out, "50%")
        m["p99_ms"] = parse_wrk_percentile(out, "99%")

    def measure_latency(self, run: Run, sc: Scenario, port: int, proc: subprocess.Popen[bytes] | None) -> None:
        argv = self.load_pin(sc) + [str(loadgen_bin()), "latency", "--addr", f"127.0.0.1:{port}",
                                    "--path", sc.path, "--rate", str(self.args.latency_rate),
                                    "--connections", str(self.args.connections),
                                    "--duration", str(self.args.duration), "--warmup", "2"]
        run.load_command = argv
        out = self.cpu_accounting(run, proc, lambda: run_load(self.procs, argv, self.args.duration + 60))
        run.load_output = out
        r = last_json(out)
        m = run.metrics
        for k in ("p50", "p90", "p99", "p999"):
            m[f"{k}_ms"] = round(r[f"{k}_us"] / 1000, 3)
        m["max_ms"] = round(r["max_us"] / 1000, 3)
        m["achieved_rate"] = round(r["achieved_rate"], 1)
        m["errors"] = r["errors"]
        m["late_sends"] = r["late_sends"]
        if r["ok"] == 0:
            raise StartError("no successful request at the constant rate")

    def measure_idle(self, run: Run, sc: Scenario, port: int, proc: subprocess.Popen[bytes] | None) -> None:
        assert proc is not None
        n = sc.idle_conns
        fds0 = settled_fds(proc.pid)
        rss0 = tree_rss_bytes(proc.pid)
        per = [n // IDLE_CLIENT_PROCS + (1 if i < n % IDLE_CLIENT_PROCS else 0) for i in range(IDLE_CLIENT_PROCS)]
        clients = []
        t0 = time.monotonic()
        try:
            for i, k in enumerate(per):
                srcs = ",".join(IDLE_SOURCES[i::IDLE_CLIENT_PROCS])
                argv = self.load_pin(sc) + [str(loadgen_bin()), "idle", "--addr", f"127.0.0.1:{port}",
                                            "--connections", str(k), "--sources", srcs]
                run.load_command = argv
                p = subprocess.Popen(NICE + argv, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
                raise_autogroup(p.pid)
                self.procs.live[p.pid] = ("idle-client", p)
                clients.append(p)
            # Every proxied connection holds two descriptors in the balancer once it has
            # been accepted and connected on: wait for all of them, with a deadline.
            want = fds0 + 2 * n
            deadline = t0 + IDLE_DEADLINE_S
            fds = tree_fds(proc.pid)
            while fds < want:
                if time.monotonic() > deadline:
                    raise StartError(f"holds {(fds - fds0) // 2} of {n} connections after "
                                     f"{IDLE_DEADLINE_S:.0f}s")
                if any(c.poll() is not None for c in clients):
                    out = b"".join(c.stdout.read() or b"" for c in clients if c.poll() is not None and c.stdout)
                    raise StartError(f"an idle client exited early: {out.decode('utf-8', 'replace')[-300:]}")
                time.sleep(0.02)
                fds = tree_fds(proc.pid)
            accept_s = time.monotonic() - t0
            time.sleep(0.5)  # let lazily-touched memory settle before reading RSS
            rss_fresh = tree_rss_bytes(proc.pid)
            # The figure of merit is what an idle connection costs once it has been idle a
            # while: quill parks connections silent for `idle_park` (1 s by default; found
            # out between 1 and 2 s), the others do not change.
            time.sleep(IDLE_SETTLE_S)
            rss1 = tree_rss_bytes(proc.pid)
            if proc.poll() is not None:
                raise StartError(f"exited with code {proc.returncode} while holding connections")
            closed = 0
            for c in clients:
                out, _ = c.communicate(input=b"", timeout=30)
                self.procs.live.pop(c.pid, None)
                r = last_json(out.decode("utf-8", "replace"))
                closed += int(r.get("closed_by_peer", 0))
        finally:
            for c in clients:
                self.procs.stop(c, grace=2.0)
        m = run.metrics
        m["connections"] = n
        m["accept_s"] = round(accept_s, 3)
        m["rss_before"] = rss0
        m["rss_after"] = rss1
        m["bytes_per_conn"] = round((rss1 - rss0) / n)
        m["bytes_per_conn_fresh"] = round((rss_fresh - rss0) / n)
        m["closed_by_balancer"] = closed
        if closed:
            raise StartError(f"the balancer closed {closed} of {n} idle connections")

    def measure_syscalls(self, run: Run, sc: Scenario, port: int, proc: subprocess.Popen[bytes] | None) -> None:
        assert proc is not None
        n = self.args.syscall_requests
        out_path = self.tmp / f"perf-{run.balancer}-{port}.txt"
        # Count the process that serves: for nginx the worker (child of the master).
        tree = proc_tree(proc.pid)
        target = tree[-1] if run.balancer == "nginx" and len(tree) > 1 else proc.pid
        perf = self.procs.start("perf", perf_stat_argv(target, out_path), self.tmp / "perf.log")
        try:
            # perf stat prints nothing until it ends; it counts once it holds every event.
            deadline = time.monotonic() + 10
            while perf_events_open(perf.pid) < len(PERF_EVENTS):
                if time.monotonic() > deadline or perf.poll() is not None:
                    raise StartError(f"perf stat did not attach: {tail(self.tmp / 'perf.log')}")
                time.sleep(0.02)
            if sc.pace_ms:
                script = self.pace_script(sc)
                argv = self.load_pin(sc) + ["wrk", f"-t{WRK_THREADS}", f"-c{self.args.connections}",
                                            f"-d{self.args.duration}s", "-s", str(script),
                                            *sc.wrk_extra, f"http://127.0.0.1:{port}{sc.path}"]
                ok = self.run_wrk(run, proc, argv).requests
            else:
                argv = self.load_pin(sc) + [str(loadgen_bin()), "count", "--addr", f"127.0.0.1:{port}",
                                            "--path", sc.path, "--requests", str(n),
                                            "--connections", str(self.args.connections)]
                run.load_command = argv
                ok = last_json(run_load(self.procs, argv, 300))["ok"]
        finally:
            if perf.poll() is None:
                perf.send_signal(signal.SIGINT)
                try:
                    perf.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            self.procs.stop(perf)
        text = out_path.read_text("utf-8", "replace") if out_path.exists() else ""
        counts = parse_perf_stat(text)
        if "calls" not in counts or ok == 0:
            raise StartError(f"no system-call count from perf stat: {text[-300:]}")
        run.load_output = (run.load_output or "") + text
        run.metrics["requests"] = ok
        run.metrics["syscalls"] = counts["calls"]
        run.metrics["syscalls_per_req"] = round(counts["calls"] / ok, 2)
        run.metrics["empty_reads_per_req"] = round(
            (counts.get("empty_read", 0) + counts.get("empty_recvfrom", 0)) / ok, 3)
        if "context_switches" in counts:
            run.metrics["context_switches_per_req"] = round(counts["context_switches"] / ok, 3)
        # The calls made most, per request.
        calls = sorted(((name, round(c / ok, 2)) for name, c in counts.items()
                        if name in SYSCALL_NAMES and c), key=lambda nc: -nc[1])
        run.metrics["top"] = calls[:6]

    def run_all(self, scs: list[Scenario]) -> None:
        self.start_backend()
        plan = []
        for rnd in range(1, self.args.rounds + 1):
            for sc in scs:
                if sc.once and rnd > 1:
                    continue
                for bal in in_turn(self.selected, rnd):
                    if bal == "backend" and not sc.with_backend:
                        continue
                    plan.append((rnd, sc, bal))
        if self.args.held:
            # Every round of a scenario in a row, its balancers started once (sorted() is
            # stable: within a scenario the rounds keep their order).
            order = {sc.name: i for i, sc in enumerate(scs)}
            plan.sort(key=lambda p: order[p[1].name])
        for i, (rnd, sc, bal) in enumerate(plan, 1):
            if self.held and i > 1 and plan[i - 2][1].name != sc.name:
                self.held.release()
            run = self.measure(rnd, sc, bal)
            self.runs.append(run)
            prefix = f"[{i:>3}/{len(plan)}] round {rnd} {sc.name:<13} {bal:<8}"
            if run.ok:
                v = run.metrics.get(sc.metric)
                unit = sc.unit
                if sc.kind == "paced":  # the overhead needs the round's backend run: later
                    v, unit = run.metrics["machine_us_per_req"], f"{sc.unit} of machine CPU"
                extra = ""
                if "cpu_us_per_req" in run.metrics:
                    extra = f"  cpu {run.metrics['cpu_us_per_req']:.2f} us/req"
                if run.metrics.get("errors"):
                    extra += f"  errors {run.metrics['errors']}"
                if "steal_share" in run.metrics:
                    extra += f"  steal {run.metrics['steal_share']:.1%}"
                    extra += " DISTURBED" if run.metrics.get("disturbed") else ""
                if sc.layout == "one-core":
                    o0, o1 = run.core0_other_cpu_s or 0.0, run.core1_other_cpu_s or 0.0
                    if max(o0, o1) > INTERFERENCE_FRAC * self.args.duration:
                        extra += f"  (foreign CPU: core 0 {o0:.1f}s, core 1 {o1:.1f}s)"
                log(f"{prefix} {v:>12,} {unit}{extra}")
            else:
                first = (run.error or "?").splitlines()
                log(f"{prefix} FAILED: {first[0]}")
                for line in first[1:]:
                    log(f"{'':>20}{line}")
        self.held.release()


def last_json(out: str) -> dict[str, Any]:
    for line in out.splitlines()[::-1]:
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    raise StartError(f"no JSON result in: {out.strip()[-300:]}")


# --------------------------------------------------------------------------- summary


def summarize(runs: list[Run], scs: list[Scenario], selected: list[str],
              fatal: dict[str, str]) -> dict[str, Any]:
    add_overheads(runs, scs)
    summary: dict[str, Any] = {}
    for sc in scs:
        rows: dict[str, Any] = {}
        for bal in selected:
            if bal == "backend" and not sc.with_backend:
                continue
            rs = [r for r in runs if r.scenario == sc.name and r.balancer == bal]
            measured = [r for r in rs if r.ok and r.metrics.get(sc.metric) is not None]
            ok = undisturbed(measured)
            failed = [r for r in rs if not r.ok]
            row: dict[str, Any] = {"runs": len(rs), "ok_runs": len(ok), "failed_runs": len(failed),
                                   "disturbed_runs_left_out": len(measured) - len(ok),
                                   "failures": sorted({(r.error or "").splitlines()[0] for r in failed
                                                       if r.error})}
            if ok:
                vals = [r.metrics[sc.metric] for r in ok]
                med = statistics.median(vals)
                row.update({
                    "status": "ok" if not failed else "partial",
                    "median": med, "min": min(vals), "max": max(vals), "all": vals,
                    "spread_pct": round((max(vals) - min(vals)) / med * 100, 1) if med else None,
                    "errors": sum(r.metrics.get("errors", 0) for r in ok),
                })
                # Secondary figures: medians of whatever else the runs measured.
                for key in ("cpu_us_per_req", "cpu_s_per_gb", "p50_ms", "p99_ms", "p999_ms", "accept_s",
                            "achieved_rate", "machine_us_per_req", "empty_reads_per_req",
                            "context_switches_per_req"):
                    xs = [r.metrics[key] for r in ok if r.metrics.get(key) is not None]
                    if xs:
                        row[key] = round(statistics.median(xs), 3)
                tops = [r.metrics["top"] for r in ok if r.metrics.get("top")]
                if tops:
                    row["top_syscalls"] = tops[0]
                foreign = [max(r.core0_other_cpu_s or 0.0, r.core1_other_cpu_s or 0.0) for r in ok]
                row["foreign_cpu_s_max"] = round(max(foreign), 2)
            else:
                row["status"] = "failed"
                if bal in fatal and not row["failures"]:
                    row["failures"] = [fatal[bal]]
            rows[bal] = row
        back = rows.get("backend", {}).get("median")
        if back and sc.higher_is_better:
            for row in rows.values():
                if row.get("median") is not None:
                    row["pct_of_backend"] = round(row["median"] / back * 100, 1)
        ratios: dict[str, float | None] = {}
        q = rows.get("quill", {}).get("median")
        present = [a for a in ANCHORS if a in rows]
        for other in present + (["backend"] if "backend" in rows else []):
            o = rows[other].get("median")
            ratios[f"quill/{other}"] = round(q / o, 3) if q and o else None
        anchor_vals = [rows[a]["median"] for a in present if rows[a].get("median") and a not in sc.not_best]
        if q and anchor_vals:
            best = max(anchor_vals) if sc.higher_is_better else min(anchor_vals)
            ratios["quill/best anchor"] = round(q / best, 3)
        cq = rows.get("quill", {}).get("cpu_us_per_req")
        for other in present:
            co = rows[other].get("cpu_us_per_req")
            if cq and co:
                ratios[f"cpu_per_req quill/{other}"] = round(cq / co, 3)
        summary[sc.name] = {"description": sc.desc, "metric": sc.metric, "unit": sc.unit,
                            "not_best": {a: sc.not_best_why for a in sc.not_best},
                            "higher_is_better": sc.higher_is_better, "layout": sc.layout,
                            "balancers": rows, "ratios": ratios}
    return summary


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v < 100:
        return f"{v:,.2f}"
    return f"{v:,.0f}"


def fmt_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines: list[str] = []
    for name, s in summary.items():
        better = "higher is better" if s["higher_is_better"] else "lower is better"
        lines.append("")
        lines.append(f"=== {name}: {s['description']} [{s['unit']}, {better}; layout {s['layout']}] ===")
        lines.append(f"{'balancer':<9} {'median':>12} {'min-max':>23} {'spread':>7} {'errors':>7} "
                     f"{'CPU us/req':>11} {'% backend':>10}  other")
        notes: list[str] = []
        for bal, row in s["balancers"].items():
            if row.get("median") is None:
                reason = row["failures"][0] if row["failures"] else "no successful run"
                lines.append(f"{bal:<9} {'FAILED':>12}  {reason}")
                continue
            mm = f"{_fmt(row['min'])}-{_fmt(row['max'])}"
            spread = f"{row['spread_pct']:.1f}%" if row.get("spread_pct") is not None else "-"
            pct = f"{row['pct_of_backend']:.1f}%" if row.get("pct_of_backend") is not None else "-"
            other = []
            if row.get("cpu_s_per_gb") is not None:
                other.append(f"CPU {row['cpu_s_per_gb']:.3f} s/GB")
            if row.get("machine_us_per_req") is not None:
                other.append(f"machine {row['machine_us_per_req']:.1f} us/req at "
                             f"{row.get('achieved_rate', 0):,.0f} req/s, p99 {row.get('p99_ms') or 0:.2f} ms")
            elif row.get("p50_ms") is not None:
                other.append(f"p50 {row['p50_ms']:.3f} ms, p99.9 {row['p999_ms']:.3f} ms")
            if row.get("accept_s") is not None:
                other.append(f"all held after {row['accept_s']:.2f} s")
            if row.get("top_syscalls"):
                other.append(", ".join(f"{n} {c}" for n, c in row["top_syscalls"][:4]))
            if row.get("empty_reads_per_req") is not None:
                other.append(f"empty reads {row['empty_reads_per_req']:.3f}, context switches "
                             f"{row.get('context_switches_per_req', 0):.3f} a request")
            lines.append(f"{bal:<9} {_fmt(row['median']):>12} {mm:>23} {spread:>7} {row['errors']:>7} "
                         f"{_fmt(row.get('cpu_us_per_req')):>11} {pct:>10}  {'; '.join(other)}")
            if row["failed_runs"]:
                notes.append(f"  {bal}: {row['failed_runs']} of {row['runs']} runs failed: "
                             f"{'; '.join(row['failures'])}")
            if s["layout"] == "one-core" and row.get("foreign_cpu_s_max", 0) > INTERFERENCE_FRAC * args.duration:
                notes.append(f"  {bal}: other processes used up to {row['foreign_cpu_s_max']:.1f} s of core 0 "
                             "or 1 during its runs -- figures disturbed, rerun on a quiet machine")
        lines.extend(notes)
        r = s["ratios"]
        if r:
            parts = [f"{k} {v:.2f}x" if v is not None else f"{k} n/a" for k, v in r.items()
                     if not k.startswith("cpu")]
            lines.append(f"ratios ({better} for quill): " + "  ".join(parts))
            for a, why in s.get("not_best", {}).items():
                lines.append(f"  best anchor leaves out {a}: {why}")
            cparts = [f"{k.split(' ', 1)[1]} {v:.2f}x" for k, v in r.items() if k.startswith("cpu") and v]
            if cparts:
                lines.append("CPU-per-request ratios (lower is better for quill): " + "  ".join(cparts))
    return "\n".join(lines)


COLOURS = {"quill": "#2b6cb0", "pen": "#a0aec0", "haproxy": "#ed8936", "nginx": "#48bb78",
           "backend": "#4a5568", "quill-nopoll": "#90cdf4", "quill-poll": "#1a365d",
           "quill-defer": "#805ad5", "quill-pbs": "#2c7a7b", "quill-base": "#b7791f"}


def svg_chart(summary: dict[str, Any], title: str) -> str:
    """One horizontal bar panel per scenario; plain SVG, no dependencies."""
    panel_w, bar_h, gap, label_w = 560, 18, 4, 90
    panels = []
    y = 40
    for name, s in summary.items():
        rows = [(b, r["median"]) for b, r in s["balancers"].items() if r.get("median") is not None]
        if not rows:
            continue
        top = max(v for _, v in rows) or 1
        better = "higher is better" if s["higher_is_better"] else "lower is better"
        parts = [f'<text x="10" y="{y}" font-weight="bold">{html.escape(name)}: '
                 f'{html.escape(s["description"])} ({html.escape(s["unit"])}, {better})</text>']
        y += 8
        for bal, v in rows:
            w = max(1, int((panel_w - label_w - 120) * v / top))
            parts.append(f'<text x="10" y="{y + bar_h - 5}">{bal}</text>'
                         f'<rect x="{label_w}" y="{y}" width="{w}" height="{bar_h}" '
                         f'fill="{COLOURS.get(bal, "#718096")}"/>'
                         f'<text x="{label_w + w + 6}" y="{y + bar_h - 5}">{_fmt(v)}</text>')
            y += bar_h + gap
        best = s["ratios"].get("quill/best anchor")
        if best is not None:
            parts.append(f'<text x="{label_w}" y="{y + 12}" fill="#2b6cb0">quill / best anchor: {best:.2f}x</text>')
            y += 18
        y += 26
        panels.append("".join(parts))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{panel_w + 40}" height="{y}" '
            f'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>'
            f'<text x="10" y="20" font-size="15" font-weight="bold">{html.escape(title)}</text>'
            + "".join(panels) + "</svg>\n")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run",
        description="Compare quill with Pen, HAProxy and NGINX (stream) as TCP load balancers in front "
                    "of one nginx backend: throughput (wrk), latency at a constant rate, idle memory, "
                    "system calls; balancer on core 0, load and backend on core 1, then on both cores.")
    p.add_argument("--quick", action="store_true",
                   help="smoke check of the harness (~2 min): 1 round, 3 s runs, 1,000 idle only, "
                        "no both-cores table")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick: 1)")
    p.add_argument("--duration", type=int, default=None, help="seconds per load run (default 10, --quick: 3)")
    p.add_argument("--only", default=",".join(b for b in ALL_BALANCERS if b not in OPTIONAL_BALANCERS),
                   help=f"comma list out of {','.join(ALL_BALANCERS)} (default: all)")
    p.add_argument("--base-bin", type=Path, default=None,
                   help="the binary of the quill-base variant (another build, or a script running one "
                        "with options), for an A/B in one run; measured when --only names quill-base")
    p.add_argument("--scenarios", default=None,
                   help="comma list of scenario names to run (default: all; see the table headings)")
    p.add_argument("--latency-rate", type=int, default=20000,
                   help="requests/s of the constant-rate latency scenario (default 20000)")
    p.add_argument("--syscall-requests", type=int, default=20000,
                   help="requests traced in the syscalls scenario (default 20000)")
    p.add_argument("--no-all-cores", action="store_true", help="skip the both-cores table")
    p.add_argument("--efficiency", action="store_true",
                   help="only the efficiency yardstick: machine CPU per request over the backend "
                        "alone at paced loads (1, 5, 20 ms per connection; also in the full run)")
    p.add_argument("--held", action="store_true",
                   help="paced scenarios: start each balancer once per scenario and keep it running through "
                        "all its rounds, which then follow one another (many short rounds spread the "
                        "host's spells of steal over every balancer alike)")
    p.add_argument("--warmup", type=int, default=None,
                   help="seconds of the same load before each measured wrk run (saturated or paced), unmeasured "
                        "(default 3, --quick: 1; 0: none)")
    p.add_argument("--quill-bin", type=Path, default=None,
                   help="quill binary (default: <repo>/target/release/quill; giving it skips the build)")
    p.add_argument("--no-build", action="store_true", help="do not build quill and the load generator")
    p.add_argument("--connections", type=int, default=WRK_CONNECTIONS, help=argparse.SUPPRESS)
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (configs, logs) for debugging")
    p.add_argument("--no-save", action="store_true", help="do not write bench/results/*")
    a = p.parse_args(argv)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    a.duration = a.duration if a.duration is not None else (3 if a.quick else 10)
    a.warmup = a.warmup if a.warmup is not None else (1 if a.quick else 3)
    if a.quick and a.syscall_requests == 20000:
        a.syscall_requests = 5000
    if a.rounds < 1 or a.duration < 1 or a.latency_rate < 1 or a.syscall_requests < 1:
        p.error("--rounds, --duration, --latency-rate and --syscall-requests must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    sel = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in sel if s not in ALL_BALANCERS]
    if bad or not sel:
        p.error(f"--only: unknown {bad}; choose from {','.join(ALL_BALANCERS)}")
    a.selected = [b for b in ALL_BALANCERS if b in sel]  # canonical order
    if "quill-base" in a.selected and a.base_bin is None:
        p.error("--only names quill-base: give its binary with --base-bin")
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def on_signal(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    started = dt.datetime.now()
    selected: list[str] = args.selected
    scs = scenarios(args)
    if args.scenarios:
        want = [s.strip() for s in args.scenarios.split(",") if s.strip()]
        unknown = [w for w in want if w not in {s.name for s in scs}]
        if unknown:
            print(f"bench: unknown scenarios {unknown}; known: {', '.join(s.name for s in scs)}",
                  file=sys.stderr)
            return 2
        scs = [s for s in scs if s.name in want]
    fatal: dict[str, str] = {}
    quill_bin = (args.quill_bin or REPO_ROOT / "target" / "release" / "quill").resolve()

    try:
        ensure_tools(selected, any(s.kind == "syscalls" for s in scs))
        check_cores()
        if not args.no_build:
            reason = cargo_build("the load generator", LOADGEN_DIR, [])
            if reason:
                raise BenchError(reason)
        if any(s.kind not in ("wrk", "paced") for s in scs) and not loadgen_bin().is_file():
            raise BenchError(f"load generator missing: {loadgen_bin()} (run without --no-build)")
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1

    if set(QUILL_VARIANTS) & set(selected):
        if not args.no_build and args.quill_bin is None:
            reason = cargo_build("quill", REPO_ROOT, ["-p", "quill"])
            if reason:
                fatal["quill"] = reason
        elif args.quill_bin is not None and not args.no_build:
            log(f"--quill-bin given: not building, using {quill_bin}")
        if "quill" not in fatal and not (quill_bin.is_file() and os.access(quill_bin, os.X_OK)):
            fatal["quill"] = f"quill binary not found or not executable: {quill_bin}"
        if "quill" in fatal:
            for variant in QUILL_VARIANTS:
                fatal[variant] = fatal["quill"]
            warn(f"quill will not be measured: {fatal['quill']}")

    machine = describe_machine()
    versions = describe_versions(quill_bin, selected)
    if float(machine["loadavg_at_start"].split()[0]) > 0.5:
        warn(f"load average at start is {machine['loadavg_at_start'].split()[0]}: other work on this "
             "machine will skew the figures")
    log(f"bench: balancers {','.join(selected)}; {args.rounds} round(s); scenarios "
        f"{', '.join(s.name for s in scs)}; {args.duration}s per load run")
    cc = machine["sysctl"].get("net.ipv4.tcp_congestion_control")
    if cc and cc != "cubic":
        warn(f"TCP congestion control is {cc}: over loopback its pacing reorders the segments of a "
             "relay on another core than its peers, which moves 1 MiB figures and p99s "
             "(bench/RESULTS.md); compare runs only under the same one")

    raise_autogroup("self")
    bench = Bench(args, selected, quill_bin, fatal)
    interrupted: str | None = None
    fatal_error: str | None = None
    try:
        bench.run_all(scs)
    except KeyboardInterrupt:
        interrupted = "SIGINT"
    except Interrupted as e:
        interrupted = str(e)
    except BenchError as e:
        fatal_error = str(e)
    finally:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        bench.close()
    if fatal_error is not None:
        print(f"bench: {fatal_error}", file=sys.stderr)
        return 1
    if interrupted:
        print(f"\nbench: interrupted ({interrupted}); all started processes stopped, no results written",
              file=sys.stderr)
        return 130

    summary = summarize(bench.runs, scs, selected, fatal)
    log(fmt_table(summary, args))

    machine["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
    result = {
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine,
        "versions": versions,
        "config": {
            "rounds": args.rounds, "duration_s": args.duration, "warmup_s": args.warmup, "wrk_threads": WRK_THREADS,
            "connections": args.connections, "quick": args.quick, "balancers": selected,
            "balancer_core_one_core_layout": int(BALANCER_CORE), "load_and_backend_core": int(LOAD_CORE),
            "latency_rate": args.latency_rate, "syscall_requests": args.syscall_requests,
            "scenarios": {s.name: {"kind": s.kind, "description": s.desc, "layout": s.layout,
                                   "path": s.path, "wrk_extra_args": list(s.wrk_extra),
                                   "idle_connections": s.idle_conns, "once": s.once} for s in scs},
            "backend": "nginx worker_processes 1 on core 1: 1024-byte file at /1k, 1 MiB at /1m, "
                       "access_log off, sendfile off",
            "haproxy": f"mode tcp, maxconn {HAPROXY_MAXCONN}, nbthread 1 (one-core) or cores (all-cores)",
            "nginx_stream": "worker_processes 1 (one-core) or cores (all-cores), proxy_pass to the backend",
            "quill_pen": f"-f -r -x {MAX_CONNS} LISTEN BACKEND",
            "order": "per round, per scenario, each balancer in turn (each round starting one further along); each balancer started fresh per run",
        },
        "not_measured": fatal,
        "summary": summary,
        "runs": [r.to_json() for r in bench.runs],
    }
    if not args.no_save:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        stem = started.strftime('%Y-%m-%dT%H-%M-%S')
        path = RESULTS_DIR / f"{stem}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        chart = RESULTS_DIR / f"{stem}.svg"
        chart.write_text(svg_chart(summary, f"quill benchmark {stem} ({'quick' if args.quick else 'full'})"))
        log(f"\nresults written to {path}\nchart written to {chart}")
    any_failed = any(row["status"] != "ok" for s in summary.values() for row in s["balancers"].values())
    if any_failed:
        warn("some balancers failed (see table); exit code 3")
        return 3
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # e.g. during the cargo build, before any process of ours exists
        print("\nbench: interrupted", file=sys.stderr)
        sys.exit(130)
