"""What an emulated link costs the CPU: two nodes of ``emulated_network.create_cluster``, each
process pinned to its own core as ``emulated_cluster.py`` pins the ranks, exchange messages both
ways at once (each round: send one message while receiving one, as an all-to-all does) for a few
seconds; each core's user, system and softirq time over that window, from ``/proc/stat``, per
MiB the node sent and received. Needs root and ``ip netns`` (see ``emulated_network.py``).

    python benchmark/cluster/link_cpu.py --link-rate 1gbit unshaped

Under two-batch overlap this work lands on a core that is computing the other micro-batch
(``docs/performance.md``); without overlap it falls in time the core waits anyway.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

from benchmark.cluster.emulated_network import create_cluster, exit_on_signals

PORT = 29990
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(path: str = "/proc/stat") -> dict[str, dict[str, float]]:
    """Seconds per state of each core (``cpu0``, ``cpu1``, ...)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    with open(path) as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                out[name] = {k: int(v) / tick for k, v in zip(FIELDS, values)}
    return out


def busy_per_core(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Each core's seconds of user (with nice), system and softirq (with irq) between two
    snapshots."""
    out = {}
    for core in before:
        d = {k: after[core][k] - before[core][k] for k in FIELDS}
        out[core] = {
            "user": d["user"] + d["nice"],
            "system": d["system"],
            "softirq": d["softirq"] + d["irq"],
        }
    return out


def _peer(role: str, addr: str, msg: int, seconds: float) -> None:
    """One node's side: connect, print ready, wait for a line on stdin, exchange rounds, print
    the bytes received, wait for stdin to close."""
    if role == "listen":
        with socket.create_server(("0.0.0.0", PORT)) as srv:
            print("ready", flush=True)
            conn, _ = srv.accept()
    else:
        conn = socket.create_connection((addr, PORT), timeout=30)
        print("ready", flush=True)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sys.stdin.readline()
    print(_rounds(conn, msg, role == "connect", seconds), flush=True)
    sys.stdin.read()
    conn.close()


def _rounds(conn: socket.socket, msg: int, lead: bool, seconds: float) -> int:
    """Rounds of ``msg`` bytes each way at once. The lead sends each round's message at once and
    stops after ``seconds`` (then shuts its sending side); the other starts its message when the
    round's first bytes arrive, and stops when the lead has shut. Returns the bytes received."""
    out, into = bytes(msg), memoryview(bytearray(msg))
    got, end = 0, time.perf_counter() + seconds
    while not lead or time.perf_counter() < end:
        n = 0 if lead else conn.recv_into(into, msg)
        if not lead and n == 0:
            break
        sender = threading.Thread(target=conn.sendall, args=(out,))
        sender.start()
        while n < msg:
            n += conn.recv_into(into[n:], msg - n)
        sender.join()
        got += n
    if lead:
        conn.shutdown(socket.SHUT_WR)
    return got


def measure(rate: str | None, msg: int, seconds: float) -> dict:
    """One cluster at ``rate`` (None: unshaped): MiB each way and each core's CPU."""
    with create_cluster(2, rate) as c:
        me = [sys.executable, "-m", "benchmark.cluster.link_cpu", "_peer"]
        roles = [("connect", c.addrs[1]), ("listen", "")]
        peers = [None, None]
        for i in (1, 0):  # the listener first
            argv = ["taskset", "-c", str(i), *me, roles[i][0], roles[i][1], str(msg), str(seconds)]
            kw = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            peers[i] = c.popen(i, argv, **kw)
            if peers[i].stdout.readline().strip() != "ready":
                raise RuntimeError(f"node {i}'s peer did not start")
        before, start = cpu_times(), time.perf_counter()
        for p in peers:
            p.stdin.write("go\n")
            p.stdin.flush()
        received = [int(p.stdout.readline()) for p in peers]
        after, wall = cpu_times(), time.perf_counter() - start
        for p in peers:
            p.communicate(timeout=30)
    mib = min(received) / 2**20
    return {"mib_each_way": mib, "seconds": wall, "cores": busy_per_core(before, after)}


def report(label: str, r: dict) -> str:
    lines = [f"{label}: {r['mib_each_way'] / r['seconds']:.1f} MiB/s each way"]
    for core, t in r["cores"].items():
        total = sum(t.values())
        parts = ", ".join(f"{k} {1e3 * v / r['mib_each_way']:.2f}" for k, v in t.items())
        lines.append(
            f"  {core}: {100 * total / r['seconds']:.0f}% busy; ms per MiB sent and received: "
            f"{1e3 * total / r['mib_each_way']:.2f} ({parts})"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_peer"]:
        return _peer(argv[1], argv[2], int(argv[3]), float(argv[4]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link-rate", nargs="+", default=["1gbit", "unshaped"])
    p.add_argument("--message-kib", type=int, default=411, help="one all-to-all's bytes each way")
    p.add_argument("--seconds", type=float, default=5.0)
    args = p.parse_args(argv)
    with exit_on_signals():
        for rate in args.link_rate:
            r = measure(None if rate == "unshaped" else rate, args.message_kib << 10, args.seconds)
            print(report(rate, r), flush=True)


if __name__ == "__main__":
    main()
