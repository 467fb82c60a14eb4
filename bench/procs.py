"""Process accounting shared by the benchmark harnesses: process trees, their CPU time,
memory and descriptors, read from /proc; and scheduling priority for benchmark processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def raise_autogroup(pid: int | str) -> None:
    """nice -20 alone does not help against a busy process of another session: with
    sched_autogroup each session is one scheduling group of equal weight. Each process
    started here is its own session, so its group gets the weight of nice -20 too."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text("-20")
    except OSError:
        pass


def proc_tree(root: int) -> list[int]:
    """root and its live descendants."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            data = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent[int(entry)] = int(data[data.rindex(")") + 2:].split()[1])
    if root not in parent:
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(c for c, pp in parent.items() if pp == pid)
    return out


def proc_tree_ticks(root: int) -> int | None:
    """utime+stime (clock ticks) of root and its live descendants.
    /proc/PID/stat of a thread-group leader already sums all its threads."""
    tree = proc_tree(root)
    if not tree:
        return None
    total = 0
    for pid in tree:
        try:
            rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            # rest[0]=state(3) rest[1]=ppid(4) ... rest[11]=utime(14) rest[12]=stime(15)
            total += int(rest[11]) + int(rest[12])
        except (OSError, ValueError, IndexError):
            continue
    return total


def tree_rss_bytes(root: int) -> int:
    """Resident memory of root and its descendants (RSS from /proc/PID/statm)."""
    total = 0
    for pid in proc_tree(root):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_SIZE
        except (OSError, ValueError, IndexError):
            pass
    return total


def settled_fds(root: int, quiet_s: float = 0.3, deadline_s: float = 5.0) -> int:
    """The descriptor count once it has not changed for quiet_s (the verification
    request's sockets may still be closing), or the last count after deadline_s."""
    end = time.monotonic() + deadline_s
    last, since = tree_fds(root), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.05)
        now = tree_fds(root)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def tree_fds(root: int) -> int:
    total = 0
    for pid in proc_tree(root):
        try:
            total += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            pass
    return total
