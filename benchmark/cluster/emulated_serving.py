"""The emulated cluster's serving phase: one server per overlap mode (off, TBO, SBO, DBO, auto; or
those of ``--serving-modes``), all up at once, and bursts sent to them in turn.

A fresh server is started for every mode on every node (``launch_server``, one rank per node
pinned to its node's core, ports of its own), each waited for before the next starts, so
that auto's start-up calibration runs alone. Only one server works at a time; the others
sleep. Every server gets one warm-up burst, then ``--serving-runs`` rounds send one burst to
each mode, the order reversed every other round (off, TBO, SBO, auto, auto, SBO, TBO, off,
...), and every mode gets the same prompts in a round (``--seed`` per round; a new seed per
round, since the same prompts again would come from the prefix cache). Interleaving matters
on a shared two-core machine: its speed drifts by 10-30 % over tens of seconds, and a mode
measured in one stretch of time and another in the next would compare the drift, not the
modes. ``--serving-servers`` repeats all of it with fresh servers. A mode's figure pools its
measured bursts: output tokens over seconds.

It is also what ``emulated_cluster.py`` and ``emulated_faults.py`` share to run srt on the
nodes: each node's command-line flags (``parallel_flags``, with ``--srt-args``) and the wait
until node 0's server answers.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from benchmark.common.process import stop_groups
from benchmark.common.server import wait_ready

HTTP_PORT = 30000  # node 0's; the server in slot k listens on HTTP_PORT + k
DIST_PORT = 29650  # the server in serving slot k uses DIST_PORT + 20 (k + 1) and up
SERVING_FLAGS = {
    "off": [],
    "tbo": ["--enable-two-batch-overlap"],
    "sbo": ["--enable-single-batch-overlap"],
    "dbo": ["--enable-dbo"],
    "auto": ["--overlap-mode", "auto"],
}


def add_srt_args(p: argparse.ArgumentParser) -> None:
    """``--srt-args``, which ``parallel_flags`` appends to every srt command on every node."""
    # Values that start with a dash need the = form: --srt-args="--enable-dp-lm-head".
    p.add_argument("--srt-args", default="", help="extra flags for every srt process on every node")


def parallel_flags(args, cluster, i: int, dist_port: int = DIST_PORT) -> list[str]:
    """Node ``i``'s share of one srt over the cluster: one rank per node, DP attention and
    expert parallelism over the torch all-to-all, node 0's address for the rendezvous."""
    n = args.nodes
    return [
        "--model-path", args.model_path, "--tp", str(n), "--dp", str(n), "--enable-dp-attention",
        "--moe-a2a-backend", "torch", "--deepep-mode", "normal", "--dtype", "float32",
        "--nnodes", str(n), "--node-rank", str(i),
        "--dist-init-addr", f"{cluster.addrs[0]}:{dist_port}",
        *shlex.split(args.srt_args),
    ]  # fmt: skip


def node0_http_ok(cluster, url: str) -> bool:
    """Whether ``url`` answers 200 from inside node 0's namespace."""
    probe = f"import urllib.request as u; u.urlopen({url!r}, timeout=2)"  # a fresh interpreter
    cmd = cluster.exec_argv(0, [sys.executable, "-c", probe])
    return subprocess.run(cmd, capture_output=True).returncode == 0


def wait_nodes_ready(cluster, url: str, procs: list, logs: list[Path], timeout: float) -> None:
    """Until node 0's server answers ``url`` (its /health); fails naming the node whose
    server exited, or the timeout, with node 0's log."""
    named = {f"node {i}'s server": proc for i, proc in enumerate(procs)}
    probe = lambda: node0_http_ok(cluster, url)
    wait_ready(probe, named, timeout, what="the server", log=logs[0], period=0.5)


def node0_json(cluster, url: str) -> dict:
    probe = f"import urllib.request as u; print(u.urlopen({url!r}, timeout=10).read().decode())"
    cmd = cluster.exec_argv(0, [sys.executable, "-c", probe])
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


