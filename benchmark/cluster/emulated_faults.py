"""Faults on the emulated cluster: a 2-node srt (one rank per node, DP attention + expert
parallelism) in network namespaces (``emulated_network.py``), requests streaming from node 0,
then one fault at a time on a fresh server:

- ``rank-kill``: SIGKILL of node 1's scheduler rank mid-decode;
- ``link-flap``: node 1's link down for ``--flap-seconds`` (less than the watchdog timeout);
- ``link-down``: node 1's link down for longer than the watchdog timeout.

Expected, and checked: after ``rank-kill`` and ``link-down`` node 0 answers every request in
flight with an error (none hangs), exits non-zero within ``--watchdog-timeout`` + 5 s of the
fault with a log line naming the failed peer (``rank 1 (node 1)``), node 1 exits non-zero too,
and no process, namespace or IPC directory is left. After ``link-flap`` the requests finish
with all their tokens and the server stops cleanly (exit 0). Needs root and ``ip netns``.

    python benchmark/cluster/emulated_faults.py               # all three, timeout 10 s
    python benchmark/cluster/emulated_faults.py --faults link-down --watchdog-timeout 4

Prints one line per fault (``fault rank-kill: ok; exit codes [1, 1], node 0 after 2.2 s; 4
streams: 0 finished, 4 errors, 0 hung, ...; first error: ...``), writes ``OUT/faults.json``
and the nodes' logs, and exits non-zero when an expectation failed. ``--client`` is the
request side, run inside node 0's namespace by the benchmark itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from make_tiny_models import default_model_path

from benchmark.cluster.emulated_network import create_cluster, exit_on_signals
from benchmark.cluster.emulated_serving import (
    HTTP_PORT,
    add_srt_args,
    node0_http_ok,
    parallel_flags,
    wait_nodes_ready,
)
from benchmark.common.netns import live_pids, netns_exists
from benchmark.common.process import ipc_dirs, spawned_children

FAULTS = ("rank-kill", "link-flap", "link-down")
EXIT_SLACK_S = 5.0  # a failed server exits within the watchdog timeout plus this
LEFT_GRACE_S = 3.0  # for a server's last children to finish exiting after it


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS))
    p.add_argument("--model-path", default=None, help="default: the bundled tiny model")
    add_srt_args(p)
    p.add_argument("--link-rate", default="1gbit", help="tc rate, or 'unshaped'")
    p.add_argument("--watchdog-timeout", type=float, default=10.0)
    p.add_argument("--flap-seconds", type=float, default=3.0)
    p.add_argument("--requests", type=int, default=4, help="streams in flight at the fault")
    p.add_argument("--max-new-tokens", type=int, default=1500, help="per stream")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--client", default=None, metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--client-timeout", type=float, default=60.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.nodes = 2
    if "link-flap" in args.faults and args.flap_seconds >= args.watchdog_timeout / 2:
        p.error("--flap-seconds must be under half the --watchdog-timeout")
    return args


# ------------------------------------------------------------------------------ the client
def run_client(url: str, num: int, max_new_tokens: int, timeout: float) -> None:
    """Inside node 0: ``num`` concurrent streams. Prints ``ready`` once each has its first
    output (or failed before it), then one JSON line per stream: tokens received, whether it
    ended with [DONE], the error it carried, or ``hung`` when it neither finished nor failed
    within ``timeout`` s."""
    import httpx

    body = {"text": "Hello", "stream": True}
    body["sampling_params"] = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    first_outputs = threading.Semaphore(0)
    results: list[dict] = [{} for _ in range(num)]

    def stream(i: int) -> None:
        out = results[i] = {"tokens": 0, "error": None, "done": False, "hung": False}
        out["longest_stall_s"], last = 0.0, None
        started = False
        try:
            with httpx.stream("POST", url + "/generate", json=body, timeout=timeout) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if last is not None:
                        out["longest_stall_s"] = max(out["longest_stall_s"], now - last)
                    last = now
                    if not started:
                        started = True
                        first_outputs.release()
                    if line == "data: [DONE]":
                        out["done"] = True
                        break
                    data = json.loads(line[len("data: ") :])
                    if "error" in data:
                        out["error"] = data["error"]["message"]
                    else:
                        out["tokens"] = data["meta_info"]["completion_tokens"]
        except httpx.TimeoutException:
            out["hung"] = True
        except httpx.HTTPError as e:
            out["error"] = out["error"] or f"connection: {e!r}"
        finally:
            if not started:
                first_outputs.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    for _ in range(num):
        first_outputs.acquire()
    print("ready", flush=True)
    for t in threads:
        t.join()
    for out in results:
        print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------------ one fault
def _set_link(cluster, node: int, up: bool) -> None:
    argv = ["ip", "link", "set", cluster.ifname, "up" if up else "down"]
    subprocess.run(cluster.exec_argv(node, argv), check=True)


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    try:
        return proc.wait(max(0.0, timeout))
    except subprocess.TimeoutExpired:
        return None


def start_servers(args, cluster, out: Path, fault: str) -> tuple[list, list[Path]]:
    servers, logs = [], []
    for i in range(args.nodes):
        argv = [sys.executable, "-m", "launch_server", *parallel_flags(args, cluster, i),
                "--host", cluster.addrs[0], "--port", str(HTTP_PORT),
                "--watchdog-timeout", str(args.watchdog_timeout)]  # fmt: skip
        logs.append(out / f"{fault}_node{i}.log")
        with open(logs[-1], "w") as log:
            servers.append(cluster.popen(i, argv, stdout=log, stderr=subprocess.STDOUT))
    wait_nodes_ready(cluster, f"http://{cluster.addrs[0]}:{HTTP_PORT}/health", servers, logs, 300)
    return servers, logs


def inject(args, cluster, fault: str, servers: list) -> None:
    if fault == "rank-kill":
        ranks = spawned_children(servers[1].pid)
        if not ranks:
            raise RuntimeError("node 1 has no scheduler rank to kill")
        os.kill(ranks[0], signal.SIGKILL)
    elif fault == "link-flap":
        _set_link(cluster, 1, up=False)
        time.sleep(args.flap_seconds)
        _set_link(cluster, 1, up=True)
    else:
        _set_link(cluster, 1, up=False)


def run_fault(args, fault: str, out: Path) -> dict:
    shaped = None if args.link_rate == "unshaped" else args.link_rate
    row: dict = {"fault": fault, "watchdog_timeout": args.watchdog_timeout}
    with create_cluster(args.nodes, shaped) as cluster:
        servers, logs = start_servers(args, cluster, out, fault)
        ipc = set().union(*(ipc_dirs(s.pid) for s in servers))  # none when all is TCP
        base = f"http://{cluster.addrs[0]}:{HTTP_PORT}"
        client_timeout = args.watchdog_timeout + 30
        client = cluster.popen(
            0,
            [sys.executable, "-m", "benchmark.cluster.emulated_faults", "--client", base,
             "--requests", str(args.requests),
             "--client-timeout", str(client_timeout),
             "--max-new-tokens", str(args.max_new_tokens)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if client.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the client did not start its streams; see {logs[0]}")
        fault_at = time.monotonic()
        inject(args, cluster, fault, servers)
        if fault == "link-flap":
            row["streams"] = [json.loads(line) for line in client.stdout]
            row["healthy_after"] = node0_http_ok(cluster, base + "/health")
            servers[0].send_signal(signal.SIGTERM)
        limit = args.watchdog_timeout + EXIT_SLACK_S
        codes = [_wait(s, fault_at + limit + 30 - time.monotonic()) for s in servers]
        exit_s = time.monotonic() - fault_at
        if fault != "link-flap":
            row["streams"] = [json.loads(line) for line in client.stdout]
            _set_link(cluster, 1, up=True)
        client.wait(30)
        row["exit_codes"] = codes
        failed = fault != "link-flap" and codes[0] is not None
        row["node0_exit_s"] = exit_s if failed else None  # after a flap: a clean stop
        row["node0_log_names_peer"] = "rank 1 (node 1)" in logs[0].read_text(errors="replace")
        row["left_processes"] = _left_processes(cluster)
    row["left_namespaces"] = [ns for ns in cluster.node_ns if netns_exists(ns)]
    row["left_ipc_dirs"] = sorted(path for path in ipc if os.path.exists(path))
    row["problems"] = check(row, args)
    return row


def _left_processes(cluster, grace: float = LEFT_GRACE_S) -> list[str]:
    """Processes still running in the nodes once both servers have exited, after ``grace`` s:
    multiprocessing's resource tracker leaves on its own when it sees its parent gone, and
    may still be on its way out when the server's exit code is in."""
    deadline = time.monotonic() + grace
    while True:
        left = [pid for ns in cluster.node_ns for pid in live_pids(ns)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def check(row: dict, args) -> list[str]:
    """What went against the expectations (see the module docstring)."""
    problems = []
    streams = row["streams"]
    if any(s["hung"] for s in streams):
        problems.append("a request hung")
    if row["fault"] == "link-flap":
        if row["exit_codes"][0] != 0:
            problems.append(f"node 0 exit code {row['exit_codes'][0]} after a clean stop")
        if not all(s["done"] and s["error"] is None for s in streams):
            problems.append("a request failed across the flap")
        if not row["healthy_after"]:
            problems.append("node 0 unhealthy after the flap")
    else:
        if any(code in (None, 0) for code in row["exit_codes"]):
            problems.append(f"exit codes {row['exit_codes']} (expected non-zero on both nodes)")
        limit = args.watchdog_timeout + EXIT_SLACK_S
        if row["node0_exit_s"] is None or row["node0_exit_s"] > limit:
            problems.append(f"node 0 took {row['node0_exit_s']} s to exit (limit {limit:g})")
        if not all(s["error"] for s in streams):
            problems.append("a request in flight ended without an error")
        if not row["node0_log_names_peer"]:
            problems.append("node 0's log does not name rank 1 (node 1)")
    for key in ("left_processes", "left_namespaces", "left_ipc_dirs"):
        if row[key]:
            problems.append(f"{key}: {row[key]}")
    return problems


def describe(row: dict) -> str:
    streams = row["streams"]
    errors = [s["error"] for s in streams if s["error"]]
    finished = sum(s["done"] and not s["error"] for s in streams)
    exit_s = row["node0_exit_s"]
    parts = [
        f"fault {row['fault']}: {'FAILED' if row['problems'] else 'ok'}",
        f"exit codes {row['exit_codes']}"
        + (f", node 0 after {exit_s:.1f} s" if exit_s is not None else ""),
        f"{len(streams)} streams: {finished} finished, {len(errors)} errors, "
        f"{sum(s['hung'] for s in streams)} hung, longest stall "
        f"{max(s['longest_stall_s'] for s in streams):.1f} s",
    ]
    if errors:
        parts.append(f"first error: {errors[0][:240]}")
    if row["problems"]:
        parts.append("problems: " + "; ".join(row["problems"]))
    return "; ".join(parts)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.client:
        return run_client(args.client, args.requests, args.max_new_tokens, args.client_timeout)
    if os.geteuid() != 0:
        raise SystemExit("emulated_faults: needs root (network namespaces)")
    if args.model_path is None:
        args.model_path = default_model_path()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="srt-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with exit_on_signals():
        for fault in args.faults:
            rows.append(run_fault(args, fault, out))
            print(describe(rows[-1]), flush=True)
    (out / "faults.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {out}")
    if any(row["problems"] for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
