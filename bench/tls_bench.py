#!/usr/bin/env python3
"""HTTPS benchmark: quill vs NGINX vs HAProxy terminating the same TLS traffic.

Run through bench/tls. The machinery (processes in their own sessions, free ports, CPU
accounting, the plain-HTTP nginx backend serving /1k) is tcp_bench.py's; this file adds the
TLS scenarios:

* keepalive: 50 HTTPS keep-alive connections, 1 KiB responses (TLS 1.3);
* handshake: a new TCP + TLS connection per request, full handshake (no resumption);
* reencrypt: the keepalive load, but the backend is an nginx serving /1k over HTTPS
  (TLS 1.3 only, a certificate of a test CA) and every balancer speaks TLS to it,
  verifying that certificate (CA and name "localhost"): HTTPS in, HTTPS out;
* each with an ECDSA P-256 and an RSA-2048 certificate for the clients (the same files for
  every balancer; the HTTPS backend always has one ECDSA P-256 certificate).

Layout: the balancer alone on core 0; the load generator (bench/tlsload, rustls) and the
backend nginx on core 1. Balancers: quill (-E/-K, L4 relay; `upstream_tls`, `upstream_ca`,
`upstream_sni` to the HTTPS backend), HAProxy (`mode tcp`, `bind ... ssl crt`, 1 thread;
`server ... ssl verify required ca-file`), NGINX (`listen ssl` + `proxy_pass` with upstream
keep-alive, 1 worker; `proxy_pass https://` with `proxy_ssl_verify on`), and the ceilings:
"tls-direct" (keepalive, handshake): nginx serving the file itself over TLS on core 0 (no
proxying), the load generator's ceiling for a one-core TLS server; "backend" (reencrypt):
the load straight at the HTTPS backend on core 1, the ceiling of the load core. Figures:
requests/s, balancer CPU µs per request, and how busy each core was (load core at 100 % =
the generator and the backend were the limit); a run in which other processes took over
10 % of a core is marked NOISY. Every run starts with one keep-alive connection that must
get its 1 KiB bodies without error, or it is FAILED (exit code 3).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tcp_bench as tb  # noqa: E402

TLSLOAD_DIR = tb.BENCH_DIR / "tlsload"
BALANCERS = ("quill", "nginx", "haproxy", "tls-direct", "backend")
KEYS = ("ecdsa", "rsa")
SCENARIOS = ("keepalive", "handshake", "reencrypt")
# tlsload's --mode for each scenario, and the ceiling run (no balancer) that goes with it.
LOAD_MODE = {"keepalive": "keepalive", "handshake": "handshake", "reencrypt": "keepalive"}
CEILING = {"keepalive": "tls-direct", "handshake": "tls-direct", "reencrypt": "backend"}
# The name in the HTTPS backend's certificate: every balancer sends it as SNI and checks it.
BACKEND_NAME = "localhost"


@dataclass(frozen=True)
class Backend:
    """The nginx behind the balancers: plain HTTP, or HTTPS with the CA that verifies its
    certificate (reencrypt)."""
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    ca: Path | None = None


def tlsload_bin() -> Path:
    return TLSLOAD_DIR / "target" / "release" / "tlsload"


def build_tools(no_build: bool) -> None:
    """Builds quill and the load generator; with --no-build only a load generator that is
    not there yet (it is not what is measured, and every run would fail without it)."""
    for what, cwd, extra, built in (("quill", tb.REPO_ROOT, ["-p", "quill"], None),
                                    ("tlsload", TLSLOAD_DIR, [], tlsload_bin())):
        if no_build and (built is None or built.exists()):
            continue
        err = tb.cargo_build(what, cwd, extra)
        if err:
            raise tb.BenchError(err)


def openssl(*argv: str) -> None:
    rc, text = tb.run_capture(["openssl", *argv])
    if rc != 0:
        raise tb.BenchError(f"openssl {argv[0]} failed: {text}")


P256 = tb.P256


def make_certs(tmp: Path) -> dict[str, tuple[Path, Path, Path]]:
    """(cert, key, combined) per key type, made with the openssl CLI."""
    out = {}
    for kind, newkey in (("ecdsa", P256), ("rsa", ["-newkey", "rsa:2048"])):
        c = tb.make_certificate(tmp, kind, newkey)
        out[kind] = (c.cert, c.key, c.combined)
    return out


def make_backend_cert(tmp: Path) -> tuple[Path, Path, Path]:
    """(CA cert, cert, key) of the HTTPS backend: a test CA and an ECDSA P-256 server
    certificate it signed for BACKEND_NAME (a leaf, not a CA: rustls refuses a CA
    certificate as a server's)."""
    ca, ca_key = tmp / "backend-ca.crt", tmp / "backend-ca.key"
    cert, key, csr, ext = (tmp / f"backend.{x}" for x in ("crt", "key", "csr", "ext"))
    openssl("req", "-x509", *P256, "-nodes", "-keyout", str(ca_key), "-out", str(ca),
            "-subj", "/CN=quill bench test CA", "-days", "2")
    openssl("req", "-new", *P256, "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", f"/CN={BACKEND_NAME}")
    ext.write_text(f"basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                   f"extendedKeyUsage=serverAuth\nsubjectAltName=DNS:{BACKEND_NAME}\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-set_serial", "2", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return ca, cert, key


def write_nginx_tls(tmp: Path, name: str, port: int, cert: Path, key: Path,
                    backend: Backend | None, protocols: str = "TLSv1.2 TLSv1.3",
                    http2: bool = False) -> Path:
    """NGINX terminating TLS: proxy_pass with upstream keep-alive to `backend` (over HTTPS,
    verified, when it has a CA), or with no backend serving /1k itself; HTTP/2 offered by
    ALPN too when `http2`."""
    www = tmp / "www"
    upstream = ""
    if backend is None:
        body = f"""
        location / {{ root {www}; default_type application/octet-stream; }}"""
    else:
        upstream = f"upstream backend {{ server 127.0.0.1:{backend.port}; keepalive 64; }}"
        # nginx 1.22 offers only up to TLS 1.2 to upstreams unless told, and sends no SNI.
        https = "" if backend.ca is None else f"""
            proxy_ssl_protocols TLSv1.2 TLSv1.3;
            proxy_ssl_verify on;
            proxy_ssl_trusted_certificate {backend.ca};
            proxy_ssl_name {BACKEND_NAME};
            proxy_ssl_server_name on;
            proxy_ssl_session_reuse on;"""
        body = f"""
        location / {{
            proxy_pass {"http" if backend.ca is None else "https"}://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering on;{https}
        }}"""
    cfg = tmp / f"{name}.conf"
    cfg.write_text(f"""# generated by bench/tls_bench.py
worker_processes 1;
worker_rlimit_nofile 19900;
daemon off;
pid {tmp}/{name}.pid;
error_log {tmp}/{name}-error.log warn;
events {{ worker_connections 9000; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 300s;
    sendfile off;
    tcp_nodelay on;
    client_body_temp_path {tmp}/{name}-body;
    proxy_temp_path {tmp}/{name}-proxy;
    {upstream}
    server {{
        listen 127.0.0.1:{port} ssl{" http2" if http2 else ""} backlog=4096;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        ssl_protocols {protocols};
        ssl_session_tickets on;
        {body}
    }}
}}
""")
    return cfg


def write_haproxy_tls(tmp: Path, port: int, backend: Backend, combined: Path) -> Path:
    verify = "" if backend.ca is None else (
        f" ssl verify required ca-file {backend.ca} sni str({BACKEND_NAME}) verifyhost {BACKEND_NAME}")
    cfg = tmp / "haproxy-tls.cfg"
    cfg.write_text(f"""# generated by bench/tls_bench.py
global
    nbthread 1
    maxconn 9800
    tune.ssl.default-dh-param 2048
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend fe
    bind 127.0.0.1:{port} ssl crt {combined} ssl-min-ver TLSv1.2
    default_backend be
backend be
    server b1 127.0.0.1:{backend.port}{verify}
""")
    return cfg


def balancer_argv(name: str, port: int, backend: Backend, tmp: Path, quill: Path,
                  cert: tuple[Path, Path, Path]) -> list[str]:
    pin = ["taskset", "-c", tb.BALANCER_CORE]
    crt, key, both = cert
    if name == "quill":
        upstream_tls = [] if backend.ca is None else [
            "-O", "upstream_tls", "-O", f"upstream_ca {backend.ca}", "-O", f"upstream_sni {BACKEND_NAME}"]
        return pin + [str(quill), "-f", "-r", "-x", "10000", "-E", str(crt), "-K", str(key),
                      *upstream_tls, f"127.0.0.1:{port}", f"127.0.0.1:{backend.port}"]
    if name == "haproxy":
        return pin + ["haproxy", "-f", str(write_haproxy_tls(tmp, port, backend, both)), "-db"]
    # The files are named for the port: the plain backend's are tmp/nginx.*.
    cfg = write_nginx_tls(tmp, f"{name}-{port}", port, crt, key,
                          None if name == "tls-direct" else backend)
    return pin + ["nginx", "-c", str(cfg), "-p", f"{tmp}/"]


def core_ticks() -> dict[str, tuple[int, int]]:
    """Per-core (busy, total) ticks from /proc/stat. Busy is everything but idle and
    iowait: softirq included, because on loopback it is the delivery of the benchmark's own
    packets (a quarter of the load core's time), and a core with none left limits the run."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            parts = line.split()
            v = [int(x) for x in parts[1:9]]  # user nice system idle iowait irq softirq steal
            total = sum(v)
            out[parts[0]] = (total - v[3] - v[4], total)
    return out


def core_busy(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], core: str) -> float:
    b, a = before.get(f"cpu{core}"), after.get(f"cpu{core}")
    if not b or not a or a[1] == b[1]:
        return float("nan")
    return (a[0] - b[0]) / (a[1] - b[1])


def cpu_snapshot(balancer: subprocess.Popen[bytes], backend: Backend) -> dict[str, Any]:
    """CPU seconds so far of the balancer, the backend, the reaped load generators and the
    two cores (user + system), and the per-core ticks for core_busy."""
    def secs(pid: int) -> float:
        return (tb.proc_tree_ticks(pid) or 0) / tb.CLK_TCK
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    usersys = tb.cpu_core_ticks()
    return {"balancer": secs(balancer.pid), "backend": secs(backend.proc.pid),
            "load": ru.ru_utime + ru.ru_stime, "cores": core_ticks(),
            "core0": usersys[f"cpu{tb.BALANCER_CORE}"][0] / tb.CLK_TCK,
            "core1": usersys[f"cpu{tb.LOAD_CORE}"][0] / tb.CLK_TCK}


def measure(procs: tb.Procs, tmp: Path, args: argparse.Namespace, quill: Path, backend: Backend,
            certs: dict[str, tuple[Path, Path, Path]], bal: str, key: str, scenario: str) -> dict[str, Any]:
    run: dict[str, Any] = {"balancer": bal, "key": key, "scenario": scenario}
    if bal == "backend":  # no balancer: the load goes straight to the backend
        port, p = backend.port, backend.proc
        logf = tmp / f"{backend.name}.log"
    else:
        port = tb.free_port()
        logf = tmp / f"{bal}.log"
        p = procs.start(bal, balancer_argv(bal, port, backend, tmp, quill, certs[key]), logf)
    try:
        tb.wait_accepting(port, p, time.monotonic() + tb.READY_TIMEOUT_S)
        base = ["taskset", "-c", tb.LOAD_CORE, str(tlsload_bin()), "--addr", f"127.0.0.1:{port}",
                "--threads", "1", "--expect-bytes", "1024"]
        load = base + ["--mode", LOAD_MODE[scenario], "--connections", str(args.connections),
                       "--duration", str(args.duration)]
        # A short check that the path works (for reencrypt: that the balancer verified the
        # HTTPS backend and relays its 1 KiB body) before anything is measured.
        out = tb.run_load(procs, base + ["--mode", "keepalive", "--connections", "1", "--duration", "0.3"], 30)
        check = tb.last_json(out)
        if not check.get("requests") or check.get("errors"):
            raise tb.StartError(f"{bal}: no HTTPS request served ({out.strip()[-300:]}); log:\n{tb.tail(logf)}")
        before = cpu_snapshot(p, backend)
        res = tb.last_json(tb.run_load(procs, load, args.duration + 60))
        after = cpu_snapshot(p, backend)
        run.update(res)
        balancer_s = 0.0 if bal == "backend" else after["balancer"] - before["balancer"]
        if res["requests"] and bal != "backend":
            run["balancer_cpu_us_per_req"] = balancer_s * 1e6 / res["requests"]
        else:
            run["balancer_cpu_us_per_req"] = None
        run["core0_busy"] = core_busy(before["cores"], after["cores"], tb.BALANCER_CORE)
        run["core1_busy"] = core_busy(before["cores"], after["cores"], tb.LOAD_CORE)
        # What a core ran (user + system) that was not the balancer (core 0), or the backend
        # and the load generator (core 1): another job on the machine, which makes the run
        # unreliable. Without a balancer, core 0 is free for anything: nothing to count there.
        d = {k: after[k] - before[k] for k in ("balancer", "backend", "load", "core0", "core1")}
        if res["requests"]:  # where core 1's time goes, per request
            run["backend_cpu_us_per_req"] = d["backend"] * 1e6 / res["requests"]
            run["load_cpu_us_per_req"] = d["load"] * 1e6 / res["requests"]
        core0 = 0.0 if bal == "backend" else d["core0"] - d["balancer"]
        core1 = d["core1"] - d["backend"] - d["load"]
        run["foreign_cpu_s"] = round(max(0.0, core0, core1), 2)
    except tb.StartError as e:
        run["error"] = str(e)
        tb.warn(str(e))
    finally:
        if p is not backend.proc:
            procs.stop(p)
    return run


def one_line(r: dict[str, Any]) -> str:
    if "rps" not in r:
        return f"FAILED: {r.get('error', '')[:200]}"
    cpu = r["balancer_cpu_us_per_req"]
    noisy = f"  NOISY: other processes took {r['foreign_cpu_s']:.1f} s" if is_noisy(r) else ""
    return (f"{r['rps']:>10,.0f} req/s  {'–' if cpu is None else f'{cpu:.1f}':>7} µs/req  errors {r['errors']}"
            f"  balancer core {r['core0_busy'] * 100:.0f} %  load core {r['core1_busy'] * 100:.0f} %{noisy}")


def is_noisy(r: dict[str, Any]) -> bool:
    """As in bench/run: other processes took more than 10 % of one core during the run."""
    return r["foreign_cpu_s"] > tb.INTERFERENCE_FRAC * r["seconds"]


def summarize(runs: list[dict[str, Any]], keys: list[str], scenarios: list[str]) -> list[dict[str, Any]]:
    rows = []
    for key in keys:
        for sc in scenarios:
            row: dict[str, Any] = {"key": key, "scenario": sc}
            for bal in BALANCERS:
                rs = [r for r in runs if r["balancer"] == bal and r["key"] == key
                      and r["scenario"] == sc and "rps" in r]
                if rs:
                    cpu = [r["balancer_cpu_us_per_req"] for r in rs if r["balancer_cpu_us_per_req"] is not None]
                    row[bal] = {
                        "rps": statistics.median(r["rps"] for r in rs),
                        "rps_min": min(r["rps"] for r in rs), "rps_max": max(r["rps"] for r in rs),
                        "cpu_us": statistics.median(cpu) if cpu else None,
                        "core0_busy": statistics.median(r["core0_busy"] for r in rs),
                        "core1_busy": statistics.median(r["core1_busy"] for r in rs),
                        "errors": sum(r["errors"] for r in rs),
                        "foreign_cpu_s_max": max(r["foreign_cpu_s"] for r in rs),
                        "noisy_runs": sum(is_noisy(r) for r in rs),
                    }
            rows.append(row)
    return rows


def fmt(rows: list[dict[str, Any]]) -> str:
    out = ["| scenario | key | quill | NGINX | HAProxy | tls-direct | backend | quill/NGINX | quill/HAProxy "
           "| quill µs/req | NGINX µs/req | HAProxy µs/req | load core busy (quill run) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def v(b: str, f: str = "rps") -> str:
            return f"{r[b][f]:,.0f}" if b in r and r[b][f] is not None else "–"

        def ratio(b: str, f: str = "rps") -> str:
            if "quill" in r and b in r and r[b][f]:
                return f"{r['quill'][f] / r[b][f]:.2f}"
            return "–"
        busy = f"{r['quill']['core1_busy'] * 100:.0f} %" if "quill" in r else "–"
        out.append(f"| {r['scenario']} | {r['key']} | {v('quill')} | {v('nginx')} | {v('haproxy')} "
                   f"| {v('tls-direct')} | {v('backend')} | {ratio('nginx')} | {ratio('haproxy')} "
                   f"| {v('quill', 'cpu_us')} | {v('nginx', 'cpu_us')} | {v('haproxy', 'cpu_us')} | {busy} |")
    noisy = [f"{r['scenario']} {r['key']} {b} ({r[b]['noisy_runs']}, up to {r[b]['foreign_cpu_s_max']:.1f} s)"
             for r in rows for b in BALANCERS if b in r and r[b]["noisy_runs"]]
    if noisy:
        out.append("\nNOISY runs (other processes took over 10 % of a core; do not trust these): "
                   + ", ".join(noisy))
    return "\n".join(out)


def start_backends(procs: tb.Procs, tmp: Path, scenarios: list[str]) -> dict[str, Backend]:
    """The backend of each scenario, on the load core: the plain nginx of bench/run, and for
    reencrypt an nginx serving the same files over HTTPS (TLS 1.3 only)."""
    def start(name: str, port: int, cfg: Path, ca: Path | None) -> Backend:
        proc = procs.start(name, ["taskset", "-c", tb.LOAD_CORE, "nginx", "-c", str(cfg), "-p", f"{tmp}/"],
                           tmp / f"{name}.log")
        tb.wait_accepting(port, proc, time.monotonic() + tb.READY_TIMEOUT_S)
        return Backend(name, port, proc, ca)

    port = tb.free_port()
    plain = start("backend", port, tb.write_backend(tmp, port), None)  # also writes tmp/www
    out = {sc: plain for sc in scenarios if sc != "reencrypt"}
    if "reencrypt" in scenarios:
        ca, cert, key = make_backend_cert(tmp)
        port = tb.free_port()
        out["reencrypt"] = start("backend-tls", port,
                                 write_nginx_tls(tmp, "backend-tls", port, cert, key, None, "TLSv1.3"), ca)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 round of 3 s (a smoke run)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=50)
    ap.add_argument("--only", default=",".join(BALANCERS),
                    help="balancers; tls-direct runs in keepalive and handshake, backend in reencrypt")
    ap.add_argument("--keys", default=",".join(KEYS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--quill-bin", type=Path, default=tb.REPO_ROOT / "target" / "release" / "quill")
    ap.add_argument("--no-build", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.duration = 1, 3.0
    selected = [b for b in BALANCERS if b in args.only.split(",")]
    keys = [k for k in KEYS if k in args.keys.split(",")]
    scenarios = [s for s in SCENARIOS if s in args.scenarios.split(",")]
    if not selected or not keys or not scenarios:
        raise tb.BenchError(f"nothing to run: --only {args.only} --keys {args.keys} --scenarios {args.scenarios}")
    tb.check_cores()
    packages = {"nginx": "nginx-light", "haproxy": "haproxy", "openssl": "openssl", "taskset": "util-linux"}
    missing = sorted({pkg for tool, pkg in packages.items() if tb.which(tool) is None})
    if missing:
        tb.apt_install(missing)
    build_tools(args.no_build)
    procs = tb.Procs()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="quill-tls-bench-") as d:
        tmp = Path(d)
        os.chmod(tmp, 0o755)
        certs = make_certs(tmp)
        try:
            backends = start_backends(procs, tmp, scenarios)
            for rnd in range(1, args.rounds + 1):
                for key in keys:
                    for sc in scenarios:
                        for bal in tb.in_turn(selected, rnd):
                            if bal in CEILING.values() and bal != CEILING[sc]:
                                continue
                            r = measure(procs, tmp, args, args.quill_bin, backends[sc], certs, bal, key, sc)
                            r["round"] = rnd
                            runs.append(r)
                            tb.log(f"round {rnd} {key:5} {sc:9} {bal:10} {one_line(r)}")
        except tb.StartError as e:
            raise tb.BenchError(f"backend: {e}") from None
        finally:
            procs.stop_all()
    rows = summarize(runs, keys, scenarios)
    table = fmt(rows)
    tb.log("\n" + table)
    tb.RESULTS_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H-%M-%S")
    out = tb.RESULTS_DIR / f"tls-{stamp}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                               "machine": tb.describe_machine(), "runs": runs, "summary": rows},
                              indent=1, default=str))
    tb.log(f"\nJSON: {out.relative_to(tb.REPO_ROOT)}")
    failed = [f"{r['balancer']} {r['key']} {r['scenario']} round {r['round']}" for r in runs if "error" in r]
    errors = sum(r.get("errors", 0) for r in runs)
    if errors:
        tb.warn(f"{errors} requests failed during the measured runs (see the errors column of the JSON)")
    if failed:
        tb.warn(f"FAILED runs: {', '.join(failed)}")
        return 3
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except tb.BenchError as e:
        tb.warn(str(e))
        sys.exit(1)
