"""Prometheus metrics of the tokenizer manager (request latencies, token counters) and gauges
filled from the scheduler's internal state when /metrics is read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from srt.managers.io_struct import BatchStrOutput
from srt.managers.request_state import ReqState

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class TokenizerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("srt:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("srt:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("srt:num_requests", "Finished requests", registry=r)
        self.rejected = Counter(
            "srt:num_rejected_requests", "Requests refused with 503 (queue full)", registry=r
        )
        self.ttft = Histogram(
            "srt:time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "srt:inter_token_latency_seconds",
            "Inter-token latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "srt:e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("srt:num_running_reqs", "Requests running", registry=r)
        self.queued = Gauge("srt:num_queue_reqs", "Requests waiting", registry=r)
        self.token_usage = Gauge("srt:token_usage", "Fraction of KV slots in use", registry=r)
        self.overlap_steps = Gauge(
            "srt:overlap_steps",
            "--overlap-mode auto: steps run in each overlap mode, by step kind",
            ["kind", "mode"],
            registry=r,
        )
        self.overlap_estimate = Gauge(
            "srt:overlap_step_seconds_estimate",
            "--overlap-mode auto: the cost model's step time per kind, mode and token bucket "
            "(tokens ≥ 2**bucket)",
            ["kind", "mode", "bucket"],
            registry=r,
        )

    def observe(self, state: ReqState, out: BatchStrOutput, i: int, now: float) -> None:
        """Record one update of a request, before ``state.update`` applies it."""
        new_tokens = out.completion_tokens[i] - state.meta["completion_tokens"]
        if new_tokens > 0 and state.obj.stream:  # non-streamed requests report only at the end
            if state.first_token_time is None:
                state.first_token_time = now
                self.ttft.observe(now - state.created)
            elif state.last_time is not None:
                self.itl.observe((now - state.last_time) / new_tokens)
            state.last_time = now
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
        if out.finished_reasons[i] is not None:
            self.prompt_tokens.inc(out.prompt_tokens[i])
            self.requests.inc()
            self.e2e.observe(now - state.created)

    def render(self, internal_states: list[dict]) -> bytes:
        """``internal_states``: one per attention-DP group; gauges are summed over groups
        (token usage: over the groups' pools)."""
        self.running.set(sum(s["num_running_reqs"] for s in internal_states))
        self.queued.set(sum(s["num_waiting_reqs"] for s in internal_states))
        total = sum(s["max_total_num_tokens"] for s in internal_states)
        used = sum(s["token_usage"] * s["max_total_num_tokens"] for s in internal_states)
        self.token_usage.set(used / total)
        self._render_overlap(internal_states[0].get("overlap", {}))
        return generate_latest(self.registry)

    def _render_overlap(self, overlap: dict) -> None:
        """Every rank's auto policy is the same (it sees the same numbers): the first's."""
        for key, n in overlap.get("num_steps", {}).items():
            kind, mode = key.split("/")
            self.overlap_steps.labels(kind, mode).set(n)
        for kind, modes in overlap.get("estimates", {}).items():
            for mode, cells in modes.items():
                for cell in cells:
                    labels = (kind, mode, str(cell["bucket"]))
                    self.overlap_estimate.labels(*labels).set(cell["seconds"])
