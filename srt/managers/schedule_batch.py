"""Req (one request's scheduling state) and ScheduleBatch (the CPU bookkeeping of one step).

Invariant: a request's row of ``req_to_token`` holds the KV slots of its first ``kv_len``
tokens of ``origin_input_ids + output_ids``; the first ``len(prefix_indices)`` of them belong to
the cache tree (locked through ``last_node``), the rest to the request.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from srt.layers.sampler import make_generator
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.sampling.sampling_batch_info import SamplingBatchInfo
from srt.sampling.sampling_params import SamplingParams
from srt.utils.host_to_device import host_lists_to_device

if TYPE_CHECKING:
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool


def finish_length(n: int) -> dict:
    return {"type": "length", "length": n}


def finish_stop(matched: int | str) -> dict:
    return {"type": "stop", "matched": matched}


def finish_stop_regex(pattern: str) -> dict:
    """The output text matched a stop_regex (``matched`` is the pattern)."""
    return {"type": "stop", "matched": pattern, "regex": True}


def finish_abort(message: str) -> dict:
    return {"type": "abort", "message": message}


class Req:
    """One request: its tokens, cache position, finish state and logprob accumulators."""

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        eos_token_ids: set[int] | None = None,
        device: str | torch.device = "cpu",
        arrival_time: float | None = None,
    ):
        self.rid = rid
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params, self.stream = sampling_params, stream
        self.eos_token_ids = set(eos_token_ids or ())
        self.output_ids: list[int] = []
        self._init_cache_state(device)
        self.finished_reason: dict | None = None
        seed = sampling_params.sampling_seed
        self.generator = None if seed is None else make_generator(seed, device)
        self.grammar: Any = None  # a RequestGrammar when the request is constrained
        self._init_logprobs(return_logprob, logprob_start_len, top_logprobs_num)

    def _init_cache_state(self, device: str | torch.device) -> None:
        self.fill_ids: list[int] = []  # tokens that have KV once this round's extend is done
        self.prefix_indices = torch.empty(0, dtype=torch.int64, device=device)
        self.last_node: Any = None
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.extend_input_len = 0
        self.cached_tokens = 0
        self.has_started = False

    def _init_logprobs(self, return_logprob: bool, start: int, top_num: int) -> None:
        self.return_logprob, self.logprob_start_len = return_logprob, start
        self.top_logprobs_num = top_num if return_logprob else 0
        self.input_logprobs_done = not (return_logprob and start >= 0)
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        # What was already sent to the detokenizer: output ids, input and output logprobs.
        self.sent_output_len = self.sent_input_lp_len = self.sent_output_lp_len = 0

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None

    # ------------------------------------------------------------------ prefill rounds
    def init_next_round_input(self, tree_cache: Any) -> None:
        """Set fill_ids to everything known and match the longest cached prefix. At least one
        token is always recomputed (its logits give the next token); with prompt logprobs the
        match stops before the first position whose logits are needed."""
        self.fill_ids = self.all_ids()
        max_prefix = len(self.fill_ids) - 1
        if not self.input_logprobs_done:
            max_prefix = min(max_prefix, max(self.logprob_start_len - 1, 0))
        self.prefix_indices, self.last_node = tree_cache.match_prefix(self.fill_ids[:max_prefix])
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def init_chunk_continuation(self) -> None:
        """The next chunk of a chunked prefill: prefix = what earlier chunks computed."""
        self.fill_ids = self.all_ids()
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def truncate_chunk(self, num_tokens: int) -> None:
        self.fill_ids = self.fill_ids[: len(self.prefix_indices) + num_tokens]
        self.extend_input_len = num_tokens

    def is_last_chunk(self) -> bool:
        return len(self.fill_ids) == len(self.origin_input_ids) + len(self.output_ids)

    def extend_logprob_start_len(self) -> int:
        """First new-token row (relative to this extend) whose logits prompt logprobs need."""
        if self.input_logprobs_done:
            return self.extend_input_len
        first_pos = max(self.logprob_start_len - 1, 0) - len(self.prefix_indices)
        return min(max(first_pos, 0), self.extend_input_len)

    # ------------------------------------------------------------------ finishing
    def check_finished(self, tokenizer: Any) -> None:
        if self.finished():
            return
        params = self.sampling_params
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = finish_length(params.max_new_tokens)
            return
        last = self.output_ids[-1]
        if last in (params.stop_token_ids or ()) or (
            not params.ignore_eos and last in self.eos_token_ids
        ):
            self.finished_reason = finish_stop(last)
            return
        if params.stop and tokenizer is not None:
            tail = tokenizer.decode(self.output_ids[-(params.stop_str_max_len + 1) :])
            for stop_str in params.stop:
                if stop_str in tail:
                    self.finished_reason = finish_stop(stop_str)
                    return
        if params.stop_regex and tokenizer is not None:
            # A match may span any number of tokens: search the whole output.
            text = tokenizer.decode(self.output_ids)
            for pattern in params.stop_regex:
                if re.search(pattern, text):
                    self.finished_reason = finish_stop_regex(pattern)
                    return

    def reset_for_retract(self) -> None:
        """Back to waiting; output_ids stay, so the next prefill resumes the sequence."""
        self.prefix_indices = self.prefix_indices[:0]
        self.last_node, self.req_pool_idx, self.kv_len = None, None, 0
        self.fill_ids, self.extend_input_len = [], 0

    def __repr__(self) -> str:
        return f"Req({self.rid}, input={len(self.origin_input_ids)}, out={len(self.output_ids)})"


@dataclass
class BatchContext:
    """What every batch needs from the scheduler: pools, the cache tree and model facts."""

    req_to_token_pool: ReqToTokenPool
    allocator: TokenToKVPoolAllocator
    tree_cache: Any
    device: str | torch.device
    vocab_size: int

    def alloc_req_rows(self, n: int) -> list[int]:
        rows = self.req_to_token_pool.alloc(n)
        if rows is None:
            raise RuntimeError(f"out of request rows: need {n}")
        return rows

    def alloc_token_slots(self, n: int) -> torch.Tensor:
        """KV slots for n tokens, evicting from the cache tree first when short."""
        short = n - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        out = self.allocator.alloc(n)
        if out is None:
            raise RuntimeError(
                f"out of KV cache: need {n} slots, {self.allocator.available_size()} free, "
                f"{self.tree_cache.evictable_size()} evictable"
            )
        return out

    def decode_room(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()


class ScheduleBatch:
    """A list of requests plus the per-step tensors built by prepare_for_extend/decode."""

    def __init__(self, reqs: list[Req], ctx: BatchContext):
        self.reqs, self.ctx = reqs, ctx
        self.forward_mode = ForwardMode.EXTEND
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.extend_logprob_start_lens: list[int] = []
        self.num_mixed_decode = 0  # running requests decoding in this prefill (MIXED) batch

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    # ------------------------------------------------------------------ step preparation
    def prepare_for_extend(self) -> None:
        self.forward_mode = ForwardMode.EXTEND
        need_rows = [r for r in self.reqs if r.req_pool_idx is None]
        for req, row in zip(need_rows, self.ctx.alloc_req_rows(len(need_rows))):
            req.req_pool_idx = row
        self.out_cache_loc = self.ctx.alloc_token_slots(sum(r.extend_input_len for r in self.reqs))
        pool, offset = self.ctx.req_to_token_pool, 0
        self.input_ids, self.positions = [], []
        self.prefix_lens = [len(r.prefix_indices) for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        self.extend_logprob_start_lens = [r.extend_logprob_start_len() for r in self.reqs]
        for req, prefix_len, ext in zip(self.reqs, self.prefix_lens, self.extend_lens):
            pool.write(req.req_pool_idx, 0, req.prefix_indices)
            pool.write(req.req_pool_idx, prefix_len, self.out_cache_loc[offset : offset + ext])
            offset += ext
            req.kv_len = len(req.fill_ids)
            self.input_ids.extend(req.fill_ids[prefix_len:])
            self.positions.extend(range(prefix_len, len(req.fill_ids)))

    def prepare_for_decode(self) -> None:
        """One token per request: its last output token, written at position kv_len."""
        self.forward_mode = ForwardMode.DECODE
        self.input_ids = [r.output_ids[-1] for r in self.reqs]
        self.out_cache_loc, self.positions = self._alloc_next_token_slots(self.reqs)

    def mix_with_running(self, running: list[Req]) -> None:
        """Add the running requests' decode to this prepared prefill batch (--enable-mixed-chunk,
        as SGLang's): each extends its KV by its last output token, a one-token chunk after
        a prefix of everything it holds, and samples its next token from it."""
        slots, positions = self._alloc_next_token_slots(running)
        self.forward_mode = ForwardMode.MIXED
        self.num_mixed_decode = len(running)
        self.reqs = self.reqs + running
        self.out_cache_loc = torch.cat([self.out_cache_loc, slots])
        self.input_ids += [r.output_ids[-1] for r in running]
        self.positions += positions
        self.prefix_lens += positions
        self.extend_lens += [1] * len(running)
        self.extend_logprob_start_lens += [1] * len(running)  # no prompt logprobs left

    def _alloc_next_token_slots(self, reqs: list[Req]) -> tuple[torch.Tensor, list[int]]:
        """A KV slot for each request's next token, at position kv_len: (slots, positions)."""
        slots = self.ctx.alloc_token_slots(len(reqs))
        positions = [r.kv_len for r in reqs]
        req_to_token = self.ctx.req_to_token_pool.req_to_token
        rows, cols = host_lists_to_device(
            [[r.req_pool_idx for r in reqs], positions], torch.int64, req_to_token.device
        )
        req_to_token[rows, cols] = slots.to(req_to_token.device)
        for req in reqs:
            req.kv_len += 1
        return slots, positions

    # ------------------------------------------------------------------ membership
    def filter_batch(self, keep: list[Req] | None = None) -> None:
        """Keep only ``keep`` (default: the unfinished requests)."""
        if keep is None:
            keep = [r for r in self.reqs if not r.finished()]
        keep_ids = {id(r) for r in keep}
        self.reqs = [r for r in self.reqs if id(r) in keep_ids]

    def check_decode_mem(self) -> bool:
        return self.ctx.decode_room() >= len(self.reqs)

    def retract_decode(self) -> list[Req]:
        """Free requests until the next decode step fits: those with the fewest outputs and
        the longest prompts go first (SGLang's order). They keep their output_ids."""
        order = sorted(
            self.reqs,
            key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)),
            reverse=True,
        )
        retracted: list[Req] = []
        while not self.check_decode_mem():
            if len(self.reqs) == 1:
                raise RuntimeError("out of KV cache for a single request; raise max_total_tokens")
            req = order.pop()
            self.ctx.tree_cache.cache_finished_req(req)  # its KV becomes evictable
            req.reset_for_retract()
            self.reqs.remove(req)
            retracted.append(req)
        return retracted

    # ------------------------------------------------------------------ to tensors
    def to_forward_batch(self, model_runner: Any) -> ForwardBatch:
        device = model_runner.device
        seq_lens_cpu = [r.kv_len for r in self.reqs]
        rows = [r.req_pool_idx for r in self.reqs]
        input_ids, positions, req_pool_indices, seq_lens = host_lists_to_device(
            [self.input_ids, self.positions, rows, seq_lens_cpu], torch.int64, device
        )
        batch = ForwardBatch(
            forward_mode=self.forward_mode,
            batch_size=len(self.reqs),
            input_ids=input_ids,
            positions=positions,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=self.out_cache_loc.to(device),
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            return_logprob=self.return_logprob,
            sampling_info=self._sampling_info(device),
        )
        if self.forward_mode.is_extend():
            self._fill_extend_fields(batch)
        return batch

    def _fill_extend_fields(self, batch: ForwardBatch) -> None:
        batch.extend_prefix_lens_cpu = list(self.prefix_lens)
        batch.extend_seq_lens_cpu = list(self.extend_lens)
        if batch.return_logprob:
            batch.extend_logprob_start_lens_cpu = list(self.extend_logprob_start_lens)

    def _sampling_info(self, device: str | torch.device) -> SamplingBatchInfo:
        return SamplingBatchInfo.from_params(
            [r.sampling_params for r in self.reqs],
            [r.output_ids for r in self.reqs],
            [r.origin_input_ids for r in self.reqs],
            [r.generator for r in self.reqs],
            [r.eos_token_ids for r in self.reqs],
            self.ctx.vocab_size,
            device,
            [r.grammar for r in self.reqs],
        )
