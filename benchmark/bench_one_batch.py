"""Latency of one static batch: a prefill of ``batch × input_len`` tokens, then ``output_len``
decode steps, through srt's ModelRunner and scheduling structures (no server), as SGLang's
bench_one_batch. With ``--compare-hf`` the same work runs through HF transformers (a forward for
the prefill, ``generate`` for the whole) in the same process, and the ratios are printed.

    python benchmark/bench_one_batch.py --model-path DIR --batch-size 1 8 32 64 \
        --input-len 256 --output-len 32 --compare-hf
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import statistics
import time

import torch

from srt.managers.schedule_batch import BatchContext, Req, ScheduleBatch
from srt.mem_cache.chunk_cache import ChunkCache
from srt.model_executor.model_runner import ModelRunner
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


def make_runner(server_args: ServerArgs, max_batch_size: int, max_tokens: int):
    args = dataclasses.replace(
        server_args, max_total_tokens=max(max_tokens, 16), max_running_requests=max_batch_size
    )
    runner = ModelRunner(args)
    cache = ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.device)
    ctx = BatchContext(
        runner.req_to_token_pool,
        runner.token_to_kv_pool_allocator,
        cache,
        runner.device,
        runner.model_config.vocab_size,
    )
    return runner, ctx


def make_batch(ctx: BatchContext, input_ids: list[list[int]], output_len: int) -> ScheduleBatch:
    reqs = []
    for i, ids in enumerate(input_ids):
        # min_new_tokens masks EOS exactly as HF generate's min_new_tokens does.
        params = SamplingParams(max_new_tokens=output_len, min_new_tokens=output_len,
                                temperature=0, ignore_eos=True)
        params.normalize(None)
        req = Req(str(i), ids, params)
        req.init_next_round_input(ctx.tree_cache)
        reqs.append(req)
    return ScheduleBatch(reqs, ctx)


def step(runner: ModelRunner, batch: ScheduleBatch) -> list[int]:
    forward_batch = batch.to_forward_batch(runner)
    next_ids = runner.sample(runner.forward(forward_batch), forward_batch).tolist()
    for req, tok in zip(batch.reqs, next_ids):
        req.output_ids.append(tok)
    return next_ids


def run_once(runner, ctx, input_ids: list[list[int]], output_len: int, verbose: bool) -> dict:
    ctx.req_to_token_pool.clear()
    ctx.allocator.clear()
    batch_size, input_len = len(input_ids), len(input_ids[0])
    batch = make_batch(ctx, input_ids, output_len)
    start = time.perf_counter()
    batch.prepare_for_extend()
    step(runner, batch)
    prefill = time.perf_counter() - start
    report(
        verbose,
        f"Prefill. latency: {prefill:6.5f} s, "
        f"throughput: {batch_size * input_len / prefill:9.2f} token/s",
    )
    decode = []
    for i in range(output_len - 1):
        t = time.perf_counter()
        batch.prepare_for_decode()
        step(runner, batch)
        decode.append(time.perf_counter() - t)
        if i < 5:
            report(
                verbose,
                f"Decode {i}. Batch size: {batch_size}, latency: {decode[-1]:6.5f} s,"
                f" throughput: {batch_size / decode[-1]:9.2f} token/s",
            )
    total = time.perf_counter() - start
    med = statistics.median(decode) if decode else float("nan")
    report(
        verbose,
        f"Decode.  median latency: {med:6.5f} s, "
        f"median throughput: {batch_size / med:9.2f} token/s",
    )
    tokens = batch_size * (input_len + output_len)
    report(verbose, f"Total. latency: {total:6.3f} s, throughput: {tokens / total:9.2f} token/s")
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_latency": prefill,
        "median_decode_latency": med,
        "total_latency": total,
        "output_ids": [r.output_ids for r in batch.reqs],
    }


def report(verbose: bool, line: str) -> None:
    if verbose:
        print(line, flush=True)


def hf_run(model, input_ids: list[list[int]], output_len: int) -> dict:
    ids = torch.tensor(input_ids)
    with torch.no_grad():
        start = time.perf_counter()
        model(ids)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=0,
        )
        total = time.perf_counter() - start
    return {
        "prefill_latency": prefill,
        "total_latency": total,
        "output_ids": out[:, ids.shape[1] :].tolist(),
    }


def random_inputs(vocab: int, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 500), (batch_size, input_len), generator=gen).tolist()


def parse_args() -> tuple[argparse.Namespace, ServerArgs]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1])
    parser.add_argument("--input-len", type=int, nargs="+", default=[1024])
    parser.add_argument("--output-len", type=int, nargs="+", default=[16])
    parser.add_argument("--run-name", default="default")
    parser.add_argument("--result-filename", default=None, help="append JSON lines here")
    parser.add_argument(
        "--compare-hf", action="store_true", help="also run the same batch through HF transformers"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    return args, ServerArgs.from_cli_args(args)


def compare_with_hf(hf_model, inputs: list[list[int]], output_len: int, ours: dict) -> dict:
    hf_run(hf_model, [inputs[0][:8]], 2)  # warm-up
    ref = hf_run(hf_model, inputs, output_len)
    same = sum(a == b for a, b in zip(ours["output_ids"], ref["output_ids"]))
    prefill_x = ref["prefill_latency"] / ours["prefill_latency"]
    total_x = ref["total_latency"] / ours["total_latency"]
    print(
        f"HF transformers. prefill latency: {ref['prefill_latency']:6.5f} s, "
        f"generate latency: {ref['total_latency']:6.3f} s"
    )
    print(
        f"srt vs HF: prefill {prefill_x:5.2f}x, total {total_x:5.2f}x faster; "
        f"greedy outputs identical for {same}/{len(inputs)} sequences"
    )
    return {
        "hf_prefill_latency": ref["prefill_latency"],
        "hf_total_latency": ref["total_latency"],
        "prefill_speedup_vs_hf": prefill_x,
        "total_speedup_vs_hf": total_x,
        "num_identical_outputs": same,
    }


def main() -> None:
    args, server_args = parse_args()
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper()))
    configs = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    max_tokens = max(b * (i + o) for b, i, o in configs)
    runner, ctx = make_runner(server_args, max(args.batch_size), max_tokens)
    hf_model = None
    if args.compare_hf:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(
            server_args.model_path, dtype=runner.model_config.dtype
        ).eval()
    vocab = runner.model_config.vocab_size
    for batch_size, input_len, output_len in configs:
        inputs = random_inputs(vocab, batch_size, input_len, args.seed)
        print(
            f"Warmup ...\nBenchmark: batch size {batch_size}, input len {input_len}, "
            f"output len {output_len}"
        )
        run_once(runner, ctx, inputs, min(output_len, 4), verbose=False)
        result = run_once(runner, ctx, inputs, output_len, verbose=True)
        if hf_model is not None:
            result |= compare_with_hf(hf_model, inputs, output_len, result)
        result.pop("output_ids")
        if args.result_filename:
            with open(args.result_filename, "a") as f:
                f.write(json.dumps({"run_name": args.run_name, **result}) + "\n")


if __name__ == "__main__":
    main()
