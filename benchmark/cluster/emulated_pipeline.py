"""Pipeline schedules on the emulated cluster: one node (network namespace) per rank, PP × EP
nodes joined by tbf-shaped links (``emulated_network.py``), ``python -m pipeline.train --rank``
on each, every schedule of ``--runs`` in turn. Needs root and ``ip netns``.

Each node is pinned to a core (round robin) and, where the cpu cgroup can be written, held to
its share of the cores by a CFS quota (two nodes on a core: half a core each), so that a rank
waiting in a bubble or on the network leaves its core idle as a machine of its own would,
instead of lending it to the rank beside it. ``--no-cpu-quota`` turns that off.

Per run: the step time (median of the steps after the first), each computation's median cost
(F, B, a split B, W, an F&B pair), the message time measured between pipeline neighbours, and
per pipeline rank the bubble measured from its own timeline against the simulator's for those
costs, and the activations it kept at most (bytes and chunks) against the simulator's chunks.

    python benchmark/cluster/emulated_pipeline.py --pp 2 --ep 2 --link-rate 75mbit

``--repeat K`` runs the list K times, the order reversed every other round (the machine
drifts over minutes: compare within a round). Results: ``OUT/results.jsonl`` and
``OUT/results.md``; the last line is ``summary: dualpipev_fb_vs_1f1b=…
dualpipev_fb_dw_vs_1f1b=… bubble_error=…`` (step time of 1F1B over DualPipeV with fb-overlap,
without and with dW detach, the median over the rounds of the ratio within a round; and the
largest relative gap between the measured total bubble of a run's pipeline ranks and the one
replayed by the simulator from the measured costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmark.cluster.emulated_network import create_cluster, exit_on_signals
from pipeline.train import add_shape_args, shape_argv

DIST_PORT = 29710
CGROUP = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller
CFS_PERIOD_US = 10_000  # the kernel hands out quota in slices of 5 ms: a shorter period starves
# name → pipeline.train flags
RUNS = {
    "1f1b": ["--schedules-method", "1f1b"],
    "vpp": ["--schedules-method", "vpp", "--virtual-pipeline-model-parallel-size", "2"],
    "dualpipev": ["--schedules-method", "dualpipev"],
    "dualpipev-dw": ["--schedules-method", "dualpipev", "--dualpipev-dw-detach"],
    "dualpipev-fb": ["--schedules-method", "dualpipev", "--moe-fb-overlap"],
    "dualpipev-fb-dw": ["--schedules-method", "dualpipev", "--moe-fb-overlap",
                        "--dualpipev-dw-detach"],
}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--link-rate", default="75mbit", help="tbf rate, or 'unshaped'")
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--num-micro-batches", type=int, default=16)
    add_shape_args(p, hidden_size=256, moe_intermediate_size=256, seq_length=64)
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every run, the order reversed every other round")
    p.add_argument("--no-cpu-quota", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--out", help="results folder (default: a new temporary one)")
    return p.parse_args(argv)


class CpuQuota:
    """A cpu cgroup per node with a CFS quota of ``share`` cores; removed on exit."""

    def __init__(self, name: str, nodes: int, share: float):
        self.dirs = [CGROUP / f"{name}-{i}" for i in range(nodes)]
        for d in self.dirs:
            d.mkdir()
            (d / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(int(CFS_PERIOD_US * share)))

    def add(self, i: int, pid: int) -> None:
        """Move process ``pid`` (all its threads; its children inherit) into node ``i``'s
        cgroup. From outside: ``ip netns exec`` mounts a sysfs of its own, without cgroups."""
        (self.dirs[i] / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        for d in self.dirs:
            for _ in range(50):  # the processes killed a moment ago may still be exiting
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def quota_or_none(args, nodes: int, cores: int) -> CpuQuota | None:
    if args.no_cpu_quota or nodes <= cores:
        return None
    try:
        return CpuQuota(f"srt-pipeline-{os.getpid()}", nodes, cores / nodes)
    except OSError as e:
        print(f"no CPU quota ({e}); nodes on one core share it", file=sys.stderr)
        return None


def run_one(args, cluster, quota: CpuQuota | None, name: str, out: Path, tag: str) -> dict:
    nodes = args.pp * args.ep
    cores = sorted(os.sched_getaffinity(0))
    result = out / f"{name}_{tag}.json"
    result.unlink(missing_ok=True)
    procs, logs = [], []
    for i in range(nodes):
        argv = [sys.executable, "-m", "pipeline.train", *RUNS[name],
                "--pipeline-model-parallel-size", str(args.pp),
                "--expert-model-parallel-size", str(args.ep),
                "--num-micro-batches", str(args.num_micro_batches), *shape_argv(args),
                "--rank", str(i), "--dist-init-addr", f"{cluster.addrs[0]}:{DIST_PORT}",
                "--json", str(result)]  # fmt: skip
        argv = ["taskset", "-c", str(cores[i % len(cores)]), *argv]
        logs.append(out / f"{name}_{tag}_node{i}.log")
        with open(logs[-1], "w") as log:
            env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
            procs.append(cluster.popen(i, argv, env, stdout=log, stderr=subprocess.STDOUT))
        if quota is not None:
            quota.add(i, procs[-1].pid)
    for proc, log in zip(procs, logs):
        try:
            rc = proc.wait(args.timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name}: timed out; see {log}") from None
        if rc:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"{name}: {log.name} exited with {rc}:\n{tail}")
    print(logs[0].read_text(), end="")
    return {"name": name, "round": tag, **json.loads(result.read_text())}


def bubble_error(result: dict) -> float:
    """Relative gap of the measured total bubble (pipeline ranks of EP rank 0) to the
    simulated one."""
    measured = sum(r["bubble"] for r in result["ranks"])
    simulated = sum(r["replayed_bubble"] for r in result["ranks"])
    return abs(measured - simulated) / max(simulated, 1e-9)


def table(results: list[dict]) -> str:
    """One row per run; "vs 1F1B" against the 1F1B run of the same round."""
    lines = [
        "| run | step (ms) | vs 1F1B | F / B / Bi / W / F&B (ms) | bubble per rank: measured "
        "/ replayed / modelled (ms) | rank 0 peak activations: MiB, chunks (simulated) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        costs = " / ".join(f"{r['costs'][k] * 1e3:.1f}" if k in r["costs"] else "–"
                           for k in ("F", "B", "Bi", "W", "FB"))  # fmt: skip
        bubbles = ", ".join(f"{x['bubble'] * 1e3:.0f} / {x['replayed_bubble'] * 1e3:.0f} / "
                            f"{x['modelled_bubble'] * 1e3:.0f}" for x in r["ranks"])  # fmt: skip
        first = r["ranks"][0]
        base = next((x["median_step"] for x in results
                     if x["name"] == "1f1b" and x["round"] == r["round"]), None)  # fmt: skip
        speedup = f"{base / r['median_step']:.2f}×" if base else "–"
        lines.append(
            f"| {r['name']} ({r['round']}) | {r['median_step'] * 1e3:.0f} | {speedup} | {costs} | "
            f"{bubbles} | "
            f"{first['peak_bytes'] / 2**20:.2f}, {first['peak_chunks']} "
            f"({first['simulated_peak_chunks']}) |"
        )
    return "\n".join(lines)


def summary_line(results: list[dict]) -> str:
    """Step-time ratios of 1F1B over DualPipeV with fb-overlap (and dW detach), each the
    median over the rounds of the ratio within a round, and the largest bubble error."""
    parts = []
    for name in ("dualpipev-fb", "dualpipev-fb-dw"):
        ratios = []
        for r in results:
            base = next((x for x in results if x["name"] == "1f1b" and x["round"] == r["round"]),
                        None)  # fmt: skip
            if r["name"] == name and base is not None:
                ratios.append(base["median_step"] / r["median_step"])
        if ratios:
            key = name.replace("dualpipev-", "dualpipev_").replace("-", "_")
            parts.append(f"{key}_vs_1f1b={statistics.median(ratios):.3f}")
    parts.append(f"bubble_error={max(bubble_error(r) for r in results):.3f}")
    return "summary: " + " ".join(parts)


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="emulated_pipeline_"))
    out.mkdir(parents=True, exist_ok=True)
    nodes = args.pp * args.ep
    rate = None if args.link_rate == "unshaped" else args.link_rate
    results: list[dict] = []
    quota = None
    try:
        with exit_on_signals(), create_cluster(nodes, rate) as cluster:
            print(cluster.describe(), flush=True)
            quota = quota_or_none(args, nodes, len(os.sched_getaffinity(0)))
            for k in range(args.repeat):
                for name in args.runs if k % 2 == 0 else args.runs[::-1]:
                    print(f"== {name}, round {k + 1}", flush=True)
                    results.append(run_one(args, cluster, quota, name, out, str(k + 1)))
                    with open(out / "results.jsonl", "a") as f:
                        f.write(json.dumps(results[-1]) + "\n")
    finally:  # after the cluster's cleanup: a cgroup with processes left cannot be removed
        if quota is not None:
            quota.close()
    header = (f"PP {args.pp} × EP {args.ep}, {nodes} nodes, links {args.link_rate}, "
              f"{args.num_micro_batches} micro-batches, CPU quota "
              f"{'off' if quota is None else 'on'}")  # fmt: skip
    report = f"{header}\n\n{table(results)}\n"
    (out / "results.md").write_text(report)
    print(report)
    print(summary_line(results))


if __name__ == "__main__":
    main()
