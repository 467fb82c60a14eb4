#!/usr/bin/env python3
"""RSS per idle HTTP/1.x keep-alive client of quill in `http` mode (-H), served request by
request (the default `upstream_keepalive`): N clients each send one request, read the
answer and stay connected; quill's RSS is read before and 3.5 s after (long enough for
`idle_park`, 1 s by default, to take idle clients off hyper — 1 to 2 s after their answer,
the watchdog looks once a second — and for the event loops, quiet then, to hand the
memory back 0.1 s after their last park).

    bench/idle_http.py [--connections N] [--tls] [--quill-bin PATH] [-- QUILL ARGS...]

e.g. `bench/idle_http.py --tls -- -O "idle_park 0"` for the figure without parking. The
backend is a small asyncio HTTP server in this process; clients come from 127.0.0.2-11.
Needs `ulimit -n` above N + 100 (quill is started with `-x 20000`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        writer.close()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def run(args: argparse.Namespace) -> None:
    srv = await asyncio.start_server(backend, "127.0.0.1", 0)
    bport = srv.sockets[0].getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = None
    tls_args: list[str] = []
    tmp = tempfile.TemporaryDirectory()
    if args.tls:
        cert, key = Path(tmp.name, "cert.pem"), Path(tmp.name, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
                       check=True, capture_output=True)
        tls_args = ["-E", str(cert), "-K", str(key)]
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["http/1.1"])
    argv = [str(args.quill_bin), "-f", "-H", "-x", "20000", *tls_args, *args.quill_args,
            f"127.0.0.1:{port}", f"127.0.0.1:{bport}"]
    q = subprocess.Popen(argv)
    try:
        for _ in range(200):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        before = rss(q.pid)
        held = []
        for i in range(args.connections):
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                                 local_addr=(f"127.0.0.{2 + i % 10}", 0))
            w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await r.readuntil(b"ok")
            held.append((r, w))
        await asyncio.sleep(3.5)
        after = rss(q.pid)
        if q.poll() is not None:
            raise SystemExit(f"quill exited ({q.returncode}) while holding connections")
        print(f"{args.connections} idle HTTP/1.1{' over TLS' if args.tls else ''} keep-alive clients, "
              f"quill {' '.join(args.quill_args) or '(defaults)'}: RSS {before / 1e6:.1f} MB -> "
              f"{after / 1e6:.1f} MB, {(after - before) / args.connections:,.0f} B per connection", flush=True)
    finally:
        q.terminate()
        q.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=3000)
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--quill-bin", type=Path, default=REPO / "target" / "release" / "quill")
    ap.add_argument("quill_args", nargs="*", help="after --: more arguments for quill")
    args = ap.parse_args()
    asyncio.run(run(args))
    # The held connections are not closed one by one: the process ends with them.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
