"""One static batch through srt's ModelRunner and scheduling structures, no server: what
``bench_one_batch``, ``bench_step_split``, ``bench_mixed_step`` and the GPU check build their
measurements on. A runner and its batch context (``make_runner``), a batch of requests that
decode greedily for a fixed number of tokens (``make_batch``), one forward step with its
sampling (``step``, the runner's own step entry), and a timed prefill-then-decode run
(``run_once``)."""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from srt.managers.schedule_batch import BatchContext, Req, ScheduleBatch
from srt.mem_cache.chunk_cache import ChunkCache
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


def make_runner(server_args: ServerArgs, max_batch_size: int, max_tokens: int, parallel=None):
    """A runner sized for ``max_batch_size`` sequences of ``max_tokens`` KV slots in all, and
    its batch context."""
    graphs = {}
    if server_args.cuda_graph_bs is not None:  # CUDA: the batch measured has a graph of its own
        sizes = {b for b in server_args.cuda_graph_bs if b <= max_batch_size} | {max_batch_size}
        graphs = dict(cuda_graph_bs=sorted(sizes), cuda_graph_max_bs=None)
    args = dataclasses.replace(
        server_args,
        max_total_tokens=max(max_tokens, 16),
        max_running_requests=max_batch_size,
        **graphs,
    )
    runner = ModelRunner(args, parallel=parallel)
    return runner, batch_context(runner)


def batch_context(runner: ModelRunner) -> BatchContext:
    """The pools and cache a ScheduleBatch of ``runner`` allocates from (a chunk cache: no
    prefix is shared between runs)."""
    cache = ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.device)
    return BatchContext(
        runner.req_to_token_pool,
        runner.token_to_kv_pool_allocator,
        cache,
        runner.device,
        runner.model_config.vocab_size,
    )


def make_batch(ctx: BatchContext, input_ids: list[list[int]], output_len: int) -> ScheduleBatch:
    """Greedy requests that generate exactly ``output_len`` tokens each."""
    reqs = []
    for i, ids in enumerate(input_ids):
        # min_new_tokens masks EOS exactly as HF generate's min_new_tokens does.
        params = SamplingParams(
            max_new_tokens=output_len, min_new_tokens=output_len, temperature=0, ignore_eos=True
        )
        params.normalize(None)
        req = Req(str(i), ids, params)
        req.init_next_round_input(ctx.tree_cache)
        reqs.append(req)
    return ScheduleBatch(reqs, ctx)


def random_inputs(vocab: int, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 500), (batch_size, input_len), generator=gen).tolist()


def step(runner: ModelRunner, batch: ScheduleBatch) -> list[int]:
    """One forward step of ``batch`` (prepared for extend or decode) and its sampling; the
    tokens are appended to the requests."""
    forward_batch = batch.to_forward_batch(runner)
    next_ids = runner.sample(runner.forward_step(forward_batch), forward_batch).tolist()
    for req, tok in zip(batch.reqs, next_ids):
        req.output_ids.append(tok)
    return next_ids


def start_decoding(runner, ctx, inputs: list[list[int]], output_len: int) -> ScheduleBatch:
    """A fresh batch of ``inputs``, prefilled; its decode steps follow with ``decode_step``."""
    ctx.req_to_token_pool.clear()
    ctx.allocator.clear()
    batch = make_batch(ctx, inputs, output_len)
    batch.prepare_for_extend()
    step(runner, batch)
    return batch


def decode_step(runner, batch: ScheduleBatch) -> None:
    batch.prepare_for_decode()
    step(runner, batch)


def report(verbose: bool, line: str) -> None:
    if verbose:
        print(line, flush=True)


def run_once(
    runner, ctx, input_ids: list[list[int]], output_len: int, verbose: bool, observer=None
) -> dict:
    """A timed prefill, then ``output_len - 1`` timed decode steps, from empty pools. With an
    ``observer`` (recording) the result holds the operation events of the prefill step and of
    the first decode step."""
    ctx.req_to_token_pool.clear()
    ctx.allocator.clear()
    batch_size, input_len = len(input_ids), len(input_ids[0])
    batch = make_batch(ctx, input_ids, output_len)
    runner.set_operation_observer(observer)
    events = {}
    start = time.perf_counter()
    batch.prepare_for_extend()
    step(runner, batch)
    prefill = time.perf_counter() - start
    if observer is not None:
        events["prefill"] = observer.take_events()
    report(
        verbose,
        f"Prefill. latency: {prefill:6.5f} s, "
        f"throughput: {batch_size * input_len / prefill:9.2f} token/s",
    )
    decode = _timed_decode_steps(runner, batch, output_len - 1, verbose, observer, events)
    total = time.perf_counter() - start
    runner.set_operation_observer(None)
    med = statistics.median(decode) if decode else float("nan")
    _report_totals(verbose, batch_size, batch_size * (input_len + output_len), med, total)
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill,
        "median_decode_latency": med,
        "total_latency": total,
        "output_ids": [r.output_ids for r in batch.reqs],
        "events": events,
    }


def _timed_decode_steps(runner, batch, steps: int, verbose: bool, observer, events) -> list:
    """Seconds of each decode step; the first step's events go to ``events["decode"]``."""
    decode = []
    for i in range(steps):
        t = time.perf_counter()
        decode_step(runner, batch)
        decode.append(time.perf_counter() - t)
        if observer is not None and i == 0:
            events["decode"] = observer.take_events()
        if i < 5:
            report(
                verbose,
                f"Decode {i}. Batch size: {len(batch.reqs)}, latency: {decode[-1]:6.5f} s,"
                f" throughput: {len(batch.reqs) / decode[-1]:9.2f} token/s",
            )
    return decode


def _report_totals(verbose: bool, batch_size: int, tokens: int, med: float, total: float) -> None:
    report(
        verbose,
        f"Decode.  median latency: {med:6.5f} s, "
        f"median throughput: {batch_size / med:9.2f} token/s",
    )
    report(verbose, f"Total. latency: {total:6.3f} s, throughput: {tokens / total:9.2f} token/s")
