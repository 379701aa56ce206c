"""Where a ModelRunner step goes: its GEMMs against everything else, prefill and decode.

Runs one static batch (a prefill of ``batch × input_len`` tokens, then decode steps) through
srt's ModelRunner on one rank, as ``bench_one_batch.py`` does, and times every call of
``srt.layers.linear.linear`` (the linear layers, on the CPU kernels' panels or oneDNN) and of
the CPU experts' kernel (``srt.layers.cpu_kernels.fused_experts``: a layer's routed experts,
their routing and SiLU included); torch's grouped GEMM of experts the kernel does not take,
the LM head and the router count as "other". Prints, per run, the prefill and the median decode
step with their GEMM and other shares. Decode runs eagerly (``--disable-cuda-graph`` is
implied): a graph's replay runs none of the Python that times the calls.

    python benchmark/kernel/bench_step_split.py --model-path DIR --batch-size 16 --input-len 128
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from make_tiny_models import default_model_path

import srt.layers.linear as linear_module
import srt.layers.moe.fused_moe as fused_moe_module
from benchmark.common.static_batch import make_batch, make_runner, random_inputs, step
from srt.layers import cpu_kernels
from srt.server_args import ServerArgs


class GemmTimer:
    """Wraps ``linear`` and the CPU experts' kernel where the layers look them up and adds up
    their wall time."""

    def __init__(self):
        self.seconds = 0.0
        linear_module.linear = fused_moe_module.linear = self.timed(linear_module.linear)
        cpu_kernels.fused_experts = self.timed(cpu_kernels.fused_experts)

    def timed(self, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        return wrapper

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run(runner, ctx, timer: GemmTimer, args, seed: int) -> dict[str, float]:
    ctx.req_to_token_pool.clear()
    ctx.allocator.clear()
    vocab = runner.model_config.vocab_size
    inputs = random_inputs(vocab, args.batch_size, args.input_len, seed)
    batch = make_batch(ctx, inputs, args.output_len)
    timer.take()
    start = time.perf_counter()
    batch.prepare_for_extend()
    step(runner, batch)
    prefill, prefill_gemm = time.perf_counter() - start, timer.take()
    steps = []
    for _ in range(args.output_len - 1):
        start = time.perf_counter()
        batch.prepare_for_decode()
        step(runner, batch)
        steps.append(time.perf_counter() - start)
    decode_gemm = timer.take() / max(1, len(steps))
    return {
        "prefill": prefill,
        "prefill_gemm": prefill_gemm,
        "decode": statistics.median(steps),
        "decode_gemm": decode_gemm,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up")
    args = parser.parse_args()
    if args.model_path is None:
        args.model_path = default_model_path()
    server_args = dataclasses.replace(ServerArgs.from_cli_args(args), disable_cuda_graph=True)
    timer = GemmTimer()
    tokens = args.batch_size * (args.input_len + args.output_len)
    runner, ctx = make_runner(server_args, args.batch_size, tokens)
    run(runner, ctx, timer, args, seed=0)
    for seed in range(1, args.repeat + 1):
        r = {k: 1000 * v for k, v in run(runner, ctx, timer, args, seed).items()}
        print(
            f"prefill {r['prefill']:7.1f} ms (GEMM {r['prefill_gemm']:7.1f}, other "
            f"{r['prefill'] - r['prefill_gemm']:6.1f})   decode step {r['decode']:6.2f} ms "
            f"(GEMM {r['decode_gemm']:6.2f}, other {r['decode'] - r['decode_gemm']:5.2f})",
            flush=True,
        )


if __name__ == "__main__":
    main()
