"""The cost of dual-batch overlap's thread executor, apart from any model: microseconds per
hand-over (one ``dbo_yield``: wake the other micro-batch's thread, sleep until it hands back)
and per step (the two worker threads started on their batches and joined), with nothing else
to do.

    python -m benchmark.kernel.bench_ubatch_handover --yields 2000 --steps 2000

Prints one line per figure, the median of ``--repeat`` runs, and ``summary: handover_us=…
step_us=…``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from srt.batch_overlap.ubatching import UBatchWrapper
from srt.layers.overlap.ubatch_context import dbo_yield


def _batch(index: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=torch.zeros(1), positions=torch.zeros(1), index=index)


def handover_us(yields: int) -> float:
    """One step whose two threads yield ``yields`` times each: µs per hand-over."""

    def model(input_ids, positions, batch):
        for _ in range(yields):
            dbo_yield()
        return input_ids

    wrapper = UBatchWrapper(model)
    wrapper.run([_batch(0), _batch(1)])  # threads started
    start = time.perf_counter()
    wrapper.run([_batch(0), _batch(1)])
    seconds = time.perf_counter() - start
    wrapper.close()
    return seconds / (2 * yields) * 1e6


def step_us(steps: int) -> float:
    """Steps with no yield: µs to run both threads and join them."""
    wrapper = UBatchWrapper(lambda input_ids, positions, batch: input_ids)
    wrapper.run([_batch(0), _batch(1)])
    start = time.perf_counter()
    for _ in range(steps):
        wrapper.run([_batch(0), _batch(1)])
    seconds = time.perf_counter() - start
    wrapper.close()
    return seconds / steps * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--yields", type=int, default=2000)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    handover = statistics.median(handover_us(args.yields) for _ in range(args.repeat))
    step = statistics.median(step_us(args.steps) for _ in range(args.repeat))
    print(f"hand-over: {handover:.1f} us per dbo_yield ({args.yields} per thread, median of "
          f"{args.repeat})")  # fmt: skip
    print(f"step: {step:.1f} us to start and join the two threads (median of {args.repeat})")
    print(f"summary: handover_us={handover:.1f} step_us={step:.1f}")


if __name__ == "__main__":
    main()
