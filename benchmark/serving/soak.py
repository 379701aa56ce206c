"""Soak: a bounded run of mixed traffic against one srt server, then the checks that nothing was
lost or leaked.

    python benchmark/serving/soak.py --duration 600              # starts a tp 1 server itself
    python benchmark/serving/soak.py --duration 600 -- --tp 2 --dp 2 --enable-dp-attention \
        --moe-a2a-backend torch --enable-two-batch-overlap       # flags after -- go to the server
    python benchmark/serving/soak.py --base-url http://127.0.0.1:30000 --server-pid PID

Traffic (seeded): ``--concurrency`` clients, each drawing its next request from: native
/generate and OpenAI /v1/completions and /v1/chat/completions, streamed or not, greedy or
sampled, prompts from a few shared prefixes plus a random tail, random output lengths; client
aborts (a stream closed after a few chunks); bad inputs, each of which must get a 400. It stops
after ``--max-requests`` requests or ``--duration`` seconds, whichever comes first.

A server started here gets ``--max-total-tokens 32768`` unless its flags set one: the KV pool's
pages are touched on first use, so resident memory rises until the prefix cache has filled the
pool once, and a small pool fills within the warm-up.

Checks at the end: every good request answered (200, a finish reason, at least one token);
every bad one a 400; a sample of the greedy requests sent again one at a time gives the same
tokens; every KV slot free or in the prefix cache again; the resident memory of each server
process flat after the warm-up (least-squares slope in MiB per minute over the last 3/4 of the
run); no ``ERROR`` or traceback in the server's log (when this script started it). Prints one
``soak:`` line and writes ``OUT/soak.json``; exits non-zero when a check failed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
from make_tiny_models import default_model_path

from benchmark.common.process import descendants, start_ticks
from benchmark.common.server import ServerProcess
from benchmark.serving.soak_traffic import Outcome, make_request, run_request

MEMORY_PERIOD_S = 1.0
MAX_SLOPE_MIB_PER_MIN = 1.0  # "flat": less than this
# The KV pool's pages are touched on first use, so resident memory grows until the prefix
# cache has filled the pool once. A pool this small fills within the warm-up quarter.
POOL = "32768"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start one)")
    p.add_argument("--server-pid", type=int, default=None, help="its pid, for memory")
    p.add_argument("--model-path", default=None, help="default: the bundled tiny model")
    p.add_argument("--duration", type=float, default=300.0, help="seconds at most")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--reference-sample", type=int, default=40, help="greedy requests re-sent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=None)
    p.add_argument("server_args", nargs="*", help="after --: flags for launch_server")
    return p.parse_args(argv)


def start_server(args, out: Path) -> ServerProcess:
    """A healthy server of ``--model-path`` (default: the bundled model) with the flags after
    --, its log in ``OUT/server.log``."""
    model_path = args.model_path or default_model_path()
    pool = [] if "--max-total-tokens" in args.server_args else ["--max-total-tokens", POOL]
    return ServerProcess.start(model_path, *pool, *args.server_args, log_path=out / "server.log")


class MemorySampler:
    """Resident memory (VmRSS) of a process and its descendants, once per period."""

    def __init__(self, pid: int):
        self.pid, self.samples = pid, {}  # pid -> [(t, MiB)]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(MEMORY_PERIOD_S):
            now = time.monotonic()
            for pid in descendants(self.pid):
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kib = next(
                    (line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")),
                    None,
                )
                if kib is not None:
                    self.samples.setdefault(pid, []).append((now, int(kib) / 1024))

    def roles(self, info: dict) -> dict[int, str]:
        """Names of the tree's processes, from the launch order: the scheduler ranks of this
        node, the DP controller (DP attention), the detokenizer; multiprocessing's tracker."""
        names = {self.pid: "http"}
        spawned = []
        for pid in descendants(self.pid)[1:]:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"resource_tracker" in cmdline:
                names[pid] = "resource tracker"
            else:
                spawned.append((start_ticks(pid) or 0, pid))
        ranks = info["tp_size"] // info["nnodes"]
        tail = ["dp controller"] if info["enable_dp_attention"] else []
        order = [f"scheduler rank {r}" for r in range(ranks)] + tail + ["detokenizer"]
        for name, (_, pid) in zip(order, sorted(spawned)):
            names[pid] = name
        return names

    def slopes(self, roles: dict[int, str]) -> dict[str, dict]:
        """Per process: MiB at the end and the slope (MiB/min) over the last 3/4 of the run."""
        out = {}
        for pid, samples in self.samples.items():
            tail = samples[len(samples) // 4 :]
            if len(tail) < 3:
                continue
            ts, ms = [t for t, _ in tail], [m for _, m in tail]
            slope = statistics.linear_regression(ts, ms).slope * 60
            name = f"{roles.get(pid, 'process')} (pid {pid})"
            out[name] = {"rss_mib": round(ms[-1], 1), "slope_mib_per_min": round(slope, 3)}
        return out


def run_traffic(args, url: str) -> list[Outcome]:
    rng = random.Random(args.seed)
    lock, outcomes = threading.Lock(), []
    deadline = time.monotonic() + args.duration

    def worker(seed: int) -> None:
        rng_w = random.Random(seed)
        with httpx.Client(base_url=url, timeout=120.0) as http:
            while time.monotonic() < deadline:
                with lock:
                    if len(outcomes) >= args.max_requests:
                        return
                    outcomes.append(None)  # reserve a slot
                    slot = len(outcomes) - 1
                outcome = run_request(http, make_request(rng_w))
                with lock:
                    outcomes[slot] = outcome

    threads = [
        threading.Thread(target=worker, args=(rng.randrange(2**31),))
        for _ in range(args.concurrency)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [o for o in outcomes if o is not None]


def check_reference(args, url: str, outcomes: list[Outcome]) -> tuple[int, int]:
    """Greedy native requests sent again one at a time: (mismatches, sampled)."""
    greedy = [o for o in outcomes if o.reference is not None]
    sample = random.Random(args.seed + 1).sample(greedy, min(len(greedy), args.reference_sample))
    mismatches = 0
    with httpx.Client(base_url=url, timeout=120.0) as http:
        for o in sample:
            body, ids = o.reference
            again = http.post("/generate", json=body).json()["output_ids"]
            mismatches += again != ids
    return mismatches, len(sample)


def pool_state(info: dict) -> list[dict]:
    states = info["internal_states"]
    keys = ("num_running_reqs", "num_waiting_reqs", "num_free_tokens", "num_evictable_tokens")
    return [{k: s[k] for k in (*keys, "max_total_num_tokens")} for s in states]


def log_errors(log_path: Path | None) -> list[str]:
    if log_path is None:
        return []
    lines = log_path.read_text(errors="replace").splitlines()
    return [line for line in lines if " ERROR " in line or "Traceback" in line]


def summarize(outcomes: list[Outcome], elapsed: float) -> dict:
    kinds = {}
    for o in outcomes:
        kinds.setdefault(o.kind, {"count": 0, "failed": 0})
        kinds[o.kind]["count"] += 1
        kinds[o.kind]["failed"] += o.failure is not None
    return {
        "requests": len(outcomes),
        "duration_s": round(elapsed, 1),
        "good": sum(o.kind not in ("abort", "bad") for o in outcomes),
        "aborted": kinds.get("abort", {}).get("count", 0),
        "bad": kinds.get("bad", {}).get("count", 0),
        "failures": [f"{o.kind}: {o.failure}" for o in outcomes if o.failure][:20],
        "num_failures": sum(o.failure is not None for o in outcomes),
        "kinds": kinds,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="srt-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    server = log_path = None
    url, pid = args.base_url, args.server_pid
    if url is None:
        server = start_server(args, out)
        url, pid, log_path = server.url, server.pid, server.log_path
    sampler = MemorySampler(pid) if pid else None
    try:
        if sampler:
            sampler.thread.start()
        start = time.monotonic()
        outcomes = run_traffic(args, url)
        elapsed = time.monotonic() - start
        if sampler:
            sampler.stop.set()
        time.sleep(1.0)  # aborts reach the scheduler
        result = summarize(outcomes, elapsed)
        result["reference_mismatches"], result["reference_sampled"] = check_reference(
            args, url, outcomes
        )
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        result["pools"] = pool_state(info)
        result["memory"] = sampler.slopes(sampler.roles(info)) if sampler else {}
    finally:
        if server is not None:
            server.stop(timeout=30)
    result["log_errors"] = log_errors(log_path)
    result["problems"] = problems(result)
    (out / "soak.json").write_text(json.dumps(result, indent=1))
    print(soak_line(result))
    print(f"results: {out}")
    if result["problems"]:
        raise SystemExit(1)


def problems(result: dict) -> list[str]:
    found = [f"{result['num_failures']} failed requests"] if result["num_failures"] else []
    if result["reference_mismatches"]:
        found.append(f"{result['reference_mismatches']} greedy outputs differ when sent alone")
    for pool in result["pools"]:
        idle = pool["num_running_reqs"] == pool["num_waiting_reqs"] == 0
        full = (
            pool["num_free_tokens"] + pool["num_evictable_tokens"] == pool["max_total_num_tokens"]
        )
        if not (idle and full):
            found.append(f"KV pool not full again: {pool}")
    steep = {
        p: m for p, m in result["memory"].items() if m["slope_mib_per_min"] > MAX_SLOPE_MIB_PER_MIN
    }
    if steep:
        found.append(f"resident memory grows: {steep}")
    if result["log_errors"]:
        found.append(f"{len(result['log_errors'])} error lines in the server log")
    return found


def soak_line(result: dict) -> str:
    slopes = [m["slope_mib_per_min"] for m in result["memory"].values()]
    return (
        f"soak: requests={result['requests']} duration_s={result['duration_s']} "
        f"good={result['good']} aborted={result['aborted']} bad={result['bad']} "
        f"failures={result['num_failures']} "
        f"reference_mismatches={result['reference_mismatches']}/{result['reference_sampled']} "
        f"pool_full={'no' if any('KV pool' in p for p in result['problems']) else 'yes'} "
        f"max_rss_slope_mib_per_min={max(slopes, default=float('nan')):.3f} "
        f"log_errors={len(result['log_errors'])}"
    )


if __name__ == "__main__":
    main()
