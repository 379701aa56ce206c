"""Micro-benchmark of the ``--moe-a2a-backend torch`` dispatchers on N ranks (gloo).

1. Per-layer dispatch + combine time (no expert compute) against tokens per rank, normal vs
   low_latency (capacity = tokens, and SGLang's default 128), on one process group or two
   (split by link direction).
2. Per-direction throughput with both directions loaded at once: one group; two groups used as
   "dispatch group + combine group" (two concurrent all-to-alls); two groups split by link
   direction (what the dispatchers do with two groups).

    python benchmark/kernel/bench_dispatch.py --world-size 2
    # one rank per network namespace, joined by a veth shaped with tbf at 1 Gbit/s each way
    # (made here and removed at exit, see benchmark/cluster/emulated_network.py; needs root):
    python benchmark/kernel/bench_dispatch.py --world-size 2 --netns --link-rate 1gbit
    # one rank per process by hand (e.g. on two hosts, or namespaces made elsewhere):
    GLOO_SOCKET_IFNAME=eth0 python benchmark/kernel/bench_dispatch.py --rank 0 --world-size 2 \
        --master-addr 10.77.0.1 --master-port 29500 --only throughput
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from benchmark.cluster import emulated_network
from benchmark.common.process import free_port
from srt.distributed.p2p import PendingWork
from srt.layers.moe.token_dispatcher.factory import create_dispatcher
from srt.layers.moe.token_dispatcher.torch_a2a import (
    DUPLEX_MIN_BYTES,
    DuplexAllToAll,
    EPLayout,
    RowFormat,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rank", type=int, default=None, help="run only this rank (else spawn all)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0, help="0: a free port (spawn mode)")
    p.add_argument("--only", choices=("all", "latency", "throughput"), default="all")
    p.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(12)])
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=50, help="layers timed per dispatcher")
    p.add_argument("--large-iters", type=int, default=0, help="above 256 tokens (0: iters / 4)")
    p.add_argument("--throughput-mb", type=int, default=64, help="MiB sent to each peer")
    p.add_argument(
        "--duplex-min-bytes",
        type=int,
        default=DUPLEX_MIN_BYTES,
        help="2PG columns: split an exchange by direction from this many bytes on a link",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    net = p.add_argument_group(
        "--netns: one rank per network namespace (benchmark/cluster/emulated_network.py)"
    )
    net.add_argument(
        "--netns",
        action="store_true",
        help="make world-size namespaces joined by veths, run rank i in namespace i, remove all",
    )
    net.add_argument("--link-rate", default="1gbit", help='tbf rate each way, or "unshaped"')
    net.add_argument("--tbf-burst", type=int, default=None, help="bytes (default: 1 ms of rate)")
    net.add_argument("--tbf-latency", default="20ms", help="tbf queue bound")
    net.add_argument("--no-selftest", action="store_true", help="skip the TCP link self-test")
    return p.parse_args()


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def routing(args, num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, args.num_experts, generator=gen)  # [T, E]
    weights, ids = scores.topk(args.top_k, dim=-1)  # [T, topk]
    hidden = torch.randn(num_tokens, args.hidden_size, generator=gen).to(getattr(torch, args.dtype))
    return hidden, weights, ids


def largest_link_kib(args, ids) -> float:
    """KiB on the busiest directed link in a normal dispatch (the bytes that decide the
    direction split), over all ranks."""
    layout = EPLayout(dist.get_rank(), dist.get_world_size(), args.num_experts)
    rows = layout.route(ids)[1].sum(dim=0)  # [ep] rows this rank sends each rank
    rows[dist.get_rank()] = 0  # self traffic crosses no link
    row_bytes = RowFormat(args.hidden_size, getattr(torch, args.dtype), args.top_k).row_bytes
    return max_over_ranks(int(rows.max()) * row_bytes / 1024)


def time_layers(dispatchers: list, inputs, iters: int) -> list[float]:
    """Median ms of one dispatch + combine (expert output = the dispatched hidden states) for
    each dispatcher, the slowest rank's. The dispatchers take turns, one layer each per round,
    every layer started on all ranks together (a barrier, not timed), so a slow spell of a
    shared core hits all of them alike; medians, for the same reason."""

    def once(dispatcher) -> float:
        dist.barrier()
        start = time.perf_counter()
        dispatcher.dispatch_a(*inputs)
        hidden, _, _ = dispatcher.dispatch_b()
        dispatcher.combine_a(hidden)
        dispatcher.combine_b()
        return time.perf_counter() - start

    for _ in range(3):
        for d in dispatchers:
            once(d)
    samples = [[] for _ in dispatchers]
    for _ in range(iters):
        for d, s in zip(dispatchers, samples):
            s.append(once(d))
    return [max_over_ranks(statistics.median(s) * 1e3) for s in samples]


def make(args, mode: str, groups, capacity: int):
    return create_dispatcher(
        "torch",
        mode,
        groups=groups,
        ep_rank=dist.get_rank(),
        ep_size=dist.get_world_size(),
        num_experts=args.num_experts,
        top_k=args.top_k,
        hidden_size=args.hidden_size,
        dtype=getattr(torch, args.dtype),
        max_dispatch_tokens_per_rank=capacity,
        duplex_min_bytes=args.duplex_min_bytes,
    )


def latency_table(args, one: list, two: list) -> None:
    head = [
        "tokens",
        "link KiB",
        "normal 1PG",
        "normal 2PG",
        "LL C=T 1PG",
        "LL C=T 2PG",
        "LL C=128 2PG",
    ]
    rows = []
    for t in args.tokens:
        inputs = routing(args, t, seed=dist.get_rank() * 7919 + t)
        iters = args.iters if t <= 256 else args.large_iters or max(3, args.iters // 4)
        dispatchers = [make(args, "normal", g, 1) for g in (one, two)]
        dispatchers += [make(args, "low_latency", g, t) for g in (one, two)]
        if t <= 128:
            dispatchers.append(make(args, "low_latency", two, 128))
        row = time_layers(dispatchers, inputs, iters)
        row += [None] * (5 - len(row))
        rows.append([t, largest_link_kib(args, inputs[2]), *row])
    if dist.get_rank() == 0:
        print(
            f"\nper-layer dispatch+combine, ms (H={args.hidden_size} {args.dtype}, "
            f"top-{args.top_k} of {args.num_experts}, {dist.get_world_size()} ranks; 2PG splits "
            f"by direction from {args.duplex_min_bytes} B on a link; link KiB: busiest link of "
            f"a normal dispatch)"
        )
        print("".join(f"{h:>14}" for h in head))
        for r in rows:
            print(
                f"{r[0]:>14}{r[1]:>14.1f}"
                + "".join(f"{'-' if v is None else f'{v:.3f}':>14}" for v in r[2:]),
                flush=True,
            )


def exchange_one(one: list, x, y, splits) -> PendingWork:
    ex = DuplexAllToAll(one, dist.get_rank(), dist.get_world_size())
    return ex.launch(y, x, splits, splits, max(splits))


def exchange_by_phase(two: list, x, y, splits) -> PendingWork:
    """Half on each group, both all-to-alls in flight (a dispatch and a combine at once)."""
    half = [s // 2 for s in splits]
    n = sum(half)
    rank, size = dist.get_rank(), dist.get_world_size()
    works = [
        DuplexAllToAll([g], rank, size).launch(
            y[i * n : (i + 1) * n], x[i * n : (i + 1) * n], half, half, max(half)
        )
        for i, g in enumerate(two)
    ]
    return PendingWork([w for p in works for w in p.works])


def exchange_by_direction(two: list, x, y, splits) -> PendingWork:
    ex = DuplexAllToAll(two, dist.get_rank(), dist.get_world_size(), duplex_min_bytes=0)
    return ex.launch(y, x, splits, splits, max(splits))


def throughput_table(args, one: list, two: list) -> None:
    size, rank = dist.get_world_size(), dist.get_rank()
    per_peer = args.throughput_mb * 2**20
    splits = [0 if r == rank else per_peer for r in range(size)]
    x = torch.ones(sum(splits), dtype=torch.uint8)
    y = torch.empty_like(x)
    lines = []
    for name, fn, groups in (
        ("one group", exchange_one, one),
        ("two groups: dispatch + combine", exchange_by_phase, two),
        ("two groups: split by direction", exchange_by_direction, two),
    ):
        fn(groups, x, y, splits).wait()
        dist.barrier()
        start = time.perf_counter()
        reps = 3
        for _ in range(reps):
            fn(groups, x, y, splits).wait()
        seconds = max_over_ranks((time.perf_counter() - start) / reps)  # includes the slowest
        lines.append(f"{name:>34}: {per_peer * 8 / seconds / 1e9:7.3f} Gbit/s per link direction")
    if rank == 0:
        print(f"\nboth directions at once, {args.throughput_mb} MiB to each peer, {size} ranks")
        print("\n".join(lines), flush=True)


def run_rank(rank: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{args.master_addr}:{args.master_port}",
        rank=rank,
        world_size=args.world_size,
    )
    try:
        ranks = list(range(args.world_size))
        one = [dist.new_group(ranks)]
        two = [dist.new_group(ranks), dist.new_group(ranks)]
        if args.only in ("all", "throughput"):
            throughput_table(args, one, two)
        if args.only in ("all", "latency"):
            latency_table(args, one, two)
    finally:
        dist.destroy_process_group()


def rank_argv(args: argparse.Namespace, rank: int, master_addr: str, port: int) -> list[str]:
    """This script's command line for one rank of a --netns run."""
    return [
        sys.executable, "-m", "benchmark.kernel.bench_dispatch", "--rank", str(rank),
        "--world-size", str(args.world_size), "--master-addr", master_addr,
        "--master-port", str(port), "--only", args.only,
        "--tokens", *map(str, args.tokens), "--hidden-size", str(args.hidden_size),
        "--num-experts", str(args.num_experts), "--top-k", str(args.top_k),
        "--dtype", args.dtype, "--iters", str(args.iters),
        "--large-iters", str(args.large_iters),
        "--throughput-mb", str(args.throughput_mb),
        "--duplex-min-bytes", str(args.duplex_min_bytes), "--threads", str(args.threads),
    ]  # fmt: skip


