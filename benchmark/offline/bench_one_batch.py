"""Latency of one static batch: a prefill of ``batch × input_len`` tokens, then ``output_len``
decode steps, through srt's ModelRunner and scheduling structures (no server), as SGLang's
bench_one_batch. With ``--compare-hf`` the same work runs through HF transformers (a forward for
the prefill, ``generate`` for the whole) in the same process, and the ratios are printed.

    python benchmark/offline/bench_one_batch.py --model-path DIR --batch-size 1 8 32 64 \
        --input-len 256 --output-len 32 --compare-hf

With ``--tp-size N`` it starts N rank processes (one gloo or nccl world on loopback); under DP
attention every DP group runs its own batch of ``--batch-size`` sequences, so the sizes are per
group. ``--enable-two-batch-overlap`` runs the steps split, ``--enable-single-batch-overlap``
with the blocked combine; ``--compare-overlap`` runs every configuration with that overlap (TBO
unless SBO is given) off and on, interleaved (``--repeat`` times, medians), and prints the
speed-up and the share of the all-to-all time hidden, (T_off − T_on) / T_comm, where T_comm is
the time the plain step spends in its all-to-all operations (recorded in the same run).
``--nnodes/--node-rank/--dist-init-addr`` spread the ranks over machines (run the command on
every node; rank 0, on node 0, prints). ``--profile DIR`` writes rank 0's operation timeline
of one prefill and one decode step: a Chrome / Perfetto trace (``trace_*.json``) and a PNG of
one MoE layer (``layer_*.png``).

After the runs, a single-process run (``--tp-size 1``; larger worlds print nothing of it) sets
each configuration's decode step against memory: the weight bytes the step reads as the loaded
model stores them (``benchmark/common/weight_bytes.py``: every weight outside the routed experts,
the embedding rows of the batch, and per MoE layer ``batch × top_k`` experts, at most all; fp8
weights with their scales) ÷ the median decode step, the effective GB/s, beside the read
bandwidth of a ``torch.sum`` over 1 GiB of float32 measured then, on the threads the decode
step runs on (CPU) or on the GPU, and the share of it reached. ``--result-filename`` lines carry
them (``decode_weight_bytes``, ``decode_weight_gbps``, ``read_gbps``, ``read_threads``,
``read_fraction``).

With expert parallelism, the runs' routing is recorded (``srt.eplb``) and each MoE layer's load
imbalance printed: the busiest EP rank's routed tokens over the mean under the run's expert
placement (``expert_imbalance`` in the result lines); ``--ep-num-redundant-experts`` with
``--init-expert-location`` runs it with EPLB.

    python benchmark/offline/bench_one_batch.py --model-path MID --dtype bfloat16 \
        --batch-size 1 --input-len 128 --output-len 32 --repeat 3

    python benchmark/offline/bench_one_batch.py --model-path MID --tp 2 --dp 2 \
        --enable-dp-attention --moe-a2a-backend torch --compare-overlap --batch-size 32 128 \
        --input-len 4 --output-len 8 --profile /tmp/tbo
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import multiprocessing as mp
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist
from make_tiny_models import default_model_path

from benchmark.common.hf_compare import compare_with_hf, load_hf_model
from benchmark.common.op_timeline import (
    comm_seconds,
    matplotlib_missing,
    plot_layer,
    write_chrome_trace,
)
from benchmark.common.process import free_port
from benchmark.common.static_batch import make_runner, random_inputs, report, run_once
from benchmark.common.weight_bytes import decode_weight_bytes, read_bandwidth
from srt.eplb.algorithm import imbalance, rank_load
from srt.eplb.expert_location import ExpertLocation, expert_location_from_args, model_experts
from srt.layers.overlap.operations import OperationObserver
from srt.managers.scheduler_process import init_rank_parallel_state
from srt.model_executor.forward_batch_info import ForwardMode
from srt.server_args import ServerArgs
from srt.utils.process import freeze_startup_heap


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
    parser.add_argument(
        "--compare-overlap",
        action="store_true",
        help="run every configuration with two-batch overlap off and on (needs a layout that "
        "allows it, see --enable-two-batch-overlap)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="timed runs per configuration")
    parser.add_argument("--profile", default=None, metavar="DIR", help="write timelines here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.model_path is None:
        args.model_path = default_model_path()
    if args.profile and (missing := matplotlib_missing()):
        parser.error(missing)
    if args.compare_overlap and args.overlap_mode in ("off", "auto"):
        parser.error("--compare-overlap compares off with one fixed mode: tbo, sbo or dbo")
    asked = args.enable_single_batch_overlap or args.enable_dbo
    if args.compare_overlap and args.overlap_mode is None and not asked:
        args.enable_two_batch_overlap = True  # validated for this layout by ServerArgs
    if args.compare_hf and args.tp_size > 1:
        parser.error("--compare-hf runs on one rank (--tp-size 1)")
    return args, ServerArgs.from_cli_args(args)


def _variants(args: argparse.Namespace, server_args: ServerArgs) -> dict[str, ServerArgs]:
    """The configurations one run measures: the given one, or overlap off and on."""
    if not args.compare_overlap:
        return {"": server_args}
    kind = server_args.overlap_mode
    off = dataclasses.replace(
        server_args,
        overlap_mode="off",
        enable_two_batch_overlap=False,
        enable_single_batch_overlap=False,
        enable_dbo=False,
        sbo_num_blocks=None,
        sbo_communication_sms=None,
    )
    return {f"{kind}_off": off, f"{kind}_on": server_args}


def bench_rank(rank: int, args: argparse.Namespace, server_args: ServerArgs, init) -> None:
    """One rank's whole benchmark; rank 0 prints and writes the results. The process groups
    are destroyed before the process exits (gloo's threads abort an exit that finds them)."""
    parallel = None
    if server_args.tp_size > 1:
        parallel = init_rank_parallel_state(server_args, init, rank)
    try:
        _bench(rank, args, server_args, parallel)
    finally:
        if parallel is not None:
            parallel.destroy()


def _bench(rank: int, args: argparse.Namespace, server_args: ServerArgs, parallel) -> None:
    verbose = rank == 0
    configs = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    max_tokens = max(b * (i + o) for b, i, o in configs)
    runners = {
        label: make_runner(sa, max(args.batch_size), max_tokens, parallel)
        for label, sa in _variants(args, server_args).items()
    }
    freeze_startup_heap()  # as the scheduler process does once it is up
    balance = parallel is not None and parallel.moe_ep_size > 1
    for runner, _ in runners.values():
        if balance and runner.expert_recorder is not None:
            runner.expert_recorder.start()  # the routing of every run below, warm-ups too
    any_runner = next(iter(runners.values()))[0]
    hf_model = load_hf_model(server_args, any_runner) if args.compare_hf else None
    vocab, group = any_runner.model_config.vocab_size, any_runner.parallel.attn_dp_rank
    summaries = []
    for batch_size, input_len, output_len in configs:
        inputs = random_inputs(vocab, batch_size, input_len, args.seed + group)
        report(
            verbose,
            f"Warmup ...\nBenchmark: batch size {batch_size} (per DP group), "
            f"input len {input_len}, output len {output_len}",
        )
        summary = _measure(args, runners, inputs, output_len, verbose)
        if args.profile or args.compare_overlap:
            summary = _profile(args, runners, inputs, summary, verbose, (batch_size, input_len))
        if hf_model is not None:
            summary[""] |= compare_with_hf(hf_model, inputs, output_len, summary[""])
        summaries.append(summary)
    if server_args.tp_size == 1:
        _decode_bandwidth(runners, summaries, server_args)
    if balance:
        _expert_balance(runners, summaries, parallel, verbose)
    if verbose and args.result_filename:
        for summary in summaries:
            _write_results(args, server_args, summary)


def _measure(args, runners: dict, inputs, output_len: int, verbose: bool) -> dict:
    """Warm-up, then ``--repeat`` runs of every variant, interleaved; medians."""
    results: dict[str, list[dict]] = {}
    for runner, ctx in runners.values():
        run_once(runner, ctx, inputs, min(output_len, 4), verbose=False)
    for _ in range(args.repeat):
        for label, (runner, ctx) in runners.items():
            report(verbose and label != "", f"[{label}]")
            results.setdefault(label, []).append(
                run_once(runner, ctx, inputs, output_len, verbose=verbose)
            )
    return {label: _median_result(runs) for label, runs in results.items()}


def _write_results(args, server_args: ServerArgs, summary: dict) -> None:
    with open(args.result_filename, "a") as f:
        for label, result in summary.items():
            result = {k: v for k, v in result.items() if k not in ("output_ids", "events")}
            tags = {
                "run_name": args.run_name,
                "variant": label or None,
                "tp_size": server_args.tp_size,
                "dp_size": server_args.dp_size,
                "dtype": server_args.dtype,
                "quantization": server_args.quantization,
            }
            f.write(json.dumps(tags | result) + "\n")


def _decode_bandwidth(runners: dict, summaries: list[dict], server_args: ServerArgs) -> None:
    """Each configuration's decode weight bytes per step ÷ its median step, against the read
    bandwidth measured now (once per thread count), added to its results and printed."""
    model = next(iter(runners.values()))[0].model
    stored = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    print(f"Decode weight reads (--dtype {server_args.dtype}, --quantization "
          f"{server_args.quantization or 'none'}; weights stored as {', '.join(stored)}):\n"
          "| batch | input | output | variant | weight MB / step | step ms | effective GB/s "
          "| read GB/s (threads) | share |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    bandwidths: dict[int | None, float] = {}
    for summary in summaries:
        for label, result in summary.items():
            runner, batch_size = runners[label][0], result["batch_size"]
            threads = None  # on a GPU
            if runner.cpu_threads is not None:
                threads = runner.cpu_threads.threads_for(ForwardMode.DECODE, batch_size)
            if threads not in bandwidths:
                bandwidths[threads] = read_bandwidth(runner.device, threads=threads)
            read, bandwidth = decode_weight_bytes(runner.model, batch_size), bandwidths[threads]
            step = result["median_decode_latency"]
            result |= {
                "decode_weight_bytes": read,
                "decode_weight_gbps": read / step / 1e9,
                "read_gbps": bandwidth / 1e9,
                "read_threads": threads,
                "read_fraction": read / step / bandwidth,
            }
            print(f"| {batch_size} | {result['input_len']} | {result['output_len']} "
                  f"| {label or '-'} | {read / 1e6:.3f} | {step * 1e3:.3f} "
                  f"| {read / step / 1e9:.2f} | {bandwidth / 1e9:.2f} ({threads or 'GPU'}) "
                  f"| {result['read_fraction']:.1%} |", flush=True)  # fmt: skip


def _expert_balance(runners: dict, summaries: list[dict], parallel, verbose: bool) -> None:
    """With expert parallelism: each MoE layer's imbalance under the variant's placement (the
    busiest EP rank's routed tokens over the mean, an expert's tokens split evenly over its
    copies), from what every rank routed during the runs; added to the results and printed."""
    for label, (runner, _) in runners.items():
        recorder = runner.expert_recorder
        if recorder is None:
            continue
        counts = recorder.counts.cpu()
        dist.all_reduce(counts, group=parallel.world.cpu_group)
        hf_config = runner.model_config.hf_config
        layers, experts, _ = model_experts(hf_config)
        if runner.eplb is not None:  # --enable-eplb: where the last rebalance left the experts
            location = runner.eplb.location
        else:
            location = expert_location_from_args(runner.server_args, hf_config)
        if location is None:
            location = ExpertLocation.trivial(layers, experts, 0, parallel.moe_ep_size)
        moe = [i for i in range(layers) if counts[i].any()]
        per_layer = imbalance(rank_load(location.placement, counts.double()))[moe].tolist()
        for summary in summaries:
            summary[label]["expert_imbalance"] = per_layer
        report(
            verbose,
            f"Expert load imbalance{f' [{label}]' if label else ''} (busiest EP rank / mean, "
            f"MoE layers {moe}): "
            + ", ".join(f"{x:.3f}" for x in per_layer)
            + f"; max {max(per_layer):.3f}",
        )


def _median_result(runs: list[dict]) -> dict:
    out = dict(runs[0])
    for key in ("prefill_latency", "median_decode_latency", "total_latency"):
        out[key] = statistics.median(r[key] for r in runs)
    return out


def _profile(args, runners, inputs, summary: dict, verbose: bool, shape) -> dict:
    """One recorded run per variant: T_comm of the unsplit steps, the hidden share, the
    timelines."""
    steps = {}
    for label, (runner, ctx) in runners.items():
        events = run_once(runner, ctx, inputs, 2, False, OperationObserver(record=True))["events"]
        for kind, evs in events.items():
            steps[f"{label or 'run'} {kind}"] = evs
            summary[label][f"{kind}_comm_seconds"] = comm_seconds(evs)
    if args.compare_overlap:
        (name, off), (_, on) = [(label[:3].upper(), summary[label]) for label in runners]
        for kind, key in (("prefill", "prefill_latency"), ("decode", "median_decode_latency")):
            comm = off[f"{kind}_comm_seconds"]
            on[f"{kind}_speedup"] = off[key] / on[key]
            on[f"{kind}_hidden_fraction"] = (off[key] - on[key]) / comm if comm else float("nan")
            report(
                verbose,
                f"{name} {kind}: off {off[key] * 1e3:8.2f} ms, on {on[key] * 1e3:8.2f} "
                f"ms, speed-up {on[f'{kind}_speedup']:5.3f}x, T_comm {comm * 1e3:7.2f} ms, "
                f"hidden {on[f'{kind}_hidden_fraction']:6.1%}",
            )
    if args.profile and verbose:
        out = Path(args.profile)
        out.mkdir(parents=True, exist_ok=True)
        tag = f"b{shape[0]}_i{shape[1]}"
        write_chrome_trace(out / f"trace_{tag}.json", steps)
        model = next(iter(runners.values()))[0].model.model
        middle = model.tbo_start_layer + (len(model.layers) - model.tbo_start_layer) // 2
        plot_layer(out / f"layer_{tag}.png", steps, middle)
        report(verbose, f"Timelines: {out}/trace_{tag}.json, {out}/layer_{tag}.png")
    return summary


def main() -> None:
    args, server_args = parse_args()
    logging.basicConfig(level=getattr(logging, server_args.log_level.upper()))
    if server_args.tp_size == 1:
        bench_rank(0, args, server_args, None)
        return
    if server_args.nnodes > 1:  # this node's ranks; node 0's address for the rendezvous
        host, _, port = server_args.dist_init_addr.rpartition(":")
        per_node = server_args.num_ranks_per_node
        ranks = range(server_args.node_rank * per_node, (server_args.node_rank + 1) * per_node)
    else:
        host, port, ranks = "127.0.0.1", free_port(), range(server_args.tp_size)
    init = SimpleNamespace(dist_init_method=f"tcp://{host}:{port}", dist_init_host=host)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=bench_rank, args=(rank, args, server_args, init)) for rank in ranks]
    for p in procs:
        p.start()
    failed = False
    while procs:
        for p in list(procs):
            p.join(timeout=0.2)
            if p.exitcode is None:
                continue
            procs.remove(p)
            if p.exitcode != 0 and not failed:
                failed = True
                print(f"bench_one_batch: a rank exited with {p.exitcode}", file=sys.stderr)
                for other in procs:
                    other.terminate()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
