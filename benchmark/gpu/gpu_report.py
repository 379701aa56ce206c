"""The GPU figures of srt's decode step (``benchmark/gpu_check.sh``, steps 6 and 7b;
``docs/gpu.md``).

For one checkpoint (on a GPU, the 4-layer Qwen3-30B-A3B-shaped one of
``make_random_model.py --preset qwen3-30b-a3b-4l``, or its block-FP8 copy) and each batch
size, through bench_one_batch's static batch (``benchmark.common.static_batch``: prefill of
``--input-len`` tokens, then ``--output-len`` decode steps):

- decode step ms, CUDA graphs on and off (``--disable-cuda-graph`` as the runner has it: the
  same weights decode without their graphs), and whether both decoded the same greedy tokens;
- the memory floor: the bytes a decode step must read (the weights as stored, fp8 ones as
  e4m3 bytes plus their float32 scales, but the embedding table, of the routed experts the
  share ``batch × top_k / experts`` capped at all of them, and the KV cache the batch attends
  to) ÷ the copy bandwidth measured here, and step ÷ floor;
- from torch.profiler, per decode step: CUDA kernels, launch calls, host synchronisations
  (``cudaStreamSynchronize`` and kin), ``cudaMemcpyAsync`` calls and the device-busy share
  (kernel and copy time, overlaps merged, ÷ wall time), graphs on and off;
- two-batch overlap forced on and off (``--moe-a2a-backend torch``) at ``--tbo-batch-size``;
- srt vs HF transformers end to end (``hf_compare.compare_with_hf``, as ``--compare-hf``);
- with ``--baseline``, the decode figures beside those another run wrote (``--figures-json``):
  the fp8 copy's beside bf16's.

Every section prints as it finishes; one that fails prints FAIL and the others still run (exit
status 1 if any failed). On CPU it runs too (``--device cpu --dtype float32`` with a tiny
model and small sizes), where the profiler sees no CUDA work and the counts are zero.

    python benchmark/gpu/gpu_report.py --model-path DIR --batch-size 1 64 --input-len 512
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmark.common.hf_compare import compare_with_hf, load_hf_model
from benchmark.common.static_batch import random_inputs, run_once
from benchmark.gpu.checks import TBO_FLAGS, Report, check_ran_as_asked, new_runner, release
from benchmark.gpu.decode_figures import copy_bandwidth, floor_bytes, profile_decode, sync
from srt.layers.quantization.fp8 import FP8_DTYPE


@contextlib.contextmanager
def eager(runner) -> Iterator[None]:
    """Decode without the captured graphs, as ``--disable-cuda-graph`` would: one copy of the
    weights (6 GB on the GPU) serves both measurements."""
    graphs, runner.graph_runner = runner.graph_runner, None
    try:
        yield
    finally:
        runner.graph_runner = graphs


# How a runner with graphs decodes: from them, or eagerly (``eager``).
MODES = {"graphs": contextlib.nullcontext, "eager": eager}


def timed_decode(args, runner, ctx, inputs: list[list[int]]) -> dict:
    """run_once after a short warm-up (Triton compiles, the allocator grows)."""
    run_once(runner, ctx, inputs, min(args.output_len, 4), verbose=False)
    return run_once(runner, ctx, inputs, args.output_len, verbose=False)


def measure_decode(args, runner, ctx, inputs: list[list[int]], bandwidth: float) -> dict:
    """One batch, graphs on then off: decode step, floor, greedy tokens."""
    graph = timed_decode(args, runner, ctx, inputs)
    with eager(runner):
        plain = timed_decode(args, runner, ctx, inputs)
    batch_size, input_len = len(inputs), len(inputs[0])
    # the median decode step attends to about half the generated tokens besides the prompt
    read = floor_bytes(runner, batch_size, batch_size * (input_len + args.output_len // 2))
    return {
        "graph": graph,
        "graph_ms": graph["median_decode_latency"] * 1e3,
        "eager_ms": plain["median_decode_latency"] * 1e3,
        "floor_bytes": read,
        "floor_ms": read / bandwidth * 1e3,
        "same_tokens": graph["output_ids"] == plain["output_ids"],
    }


def fmt(x: float, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def decode_table(args, runner, ctx, bandwidth: float, figures: dict) -> None:
    vocab = runner.model_config.vocab_size
    print(
        f"{'batch':>5} {'graph ms':>9} {'eager ms':>9} {'floor GB':>9} {'floor ms':>9} "
        f"{'graph/floor':>11} {'eager/floor':>11}  greedy graph == eager"
    )
    for bs in args.batch_size:
        inputs = random_inputs(vocab, bs, args.input_len, args.seed)
        r = figures[bs] = measure_decode(args, runner, ctx, inputs, bandwidth)
        print(
            f"{bs:>5} {fmt(r['graph_ms']):>9} {fmt(r['eager_ms']):>9} "
            f"{fmt(r['floor_bytes'] / 1e9, '.3f'):>9} {fmt(r['floor_ms'], '.3f'):>9} "
            f"{fmt(r['graph_ms'] / r['floor_ms']):>11} {fmt(r['eager_ms'] / r['floor_ms']):>11}"
            f"  {'yes' if r['same_tokens'] else 'NO'}",
            flush=True,
        )


def profile_table(args, runner, ctx) -> None:
    vocab = runner.model_config.vocab_size
    print(
        f"{'batch':>5} {'mode':>6} {'kernels':>8} {'launches':>8} {'syncs':>6} "
        f"{'memcpys':>7} {'busy':>6}   (per decode step)"
    )
    for bs in args.batch_size:
        inputs = random_inputs(vocab, bs, args.input_len, args.seed)
        for mode, decoding in MODES.items():
            with decoding(runner):
                c = profile_decode(runner, ctx, inputs, args.profile_steps)
            print(
                f"{bs:>5} {mode:>6} {fmt(c['kernels'], '.0f'):>8} {fmt(c['launches'], '.0f'):>8} "
                f"{fmt(c['syncs'], '.1f'):>6} {fmt(c['copies'], '.1f'):>7} "
                f"{fmt(c['busy'] * 100, '.0f'):>5}%",
                flush=True,
            )


def tbo_table(args) -> None:
    """Decode step with two-batch overlap forced off and on (both ``--moe-a2a-backend torch``,
    whose all-to-all on one rank moves nothing: this is the cost of the split itself)."""
    bs = args.tbo_batch_size
    print(f"{'batch':>5} {'tbo':>4} {'graph ms':>9} {'eager ms':>9}  greedy graph == eager")
    ms: dict[str, tuple[float, float]] = {}
    for label, flags in (("off", {"moe_a2a_backend": "torch"}), ("on", TBO_FLAGS)):
        runner, ctx = new_runner(
            args.model_path, args.device, args.dtype, bs, max_tokens(args, bs),
            cuda_graph_bs=[bs], **flags,
        )  # fmt: skip
        inputs = random_inputs(runner.model_config.vocab_size, bs, args.input_len, args.seed)
        graph = timed_decode(args, runner, ctx, inputs)
        with eager(runner):
            plain = timed_decode(args, runner, ctx, inputs)
        ms[label] = graph["median_decode_latency"] * 1e3, plain["median_decode_latency"] * 1e3
        same = graph["output_ids"] == plain["output_ids"]
        print(
            f"{bs:>5} {label:>4} {ms[label][0]:>9.2f} {ms[label][1]:>9.2f}  "
            f"{'yes' if same else 'NO'}",
            flush=True,
        )
        if label == "on":
            check_ran_as_asked(runner, "tbo+graphs")
        del runner, ctx
        release()
    (graph_on, eager_on), (graph_off, eager_off) = ms["on"], ms["off"]
    print(f"on / off: graphs {graph_on / graph_off:.2f}x, eager {eager_on / eager_off:.2f}x")


def hf_table(args, runner, figures: dict) -> None:
    """srt (graphs on, the runs of the decode table) vs HF transformers on the same batches."""
    hf_model = load_hf_model(runner.server_args, runner)
    vocab = runner.model_config.vocab_size
    rows = []
    for bs in args.batch_size:
        print(f"[batch {bs}]")
        inputs = random_inputs(vocab, bs, args.input_len, args.seed)
        ours = figures[bs]["graph"]
        rows.append((bs, compare_with_hf(hf_model, inputs, args.output_len, ours)))
    print(f"{'batch':>5} {'prefill x':>9} {'total x':>8} {'same greedy':>11}")
    for bs, r in rows:
        print(
            f"{bs:>5} {r['prefill_speedup_vs_hf']:>9.2f} {r['total_speedup_vs_hf']:>8.2f} "
            f"{r['num_identical_outputs']:>6}/{bs}"
        )
    del hf_model
    release()


def max_tokens(args, max_bs: int) -> int:
    """KV slots for the largest batch: prompt, decode steps, profiled steps, warm-up."""
    return max_bs * (args.input_len + args.output_len + args.profile_steps + 8)


def main_runner(args):
    """The runner of the decode and profile tables: graphs for exactly the batch sizes."""
    start = time.perf_counter()
    runner, ctx = new_runner(
        args.model_path, args.device, args.dtype, max(args.batch_size),
        max_tokens(args, max(args.batch_size)), cuda_graph_bs=sorted(set(args.batch_size)),
    )  # fmt: skip
    sync(runner.device)
    graphs = runner.graph_runner
    print(
        f"loaded in {time.perf_counter() - start:.1f} s: {runner.weight_bytes / 1e9:.2f} GB of "
        f"weights ({weights_label(runner)}), activations {args.dtype}, attention "
        f"{runner.server_args.attention_backend}"
        f", experts {expert_kernel(runner)}, CUDA graphs for "
        f"{graphs.batch_sizes if graphs is not None else 'none (eager only)'}"
    )
    return runner, ctx


def expert_kernel(runner) -> str:
    """How the routed experts run here (``FusedMoE.kernel``)."""
    from srt.layers.moe.fused_moe import FusedMoE

    experts = next((m for m in runner.model.modules() if isinstance(m, FusedMoE)), None)
    return "none" if experts is None else experts.kernel.value


def weights_label(runner) -> str:
    """How the weights are stored: ``fp8`` (block-FP8 linear layers and experts, e4m3 with
    float32 scales; embeddings, LM head, norms and routers in the model's dtype) or the
    model's dtype."""
    if any(p.dtype == FP8_DTYPE for p in runner.model.parameters()):
        return "fp8"
    return str(runner.model_config.dtype).removeprefix("torch.")


def write_figures(path: str, runner, bandwidth: float, figures: dict) -> None:
    """The decode table's figures as JSON, for a later run's ``--baseline``."""
    keys = ("graph_ms", "eager_ms", "floor_bytes", "floor_ms")
    out = {
        "weights": weights_label(runner),
        "weight_bytes": runner.weight_bytes,
        "bandwidth": bandwidth,
        "batches": {str(bs): {k: r[k] for k in keys} for bs, r in figures.items()},
    }
    Path(path).write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


def side_by_side(runner, figures: dict, baseline: dict) -> None:
    """This run's decode figures under the baseline's (another run's ``--figures-json``), and
    their ratios, this ÷ baseline, per batch size."""
    ours = weights_label(runner)
    theirs = baseline["weights"]
    print(
        f"{'batch':>5} {'weights':>9} {'graph ms':>9} {'eager ms':>9} {'floor GB':>9} "
        f"{'floor ms':>9} {'graph/floor':>11}"
    )
    for bs, r in figures.items():
        rows = {theirs: baseline["batches"].get(str(bs)), ours: r}
        for label, f in rows.items():
            if f is None:
                print(f"{bs:>5} {label:>9}  (not measured)")
                continue
            print(
                f"{bs:>5} {label:>9} {fmt(f['graph_ms']):>9} {fmt(f['eager_ms']):>9} "
                f"{fmt(f['floor_bytes'] / 1e9, '.3f'):>9} {fmt(f['floor_ms'], '.3f'):>9} "
                f"{fmt(f['graph_ms'] / f['floor_ms']):>11}"
            )
        base = rows[theirs]
        if base is not None:
            ratio = {k: r[k] / base[k] for k in ("graph_ms", "eager_ms", "floor_bytes")}
            print(
                f"{'':>5} {ours} / {theirs}: graph {ratio['graph_ms']:.2f}x, eager "
                f"{ratio['eager_ms']:.2f}x, floor bytes {ratio['floor_bytes']:.2f}x",
                flush=True,
            )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=16, help="tokens per timed run")
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--tbo-batch-size", type=int, default=64)
    parser.add_argument("--copy-mib", type=int, default=1024, help="tensor size, bandwidth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["profile", "tbo", "hf"], help="sections"
    )
    parser.add_argument("--figures-json", help="write the decode table's figures to this file")
    parser.add_argument(
        "--baseline",
        help="figures another run wrote with --figures-json, shown beside these (none if the "
        "file is missing: that run failed or did not run)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    report, figures = Report(), {}
    device = torch.device(args.device)
    with report.section("device"):
        describe_device(device)
        bandwidth = copy_bandwidth(device, args.copy_mib)
        print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s (read + write, {args.copy_mib} MiB)")
    with report.section("load"):
        runner, ctx = main_runner(args)
    if report.failed:
        return report.exit_status()  # nothing below runs without the runner
    with report.section(f"decode step (input {args.input_len}, {args.output_len} tokens)"):
        decode_table(args, runner, ctx, bandwidth, figures)
        if args.figures_json:
            write_figures(args.figures_json, runner, bandwidth, figures)
    if args.baseline:
        with report.section(f"decode step beside {args.baseline}"):
            if not Path(args.baseline).exists():
                print(f"no baseline figures: {args.baseline} was not written")
            else:
                baseline = json.loads(Path(args.baseline).read_text(encoding="utf-8"))
                side_by_side(runner, figures, baseline)
    if "profile" not in args.skip:
        with report.section("profile"):
            profile_table(args, runner, ctx)
    if "tbo" not in args.skip:
        with report.section(f"two-batch overlap (batch {args.tbo_batch_size})"):
            tbo_table(args)
    if "hf" not in args.skip:
        with report.section("srt vs HF transformers"):
            hf_table(args, runner, figures)
    return report.exit_status()


def describe_device(device: torch.device) -> None:
    try:  # a CPU install may have no Triton: the report runs there without it
        import triton
    except ImportError:
        triton_version = "not installed"
    else:
        triton_version = triton.__version__
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {name}, torch {torch.__version__}, triton {triton_version}")


if __name__ == "__main__":
    sys.exit(main())
