"""Prometheus metrics under SGLang's names (``sglang:``, label ``model_name``: the served model
name), so SGLang's dashboards and alerts read an srt server unchanged; ``srt:`` names only for
what SGLang has no metric for. Request metrics (token counters, latency histograms) are kept by
the tokenizer manager as outputs arrive; scheduler metrics are read from the schedulers'
internal states when /metrics is read, one state per attention-DP group, and combined over the
groups (counts summed, ratios over the summed parts). docs/api.md lists them."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from srt.constrained.grammar import KINDS as GRAMMAR_KINDS
from srt.managers.io_struct import BatchStrOutput
from srt.managers.request_state import ReqState

# SGLang's default histogram buckets (seconds).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
    0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip


class TokenizerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def counter(name: str, help_text: str) -> Counter:
            metric = Counter(name, help_text, ["model_name"], registry=self.registry)
            return metric.labels(model_name)

        def histogram(name: str, help_text: str, buckets: tuple) -> Histogram:
            metric = Histogram(
                name, help_text, ["model_name"], buckets=buckets, registry=self.registry
            )
            return metric.labels(model_name)

        self.prompt_tokens = counter("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("sglang:cached_tokens", "Number of cached prompt tokens.")
        self.requests = counter("sglang:num_requests", "Number of requests processed.")
        self.so_requests = counter(
            "sglang:num_so_requests", "Number of structured output requests processed."
        )
        self.aborted = counter("sglang:num_aborted_requests", "Number of requests aborted.")
        self.rejected = counter(
            "srt:num_rejected_requests", "Requests refused with 503 (the queue is full)."
        )
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )
        self.scheduler = SchedulerCollector(model_name)
        self.registry.register(self.scheduler)

    def observe(self, state: ReqState, out: BatchStrOutput, i: int, now: float) -> None:
        """Record one update of a request, before ``state.update`` applies it. Latencies between
        tokens are known for streamed requests only (the others report only at the end)."""
        new_tokens = out.completion_tokens[i] - state.meta["completion_tokens"]
        if new_tokens > 0 and state.obj.stream:
            if state.first_token_time is None:
                state.first_token_time = now
                self.ttft.observe(now - state.created)
            elif state.last_time is not None:
                # one observation per token, as SGLang: the update's gap shared among its tokens
                for _ in range(new_tokens):
                    self.itl.observe((now - state.last_time) / new_tokens)
            state.last_time = now
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
        if out.finished_reasons[i] is not None:
            self.prompt_tokens.inc(out.prompt_tokens[i])
            self.cached_tokens.inc(out.cached_tokens[i])
            self.requests.inc()
            params = state.obj.sampling_params or {}
            if any(params.get(kind) for kind in GRAMMAR_KINDS):
                self.so_requests.inc()
            self.e2e.observe(now - state.created)

    def render(self, internal_states: list[dict]) -> bytes:
        """The exposition text, the scheduler metrics from ``internal_states`` (one per
        attention-DP group)."""
        self.scheduler.states = internal_states
        try:
            return generate_latest(self.registry)
        finally:
            self.scheduler.states = []


class SchedulerCollector:
    """The scheduler metrics, built from the internal states ``TokenizerMetrics.render`` sets
    for the time of one read."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.states: list[dict] = []

    def collect(self) -> Iterator[Metric]:
        states = self.states
        if not states:
            return

        def total(key: str) -> float:
            return sum(s[key] for s in states)

        def ratio(part: float, whole: float) -> float:
            return part / whole if whole else 0.0

        yield self._gauge(
            "sglang:num_running_reqs", "The number of running requests.", total("num_running_reqs")
        )
        yield self._gauge(
            "sglang:num_queue_reqs",
            "The number of requests in the waiting queue.",
            total("num_waiting_reqs"),
        )
        used, capacity = total("num_used_tokens"), total("max_total_num_tokens")
        yield self._gauge("sglang:num_used_tokens", "The number of used tokens.", used)
        yield self._gauge("sglang:token_usage", "The token usage.", ratio(used, capacity))
        yield self._gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            capacity,
        )
        yield self._gauge(
            "sglang:gen_throughput",
            "The generation throughput (token/s).",
            total("last_gen_throughput"),
        )
        cached = total("last_prefill_cache_tokens")
        computed = total("last_prefill_compute_tokens")
        yield self._gauge(
            "sglang:cache_hit_rate", "The prefix cache hit rate.", ratio(cached, cached + computed)
        )
        yield self._gauge(
            "sglang:new_token_ratio",
            "The new token ratio.",
            total("new_token_ratio") / len(states),
        )
        retracted = CounterMetricFamily(
            "sglang:num_retracted_requests",
            "Total number of retracted requests.",
            labels=["model_name"],
        )
        retracted.add_metric([self.model_name], total("num_retracted_reqs"))
        yield retracted
        tokens = CounterMetricFamily(
            "sglang:realtime_tokens",
            "Total number of tokens processed. mode: prefill_compute, prefill_cache, decode.",
            labels=["model_name", "mode"],
        )
        for mode, key in (
            ("prefill_compute", "num_prefill_compute_tokens"),
            ("prefill_cache", "num_prefill_cache_tokens"),
            ("decode", "num_decode_tokens"),
        ):
            tokens.add_metric([self.model_name, mode], total(key))
        yield tokens
        yield from self._overlap(states[0].get("overlap", {}))

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
        gauge.add_metric([self.model_name], value)
        return gauge

    def _overlap(self, overlap: dict) -> Iterator[Metric]:
        """--overlap-mode auto (srt's own): every rank's policy is the same (it sees the same
        numbers), so the first group's."""
        steps = GaugeMetricFamily(
            "srt:overlap_steps",
            "--overlap-mode auto: steps run in each overlap mode, by step kind",
            labels=["model_name", "kind", "mode"],
        )
        for key, n in overlap.get("num_steps", {}).items():
            steps.add_metric([self.model_name, *key.split("/")], n)
        estimates = GaugeMetricFamily(
            "srt:overlap_step_seconds_estimate",
            "--overlap-mode auto: the cost model's step time per kind, mode and token bucket "
            "(tokens ≥ 2**bucket)",
            labels=["model_name", "kind", "mode", "bucket"],
        )
        for kind, modes in overlap.get("estimates", {}).items():
            for mode, cells in modes.items():
                for cell in cells:
                    labels = [self.model_name, kind, mode, str(cell["bucket"])]
                    estimates.add_metric(labels, cell["seconds"])
        yield steps
        yield estimates
