"""CPU GEMM kernels for a linear layer, by row count: MKL (``F.linear``) against oneDNN with a
packed weight (``srt.layers.linear``), on weights too large to stay in cache (decode streams
them from memory). Prints effective weight bandwidth (GB/s) and GFLOP/s.

    python benchmark/kernel/bench_gemm.py [--rows 1 2 4 16 128 2048] [--out 2048 --in 1024]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from srt.layers.linear import linear, pack_weight


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512, 2048])
    p.add_argument("--out", type=int, default=2048)
    p.add_argument("--in", dest="inp", type=int, default=1024)
    p.add_argument("--num-weights", type=int, default=48, help="cycled through, cache-cold")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    weights = [torch.randn(args.out, args.inp) * 0.02 for _ in range(args.num_weights)]
    packed = [pack_weight(w) for w in weights]
    if packed[0] is None:
        raise SystemExit("oneDNN is not available in this torch build")
    weight_bytes = sum(w.nbytes for w in weights)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.num_weights} weights [{args.out}, {args.inp}] fp32")  # fmt: skip
    print("| rows | MKL GB/s | MKL GFLOP/s | oneDNN GB/s | oneDNN GFLOP/s | oneDNN / MKL |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        x = torch.randn(rows, args.inp)
        mkl = timed(lambda: [F.linear(x, w) for w in weights], args.repeat)  # noqa: B023
        dnn = timed(
            lambda: [linear(x, w, packed=q) for w, q in zip(weights, packed)],  # noqa: B023
            args.repeat,
        )
        flops = 2 * rows * args.out * args.inp * args.num_weights
        cells = [f"{weight_bytes / t / 1e9:.1f} | {flops / t / 1e9:.0f}" for t in (mkl, dnn)]
        print(f"| {rows} | {cells[0]} | {cells[1]} | {mkl / dnn:.2f}× |")


if __name__ == "__main__":
    main()