def _relay(stream, prefix: str) -> None:
    for line in stream:
        print(prefix + line, end="", flush=True)


def run_netns(args: argparse.Namespace) -> None:
    """One rank per namespace; rank 0's output as is, the others' prefixed. Namespaces, links
    and rank processes are removed on return, error, Ctrl-C or SIGTERM."""
    rate = None if args.link_rate == "unshaped" else args.link_rate
    with (
        emulated_network.exit_on_signals(),
        emulated_network.create_cluster(
            args.world_size, rate, burst=args.tbf_burst, latency=args.tbf_latency
        ) as cluster,
    ):
        print(f"torch {torch.__version__}, gloo; {cluster.describe()}", flush=True)
        if not args.no_selftest:
            selftest = emulated_network.link_selftest(cluster)
            print(emulated_network.format_selftest(cluster, selftest), flush=True)
        procs, relays = [], []
        for r in range(args.world_size):
            p = cluster.popen(
                r,
                rank_argv(args, r, cluster.addrs[0], 29500),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            t = threading.Thread(target=_relay, args=(p.stdout, "" if r == 0 else f"[rank {r}] "))
            t.start()
            procs.append(p)
            relays.append(t)
        while any(p.poll() is None for p in procs):  # a failed rank ends the run at once
            if any(p.poll() for p in procs):
                break
            time.sleep(0.2)
        codes = [p.poll() for p in procs]
        if any(c is None or c for c in codes):
            raise SystemExit(f"a rank failed: exit codes {codes} (None: killed at cleanup)")
        for t in relays:
            t.join()


def main() -> None:
    args = parse_args()
    if args.netns:
        run_netns(args)
        return
    if args.rank is not None:
        run_rank(args.rank, args)
        return
    if not args.master_port:
        args.master_port = free_port(args.master_addr)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run_rank, args=(r, args)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")


if __name__ == "__main__":
    main()
