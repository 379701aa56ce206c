"""Where the time between two chunks of a stream goes: a per-token timeline across srt's
processes, and the tokens each SSE chunk carried.

Starts srt with ``SRT_STREAM_TRACE`` (``srt/utils/stream_trace.py``: each process logs, per
request and message, when the scheduler sent a step's output, when the detokenizer sent its
text on, when the HTTP process received it and when the stream handed a chunk to the
response), streams ``--num-prompts`` greedy ``/generate`` requests (``ignore_eos``; each event
carries the output ids so far, so a chunk's tokens are counted exactly) at each
``--concurrency`` with its own client, which stamps every SSE chunk's arrival, and joins the
two: for each chunk, the token that ends it and that token's time at every stage.

    python -m benchmark.serving.stream_timeline --model-path DIR --concurrency 1 16

Per concurrency: tokens per chunk (its distribution), the gap between chunks (median, p99)
against the scheduler's gap between steps, and for the gaps over twice the median step, how
long their last token spent in each hop (scheduler → detokenizer → HTTP process → response →
client) and how long its step took; ``--json FILE`` keeps every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.common.server import ServerProcess

ENV = "SRT_STREAM_TRACE"  # srt/utils/stream_trace.py's (not imported: runs against any srt)

STAGES = ("scheduler", "detokenizer", "tokenizer", "http", "client")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else 0.0


async def one_stream(client: httpx.AsyncClient, rid: str, prompt: str, max_tokens: int,
                     arrivals: list) -> None:  # fmt: skip
    """One streamed ``/generate``; every chunk's (arrival, rid, tokens so far)."""
    params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body = {"text": prompt, "sampling_params": params, "stream": True, "rid": rid}
    async with client.stream("POST", "/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            now = time.monotonic()
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append((now, rid, len(json.loads(line[6:])["output_ids"])))


async def drive(url: str, concurrency: int, num_prompts: int, max_tokens: int) -> list:
    arrivals: list = []
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(num_prompts):
        queue.put_nowait((f"c{concurrency}-{i}", f"Request {i}: count the primes below {97 + i}"))

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            rid, prompt = queue.get_nowait()
            await one_stream(client, rid, prompt, max_tokens, arrivals)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return arrivals


def load_trace(folder: Path) -> dict[tuple[str, int], dict[str, float]]:
    """(rid, tokens) → stage → time (the first time a stage logged that count)."""
    out: dict[tuple[str, int], dict[str, float]] = collections.defaultdict(dict)
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            t, stage, rid, n = line.split()
            out[(rid, int(n))].setdefault(stage, float(t))
    return out


def analyse(arrivals: list, trace: dict) -> dict:
    """Tokens per chunk, gaps, and the hops of the long gaps' last tokens."""
    by_rid: dict[str, list] = collections.defaultdict(list)
    for now, rid, tokens in sorted(arrivals):
        by_rid[rid].append((now, tokens))
    per_chunk, gaps, step_gaps, long = [], [], [], []
    for rid, chunks in by_rid.items():
        chunks = [c for c in chunks if c[1] > 0]
        for (t0, n0), (t1, n1) in zip(chunks, chunks[1:]):
            if n1 == n0:
                continue  # the finish chunk after the last token's
            per_chunk.append(n1 - n0)
            gap = t1 - t0
            gaps.append(gap)
            sched0 = trace.get((rid, n0), {}).get("scheduler")
            stamps = trace.get((rid, n1), {})
            if sched0 is None or "scheduler" not in stamps:
                continue
            step = stamps["scheduler"] - sched0
            step_gaps.append(step / (n1 - n0))
            long.append((gap, step, [stamps.get(s) for s in STAGES[:-1]] + [t1]))
    median_step = statistics.median(step_gaps) if step_gaps else 0.0
    hops = {f"{a}->{b}": [] for a, b in zip(STAGES, STAGES[1:])}
    slow_steps = []
    for gap, step, times in long:
        if gap <= 2 * median_step or None in times:
            continue
        slow_steps.append(step)
        for values, a, b in zip(hops.values(), times, times[1:]):
            values.append(b - a)
    ms = lambda v: 1e3 * v  # noqa: E731
    return {
        "chunks": len(per_chunk) + len(by_rid),
        "tokens_per_chunk": collections.Counter(per_chunk),
        "mean_tokens_per_chunk": statistics.mean(per_chunk) if per_chunk else 0.0,
        "gap_median_ms": ms(statistics.median(gaps)) if gaps else 0.0,
        "gap_p99_ms": ms(pct(gaps, 99)),
        "step_median_ms": ms(median_step),
        "step_p99_ms": ms(pct(step_gaps, 99)),
        "long_gaps": len(slow_steps),
        "long_gap_step_ms": ms(statistics.mean(slow_steps)) if slow_steps else 0.0,
        "long_gap_hops_ms": {k: ms(statistics.mean(v)) if v else 0.0 for k, v in hops.items()},
    }


def report(concurrency: int, a: dict) -> str:
    dist = ", ".join(f"{k}: {v}" for k, v in sorted(a["tokens_per_chunk"].items()))
    hops = ", ".join(f"{k} {v:.2f}" for k, v in a["long_gap_hops_ms"].items())
    return (
        f"concurrency {concurrency}: {a['mean_tokens_per_chunk']:.2f} tokens a chunk ({dist}); "
        f"gap between chunks median {a['gap_median_ms']:.2f} ms, p99 {a['gap_p99_ms']:.2f} ms; "
        f"scheduler step median {a['step_median_ms']:.2f} ms, p99 {a['step_p99_ms']:.2f} ms\n"
        f"  {a['long_gaps']} gaps over twice the median step: their step "
        f"{a['long_gap_step_ms']:.2f} ms on average; hops of their last token (ms): {hops}"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--server-args", default="--dtype float32")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="srt-stream-trace-") as tmp:
        os.environ[ENV] = tmp
        try:
            with ServerProcess.running(args.model_path, *args.server_args.split()) as server:
                asyncio.run(drive(server.url, 1, 2, 8))  # warm-up
                for c in args.concurrency:
                    arrivals = asyncio.run(drive(server.url, c, args.num_prompts,
                                                 args.max_tokens))  # fmt: skip
                    results[c] = (arrivals, c)
        finally:
            os.environ.pop(ENV, None)
        trace = load_trace(Path(tmp))
    out = {}
    for c, (arrivals, _) in results.items():
        out[c] = analyse(arrivals, trace)
        print(report(c, out[c]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, default=dict, indent=1))


if __name__ == "__main__":
    main()
