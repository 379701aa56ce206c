"""Emulated cluster links on one machine: N network namespaces joined by veth pairs, each
direction rate-limited with a tbf qdisc on its sending end. Needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN), iproute2 and tc; no netem (so no added delay, only a rate).

Topology: 2 nodes: one veth pair ``eth0 <-> eth0``; N > 2: every node's ``eth0`` is a veth to a
port of a bridge in a hub namespace (a switch), shaped at both ends (node upload on the node
side, node download on the hub side). Node ``i`` is ``10.77.0.(i+1)/24`` by default. Nothing is
created in the caller's namespace, so clusters of parallel runs share neither names (they carry
the creating pid and a sequence number) nor addresses (each cluster is its own set of isolated
namespaces).

Reusable API::

    with create_cluster(2, rate="1gbit") as c:        # rate=None: unshaped
        p = c.popen(0, [sys.executable, "server.py"])  # runs in node 0; env sets
        ...                                             # GLOO_SOCKET_IFNAME=eth0
        print(link_selftest(c))                         # TCP throughput per direction
    # processes killed, namespaces (and their links) deleted: also on error, Ctrl-C, SIGTERM

``c.exec_argv(i, argv)`` is the ``ip netns exec`` command line for node ``i``; ``c.env(i)`` its
environment; ``c.cleanup()`` is idempotent and also registered with atexit.

Command line::

    python benchmark/cluster/emulated_network.py selftest --nodes 2 --link-rate 1gbit
    python benchmark/cluster/emulated_network.py cleanup    # namespaces left by SIGKILLed runs
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from benchmark.common.netns import ip, kill_netns_pids, list_namespaces
from benchmark.common.process import is_running, stop_groups

DEFAULT_PREFIX = "srtnet"
DEFAULT_SUBNET = "10.77.0"
IFNAME = "eth0"
_seq = itertools.count()

_UNITS = {  # tc rate units (tc-tbf(8)): bit-based, and "bps" = bytes per second
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}


def parse_rate(rate: str) -> float:
    """tc rate string → bits per second ("1gbit" → 1e9, "100mbit", "500kbps")."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", rate.lower())
    if not m or (m.group(2) or "bit") not in _UNITS:
        raise ValueError(f"rate {rate!r}: expected a number and one of {sorted(_UNITS)}")
    return float(m.group(1)) * _UNITS[m.group(2) or "bit"]


def default_burst(rate: str) -> int:
    """tbf bucket size in bytes: 1 ms of the rate, at least 64 KiB (one GSO super-packet on a
    veth; tbf splits any packet larger than the bucket) and at most 1 MiB.

    The bucket is what the link may send back-to-back at full speed after an idle spell, so a
    message smaller than it sees almost no link. A smaller bucket is closer to a wire for small
    messages, but at 1 Gbit/s on 2 cores anything below 1 ms of the rate lost 10-30 % of the
    rate with both directions loaded (docs/distributed.md, "The emulated link")."""
    return int(min(max(parse_rate(rate) / 8 / 1000, 64 << 10), 1 << 20))


def _tc(ns: str, *argv: str) -> None:
    ip("netns", "exec", ns, "tc", *argv)


