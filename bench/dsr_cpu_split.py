#!/usr/bin/env python3
"""Where a balancer's CPU time goes, from a `perf record -g -p PID` file (Python 3 stdlib).

Usage: dsr_cpu_split.py PERF_DATA [LABEL]

Why: on this kernel (CONFIG_TICK_CPU_ACCOUNTING, no CONFIG_IRQ_TIME_ACCOUNTING) a softirq
that runs in a process's context is charged to that process. On a veth + bridge topology, a
frame the balancer sends is processed at once, inside its `send()`: the bridge forwards it,
the backend's TCP takes the ACK and transmits the next data, the client's TCP receives that
data, all in the balancer's softirq. With real network cards that work runs on the other
machines. This script classifies each sample by its call chain, so the balancer's own work
can be told from its peers'. It does not change the metric: the process CPU (schedstat)
stays the figure of merit; this is the evidence of what it contains.

Classes (a sample is put in the first that matches, leaf to root):
  softirq/TCP     TCP receive under net_rx_action: in DSR mode quill has no TCP socket on
                  the data path, so these are the backends' and the client's sockets; in
                  proxy mode they are quill's own sockets and its peers' (not separable).
  softirq/bridge  the bridge (the switch between the hosts).
  softirq/packet  the packet socket's receive (quill's own, DSR).
  softirq/IP      other IP receive (ARP, frames the balancer's kernel drops).
  softirq/other   backlog, veth, softirq entry and exit, timers.
  send            quill's send path down to the veth driver (its own).
  poll            waiting for frames/events: poll, epoll, sleep and wake-up.
  user            quill's own code in user space.
  kernel/other    the rest (receive syscalls, splice, accept...).
"""
import collections
import subprocess
import sys

ORDER = ["user", "send", "poll", "kernel/other", "softirq/packet", "softirq/IP",
         "softirq/TCP", "softirq/bridge", "softirq/other"]


def classify(chain):
    """chain: [(symbol, dso)] leaf first."""
    if not chain:
        return None
    if "kernel" not in chain[0][1]:
        return "user"
    root = [s for s, _ in reversed(chain)]
    if "net_rx_action" in root:
        sub = root[root.index("net_rx_action"):]
        if "tcp_v4_rcv" in sub or "tcp_v6_rcv" in sub:
            return "softirq/TCP"
        if any(s.startswith("br_") for s in sub):
            return "softirq/bridge"
        if any(s in ("tpacket_rcv", "packet_rcv") for s in sub):
            return "softirq/packet"
        if any(s.startswith(("ip_rcv", "ip_list_rcv", "ip_sublist", "ip_local_deliver",
                             "arp_rcv", "ip_route_input", "ipv6_rcv")) for s in sub):
            return "softirq/IP"
        return "softirq/other"
    if any(s in ("handle_softirqs", "__do_softirq") for s in root):
        return "softirq/other"
    if any(("sendto" in s or "sendmsg" in s or "sendmmsg" in s or s == "__x64_sys_write"
            or "splice" in s) for s in root):
        return "send"
    if any(("poll" in s or "epoll" in s or s.startswith("schedule")
            or s.startswith("finish_task_switch")) for s in root):
        return "poll"
    return "kernel/other"


def samples(path):
    out = subprocess.run(["perf", "script", "-i", path, "-F", "ip,sym,dso"],
                         capture_output=True, text=True, check=True).stdout
    for block in out.split("\n\n"):
        chain = []
        for line in block.strip().split("\n"):
            parts = line.strip().split(None, 1)
            if len(parts) < 2:
                continue
            sym = parts[1].split(" (")[0].split("+0x")[0]
            dso = parts[1].rsplit("(", 1)[-1].rstrip(")")
            chain.append((sym, dso))
        if chain:
            yield chain


def split(path):
    counts = collections.Counter()
    for chain in samples(path):
        c = classify(chain)
        if c:
            counts[c] += 1
    total = sum(counts.values())
    return {k: counts[k] / total for k in ORDER} if total else {}


def main():
    path = sys.argv[1]
    label = sys.argv[2] if len(sys.argv) > 2 else path
    shares = split(path)
    print(f"  {label}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in shares.items()))


if __name__ == "__main__":
    main()
