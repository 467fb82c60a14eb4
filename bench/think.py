#!/usr/bin/env python3
"""What `idle_park` costs clients that think between requests: N keep-alive clients each
send a request every PACE ms (longer than `idle_park`, so their connections park between
requests), through quill with `idle_park 1` and with `idle_park 0`, for each binary given;
quill's own CPU and the whole machine's per request.

    bench/think.py [--mode https|raw] [--connections N] [--pace MS] [--duration S]
                   [--rounds R] [--quill-bin PATH ...]

`https`: HTTPS in, HTTPS out to nginx (bench/https's set-up, `-H` request by request);
`raw`: plain TCP relay to the plain nginx. quill on core 0, tlsload and nginx on core 1.
Several `--quill-bin` run interleaved (an A/B of two builds in one run). Needs the tlsload
build of bench/tls.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import https_bench as hb  # noqa: E402
import tcp_bench as tb  # noqa: E402
import tls_bench as tls  # noqa: E402


def quill_argv(mode: str, quill: Path, port: int, backend: tls.Backend, tmp: Path,
               cert: tuple[Path, Path, Path], park: int) -> list[str]:
    if mode == "https":
        argv = hb.balancer_argv("quill", port, backend, tmp, quill, cert, 128)
    else:
        argv = ["taskset", "-c", tb.BALANCER_CORE, str(quill), "-f", "-x", "10000",
                f"127.0.0.1:{port}", f"127.0.0.1:{backend.port}"]
    return argv[:-2] + ["-O", f"idle_park {park}"] + argv[-2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("https", "raw"), default="https")
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--pace", type=int, default=2000, help="ms between a client's answer and its next request")
    ap.add_argument("--duration", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quill-bin", type=Path, action="append")
    args = ap.parse_args()
    bins = args.quill_bin or [tb.REPO_ROOT / "target" / "release" / "quill"]
    procs = tb.Procs()
    with tempfile.TemporaryDirectory(prefix="quill-think-") as d:
        tmp = Path(d)
        os.chmod(tmp, 0o755)
        cert = tls.make_certs(tmp)["ecdsa"]
        scenario = "reencrypt" if args.mode == "https" else "h1"
        backend = tls.start_backends(procs, tmp, [scenario])[scenario]
        try:
            for rnd in range(1, args.rounds + 1):
                for quill in bins:
                    for park in (1, 0):
                        port = tb.free_port()
                        p = procs.start("quill", quill_argv(args.mode, quill, port, backend, tmp, cert, park),
                                        tmp / "quill.log")
                        tb.wait_accepting(port, p, time.monotonic() + tb.READY_TIMEOUT_S)
                        load = ["taskset", "-c", tb.LOAD_CORE, str(tls.tlsload_bin()), "--addr",
                                f"127.0.0.1:{port}", "--threads", "1", "--expect-bytes", "1024",
                                "--mode", "keepalive", "--connections", str(args.connections),
                                "--duration", str(args.duration), "--pace", str(args.pace)]
                        if args.mode == "raw":
                            load.append("--plain")
                        cpu0, idle0 = tls.cpu_snapshot(p, backend), tb.machine_idle()
                        r = tb.last_json(tb.run_load(procs, load, args.duration + 60))
                        idle1, cpu1 = tb.machine_idle(), tls.cpu_snapshot(p, backend)
                        procs.stop(p)
                        n = r["requests"]
                        if not n:
                            raise tb.BenchError(f"no request served: {r}")
                        tb.log(f"round {rnd} {quill} idle_park {park}: {n} requests, {r.get('errors', 0)} errors, "
                               f"quill {(cpu1['balancer'] - cpu0['balancer']) * 1e6 / n:.1f} µs/req, "
                               f"machine {tb.machine_busy_s(idle0, idle1) * 1e6 / n:.1f} µs/req")
        finally:
            procs.stop_all()


if __name__ == "__main__":
    try:
        main()
    except tb.BenchError as e:
        tb.warn(str(e))
        sys.exit(1)
