"""Metrics of bench_serving and SGLang's "Serving Benchmark Result" block."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from benchmark.serving.bench_serving_backends import RequestOutput

MAX_PRINTED_ERRORS = 5


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_throughput: float
    concurrency: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float


def resolve_output_lens(outputs: Sequence[RequestOutput], tokenizer) -> list[int]:
    """Output tokens per request: the server's count, else the re-tokenized text; 0 if failed."""
    lens = []
    for out in outputs:
        if not out.success:
            lens.append(0)
        elif out.output_len is not None:
            lens.append(out.output_len)
        else:
            lens.append(len(tokenizer.encode(out.generated_text, add_special_tokens=False)))
    return lens


def _summary(name: str, seconds: Sequence[float], percentiles: Sequence[int]) -> dict[str, float]:
    values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000
    summary = {
        f"mean_{name}_ms": float(np.mean(values)),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(np.std(values)),
    }
    for p in percentiles:
        summary[f"p{p}_{name}_ms"] = float(np.percentile(values, p))
    return summary


def calculate_metrics(
    outputs: Sequence[RequestOutput], output_lens: Sequence[int], duration_s: float
) -> BenchmarkMetrics:
    done = [(out, n) for out, n in zip(outputs, output_lens) if out.success]
    e2e = [out.latency for out, _ in done]
    tpots = [(out.latency - out.ttft) / (n - 1) for out, n in done if n > 1]
    itls = [gap for out, _ in done for gap in out.itl]
    total_input = sum(out.prompt_len for out, _ in done)
    total_output = sum(n for _, n in done)
    duration_s = max(duration_s, 1e-9)
    itl_summary = _summary("itl", itls, (95, 99))
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(outputs) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        input_throughput=total_input / duration_s,
        output_throughput=total_output / duration_s,
        total_throughput=(total_input + total_output) / duration_s,
        concurrency=sum(e2e) / duration_s,
        **_summary("e2e_latency", e2e, (99,)),
        **_summary("ttft", [out.ttft for out, _ in done], (99,)),
        **_summary("tpot", tpots, (99,)),
        **itl_summary,
        max_itl_ms=max(itls) * 1000 if itls else 0.0,
    )


def _row(name: str, value) -> str:
    spec = "{:<40} {:<10.2f}" if isinstance(value, float) else "{:<40} {:<10}"
    return spec.format(name, value)


def format_result(
    metrics: BenchmarkMetrics,
    backend: str,
    request_rate: float,
    max_concurrency: int | None,
    duration_s: float,
) -> str:
    m = metrics
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Backend:", backend),
        "{:<40} {:<10}".format("Traffic request rate:", request_rate),
        _row("Max request concurrency:", max_concurrency if max_concurrency else "not set"),
        _row("Successful requests:", m.completed),
        _row("Benchmark duration (s):", float(duration_s)),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_throughput),
        _row("Concurrency:", m.concurrency),
        "{s:{c}^{n}}".format(s="End-to-End Latency", n=50, c="-"),
        _row("Mean E2E Latency (ms):", m.mean_e2e_latency_ms),
        _row("Median E2E Latency (ms):", m.median_e2e_latency_ms),
        "{s:{c}^{n}}".format(s="Time to First Token", n=50, c="-"),
        _row("Mean TTFT (ms):", m.mean_ttft_ms),
        _row("Median TTFT (ms):", m.median_ttft_ms),
        _row("P99 TTFT (ms):", m.p99_ttft_ms),
        "{s:{c}^{n}}".format(s="Time per Output Token (excl. 1st token)", n=50, c="-"),
        _row("Mean TPOT (ms):", m.mean_tpot_ms),
        _row("Median TPOT (ms):", m.median_tpot_ms),
        _row("P99 TPOT (ms):", m.p99_tpot_ms),
        "{s:{c}^{n}}".format(s="Inter-Token Latency", n=50, c="-"),
        _row("Mean ITL (ms):", m.mean_itl_ms),
        _row("Median ITL (ms):", m.median_itl_ms),
        _row("P95 ITL (ms):", m.p95_itl_ms),
        _row("P99 ITL (ms):", m.p99_itl_ms),
        _row("Max ITL (ms):", m.max_itl_ms),
        "=" * 50,
    ]
    return "\n".join(lines)


def format_errors(outputs: Sequence[RequestOutput]) -> str:
    """The failure count and the first few distinct error messages, or "" when none failed."""
    errors = [out.error or "unknown error" for out in outputs if not out.success]
    if not errors:
        return ""
    lines = [f"Failed requests: {len(errors)} of {len(outputs)}"]
    for error in list(dict.fromkeys(errors))[:MAX_PRINTED_ERRORS]:
        lines.append(f"  error: {error}")
    return "\n".join(lines)