class ServingServer:
    """One mode's server on every node; ``slot`` picks its ports."""

    def __init__(self, args, cluster, mode: str, slot: int, out: Path, tag: str, launch):
        self.args, self.cluster = args, cluster
        port = HTTP_PORT + slot
        self.base = f"http://{cluster.addrs[0]}:{port}"
        self.record = out / f"serving_{tag}_{mode}.jsonl"
        self.record.unlink(missing_ok=True)
        self.bench_log = out / f"bench_serving_{tag}_{mode}.log"
        self.logs = [out / f"server_{tag}_{mode}_node{i}.log" for i in range(args.nodes)]
        self.procs: list[subprocess.Popen] = []
        for i, log_path in enumerate(self.logs):
            extra = [*SERVING_FLAGS[mode], "--host", cluster.addrs[0], "--port", str(port),
                     "--max-running-requests", "64", "--log-level", "warning"]  # fmt: skip
            with open(log_path, "w") as log:
                self.procs.append(launch(i, slot, extra, log))

    def wait_ready(self) -> None:
        url = self.base + "/health"
        wait_nodes_ready(self.cluster, url, self.procs, self.logs, self.args.timeout)

    def burst(self, seed: int) -> dict:
        """One bench_serving burst; its record."""
        bench = [sys.executable, "-m", "benchmark.serving.bench_serving", "--base-url", self.base,
                 "--num-prompts", str(self.args.num_prompts), "--random-input-len", "64",
                 "--random-output-len", str(self.args.serving_output_len),
                 "--random-range-ratio", "1.0", "--disable-tqdm",
                 "--output-file", str(self.record), "--seed", str(seed)]  # fmt: skip
        with open(self.bench_log, "a") as log:
            argv = self.cluster.exec_argv(0, bench)
            rc = subprocess.run(argv, stdout=log, stderr=log, timeout=self.args.timeout).returncode
        if rc:
            raise RuntimeError(f"bench_serving exited with {rc}; see {self.bench_log}")
        return json.loads(self.record.read_text().splitlines()[-1])

    def overlap_info(self) -> dict:
        """What auto's policy chose, and its estimates (node 0, DP group 0)."""
        info = node0_json(self.cluster, self.base + "/get_server_info")
        return info["internal_states"][0]["overlap"]

    def stop(self) -> None:
        stop_groups(self.procs, grace=30.0)  # node 0 first: the others follow its lifetime


def round_order(modes: list[str], rounds: int) -> list[list[str]]:
    """The modes in each round's order: every other round reversed, so that a drift of the
    machine during a round weighs on every mode alike."""
    return [modes if r % 2 == 0 else modes[::-1] for r in range(rounds)]


def run_serving_modes(args, cluster, out: Path, tag: str, launch) -> dict:
    """Every mode's pooled figure (see the module docstring). ``launch(node, slot, extra_argv,
    log)`` starts one node's server."""
    modes = args.serving_modes
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i in range(args.serving_servers):
        servers: dict[str, ServingServer] = {}
        try:
            for slot, mode in enumerate(modes):
                servers[mode] = ServingServer(args, cluster, mode, slot, out, f"{tag}_s{i}", launch)
                servers[mode].wait_ready()
            for mode in modes:
                servers[mode].burst(seed=1)  # warm-up
            bursts: dict[str, list[dict]] = {mode: [] for mode in modes}
            for r, order in enumerate(round_order(modes, args.serving_runs)):
                for mode in order:
                    bursts[mode].append(servers[mode].burst(seed=r + 2))
            for mode in modes:
                run = {"bursts": bursts[mode]}
                if mode == "auto":
                    run["overlap"] = servers[mode].overlap_info()
                runs[mode].append(run)
                tput = [round(b["output_throughput"]) for b in bursts[mode]]
                print(f"  serving {mode} (server {i}): bursts {tput} output tok/s", flush=True)
        finally:
            for server in servers.values():
                server.stop()
    serving = {mode: pool_servers(mode_runs) for mode, mode_runs in runs.items()}
    for mode, rec in serving.items():
        print(f"  serving {mode}: {rec['output_throughput']:.1f} output tok/s, "
              f"{rec['total_throughput']:.1f} total tok/s", flush=True)  # fmt: skip
    return serving


def pool_servers(runs: list[dict]) -> dict:
    """One mode's figure from its servers' measured bursts: tokens over seconds of them all
    (a burst weighs by its length, not by its rank among the others); TTFT and TPOT are the
    means over requests; auto's step counts are summed."""
    bursts = [b for run in runs for b in run["bursts"]]
    seconds = sum(b["duration"] for b in bursts)
    output = sum(b["total_output_tokens"] for b in bursts)
    requests = sum(b["completed"] for b in bursts)
    pooled = {
        "output_throughput": output / seconds,
        "total_throughput": (output + sum(b["total_input_tokens"] for b in bursts)) / seconds,
        "num_servers": len(runs),
        "burst_output_throughputs": [b["output_throughput"] for b in bursts],
    }
    for key in ("mean_ttft_ms", "mean_tpot_ms"):
        pooled[key] = sum(b[key] * b["completed"] for b in bursts) / requests
    overlaps = [run["overlap"] for run in runs if "overlap" in run]
    if overlaps:
        steps: dict[str, int] = {}
        for overlap in overlaps:
            for key, n in overlap["num_steps"].items():
                steps[key] = steps.get(key, 0) + n
        pooled["overlap"] = {"num_steps": steps, "per_server": overlaps}
    return pooled
