#!/usr/bin/env python3
"""Comparative TCP load-balancer benchmark: quill vs pen vs haproxy vs backend alone.

Python 3.11, standard library only.  See bench/README.md for the rules.

Layout of one benchmark:
  * one backend: nginx (worker_processes 1) serving a 1024-byte file at /1k,
    pinned to core 1 (generated config in a temp dir);
  * each balancer in turn on its own loopback port, pinned to core 0, started
    fresh for every measurement, waited for (connect poll with a deadline) and
    verified with one HTTP request that must return the exact 1 KiB body;
  * wrk pinned to core 1: `wrk -t1 -c50 -dDs http://127.0.0.1:PORT/1k`,
    keep-alive and with `-H 'Connection: close'`;
  * rounds are interleaved (A B C A B C ...), medians are reported;
  * the balancer's CPU time (utime+stime from /proc/PID/stat) over each run is
    turned into CPU microseconds per request.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import http.client
import json
import os
import random
import resource
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

ALL_BALANCERS = ("quill", "pen", "haproxy", "backend")
ANCHORS = ("pen", "haproxy")
# name, extra wrk arguments, human description
SCENARIOS: list[tuple[str, list[str], str]] = [
    ("keepalive", [], "keep-alive"),
    ("close", ["-H", "Connection: close"], "connection per request (Connection: close)"),
]

BALANCER_CORE = "0"
LOAD_CORE = "1"  # wrk and the backend nginx
WRK_THREADS = 1
WRK_CONNECTIONS = 50
MAX_CONNS = "10000"  # -x for quill and pen
HAPROXY_MAXCONN = 9800  # 2*maxconn + overhead must fit in the 20,000 fd limit
READY_TIMEOUT_S = 10.0
STOP_GRACE_S = 5.0
GIVE_UP_AFTER_START_FAILURES = 2
# A run is flagged when processes other than balancer/nginx/wrk used more than this
# fraction of core 0 or core 1 (user+system time from /proc/stat; approximate).
INTERFERENCE_FRAC = 0.10

# Deterministic, non-compressible-looking 1 KiB body.
BODY = bytes((i * 37 + 11) % 94 + 33 for i in range(1024))

CLK_TCK = os.sysconf("SC_CLK_TCK")

ENV = dict(os.environ)
ENV["PATH"] = ENV.get("PATH", "/usr/bin:/bin") + ":/usr/local/sbin:/usr/sbin:/sbin"
ENV["LC_ALL"] = "C"

# tool command -> Debian package
TOOL_PACKAGES = {"pen": "pen", "haproxy": "haproxy", "nginx": "nginx-light", "wrk": "wrk", "taskset": "util-linux"}


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
            p = subprocess.Popen(argv, env=ENV, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                 start_new_session=True)
        finally:
            if f is not None:
                f.close()
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


def proc_tree_ticks(root: int) -> int | None:
    """utime+stime (clock ticks) of root and its live descendants.
    /proc/PID/stat of a thread-group leader already sums all its threads."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            data = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        rest = data[data.rindex(")") + 2:].split()
        # rest[0]=state(3) rest[1]=ppid(4) ... rest[11]=utime(14) rest[12]=stime(15)
        stats[int(entry)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    if root not in stats:
        return None
    total = 0
    todo = [root]
    seen = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(c for c, (pp, _) in stats.items() if pp == pid)
    return total


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


def http_get_1k(port: int, timeout: float) -> None:
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


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = READY_TIMEOUT_S) -> float:
    """Poll connect until it accepts, then verify one HTTP request returns the 1 KiB body.
    Returns seconds taken."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    wait_accepting(port, proc, deadline)
    last: Exception | None = None
    while True:
        if proc.poll() is not None:
            raise StartError(f"process exited with code {proc.returncode} during verification")
        try:
            http_get_1k(port, timeout=max(0.5, min(5.0, deadline - time.monotonic())))
            return time.monotonic() - t0
        except (OSError, http.client.HTTPException, StartError) as e:
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


def parse_wrk(out: str) -> WrkResult:
    m = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    n = re.search(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m|h)", out, re.M)
    if not m or not n:
        raise ValueError("could not find 'Requests/sec' in wrk output")
    r = WrkResult(rps=float(m.group(1)), requests=int(n.group(1)),
                  seconds=float(n.group(2)) * _UNIT_S[n.group(3)])
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


# --------------------------------------------------------------------------- configs


def write_backend(tmp: Path, port: int) -> Path:
    www = tmp / "www"
    www.mkdir()
    (www / "1k").write_bytes(BODY)
    os.chmod(www, 0o755)
    os.chmod(www / "1k", 0o644)
    cfg = tmp / "nginx.conf"
    cfg.write_text(f"""# generated by bench/tcp_bench.py
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
    keepalive_requests 100000;
    keepalive_timeout 65s;
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
        location = /1k {{
            default_type application/octet-stream;
        }}
    }}
}}
""")
    return cfg


def write_haproxy(tmp: Path, port: int, backend_port: int) -> Path:
    cfg = tmp / f"haproxy-{port}.cfg"
    cfg.write_text(f"""# generated by bench/tcp_bench.py
