"""Which waiting requests join the next prefill batch.

SchedulePolicy orders the waiting queue (fcfs, or lpm: longest cached prefix first) and matches
each request's prefix. PrefillAdder admits requests while the KV budget allows: free plus
evictable slots, minus the room reserved for the decode of running requests (their remaining
``max_new_tokens`` scaled by ``new_token_ratio``, as SGLang), and cuts a prompt that exceeds the
chunk budget into a chunk (chunked prefill). BurstPolicy decides when a prefill waits for the
rest of a burst of requests, and whether a burst larger than a batch is prefilled in one wave or
spread over mixed batches.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any, NamedTuple

from srt.managers.schedule_batch import BatchContext, Req
from srt.server_args_choices import BURST_QUIET_S

# SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION: reserve at most this many decode tokens per request.
CLIP_MAX_NEW_TOKENS = 4096
# SGLang's defaults: start at 0.7, decay to 0.7 * 0.14 over 600 decode steps.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600
RETRACT_DECODE_STEPS = 20
LPM_MAX_QUEUE = 128


class NewTokenRatio:
    """The share of their remaining max_new_tokens that running requests are expected to use.

    It decays while decoding goes well and jumps up after a retraction."""

    def __init__(self) -> None:
        self.value = INIT_NEW_TOKEN_RATIO

    def decay(self) -> None:
        self.value = max(self.value - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def on_retract(self, running: list[Req]) -> None:
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(r.sampling_params.max_new_tokens for r in running)
        estimate = (decoded + RETRACT_DECODE_STEPS * len(running)) / max(max_new, 1)
        self.value = min(1.0, max(self.value, estimate))


def decode_reserve(req: Req, ratio: float) -> int:
    remaining = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    return int(min(remaining, CLIP_MAX_NEW_TOKENS) * ratio)


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: Any):
        self.policy, self.tree_cache = policy, tree_cache

    def calc_priority(self, waiting: list[Req]) -> None:
        """Order the queue in place. lpm matches every waiting prefix and sorts the longest
        first; like SGLang it falls back to fcfs on long queues, where matching costs too much."""
        if self.policy != "lpm" or len(waiting) > LPM_MAX_QUEUE:
            return
        for req in waiting:
            req.init_next_round_input(self.tree_cache)
        waiting.sort(key=lambda r: -len(r.prefix_indices))


class PrefillKind(Enum):
    """How the next prefill takes a burst (BurstPolicy)."""

    PLAIN = auto()  # batches of the prefill batch budget
    WAVE = auto()  # the whole burst in one batch of the wave budget
    SPREAD = auto()  # mixed batches of the spread chunk, the running requests decoding in each


class PrefillShape(NamedTuple):
    """The next prefill batch: its kind, the running requests' decode tokens that ride in it
    (one each; 0: the batch is not mixed) and its chunk budget."""

    kind: PrefillKind
    num_mixed_decode: int
    chunk_tokens: int


class BurstPolicy:
    """How a burst of new requests is prefilled while other requests decode.

    Requests sent at once reach the scheduler over tens of milliseconds (the client and the
    HTTP process handle them one by one, a few milliseconds apart on a busy host).

    Hold: prefilling each fragment as it arrives makes every request already decoding wait for
    each later fragment's prefill, and a fragment prefilled while many decode hits them all.
    While requests keep arriving (the last one less than BURST_QUIET_S ago), the prefill is
    held and the running requests decode on; the burst is then prefilled in one batch. Never
    longer than ``hold_s`` after the oldest waiting request arrived, never when nothing
    decodes, and not when the waiting prompts already fill a prefill batch (``budget`` tokens).
    The times are the scheduler's iteration clock (``Scheduler.begin_iteration``): on every
    rank of a group the entry rank's, so that all of them hold alike.

    A burst that needs more than one prefill batch would run its batches back to back
    (prefill first), every stream started by one batch stopped for the next ones. Two ways out,
    each on its own switch:

    Wave (``wave_budget`` above ``budget``): while more requests wait than decode (a wave of
    new requests reaching a server that is idle or nearly so), the burst is prefilled in one
    batch of up to ``wave_budget`` tokens (--max-prefill-tokens), each prompt within a batch
    (``budget``), so a prompt is still chunked as before: only the few running streams pay one
    gap, where batches back to back or a spread would stop every stream that an earlier batch
    started (at c32 on 2 cores, the 32 streams of a one-wave run took 3-5 spread steps of
    12-25 ms each, 3-4x their TPOT).

    Spread (``spread_chunk`` set): otherwise (more requests decode than wait) the burst is
    prefilled in MIXED batches of at most ``spread_chunk`` new tokens, the running requests
    decoding in each: many short gaps in place of one long one for each of the many running
    streams.

    ``holds`` and ``prefill_kind`` only answer; the scheduler counts what it did with
    ``record_hold`` and ``record_prefill``.
    """

    def __init__(self, hold_s: float, budget: int, spread_chunk: int, wave_budget: int = 0):
        self.hold_s, self.budget, self.spread_chunk = hold_s, budget, spread_chunk
        self.wave_budget = max(wave_budget, budget)
        self.last_arrival = float("-inf")
        self.num_holds = self.num_spread_batches = self.num_wave_batches = 0

    def on_arrival(self, now: float) -> None:
        self.last_arrival = now

    def holds(self, waiting: list[Req], num_running: int, now: float) -> bool:
        """Whether the next prefill waits for the rest of the burst."""
        if not (self.hold_s and num_running and waiting):
            return False
        if now - self.last_arrival >= BURST_QUIET_S:
            return False
        if now - min(r.arrival_time for r in waiting) >= self.hold_s:
            return False
        wave = self.prefill_kind(waiting, False, num_running) is PrefillKind.WAVE
        return _prompt_tokens(waiting) < (self.wave_budget if wave else self.budget)

    def prefill_kind(self, waiting: list[Req], chunking: bool, num_running: int) -> PrefillKind:
        """How the next prefill takes the waiting burst (``chunking``: a prompt is mid-prefill,
        which goes on in batches of ``budget``)."""
        if self._is_wave(waiting, chunking, num_running):
            return PrefillKind.WAVE
        if not 0 < self.spread_chunk < self.budget or not 0 < num_running < self.spread_chunk:
            return PrefillKind.PLAIN
        if chunking or _prompt_tokens(waiting) > self.budget:
            return PrefillKind.SPREAD
        return PrefillKind.PLAIN

    def _is_wave(self, waiting: list[Req], chunking: bool, num_running: int) -> bool:
        if self.wave_budget <= self.budget or chunking or len(waiting) <= num_running:
            return False
        return max(len(r.origin_input_ids) for r in waiting) <= self.budget

    def record_hold(self) -> None:
        self.num_holds += 1

    def record_prefill(self, kind: PrefillKind, num_new_tokens: int) -> None:
        """Count a prefill batch formed as ``kind``: every spread one, and the waves that carry
        more than one prefill batch (a smaller wave is the batch a plain prefill would be)."""
        if kind is PrefillKind.SPREAD:
            self.num_spread_batches += 1
        elif kind is PrefillKind.WAVE and num_new_tokens > self.budget:
            self.num_wave_batches += 1


def _prompt_tokens(reqs: list[Req]) -> int:
    return sum(len(r.origin_input_ids) for r in reqs)


class AddReqResult(Enum):
    CONTINUE = auto()  # admitted; try the next request
    NO_TOKEN = auto()  # out of KV budget
    OTHER = auto()  # another limit (batch size, prefill tokens, chunk budget)


class PrefillAdder:
    def __init__(
        self,
        ctx: BatchContext,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        max_new_reqs: int,
        mixed_with_decode_tokens: int = 0,
    ):
        """``mixed_with_decode_tokens``: the decode tokens that will ride in the same batch
        (--enable-mixed-chunk); the prefill's token budgets leave room for them."""
        self.ctx = ctx
        self.running_reserve = sum(decode_reserve(r, new_token_ratio) for r in running)
        self.num_running = len(running)
        self.admitted_cost = 0
        self.rem_input_tokens = max_prefill_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None
        if chunked_prefill_size > 0:
            self.rem_chunk_tokens = chunked_prefill_size - mixed_with_decode_tokens
        self.max_new_reqs = max_new_reqs
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None

    def rem_total_tokens(self) -> int:
        return self.ctx.decode_room() - self.running_reserve - self.admitted_cost

    def add_chunked_req(self, req: Req) -> None:
        """Continue a chunked prefill first; its prefix is already locked."""
        req.init_chunk_continuation()
        self._take(req)

    def add_one_req(self, req: Req) -> AddReqResult:
        if len(self.can_run_list) >= self.max_new_reqs:
            return AddReqResult.OTHER
        if self.rem_chunk_tokens == 0 or (self.rem_input_tokens <= 0 and self.can_run_list):
            return AddReqResult.OTHER
        if req.extend_input_len > self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        # Lock first: the matched prefix stops being evictable room (SGLang does the same).
        self.ctx.tree_cache.inc_lock_ref(req.last_node)
        cost = req.extend_input_len + decode_reserve(req, 1.0)
        if cost > self.rem_total_tokens() and not self._lone(req):
            self.ctx.tree_cache.dec_lock_ref(req.last_node)
            return AddReqResult.NO_TOKEN
        self._take(req)
        return AddReqResult.CONTINUE

    def _lone(self, req: Req) -> bool:
        """Nothing else runs: admit whatever fits now (max_new_tokens is clamped to the pool)."""
        alone = self.num_running == 0 and not self.can_run_list
        return alone and req.extend_input_len < self.rem_total_tokens()

    def _take(self, req: Req) -> None:
        if self.rem_chunk_tokens is not None and req.extend_input_len > self.rem_chunk_tokens:
            req.truncate_chunk(self.rem_chunk_tokens)
        if not req.is_last_chunk():
            self.new_chunked_req = req
        self.can_run_list.append(req)
        reserve = decode_reserve(req, 1.0) if req.is_last_chunk() else 0
        self.admitted_cost += req.extend_input_len + reserve
        self.rem_input_tokens -= req.extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.extend_input_len
