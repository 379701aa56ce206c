"""Benchmark online serving with SGLang's bench_serving flags and report (random dataset only).

Usage:
    python benchmark/serving/bench_serving.py --backend sglang --port 30000 --num-prompts 200 \
        --random-input-len 1024 --random-output-len 256 --request-rate 16 --max-concurrency 64

Prompts are random token ids from the tokenizer's regular vocabulary. The sglang backend sends
them to /generate as `input_ids`, so prompt lengths are exact; the OpenAI backends send the
decoded text and count the prompt by re-encoding it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from benchmark.serving import bench_serving_backends as backends
from benchmark.serving import bench_serving_dataset as dataset
from benchmark.serving import bench_serving_metrics as bench_metrics

if TYPE_CHECKING:
    import aiohttp


# Arguments left out of the result record (secrets).
PRIVATE_ARGS = ("api_key",)


class BenchmarkSetupError(RuntimeError):
    """The benchmark could not start: server unreachable, no model, no tokenizer."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    p.add_argument("--backend", choices=list(backends.BACKENDS), default="sglang")
    p.add_argument("--base-url", default=None, help="Server URL; overrides --host/--port.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="Default: the first id of GET /v1/models.")
    p.add_argument("--tokenizer", default=None, help="Default: model_path of /get_model_info.")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="Lengths are uniform integers in [len * ratio, len].",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Requests per second, Poisson arrivals; inf sends all at once.",
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--disable-stream", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--output-file", default=None, help="Append one JSON line of results.")
    p.add_argument("--api-key", default=None, help="Sent as `Authorization: Bearer <key>`.")
    p.add_argument(
        "--extra-request-body",
        default=None,
        metavar='{"key": "value"}',
        help="JSON object merged into every request body.",
    )
    return p


def validate_args(args: argparse.Namespace) -> None:
    checks = [
        (args.backend in backends.BACKENDS, f"unknown backend {args.backend!r}"),
        (args.dataset_name == "random", "only --dataset-name random is supported"),
        (args.num_prompts >= 1, "--num-prompts must be >= 1"),
        (args.random_input_len >= 1, "--random-input-len must be >= 1"),
        (args.random_output_len >= 1, "--random-output-len must be >= 1"),
        (0.0 <= args.random_range_ratio <= 1.0, "--random-range-ratio must be in [0, 1]"),
        (args.request_rate > 0, "--request-rate must be > 0"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "bad --max-concurrency"),
        (args.warmup_requests >= 0, "--warmup-requests must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if args.extra_request_body and not isinstance(json.loads(args.extra_request_body), dict):
        raise ValueError("--extra-request-body must be a JSON object")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


@dataclass
class Target:
    """Where and how every request of this run is sent."""

    base_url: str
    backend: str
    model: str = ""
    stream: bool = True
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def api_url(self) -> str:
        return self.base_url + backends.BACKENDS[self.backend].path

    def request(self, row: dataset.DatasetRow) -> backends.RequestInput:
        # input_ids only for /generate: the OpenAI APIs take the prompt as text.
        input_ids = row.input_ids if self.backend == "sglang" else []
        return backends.RequestInput(
            api_url=self.api_url,
            prompt=row.prompt,
            input_ids=input_ids,
            prompt_len=row.prompt_len,
            output_len=row.output_len,
            model=self.model,
            stream=self.stream,
            extra_body=self.extra_body,
            headers=self.headers,
        )


def _get_json(url: str, headers: dict[str, str]) -> Any:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=60) as r:
        return json.loads(r.read())


def _resolve_model(target: Target, model: str | None) -> str:
    if model:
        return model
    url = target.base_url + "/v1/models"
    try:
        models = _get_json(url, target.headers).get("data") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise BenchmarkSetupError(f"cannot list models at {url} ({exc}); set --model") from exc
    if not models:
        raise BenchmarkSetupError(f"{url} lists no model; set --model")
    return models[0]["id"]


def _load_tokenizer(target: Target, path: str | None):
    if not path:
        url = target.base_url + "/get_model_info"
        try:
            info = _get_json(url, target.headers)
            path = info.get("tokenizer_path") or info["model_path"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BenchmarkSetupError(f"cannot ask {url} ({exc}); set --tokenizer") from exc
    from transformers import AutoTokenizer  # slow import: keep --help and arg errors fast

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BenchmarkSetupError(f"cannot load tokenizer {path!r}: {exc}") from exc


async def _arrivals(
    rows: Sequence[dataset.DatasetRow], rate: float, rng: np.random.Generator
) -> AsyncIterator[dataset.DatasetRow]:
    """Poisson arrivals: exponential gaps of mean 1/rate; all at once when rate is inf."""
    for i, row in enumerate(rows):
        if i and not math.isinf(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))
        yield row


async def _warmup(
    session: aiohttp.ClientSession, target: Target, row: dataset.DatasetRow, num_requests: int
) -> None:
    if num_requests <= 0:
        return
    backend, inp = backends.BACKENDS[target.backend], target.request(row)
    print(f"Starting warmup with {num_requests} sequences...")
    outs = await asyncio.gather(
        *(backends.send_request(session, backend, inp) for _ in range(num_requests))
    )
    failed = [out for out in outs if not out.success]
    if failed:
        print(f"Warmup: {len(failed)} of {num_requests} failed: {failed[0].error}")
    else:
        print("Warmup completed. Starting main benchmark run...")


async def _run_requests(
    args: argparse.Namespace,
    target: Target,
    rows: Sequence[dataset.DatasetRow],
    rng: np.random.Generator,
) -> tuple[list[backends.RequestOutput], float]:
    backend = backends.BACKENDS[target.backend]
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    async with backends.make_session() as session:
        await _warmup(session, target, rows[0], args.warmup_requests)
        pbar = tqdm(total=len(rows), disable=args.disable_tqdm)

        async def run_one(inp: backends.RequestInput) -> backends.RequestOutput:
            if semaphore is None:
                out = await backends.send_request(session, backend, inp)
            else:
                async with semaphore:
                    out = await backends.send_request(session, backend, inp)
            pbar.update(1)
            return out

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(run_one(target.request(row)))
            async for row in _arrivals(rows, args.request_rate, rng)
        ]
        outputs = await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - start
        pbar.close()
    return list(outputs), duration_s