global
    nbthread 1
    maxconn {HAPROXY_MAXCONN}

defaults
    mode tcp
    timeout connect 30s
    timeout client 30s
    timeout server 30s

frontend fe
    bind 127.0.0.1:{port}
    default_backend be

backend be
    server s1 127.0.0.1:{backend_port}
""")
    return cfg


def balancer_argv(name: str, port: int, backend_port: int, tmp: Path, quill_bin: Path) -> list[str]:
    listen, target = f"127.0.0.1:{port}", f"127.0.0.1:{backend_port}"
    pin = ["taskset", "-c", BALANCER_CORE]
    if name == "quill":
        return pin + [str(quill_bin), "-f", "-r", "-x", MAX_CONNS, listen, target]
    if name == "pen":
        return pin + ["pen", "-f", "-r", "-x", MAX_CONNS, listen, target]
    if name == "haproxy":
        return pin + ["haproxy", "-f", str(write_haproxy(tmp, port, backend_port)), "-db"]
    raise ValueError(name)


# --------------------------------------------------------------------------- setup


def ensure_tools(selected: list[str]) -> None:
    needed = ["taskset", "nginx", "wrk"] + [b for b in ("pen", "haproxy") if b in selected]
    missing = [t for t in needed if which(t) is None]
    if not missing:
        return
    pkgs = sorted({TOOL_PACKAGES[t] for t in missing})
    log(f"missing commands {missing}: apt-get install -y {' '.join(pkgs)}")
    if os.geteuid() != 0:
        raise BenchError(f"missing {missing} and not root; install: apt-get install -y {' '.join(pkgs)}")
    env = dict(ENV, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", *pkgs]
    if subprocess.run(cmd, env=env, check=False).returncode != 0:
        log("apt-get install failed; running apt-get update and retrying")
        subprocess.run(["apt-get", "update"], env=env, check=False)
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            raise BenchError(f"apt-get install -y {' '.join(pkgs)} failed")
    still = [t for t in needed if which(t) is None]
    if still:
        raise BenchError(f"still missing after install: {still}")


def check_cores() -> None:
    try:
        aff = os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover
        aff = set(range(os.cpu_count() or 1))
    need = {int(BALANCER_CORE), int(LOAD_CORE)}
    if not need <= aff:
        raise BenchError(f"need CPU cores {sorted(need)} available (have {sorted(aff)})")
    if len(aff) > 2:
        warn(f"{len(aff)} cores available; only cores 0 and 1 are used, others stay idle")


def build_quill() -> str | None:
    """Returns None on success, else a failure reason."""
    cargo = which("cargo")
    if cargo is None:
        return "cargo not found; cannot build quill (use --no-build / --quill-bin)"
    log(f"building quill: (cd {REPO_ROOT} && cargo build --release -p quill)")
    rc = subprocess.run([cargo, "build", "--release", "-p", "quill"], cwd=REPO_ROOT, env=ENV,
                        stdin=subprocess.DEVNULL, check=False).returncode
    if rc != 0:
        return f"cargo build --release -p quill failed with exit code {rc} (see output above)"
    return None


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
    for k in ("net/ipv4/ip_local_port_range", "net/ipv4/tcp_tw_reuse", "net/ipv4/tcp_max_tw_buckets",
              "net/core/somaxconn", "net/ipv4/tcp_max_syn_backlog"):
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


@dataclass
class Run:
    round: int
    scenario: str
    balancer: str
    ok: bool = False
    error: str | None = None
    port: int | None = None
    command: list[str] | None = None
    wrk_command: list[str] | None = None
    ready_s: float | None = None
    cpus_allowed: str | None = None
    wrk: WrkResult | None = None
    balancer_cpu_s: float | None = None
    backend_cpu_s: float | None = None
    wrk_cpu_s: float | None = None
    core0_other_cpu_s: float | None = None
    core1_other_cpu_s: float | None = None
    core1_busy_frac: float | None = None
    wrk_output: str | None = None

    @property
    def cpu_us_per_req(self) -> float | None:
        if self.balancer_cpu_s is None or not self.wrk or self.wrk.requests == 0:
            return None
        return self.balancer_cpu_s * 1e6 / self.wrk.requests

    @property
    def backend_cpu_us_per_req(self) -> float | None:
        if self.backend_cpu_s is None or not self.wrk or self.wrk.requests == 0:
            return None
        return self.backend_cpu_s * 1e6 / self.wrk.requests

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "round": self.round, "scenario": self.scenario, "balancer": self.balancer, "ok": self.ok,
            "error": self.error, "port": self.port, "command": self.command,
            "wrk_command": self.wrk_command, "ready_s": _r(self.ready_s, 3),
            "balancer_cpus_allowed": self.cpus_allowed,
            "balancer_cpu_s": _r(self.balancer_cpu_s, 3), "backend_cpu_s": _r(self.backend_cpu_s, 3),
            "cpu_us_per_req": _r(self.cpu_us_per_req, 3),
            "backend_cpu_us_per_req": _r(self.backend_cpu_us_per_req, 3),
            "wrk_cpu_s": _r(self.wrk_cpu_s, 3),
            "core0_other_user_sys_s": _r(self.core0_other_cpu_s, 3),
            "core1_other_user_sys_s": _r(self.core1_other_cpu_s, 3),
            "core1_busy_frac": _r(self.core1_busy_frac, 3),
        }
        if self.wrk:
            w = self.wrk
            d.update({
                "rps": w.rps, "requests": w.requests, "seconds": w.seconds,
                "latency_avg": w.latency_avg,
                "errors": {"connect": w.errors_connect, "read": w.errors_read, "write": w.errors_write,
                           "timeout": w.errors_timeout, "non2xx": w.non2xx, "total": w.errors},
            })
        d["wrk_output"] = self.wrk_output
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
        self.runs: list[Run] = []

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
            f"http://127.0.0.1:{self.backend_port}/1k")

    def measure(self, rnd: int, scenario: str, extra: list[str], bal: str) -> Run:
        run = Run(round=rnd, scenario=scenario, balancer=bal)
        if bal in self.fatal:
            run.error = self.fatal[bal]
            return run
        assert self.backend is not None
        if self.backend.poll() is not None:
            raise BenchError(f"backend nginx died (exit {self.backend.returncode}):\n"
                             f"{tail(self.tmp / 'nginx-error.log')}")
        proc = None
        logf = None
        try:
            if bal == "backend":
                port = self.backend_port
                run.command = self.backend_argv
            else:
                port = free_port()
                argv = balancer_argv(bal, port, self.backend_port, self.tmp, self.quill_bin)
                run.command = argv
                logf = self.tmp / f"{bal}-{port}.log"
                try:
                    proc = self.procs.start(bal, argv, logf)
                except OSError as e:
                    raise StartError(f"cannot execute {argv[3]}: {e}") from None
                try:
                    run.ready_s = wait_ready(port, proc)
                except StartError as e:
                    t = tail(logf)
                    raise StartError(f"{e}" + (f"\n--- {bal} output (tail) ---\n{t}" if t else "")) from None
                run.cpus_allowed = cpus_allowed(proc.pid)
                if run.cpus_allowed != BALANCER_CORE:
                    warn(f"{bal} pid {proc.pid} allowed on CPUs {run.cpus_allowed}, expected {BALANCER_CORE}")
            run.port = port
            if bal == "backend":
                http_get_1k(port, 5.0)
            url = f"http://127.0.0.1:{port}/1k"
            wrk_argv = ["taskset", "-c", LOAD_CORE, "wrk", f"-t{WRK_THREADS}", f"-c{self.args.connections}",
                        f"-d{self.args.duration}s", *extra, url]
            run.wrk_command = wrk_argv

            cores0 = cpu_core_ticks()
            b0 = proc_tree_ticks(proc.pid) if proc else None
            n0 = proc_tree_ticks(self.backend.pid)
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            wrk = self.procs.start("wrk", wrk_argv, None, stdout_pipe=True)
            try:
                out_b, _ = wrk.communicate(timeout=self.args.duration + 60)
            except subprocess.TimeoutExpired:
                self.procs.stop(wrk)
                raise StartError("wrk did not finish in time") from None
            except BaseException:
                self.procs.stop(wrk)
                raise
            self.procs.live.pop(wrk.pid, None)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # wrk is the only child reaped here
            b1 = proc_tree_ticks(proc.pid) if proc else None
            n1 = proc_tree_ticks(self.backend.pid)
            cores1 = cpu_core_ticks()

            out = out_b.decode("utf-8", "replace")
            run.wrk_output = out
            if proc is not None and proc.poll() is not None:
                raise StartError(f"{bal} exited with code {proc.returncode} during the run"
                                 + (f"\n{tail(logf)}" if logf else ""))
            if wrk.returncode != 0:
                raise StartError(f"wrk exited with code {wrk.returncode}: {out.strip()[-500:]}")
            try:
                run.wrk = parse_wrk(out)
            except ValueError as e:
                raise StartError(f"{e}: {out.strip()[-500:]}") from None
            if b0 is not None and b1 is not None:
                run.balancer_cpu_s = (b1 - b0) / CLK_TCK
            if n0 is not None and n1 is not None:
                run.backend_cpu_s = (n1 - n0) / CLK_TCK
            c0 = f"cpu{BALANCER_CORE}"
            c1 = f"cpu{LOAD_CORE}"
            if c0 in cores0 and c0 in cores1:
                busy0 = (cores1[c0][0] - cores0[c0][0]) / CLK_TCK
                run.core0_other_cpu_s = max(0.0, busy0 - (run.balancer_cpu_s or 0.0))
            if c1 in cores0 and c1 in cores1:
                tot = cores1[c1][1] - cores0[c1][1]
                busy1 = (cores1[c1][0] - cores0[c1][0]) / CLK_TCK
                run.core1_busy_frac = busy1 * CLK_TCK / tot if tot else None
                run.wrk_cpu_s = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
                run.core1_other_cpu_s = max(0.0, busy1 - run.wrk_cpu_s - (run.backend_cpu_s or 0.0))
            if run.wrk.requests == 0:
                raise StartError("wrk completed 0 requests")
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
            if proc is not None:
                self.procs.stop(proc)
        return run

    def run_all(self) -> None:
        self.start_backend()
        total = self.args.rounds * len(SCENARIOS) * len(self.selected)
        i = 0
        for rnd in range(1, self.args.rounds + 1):
            for sc, extra, _desc in SCENARIOS:
                for bal in self.selected:
                    i += 1
                    run = self.measure(rnd, sc, extra, bal)
                    self.runs.append(run)
                    prefix = f"[{i:>2}/{total}] round {rnd} {sc:<9} {bal:<8}"
                    if run.ok and run.wrk:
                        cpu = run.cpu_us_per_req
                        cpu_s = f"{cpu:6.2f} us/req" if cpu is not None else "      -"
                        extra_s = ""
                        o0, o1 = run.core0_other_cpu_s or 0.0, run.core1_other_cpu_s or 0.0
                        if max(o0, o1) > INTERFERENCE_FRAC * self.args.duration:
                            extra_s = (f"  (foreign CPU: core 0 {o0:.1f}s, core 1 {o1:.1f}s "
                                       f"of {self.args.duration}s)")
                        log(f"{prefix} {run.wrk.rps:>12,.0f} req/s  errors {run.wrk.errors:<6} "
                            f"cpu {cpu_s}{extra_s}")
                    else:
                        first = (run.error or "?").splitlines()
                        log(f"{prefix} FAILED: {first[0]}")
                        for line in first[1:]:
                            log(f"{'':>20}{line}")


# --------------------------------------------------------------------------- summary


def summarize(runs: list[Run], selected: list[str], fatal: dict[str, str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for sc, _extra, desc in SCENARIOS:
        rows: dict[str, Any] = {}
        for bal in selected:
            rs = [r for r in runs if r.scenario == sc and r.balancer == bal]
            ok = [r for r in rs if r.ok and r.wrk]
            failed = [r for r in rs if not r.ok]
            row: dict[str, Any] = {"runs": len(rs), "ok_runs": len(ok), "failed_runs": len(failed),
                                   "failures": sorted({(r.error or "").splitlines()[0] for r in failed
                                                       if r.error})}
            if ok:
                rps = [r.wrk.rps for r in ok if r.wrk]
                med = statistics.median(rps)
                cpu = [r.cpu_us_per_req for r in ok if r.cpu_us_per_req is not None]
                bcpu = [r.backend_cpu_us_per_req for r in ok if r.backend_cpu_us_per_req is not None]
                errs = {k: sum(getattr(r.wrk, f"errors_{k}") for r in ok if r.wrk)
                        for k in ("connect", "read", "write", "timeout")}
                errs["non2xx"] = sum(r.wrk.non2xx for r in ok if r.wrk)
                errs["total"] = sum(errs.values())
                row.update({
                    "status": "ok" if not failed else "partial",
                    "rps_median": round(med, 2), "rps_min": min(rps), "rps_max": max(rps),
                    "rps_all": rps,
                    "spread_pct": round((max(rps) - min(rps)) / med * 100, 2) if med else None,
                    "errors": errs,
                    "cpu_us_per_req_median": round(statistics.median(cpu), 3) if cpu else None,
                    "cpu_us_per_req_all": [round(c, 3) for c in cpu],
                    "backend_cpu_us_per_req_median": round(statistics.median(bcpu), 3) if bcpu else None,
                    "foreign_cpu_frac_max": round(max(
                        max(r.core0_other_cpu_s or 0.0, r.core1_other_cpu_s or 0.0) / r.wrk.seconds
                        for r in ok if r.wrk and r.wrk.seconds), 3),
                })
            else:
                row["status"] = "failed"
                if bal in fatal and not row["failures"]:
                    row["failures"] = [fatal[bal]]
            rows[bal] = row
        back = rows.get("backend", {}).get("rps_median")
        for bal, row in rows.items():
            if back and row.get("rps_median") is not None:
                row["pct_of_backend"] = round(row["rps_median"] / back * 100, 1)
        ratios: dict[str, Any] = {}
        q = rows.get("quill", {})
        for other in (*ANCHORS, "backend"):
            if "quill" not in rows or other not in rows:
                continue
            o = rows[other]
            key = f"quill/{other}"
            if q.get("rps_median") and o.get("rps_median"):
                ratios[key] = round(q["rps_median"] / o["rps_median"], 3)
            else:
                ratios[key] = None
            if other in ANCHORS:
                if q.get("cpu_us_per_req_median") and o.get("cpu_us_per_req_median"):
                    ratios[f"cpu_per_req {key}"] = round(q["cpu_us_per_req_median"] / o["cpu_us_per_req_median"], 3)
                else:
                    ratios[f"cpu_per_req {key}"] = None
        summary[sc] = {"description": desc, "balancers": rows, "ratios": ratios}
    return summary


def fmt_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines: list[str] = []
    for sc, extra, desc in SCENARIOS:
        s = summary[sc]
        hdr_extra = " -H 'Connection: close'" if extra else ""
        lines.append("")
        lines.append(f"=== {sc}: {desc} -- wrk -t{WRK_THREADS} -c{args.connections} -d{args.duration}s"
                     f"{hdr_extra} .../1k, {args.rounds} round(s) ===")
        lines.append(f"{'balancer':<9} {'median req/s':>13} {'min-max req/s':>21} {'spread':>7} "
                     f"{'errors':>7} {'CPU us/req':>11} {'% backend':>10}")
        notes: list[str] = []
        for bal, row in s["balancers"].items():
            if row.get("rps_median") is None:
                reason = row["failures"][0] if row["failures"] else "no successful run"
                lines.append(f"{bal:<9} {'FAILED':>13}  {reason}")
                continue
            mm = f"{row['rps_min']:,.0f}-{row['rps_max']:,.0f}"
            cpu = row.get("cpu_us_per_req_median")
            cpu_s = f"{cpu:.2f}" if cpu is not None else "-"
            pct = row.get("pct_of_backend")
            pct_s = f"{pct:.1f}%" if pct is not None else "-"
            spread = row.get("spread_pct")
            spread_s = f"{spread:.1f}%" if spread is not None else "-"
            lines.append(f"{bal:<9} {row['rps_median']:>13,.0f} {mm:>21} {spread_s:>7} "
                         f"{row['errors']['total']:>7} {cpu_s:>11} {pct_s:>10}")
            e = row["errors"]
            if e["total"]:
                notes.append(f"  {bal} errors: connect {e['connect']}, read {e['read']}, write {e['write']}, "
                             f"timeout {e['timeout']}, non-2xx/3xx {e['non2xx']} (summed over runs)")
            if row["failed_runs"]:
                notes.append(f"  {bal}: {row['failed_runs']} of {row['runs']} runs failed: "
                             f"{'; '.join(row['failures'])}")
            ff = row.get("foreign_cpu_frac_max")
            if ff is not None and ff > INTERFERENCE_FRAC:
                notes.append(f"  {bal}: other processes used up to {ff * 100:.0f}% of core 0 or 1 during "
                             "its runs -- figures disturbed, rerun on a quiet machine")
        lines.extend(notes)
        r = s["ratios"]
        if r:
            def f(k: str) -> str:
                v = r.get(k)
                return f"{v:.2f}x" if v is not None else "n/a"
            parts = [f"{k} {f(k)}" for k in r if not k.startswith("cpu")]
            lines.append("throughput ratios (higher is better for quill): " + "  ".join(parts))
            cparts = [f"{k.split(' ', 1)[1]} {f(k)}" for k in r if k.startswith("cpu")]
            if cparts:
                lines.append("CPU-per-request ratios (lower is better for quill): " + "  ".join(cparts))
            if "quill" in s["balancers"] and s["balancers"]["quill"].get("rps_median") is None:
                lines.append("quill FAILED in this scenario: ratios are n/a")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/run",
        description="Compare quill with pen and haproxy (and the backend alone) as TCP load "
                    "balancers in front of one nginx, with wrk. Balancer on core 0, wrk + nginx on core 1.")
    p.add_argument("--quick", action="store_true", help="smoke check: 1 round, 3 s runs")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, --quick: 1)")
    p.add_argument("--duration", type=int, default=None, help="seconds per wrk run (default 10, --quick: 3)")
    p.add_argument("--only", default=",".join(ALL_BALANCERS),
                   help="comma list out of quill,pen,haproxy,backend (default: all)")
    p.add_argument("--quill-bin", type=Path, default=None,
                   help="quill binary (default: <repo>/target/release/quill; giving it skips the build)")
    p.add_argument("--no-build", action="store_true", help="do not run cargo build --release -p quill")
    p.add_argument("--connections", type=int, default=WRK_CONNECTIONS, help=argparse.SUPPRESS)
    p.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (configs, logs) for debugging")
    p.add_argument("--no-save", action="store_true", help="do not write bench/results/*.json")
    a = p.parse_args(argv)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    a.duration = a.duration if a.duration is not None else (3 if a.quick else 10)
    if a.rounds < 1 or a.duration < 1:
        p.error("--rounds and --duration must be >= 1")
    sel = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in sel if s not in ALL_BALANCERS]
    if bad or not sel:
        p.error(f"--only: unknown {bad}; choose from {','.join(ALL_BALANCERS)}")
    a.selected = [b for b in ALL_BALANCERS if b in sel]  # canonical order
    return a


def main(argv: list[str]) -> int:
    args = parse_args(argv)

    def on_signal(signum: int, _frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    started = dt.datetime.now()
    selected: list[str] = args.selected
    fatal: dict[str, str] = {}
    quill_bin = (args.quill_bin or REPO_ROOT / "target" / "release" / "quill").resolve()

    try:
        ensure_tools(selected)
        check_cores()
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1

    if "quill" in selected:
        if not args.no_build and args.quill_bin is None:
            reason = build_quill()
            if reason:
                fatal["quill"] = reason
        elif args.quill_bin is not None and not args.no_build:
            log(f"--quill-bin given: not building, using {quill_bin}")
        if "quill" not in fatal and not (quill_bin.is_file() and os.access(quill_bin, os.X_OK)):
            fatal["quill"] = f"quill binary not found or not executable: {quill_bin}"
        if "quill" in fatal:
            warn(f"quill will not be measured: {fatal['quill']}")

    machine = describe_machine()
    versions = describe_versions(quill_bin, selected)
    if float(machine["loadavg_at_start"].split()[0]) > 0.5:
        warn(f"load average at start is {machine['loadavg_at_start'].split()[0]}: other work on this "
             "machine will skew the figures")
    log(f"bench: balancers {','.join(selected)}; {args.rounds} round(s) x {len(SCENARIOS)} scenarios, "
        f"{args.duration}s each; balancer on core {BALANCER_CORE}, wrk + nginx on core {LOAD_CORE}")

    bench = Bench(args, selected, quill_bin, fatal)
    interrupted: str | None = None
    fatal_error: str | None = None
    try:
        bench.run_all()
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

    summary = summarize(bench.runs, selected, fatal)
    table = fmt_table(summary, args)
    log(table)

    machine["loadavg_at_end"] = Path("/proc/loadavg").read_text().strip()
    result = {
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine,
        "versions": versions,
        "config": {
            "rounds": args.rounds, "duration_s": args.duration, "wrk_threads": WRK_THREADS,
            "wrk_connections": args.connections, "quick": args.quick, "balancers": selected,
            "balancer_core": int(BALANCER_CORE), "wrk_and_backend_core": int(LOAD_CORE),
            "scenarios": {sc: {"wrk_extra_args": extra, "description": desc} for sc, extra, desc in SCENARIOS},
            "backend": "nginx worker_processes 1, 1024-byte file at /1k, keepalive_requests 100000, "
                       "access_log off",
            "haproxy_maxconn": HAPROXY_MAXCONN, "max_conns_x": int(MAX_CONNS),
            "order": "per round, per scenario, each balancer in turn; each balancer started fresh per run",
        },
        "not_measured": fatal,
        "summary": summary,
        "runs": [r.to_json() for r in bench.runs],
    }
    if not args.no_save:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{started.strftime('%Y-%m-%dT%H-%M-%S')}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        log(f"\nresults written to {path}")
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
