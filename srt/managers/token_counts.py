"""The tokens a scheduler has run since start-up, by kind, and the prefix-cache split of its last
prefill batch: what /metrics reports as SGLang's ``sglang:realtime_tokens_total`` and
``sglang:cache_hit_rate`` (read through the scheduler's internal state)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TokenCounts:
    def __init__(self) -> None:
        self.prefill_compute = 0  # prompt tokens prefilled (their KV computed)
        self.prefill_cache = 0  # prompt tokens whose KV came from the prefix cache
        self.decode = 0  # tokens decoded (mixed into prefill batches included)
        self.last_prefill_cache = 0
        self.last_prefill_compute = 0

    def on_prefill(self, reqs: Sequence[Any], continuing: Any) -> None:
        """A prefill batch of ``reqs``; ``continuing``: the chunked request whose next chunk
        it carries (None if none), whose prefix is its own earlier chunks, not a cache hit."""
        cached = sum(len(r.prefix_indices) for r in reqs if r is not continuing)
        computed = sum(r.extend_input_len for r in reqs)
        self.prefill_cache += cached
        self.prefill_compute += computed
        self.last_prefill_cache, self.last_prefill_compute = cached, computed

    def state(self) -> dict[str, int]:
        return {
            "num_prefill_compute_tokens": self.prefill_compute,
            "num_prefill_cache_tokens": self.prefill_cache,
            "num_decode_tokens": self.decode,
            "last_prefill_cache_tokens": self.last_prefill_cache,
            "last_prefill_compute_tokens": self.last_prefill_compute,
        }
