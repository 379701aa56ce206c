"""What a prefill costs the requests that are decoding: one ModelRunner (no server) holds
``--running`` requests that decode, and each round times, back to back, their decode step
(D), a prefill of ``--new`` prompts of ``--input-len`` tokens alone (P) and the same prefill
with the running requests' decode in its batch (M, a MIXED batch, as the scheduler builds it
with mixed batches on). Without mixed batches a prefill stops every stream for P + D, with
them for M. ``--no-mla-split`` times M for an MLA model as it ran before its decoding rows
attended on the cached latent (every row expanded), in the same process: both M columns.

    python benchmark/offline/make_random_model.py --out-dir /tmp/dsv3 --preset deepseek-v3
    python benchmark/offline/bench_mixed_step.py --model-path /tmp/dsv3 --running 14 --new 2 \
        --input-len 128 --rounds 6 --no-mla-split
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from make_tiny_models import default_model_path

from benchmark.common.static_batch import make_batch, make_runner, step
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the bundled tiny model")
    p.add_argument("--running", type=int, default=14, help="requests decoding")
    p.add_argument("--new", type=int, default=2, help="prompts in each prefill")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6, help="the first is a warm-up, not counted")
    p.add_argument("--no-mla-split", action="store_true", help="also time M, every row expanded")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    """Milliseconds per round for each of D, P, M (and M expanded)."""
    server_args = ServerArgs(model_path=args.model_path or default_model_path(), device="cpu")
    rows = args.running + args.new * (args.rounds * 3)
    # Every round the running requests grow by up to 3 tokens and 3 prefills arrive.
    tokens = (
        args.running * (args.input_len + 3 * args.rounds + 1)
        + args.new * args.rounds * 3 * args.input_len
    )
    runner, ctx = make_runner(server_args, rows, tokens + 64)
    rng = random.Random(0)
    vocab = runner.model_config.vocab_size

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(n)]

    running = make_batch(ctx, prompts(args.running), 1 << 20)
    running.prepare_for_extend()
    step(runner, running)

    def decode() -> None:
        running.prepare_for_decode()
        step(runner, running)

    def prefill(mixed: bool) -> None:
        batch = make_batch(ctx, prompts(args.new), 4)
        batch.prepare_for_extend()
        if mixed:
            batch.mix_with_running(running.reqs)
        step(runner, batch)

    kinds = {"D": decode, "P": lambda: prefill(False), "M": lambda: prefill(True)}
    if args.no_mla_split:
        kinds["M expanded"] = lambda: _without_split(runner, lambda: prefill(True))
    times = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, run in kinds.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def _without_split(runner: ModelRunner, run) -> None:
    runner.split_mla_decode_tail = False
    try:
        run()
    finally:
        runner.split_mla_decode_tail = True


def main(argv=None) -> None:
    args = parse_args(argv)
    times = {name: values[1:] for name, values in measure(args).items()}
    med = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        rounds = " ".join(f"{v:.1f}" for v in values)
        print(f"{name:10s} median {med[name]:7.2f} ms   rounds {rounds}")
    print(f"M / (P + D) {med['M'] / (med['P'] + med['D']):.2f}")


if __name__ == "__main__":
    main()
