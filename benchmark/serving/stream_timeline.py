"""Where the time between two chunks of a stream goes: a per-token timeline across srt's
processes, and the tokens each SSE chunk carried.

Starts srt with ``SRT_STREAM_TRACE`` (the alias of ``--stream-trace-dir``;
``srt/utils/stream_trace.py``: each process logs, per
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
client) and how long its step took; and each kind of forward step (mode, threads): how long
it took and how long its threads waited for a core (the other processes on its cores), in
all and in the long gaps' steps. ``--json FILE`` keeps every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmark.common.server import ServerProcess

ENV = "SRT_STREAM_TRACE"  # --stream-trace-dir's alias (not imported: runs against any srt)

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
        if path.name.startswith("step-"):
            continue
        for line in path.read_text().splitlines():
            t, stage, rid, n = line.split()
            out[(rid, int(n))].setdefault(stage, float(t))
    return out


def load_steps(folder: Path) -> list[tuple]:
    """Every rank's forward steps, by end time: (end, mode, sequences, tokens, threads, wall
    ms, ms its threads waited for a core)."""
    steps = []
    for path in folder.glob("step-*.log"):
        for line in path.read_text().splitlines():
            end, _, mode, seqs, tokens, threads, wall, waited = line.split()
            steps.append((float(end), mode, int(seqs), int(tokens), int(threads),
                          float(wall), float(waited)))  # fmt: skip
    return sorted(steps)


def step_before(steps: list[tuple], t: float) -> tuple | None:
    """The last forward step that ended by ``t`` (the one whose output the scheduler sent)."""
    i = bisect.bisect_right(steps, (t, "\uffff")) - 1
    return steps[i] if i >= 0 else None


def summarise_steps(steps: list[tuple], start: float, end: float) -> dict:
    """Per kind of step (mode, threads) in [start, end]: count, median and longest wall time,
    and the time its threads waited for a core, in all and in the longest step."""
    kinds: dict[str, list] = collections.defaultdict(list)
    for step in steps:
        if start <= step[0] <= end:
            kinds[f"{step[1].lower()} on {step[4]}"].append(step)
    return {
        kind: {
            "steps": len(group),
            "wall_median_ms": statistics.median(s[5] for s in group),
            "wall_max_ms": max(s[5] for s in group),
            "waited_ms": sum(max(s[6], 0.0) for s in group),
            "waited_in_longest_ms": max(group, key=lambda s: s[5])[6],
        }
        for kind, group in sorted(kinds.items())
    }


def analyse(arrivals: list, trace: dict, steps: list[tuple] | None = None) -> dict:
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
    slow_steps, forwards = [], []
    for gap, step, times in long:
        if gap <= 2 * median_step or None in times:
            continue
        slow_steps.append(step)
        for values, a, b in zip(hops.values(), times, times[1:]):
            values.append(b - a)
        forward = step_before(steps or [], times[0])
        if forward is not None:
            forwards.append(forward)
    ms = lambda v: 1e3 * v  # noqa: E731
    span = [t for t, _, _ in arrivals]
    return {
        "steps": summarise_steps(steps or [], min(span, default=0), max(span, default=0)),
        "long_gap_forward_ms": statistics.mean(f[5] for f in forwards) if forwards else 0.0,
        "long_gap_waited_ms": statistics.mean(max(f[6], 0) for f in forwards) if forwards else 0.0,
        "long_gap_forwards": collections.Counter(f"{f[1].lower()} on {f[4]}" for f in forwards),
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
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(a["long_gap_forwards"].items()))
    return (
        f"concurrency {concurrency}: {a['mean_tokens_per_chunk']:.2f} tokens a chunk ({dist}); "
        f"gap between chunks median {a['gap_median_ms']:.2f} ms, p99 {a['gap_p99_ms']:.2f} ms; "
        f"scheduler step median {a['step_median_ms']:.2f} ms, p99 {a['step_p99_ms']:.2f} ms\n"
        f"  {a['long_gaps']} gaps over twice the median step: their step "
        f"{a['long_gap_step_ms']:.2f} ms on average; hops of their last token (ms): {hops}\n"
        f"  their forward steps ({kinds}): {a['long_gap_forward_ms']:.2f} ms on average, "
        f"{a['long_gap_waited_ms']:.2f} ms of it waiting for a core\n"
        + "\n".join(
            f"  {kind} steps: {k['steps']}, wall median {k['wall_median_ms']:.2f} ms, longest "
            f"{k['wall_max_ms']:.2f} ms ({k['waited_in_longest_ms']:.2f} waiting for a core), "
            f"{k['waited_ms']:.1f} ms waiting in all"
            for kind, k in a["steps"].items()
        )
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
        trace, steps = load_trace(Path(tmp)), load_steps(Path(tmp))
    out = {}
    for c, (arrivals, _) in results.items():
        out[c] = analyse(arrivals, trace, steps)
        print(report(c, out[c]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, default=dict, indent=1))


if __name__ == "__main__":
    main()
