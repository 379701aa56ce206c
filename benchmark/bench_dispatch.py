"""Micro-benchmark of the ``--moe-a2a-backend torch`` dispatchers on N ranks (gloo).

1. Per-layer dispatch + combine time (no expert compute) against tokens per rank, normal vs
   low_latency (capacity = tokens, and SGLang's default 128), on one process group or two
   (split by link direction).
2. Per-direction throughput with both directions loaded at once: one group; two groups used as
   "dispatch group + combine group" (two concurrent all-to-alls); two groups split by link
   direction (what the dispatchers do with two groups).

    python benchmark/bench_dispatch.py --world-size 2
    # one rank per process, e.g. in two network namespaces joined by a rate-limited veth:
    GLOO_SOCKET_IFNAME=veth0 python benchmark/bench_dispatch.py --rank 0 --world-size 2 \
        --master-addr 10.0.0.1 --only throughput
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch
import torch.distributed as dist

from srt.layers.moe.token_dispatcher.factory import create_dispatcher
from srt.layers.moe.token_dispatcher.torch_a2a import (
    DUPLEX_MIN_BYTES,
    DuplexAllToAll,
    PendingWork,
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
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--throughput-mb", type=int, default=64, help="MiB sent to each peer")
    p.add_argument(
        "--duplex-min-bytes",
        type=int,
        default=DUPLEX_MIN_BYTES,
        help="2PG columns: split an exchange by direction from this many bytes on a link",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
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


def time_layer(dispatcher, inputs, iters: int) -> float:
    """Median ms of one dispatch + combine (expert output = the dispatched hidden states), the
    slowest rank's. Medians, because other processes share the cores."""

    def once() -> float:
        start = time.perf_counter()
        dispatcher.dispatch_a(*inputs)
        hidden, _, _ = dispatcher.dispatch_b()
        dispatcher.combine_a(hidden)
        dispatcher.combine_b()
        return time.perf_counter() - start

    for _ in range(3):
        once()
    dist.barrier()
    return max_over_ranks(statistics.median(once() for _ in range(iters)) * 1e3)


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
    head = ["tokens", "normal 1PG", "normal 2PG", "LL C=T 1PG", "LL C=T 2PG", "LL C=128 2PG"]
    rows = []
    for t in args.tokens:
        inputs = routing(args, t, seed=dist.get_rank() * 7919 + t)
        iters = max(3, args.iters if t <= 256 else args.iters // 4)
        row = [time_layer(make(args, "normal", g, 1), inputs, iters) for g in (one, two)]
        row += [time_layer(make(args, "low_latency", g, t), inputs, iters) for g in (one, two)]
        row.append(
            time_layer(make(args, "low_latency", two, 128), inputs, iters) if t <= 128 else None
        )
        rows.append([t, *row])
    if dist.get_rank() == 0:
        print(
            f"\nper-layer dispatch+combine, ms (H={args.hidden_size} {args.dtype}, "
            f"top-{args.top_k} of {args.num_experts}, {dist.get_world_size()} ranks; 2PG splits "
            f"by direction from {args.duplex_min_bytes} B on a link)"
        )
        print("".join(f"{h:>14}" for h in head))
        for r in rows:
            print(f"{r[0]:>14}" + "".join(f"{'-' if v is None else f'{v:.3f}':>14}" for v in r[1:]))


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
        lines.append(f"{name:>34}: {per_peer * 8 / seconds / 1e9:7.2f} Gbit/s per link direction")
    if rank == 0:
        print(f"\nboth directions at once, {args.throughput_mb} MiB to each peer, {size} ranks")
        print("\n".join(lines))


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


def main() -> None:
    args = parse_args()
    if args.rank is not None:
        run_rank(args.rank, args)
        return
    if not args.master_port:
        with socket.socket() as s:
            s.bind((args.master_addr, 0))
            args.master_port = s.getsockname()[1]
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