def _raise_fd_limit(target: int = 65535) -> None:
    # One socket per in-flight request: thousands of concurrent requests exceed the default 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, hard), hard))
        except (ValueError, OSError):
            pass


def _complete_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill fields missing from a hand-built namespace with the parser's defaults."""
    return argparse.Namespace(**{**vars(build_parser().parse_args([])), **vars(args)})


def _make_target(args: argparse.Namespace) -> Target:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    return Target(base_url, args.backend, "", not args.disable_stream, headers, extra)


def _details(outputs: Sequence[backends.RequestOutput], output_lens: list[int]) -> dict[str, list]:
    return {
        "input_lens": [out.prompt_len for out in outputs],
        "output_lens": output_lens,
        "ttfts": [out.ttft for out in outputs],
        "itls": [out.itl for out in outputs],
        "generated_texts": [out.generated_text for out in outputs],
        "errors": [out.error for out in outputs],
    }


def _report(
    args: argparse.Namespace,
    outputs: Sequence[backends.RequestOutput],
    tokenizer,
    duration_s: float,
) -> dict[str, Any]:
    """Print the failures and the result block; append the record to --output-file."""
    output_lens = bench_metrics.resolve_output_lens(outputs, tokenizer)
    metrics = bench_metrics.calculate_metrics(outputs, output_lens, duration_s)
    errors = bench_metrics.format_errors(outputs)
    if errors:
        print(errors)
    print()
    print(
        bench_metrics.format_result(
            metrics, args.backend, args.request_rate, args.max_concurrency, duration_s
        )
    )
    record = {k: v for k, v in vars(args).items() if k not in PRIVATE_ARGS}
    record.update(duration=duration_s, **asdict(metrics))
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record | _details(outputs, output_lens)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `args`; print the report and return all results.

    The returned dict holds the arguments (less the API key), every metric under SGLang's
    result names, and per-request details (input_lens, output_lens, ttfts, itls, errors, ...);
    --output-file gets the same dict without the details.
    """
    args = _complete_args(args)
    validate_args(args)
    _raise_fd_limit()
    target = _make_target(args)
    target.model = args.model = _resolve_model(target, args.model)
    tokenizer = _load_tokenizer(target, args.tokenizer)
    args.tokenizer = tokenizer.name_or_path
    data_seq, arrival_seq = np.random.SeedSequence(args.seed).spawn(2)
    rows = dataset.sample_random_requests(
        tokenizer, args, np.random.default_rng(data_seq), count_text=args.backend != "sglang"
    )
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}")
    print(f"#Output tokens: {sum(r.output_len for r in rows)}")
    outputs, duration_s = asyncio.run(
        _run_requests(args, target, rows, np.random.default_rng(arrival_seq))
    )
    return _report(args, outputs, tokenizer, duration_s)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry; returns 1 when the benchmark cannot start or every request fails."""
    args = parse_args(argv)
    try:
        result = run_benchmark(args)
    except BenchmarkSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0 if result["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
