"""Emulated multi-node cluster: N network namespaces ("nodes") joined by tbf-shaped veth links
(``emulated_network.py``), a real multi-node srt in them, and the overlap benchmarks end to end.
Needs root and ``ip netns``.

For each link rate it builds the cluster, prints a link self-test (TCP throughput per
direction), then, with one rank per node pinned to its own core (``taskset``):
- ``bench_one_batch.py --compare-overlap`` on every node (``--nnodes/--node-rank``), once each
  for two-batch, single-batch and dual-batch overlap: step latency off and on, prefill and
  decode, in one run each, and the share of the all-to-all time hidden;
- the serving phase (``emulated_serving.py``): a server per overlap mode (off, TBO, SBO, DBO,
  ``--overlap-mode auto``, or those of ``--serving-modes``) on every node, all up at once, and
  ``bench_serving.py`` bursts from inside node 0's namespace sent to them in turn: one warm-up
  burst each, then ``--serving-runs`` rounds of one burst per mode, the order reversed every
  other round; a mode's figure pools its measured bursts (for auto it also keeps the policy's
  choices from /get_server_info);
then stops every process and removes the namespaces and links, also on failure or Ctrl-C.
Results: ``OUT/results.jsonl``, ``OUT/results.md``, ``OUT/throughput.png``, ``OUT/step_time.png``.

    python benchmark/cluster/emulated_cluster.py --nodes 2 --link-rate 1gbit --quick
    python benchmark/cluster/emulated_cluster.py --nodes 2 --link-rate 0.5gbit 1gbit 2gbit unshaped

``--quick`` runs the 2-node point at the first rate with one repeat and one batch size, and
ends with ``summary: tbo_decode_speedup=… tbo_prefill_speedup=… sbo_decode_speedup=…
dbo_decode_speedup=… dbo_prefill_speedup=… hidden_fraction=… serving_auto_vs_off=…
serving_auto_vs_best=… serving_dbo_vs_off=…`` (throughput ratios over overlap off in the same
run; the hidden fraction is TBO's, prefill and decode together: (T_off − T_on) / T_comm; the
serving ratios are output tok/s of auto over off and over the best of off, TBO and SBO, and of
DBO over off, those of them served, without ``--no-serving``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark.cluster.emulated_network import (
    create_cluster,
    exit_on_signals,
    format_selftest,
    link_selftest,
)
from benchmark.cluster.emulated_report import write_report
from benchmark.cluster.emulated_serving import (
    DIST_PORT,
    SERVING_FLAGS,
    add_srt_args,
    parallel_flags,
    run_serving_modes,
)
from benchmark.common.op_timeline import matplotlib_missing
from benchmark.offline.make_random_model import make_mid_size_model

# bench_one_batch measures the overlap itself: every step splits (thresholds 0). The servers
# run as users would, with the default thresholds.
OVERLAP_FLAGS = {
    "off": [],
    "tbo": ["--enable-two-batch-overlap", "--tbo-decode-token-threshold", "0",
            "--tbo-prefill-token-threshold", "0"],
    "sbo": ["--enable-single-batch-overlap"],
    "dbo": ["--enable-dbo", "--dbo-decode-token-threshold", "0",
            "--dbo-prefill-token-threshold", "0"],
}  # fmt: skip


OVERLAP_MODES = ("tbo", "sbo", "dbo")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--link-rate", nargs="+", default=["1gbit"], help="tc rates, or 'unshaped'")
    p.add_argument("--burst", type=int, default=None, help="tbf burst bytes (default: 1 ms)")
    p.add_argument("--latency", default="20ms", help="tbf queue bound")
    p.add_argument("--model-path", default=None, help="default: the 'emulated' random preset")
    add_srt_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[64, 256])
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64, help="bench_serving prompts per burst")
    p.add_argument(
        "--serving-output-len", type=int, default=64,
        help="output tokens per prompt of a serving burst (64 input tokens each)",
    )  # fmt: skip
    p.add_argument(
        "--one-batch-modes", nargs="+", choices=OVERLAP_MODES, default=list(OVERLAP_MODES),
        help="the overlaps bench_one_batch compares with off, in this order",
    )  # fmt: skip
    p.add_argument("--no-serving", action="store_true", help="skip the launch_server runs")
    p.add_argument(
        "--serving-modes", nargs="+", choices=list(SERVING_FLAGS), default=list(SERVING_FLAGS),
        help="the overlap modes served (a server each), in this order",
    )  # fmt: skip
    p.add_argument(
        "--serving-runs", type=int, default=8,
        help="measured rounds: one bench_serving burst per mode each, after one warm-up burst "
        "per server, each round with prompts of its own",
    )  # fmt: skip
    p.add_argument(
        "--serving-servers", type=int, default=1,
        help="times the serving phase runs with fresh servers; a mode's output tok/s pools "
        "the measured bursts of all its servers",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", default=None, metavar="DIR", help="node 0's op timelines")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--timeout", type=float, default=600.0, help="per benchmark command (s)")
    args = p.parse_args(argv)
    if args.profile and (missing := matplotlib_missing()):
        p.error(missing)
    if args.serving_output_len < 1:
        p.error("--serving-output-len must be at least 1")
    if args.serving_runs < 1:
        p.error("--serving-runs must be at least 1")
    if args.serving_servers < 1:
        p.error("--serving-servers must be at least 1")
    if args.quick:
        args.link_rate, args.batch_size = args.link_rate[:1], args.batch_size[-1:]
        args.repeat = min(args.repeat, 2)
    return args


def _pinned(cluster, i: int, argv: list[str]) -> list[str]:
    """One core per node (round robin over this process's cores)."""
    cores = sorted(os.sched_getaffinity(0))
    return ["taskset", "-c", str(cores[i % len(cores)]), *argv]


def _wait_all(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc, log in zip(procs, logs):
        try:
            rc = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {timeout:.0f} s; see {log}") from None
        if rc != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{log.name} exited with {rc}:\n{tail}")


def run_one_batch(args, cluster, mode: str, out: Path, tag: str) -> list[dict]:
    """bench_one_batch --compare-overlap for ``mode`` (tbo / sbo / dbo) on every node."""
    result = out / f"one_batch_{tag}_{mode}.jsonl"
    result.unlink(missing_ok=True)
    procs, logs = [], []
    for i in range(args.nodes):
        argv = [sys.executable, "-m", "benchmark.offline.bench_one_batch",
                *parallel_flags(args, cluster, i), *OVERLAP_FLAGS[mode],
                "--compare-overlap", "--repeat", str(args.repeat),
                "--batch-size", *map(str, args.batch_size), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--result-filename", str(result),
                "--run-name", f"{tag}-{mode}"]  # fmt: skip
        if args.profile and i == 0:
            argv += ["--profile", str(Path(args.profile) / f"{tag}_{mode}")]
        logs.append(out / f"one_batch_{tag}_{mode}_node{i}.log")
        with open(logs[-1], "w") as log:
            procs.append(cluster.popen(i, _pinned(cluster, i, argv), stdout=log, stderr=log))
    _wait_all(procs, logs, args.timeout)
    return [json.loads(line) for line in result.read_text().splitlines()]


def run_rate(args, rate: str, out: Path) -> dict:
    shaped = None if rate == "unshaped" else rate
    tag = rate.replace(".", "p")
    point: dict = {"rate": rate}
    with create_cluster(args.nodes, shaped, burst=args.burst, latency=args.latency) as cluster:
        print(f"== {cluster.describe()}", flush=True)
        print(format_selftest(cluster, link_selftest(cluster)), flush=True)
        for mode in args.one_batch_modes:
            point[mode] = run_one_batch(args, cluster, mode, out, tag)
            for row in point[mode]:
                if row["variant"].endswith("_on"):
                    print(f"  {mode} batch {row['batch_size']}: prefill "
                          f"{row['prefill_speedup']:.3f}x, decode {row['decode_speedup']:.3f}x, "
                          f"hidden {row['prefill_hidden_fraction']:.0%} / "
                          f"{row['decode_hidden_fraction']:.0%}", flush=True)  # fmt: skip
        if not args.no_serving:

            def launch(i: int, slot: int, extra: list[str], log):
                flags = parallel_flags(args, cluster, i, DIST_PORT + 20 * (slot + 1))
                argv = [sys.executable, "-m", "launch_server", *flags, *extra]
                return cluster.popen(i, _pinned(cluster, i, argv), stdout=log, stderr=log)

            point["serving"] = run_serving_modes(args, cluster, out, tag, launch)
    return point


def _pair(rows: list[dict], batch: int) -> tuple[dict, dict]:
    off = next(r for r in rows if r["batch_size"] == batch and r["variant"].endswith("_off"))
    on = next(r for r in rows if r["batch_size"] == batch and r["variant"].endswith("_on"))
    return off, on


def summary_line(point: dict, batch: int) -> str:
    parts = ["summary:"]
    for mode, kinds in (("tbo", ("decode", "prefill")), ("sbo", ("decode",)),
                        ("dbo", ("decode", "prefill"))):  # fmt: skip
        if mode in point:
            on = _pair(point[mode], batch)[1]
            parts += [f"{mode}_{kind}_speedup={on[f'{kind}_speedup']:.3f}" for kind in kinds]
    if "tbo" in point:
        t_off, t_on = _pair(point["tbo"], batch)
        keys = ("prefill_latency", "median_decode_latency")
        saved = sum(t_off[k] - t_on[k] for k in keys)
        comm = t_off["prefill_comm_seconds"] + t_off["decode_comm_seconds"]
        parts.append(f"hidden_fraction={saved / comm if comm else float('nan'):.3f}")
    line = " ".join(parts)
    serving = point.get("serving", {})
    ratios = serving_auto_ratios(serving) | serving_dbo_ratio(serving)
    return " ".join([line, *(f"{key}={value:.3f}" for key, value in ratios.items())])


def serving_dbo_ratio(serving: dict) -> dict[str, float]:
    """DBO's output tok/s over off's, where both were served."""
    if "dbo" not in serving or "off" not in serving:
        return {}
    return {
        "serving_dbo_vs_off": serving["dbo"]["output_throughput"]
        / serving["off"]["output_throughput"]
    }


def serving_auto_ratios(serving: dict) -> dict[str, float]:
    """auto's output tok/s over off's, and over the best fixed mode's (off, TBO, SBO), of the
    modes served; empty when auto or every fixed mode was left out."""
    tput = {mode: rec["output_throughput"] for mode, rec in serving.items()}
    fixed = [tput[mode] for mode in ("off", "tbo", "sbo") if mode in tput]
    if "auto" not in tput or not fixed:
        return {}
    ratios = {"serving_auto_vs_off": tput["auto"] / tput["off"]} if "off" in tput else {}
    return ratios | {"serving_auto_vs_best": tput["auto"] / max(fixed)}


def main(argv=None) -> None:
    args = parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("emulated_cluster: needs root (network namespaces)")
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="srt-emulated-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.model_path is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        args.model_path = make_mid_size_model(str(cache / "srt" / "emulated-qwen3-moe"), "emulated")
    points = []
    with exit_on_signals():
        for rate in args.link_rate:
            points.append(run_rate(args, rate, out))
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(points[-1]) + "\n")
    write_report(points, out)
    print(f"results: {out}")
    if args.quick:
        print(summary_line(points[0], args.batch_size[-1]))


if __name__ == "__main__":
    main()