class Cluster:
    """Handle of the namespaces made by :func:`create_cluster`; see the module docstring."""

    def __init__(self, prefix: str, n: int, subnet: str, rate: str | None, burst, latency):
        self.name = f"{prefix}-{os.getpid()}-{next(_seq)}"
        self.n, self.rate, self.burst, self.latency = n, rate, burst, latency
        self.addrs = [f"{subnet}.{i + 1}" for i in range(n)]
        self.ifname = IFNAME
        self.node_ns = [f"{self.name}-{i}" for i in range(n)]
        self.hub_ns = f"{self.name}-hub" if n > 2 else None
        self.created: list[str] = []  # namespaces that exist, deleted by cleanup
        self.procs: list[subprocess.Popen] = []
        self._closed = False
        atexit.register(self.cleanup)

    # ---- running things in a node

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.node_ns[i], *argv]

    def env(self, i: int, base: dict | None = None) -> dict:
        """Environment for node ``i``: gloo (and NCCL/TP) bound to the cluster interface."""
        env = dict(os.environ if base is None else base)
        for key in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[key] = self.ifname
        env["SRT_NODE_ADDR"] = self.addrs[i]
        return env

    def popen(self, i: int, argv: Sequence[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start ``argv`` in node ``i`` (own session, so a terminal Ctrl-C reaches only us and
        cleanup kills its whole process group); tracked and killed by :meth:`cleanup`."""
        if self._closed:
            raise RuntimeError("cluster already cleaned up")
        proc = subprocess.Popen(
            self.exec_argv(i, argv), env=self.env(i, env), start_new_session=True, **kw
        )
        self.procs.append(proc)
        return proc

    def qdisc_stats(self, i: int) -> str:
        """``tc -s qdisc`` of node ``i``'s interface (sent bytes, drops, overlimits)."""
        return subprocess.run(
            self.exec_argv(i, ["tc", "-s", "qdisc", "show", "dev", self.ifname]),
            capture_output=True,
            text=True,
        ).stdout

    def describe(self) -> str:
        shaping = (
            f"tbf rate {self.rate} burst {self.burst} B latency {self.latency} on both ends"
            if self.rate
            else "unshaped"
        )
        topo = "one veth pair" if self.hub_ns is None else "veths to a bridge"
        return f"{self.n} namespaces ({topo}, {', '.join(self.addrs)}), {shaping}"

    # ---- building and removing

    def _add_ns(self, ns: str) -> None:
        ip("netns", "add", ns)
        self.created.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate:
            _tc(
                ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                "burst", str(self.burst), "latency", self.latency,
            )  # fmt: skip

    def _build(self) -> None:
        for ns in self.node_ns:
            self._add_ns(ns)
        if self.hub_ns is None:
            a, b = self.node_ns
            ip("-n", a, "link", "add", IFNAME, "type", "veth", "peer", "name", IFNAME, "netns", b)
            ends = [(a, IFNAME), (b, IFNAME)]
        else:
            hub = self.hub_ns
            self._add_ns(hub)
            ip("-n", hub, "link", "add", "br0", "type", "bridge")
            ip("-n", hub, "link", "set", "br0", "up")
            ends = []
            for i, ns in enumerate(self.node_ns):
                port = f"p{i}"
                ip("-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", port,
                    "netns", hub)  # fmt: skip
                ip("-n", hub, "link", "set", port, "master", "br0")
                ip("-n", hub, "link", "set", port, "up")
                ends += [(ns, IFNAME), (hub, port)]
        for i, ns in enumerate(self.node_ns):
            ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", IFNAME)
            ip("-n", ns, "link", "set", IFNAME, "up")
        for ns, dev in ends:
            self._shape(ns, dev)

    def cleanup(self) -> None:
        """Kill the processes started here (their process groups: SIGTERM, then SIGKILL after
        3 s), then delete the namespaces (their veths and the bridge go with them)."""
        if self._closed:
            return
        self._closed = True
        stop_groups(self.procs, grace=3.0)
        for ns in reversed(self.created):
            kill_netns_pids(ns)
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", ns)
        self.created.clear()
        atexit.unregister(self.cleanup)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


def create_cluster(
    n: int,
    rate: str | None = "1gbit",
    *,
    burst: int | None = None,
    latency: str = "20ms",
    subnet: str = DEFAULT_SUBNET,
    prefix: str = DEFAULT_PREFIX,
) -> Cluster:
    """``n`` namespaces joined by veths (a bridge for ``n > 2``), each direction of each link
    shaped with ``tbf rate RATE burst BURST latency LATENCY`` (``rate=None``: unshaped).
    ``latency`` bounds the tbf queue (rate × latency bytes; beyond it packets drop).
    Returns the handle; on any failure everything made so far is removed first."""
    if not 2 <= n <= 250:
        raise ValueError(f"cluster of {n} nodes: expected 2..250")
    if os.geteuid() != 0:
        raise PermissionError("network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)")
    if rate is not None:
        parse_rate(rate)
        burst = default_burst(rate) if burst is None else burst
    cluster = Cluster(prefix, n, subnet, rate, burst, latency)
    try:
        cluster._build()
    except BaseException:
        cluster.cleanup()
        raise
    return cluster


@contextlib.contextmanager
def exit_on_signals(signums=(signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into SystemExit while active (SIGINT already raises
    KeyboardInterrupt), so ``finally`` blocks and context managers clean up. Main thread only;
    elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cluster_name(prefix: str, ns: str) -> re.Match | None:
    return re.fullmatch(rf"{re.escape(prefix)}-(\d+)-\d+-(\d+|hub)", ns)


def cluster_namespaces(prefix: str = DEFAULT_PREFIX) -> set[str]:
    """The namespaces named by this module (nodes and hubs of any process's clusters)."""
    return {ns for ns in list_namespaces() if _cluster_name(prefix, ns)}


def cleanup_stale(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Delete namespaces named by this module whose creating process is gone (after SIGKILL)."""
    removed = []
    for ns in sorted(cluster_namespaces(prefix)):
        if is_running(int(_cluster_name(prefix, ns).group(1))):
            continue
        kill_netns_pids(ns)
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", ns)
            removed.append(ns)
    return removed


# ---- link self-test: raw TCP streams between nodes, measured at the receiver


def _sink(port: int, nbytes: int) -> None:
    with socket.create_server(("0.0.0.0", port)) as srv:
        print("listening", flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(1 << 20)
            got = conn.recv_into(buf)
            start = time.perf_counter()  # from the first byte: excludes connection set-up
            while got < nbytes:
                k = conn.recv_into(buf)
                if not k:
                    break
                got += k
            seconds = time.perf_counter() - start
            conn.sendall(b"k")  # the source waits for this: its process outlives the stream
    print(json.dumps({"bytes": got, "seconds": seconds}), flush=True)


def _source(addr: str, port: int, nbytes: int) -> None:
    with socket.create_connection((addr, port), timeout=30) as conn:
        chunk = bytes(1 << 20)
        sent = 0
        while sent < nbytes:
            conn.sendall(chunk[: min(len(chunk), nbytes - sent)])
            sent += min(len(chunk), nbytes - sent)
        conn.recv(1)


def link_selftest(
    cluster: Cluster, src: int = 0, dst: int = 1, mib: int = 32, port: int = 5201
) -> list[tuple[str, float, float]]:
    """TCP throughput between two nodes, in Gbit/s per direction: ``src → dst`` alone,
    ``dst → src`` alone, both at once. → [(case, Gbit/s forward, Gbit/s backward)]."""
    nbytes = mib << 20
    me = [sys.executable, "-m", "benchmark.cluster.emulated_network"]

    def streams(pairs: list[tuple[int, int]]) -> list[float]:
        sinks = []
        for k, (_, b) in enumerate(pairs):
            p = cluster.popen(
                b, [*me, "_sink", str(port + k), str(nbytes)], stdout=subprocess.PIPE, text=True
            )
            if p.stdout.readline().strip() != "listening":
                raise RuntimeError(f"self-test sink on node {b} did not start")
            sinks.append(p)
        sources = [
            cluster.popen(a, [*me, "_source", cluster.addrs[b], str(port + k), str(nbytes)])
            for k, (a, b) in enumerate(pairs)
        ]
        rates = []
        for p in sinks:
            out, _ = p.communicate(timeout=120)
            r = json.loads(out.strip().splitlines()[-1])
            rates.append(r["bytes"] * 8 / r["seconds"] / 1e9)
        for p in sources:
            if p.wait(timeout=30):
                raise RuntimeError(f"self-test source failed: exit {p.returncode}")
        return rates

    fwd = streams([(src, dst)])[0]
    bwd = streams([(dst, src)])[0]
    both = streams([(src, dst), (dst, src)])
    return [("one direction at a time", fwd, bwd), ("both directions at once", *both)]


def format_selftest(cluster: Cluster, rows, src: int = 0, dst: int = 1) -> str:
    lines = [f"link self-test (TCP, node {src} <-> node {dst}): {cluster.describe()}"]
    for case, fwd, bwd in rows:
        lines.append(f"{case:>26}: {src}->{dst} {fwd:6.3f} Gbit/s, {dst}->{src} {bwd:6.3f} Gbit/s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_sink"]:
        return _sink(int(argv[1]), int(argv[2]))
    if argv[:1] == ["_source"]:
        return _source(argv[1], int(argv[2]), int(argv[3]))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("selftest", help="build a cluster, measure a link, remove it")
    st.add_argument("--nodes", type=int, default=2)
    st.add_argument("--link-rate", default="1gbit", help='tc rate, or "unshaped"')
    st.add_argument("--tbf-burst", type=int, default=None, help="bytes (default: see code)")
    st.add_argument("--tbf-latency", default="20ms")
    st.add_argument("--mib", type=int, default=32, help="MiB per stream")
    st.add_argument("--repeat", type=int, default=1)
    cl = sub.add_parser("cleanup", help="delete namespaces left by killed runs")
    cl.add_argument("--prefix", default=DEFAULT_PREFIX)
    args = p.parse_args(argv)
    if args.cmd == "cleanup":
        print("\n".join(cleanup_stale(args.prefix)) or "nothing to remove")
        return
    rate = None if args.link_rate == "unshaped" else args.link_rate
    with (
        exit_on_signals(),
        create_cluster(args.nodes, rate, burst=args.tbf_burst, latency=args.tbf_latency) as c,
    ):
        for _ in range(args.repeat):
            print(format_selftest(c, link_selftest(c, mib=args.mib)), flush=True)


if __name__ == "__main__":
    main()
