"""Scheduler: one iteration = pick a batch (prefill first, else decode), run it, process it.

Composed of small parts: SchedulePolicy + PrefillAdder (admission), ScheduleBatch (bookkeeping
and retraction), the cache tree (RadixCache or ChunkCache), SchedulerOutputProcessor and the
batch log (SchedulerBatchLog).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from srt.constrained.grammar import GrammarBackend, grammar_spec
from srt.managers.io_struct import AbortReq, BatchTokenIDOutput, TokenizedGenerateReqInput
from srt.managers.schedule_batch import BatchContext, Req, ScheduleBatch, finish_abort
from srt.managers.schedule_policy import (
    AddReqResult,
    BurstPolicy,
    NewTokenRatio,
    PrefillAdder,
    PrefillKind,
    PrefillShape,
    SchedulePolicy,
)
from srt.managers.scheduler_batch_log import SchedulerBatchLog
from srt.managers.scheduler_output_processor import SchedulerOutputProcessor
from srt.managers.token_counts import TokenCounts
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.radix_cache import RadixCache
from srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


def max_req_len(context_len: int, max_total_tokens: int) -> int:
    """The longest sequence (prompt + output) one request may reach, as SGLang."""
    return min(context_len, max_total_tokens) - 1


def check_request_length(req: Req, context_len: int, max_total_tokens: int) -> str | None:
    """An abort message for a request that can never run; else None. Like SGLang, clamps
    max_new_tokens so that the request alone fits in the KV pool."""
    num_input, params = len(req.origin_input_ids), req.sampling_params
    max_len = max_req_len(context_len, max_total_tokens)
    if num_input > max_len - 1:
        return (
            f"Input length ({num_input} tokens) exceeds the maximum allowed length "
            f"({max_len - 1} tokens: context length {context_len}, KV cache "
            f"{max_total_tokens} tokens)."
        )
    if num_input + params.max_new_tokens > context_len:
        return (
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {num_input + params.max_new_tokens} tokens: "
            f"{num_input} tokens from the input and {params.max_new_tokens} for the completion."
        )
    params.max_new_tokens = min(params.max_new_tokens, max_len - num_input)
    return None


class Scheduler(SchedulerBatchLog):
    """``parallel``: this rank's groups under tensor parallelism (default: one rank). Every rank
    runs the same schedule on the same messages, so their batches stay identical."""

    def __init__(self, server_args: ServerArgs, model_runner: Any = None, parallel: Any = None):
        self.server_args = server_args
        self._init_model_runner(model_runner, parallel)
        self._init_tokenizer()
        self._init_cache()
        self._init_state()

    def _init_model_runner(self, model_runner: Any, parallel: Any) -> None:
        if model_runner is None:
            from srt.model_executor.model_runner import ModelRunner

            model_runner = ModelRunner(self.server_args, parallel=parallel)
        self.model_runner = model_runner
        self.model_config = model_runner.model_config
        self.max_total_num_tokens = model_runner.max_total_num_tokens
        self.max_running_requests = model_runner.max_running_requests
        context_len = self.model_config.context_len
        self.max_req_input_len = max_req_len(context_len, self.max_total_num_tokens) - 1

    def _init_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.server_args.tokenizer_path)

    def _init_cache(self) -> None:
        runner = self.model_runner
        cache_cls = ChunkCache if self.server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(
            runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.device
        )
        self.ctx = BatchContext(
            runner.req_to_token_pool,
            runner.token_to_kv_pool_allocator,
            self.tree_cache,
            runner.device,
            self.model_config.vocab_size,
        )

    def _init_state(self) -> None:
        self.waiting_queue: list[Req] = []
        self.running_batch = ScheduleBatch([], self.ctx)
        self.chunked_req: Req | None = None
        self.finished_outside_batch: list[Req] = []
        self.policy = SchedulePolicy(self.server_args.schedule_policy, self.tree_cache)
        self.new_token_ratio = NewTokenRatio()
        args = self.server_args
        self.burst = BurstPolicy(
            args.prefill_burst_hold_ms / 1e3,
            args.prefill_batch_tokens,
            args.burst_chunk_size,
            args.max_prefill_tokens if args.wave_prefill else 0,
        )
        self.output_processor = SchedulerOutputProcessor(
            self.tree_cache, self.tokenizer, self.server_args.stream_interval
        )
        self.num_retracted_reqs = 0
        self.num_forward_steps = 0
        self.token_counts = TokenCounts()  # for /metrics
        self.iteration_time: float | None = None  # begin_iteration's; None: this process's clock
        self.current_step = "start-up"  # what this rank is doing, for the watchdog
        self.enable_dp_attention = self.server_args.enable_dp_attention
        self.dp_rank = self.model_runner.parallel.attn_dp_rank
        self.grammar_backend: GrammarBackend | None = None  # made by the first constrained request
        self._init_batch_log()

    # ------------------------------------------------------------------ time
    def begin_iteration(self, now: float) -> None:
        """The time this iteration's requests arrive at and its schedule is decided at (the
        burst hold's clock). Under TP the loop gives every rank of a group the entry rank's
        clock, received with the iteration's messages: each rank reading its own would let
        them decide a hold differently near its thresholds and step with different batches."""
        self.iteration_time = now

    def now(self) -> float:
        return time.monotonic() if self.iteration_time is None else self.iteration_time

    # ------------------------------------------------------------------ requests in
    def add_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = Req(
            recv.rid,
            recv.input_ids,
            recv.sampling_params,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            stream=recv.stream,
            eos_token_ids=self.model_config.eos_token_ids,
            device=self.model_runner.device,
            arrival_time=self.now(),
        )
        error = check_request_length(req, self.model_config.context_len, self.max_total_num_tokens)
        if error is None:
            error = self._attach_grammar(req)
        if error is not None:
            req.finished_reason = finish_abort(error)
            self.finished_outside_batch.append(req)
            return
        self.waiting_queue.append(req)
        self.burst.on_arrival(req.arrival_time)

    def _attach_grammar(self, req: Req) -> str | None:
        """Compile the request's constraint into its matcher; an error message if that fails."""
        spec = grammar_spec(req.sampling_params)
        if spec is None:
            return None
        try:
            if self.grammar_backend is None:
                args = self.server_args
                self.grammar_backend = GrammarBackend(
                    self.tokenizer,
                    self.model_config.vocab_size,
                    self.model_config.eos_token_ids,
                    any_whitespace=not args.constrained_json_disable_any_whitespace,
                    max_whitespace_cnt=args.constrained_json_max_whitespace_cnt,
                )
            req.grammar = self.grammar_backend.matcher(spec)
        except (RuntimeError, ValueError) as e:
            return f"{spec.kind} could not be compiled: {e}"
        return None

    def abort_request(self, recv: AbortReq) -> None:
        """Finish the request now, wherever it is; its computed KV goes to the cache."""
        for req in self.waiting_queue:
            if req.rid == recv.rid:
                self.waiting_queue.remove(req)
                return self._finish_aborted(req)
        if self.chunked_req is not None and self.chunked_req.rid == recv.rid:
            req, self.chunked_req = self.chunked_req, None
            self.tree_cache.cache_finished_req(req)
            return self._finish_aborted(req)
        for req in self.running_batch.reqs:
            if req.rid == recv.rid:
                self.tree_cache.cache_finished_req(req)
                self.running_batch.filter_batch(
                    [r for r in self.running_batch.reqs if r is not req]
                )
                return self._finish_aborted(req)

    def _finish_aborted(self, req: Req) -> None:
        req.finished_reason = finish_abort("Aborted by request.")
        self.finished_outside_batch.append(req)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[BatchTokenIDOutput]:
        """One iteration. Under DP attention every rank calls it every iteration, idle or not:
        the MLP-sync all-gather inside must line up across all ranks."""
        outputs = []
        if self.finished_outside_batch:
            out = self.output_processor.build_output(self.finished_outside_batch)
            outputs.append(out)  # never None: every request in it is finished
            self.finished_outside_batch = []
        batch = self.get_next_batch()
        self.current_step = self._describe_step(batch)
        forward_batch = batch.to_forward_batch(self.model_runner) if batch is not None else None
        logits_output = self.model_runner.forward_step(forward_batch)
        if batch is not None:
            reqs = list(batch.reqs)  # processing filters finished requests out of the batch
            next_token_ids = self.model_runner.sample(logits_output, forward_batch)
            self.num_forward_steps += 1
            self.process_batch_result(batch, logits_output, next_token_ids)
            out = self.output_processor.build_output(reqs)
            if out is not None:
                outputs.append(out)
        return outputs

    def _describe_step(self, batch: ScheduleBatch | None) -> str:
        """What this rank is doing now, for the watchdog's message."""
        if batch is None:
            return f"an idle step (MLP sync) after forward step {self.num_forward_steps}"
        return (
            f"forward step {self.num_forward_steps + 1} ({batch.forward_mode.name.lower()}, "
            f"{len(batch.reqs)} requests)"
        )

    def get_next_batch(self) -> ScheduleBatch | None:
        batch = self._get_new_batch_prefill()
        if batch is not None:
            return batch
        if self.running_batch.is_empty():
            return None
        self._update_running_batch()
        return None if self.running_batch.is_empty() else self.running_batch

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = self.running_batch.reqs
        waiting = self.waiting_queue
        if self.chunked_req is None and self.burst.holds(waiting, len(running), self.now()):
            self.burst.record_hold()
            return None  # the running requests decode while the rest of the burst arrives
        max_new_reqs = min(
            self.max_running_requests - len(running),
            self.ctx.req_to_token_pool.available_size() + (self.chunked_req is not None),
        )
        shape = self._prefill_shape()
        adder = PrefillAdder(
            self.ctx,
            running,
            self.new_token_ratio.value,
            self.server_args.max_prefill_tokens,
            shape.chunk_tokens,
            max_new_reqs,
            shape.num_mixed_decode,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        if adder.new_chunked_req is None and max_new_reqs > len(adder.can_run_list):
            self.policy.calc_priority(self.waiting_queue)
            for req in self.waiting_queue:
                req.init_next_round_input(self.tree_cache)
                if adder.add_one_req(req) != AddReqResult.CONTINUE:
                    break
        return self._make_prefill_batch(adder, shape)

    def _prefill_shape(self) -> PrefillShape:
        """The next prefill's kind, decode tokens (the running requests that ride in its batch,
        one token each) and chunk budget: a wave (BurstPolicy: more requests wait than run)
        takes the whole burst in one batch of --max-prefill-tokens; a burst's spread prefill
        carries them in chunks of --burst-chunk-size; with mixed batches on
        (--enable-mixed-chunk, the default on CPU: ``ServerArgs.mixes_decode_into_prefill``)
        every prefill carries them (not when they would leave it no room)."""
        args, num_running = self.server_args, len(self.running_batch.reqs)
        chunking = self.chunked_req is not None
        kind = self.burst.prefill_kind(self.waiting_queue, chunking, num_running)
        mixes = args.mixes_decode_into_prefill
        if kind is PrefillKind.WAVE:
            return PrefillShape(kind, num_running if mixes else 0, self.burst.wave_budget)
        if kind is PrefillKind.SPREAD:
            return PrefillShape(kind, num_running, args.burst_chunk_size)
        if mixes and num_running < args.prefill_batch_tokens:
            return PrefillShape(kind, num_running, args.chunked_prefill_size)
        return PrefillShape(kind, 0, args.chunked_prefill_size)

    def _make_prefill_batch(self, adder: PrefillAdder, shape: PrefillShape) -> ScheduleBatch | None:
        can_run = adder.can_run_list
        if not can_run:
            return None
        self.burst.record_prefill(shape.kind, sum(r.extend_input_len for r in can_run))
        self.token_counts.on_prefill(can_run, self.chunked_req)
        admitted = {id(r) for r in can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req
        self.log_prefill_batch(len(can_run))
        for req in can_run:
            if not req.has_started:
                req.cached_tokens, req.has_started = len(req.prefix_indices), True
        batch = ScheduleBatch(can_run, self.ctx)
        batch.prepare_for_extend()
        # The running requests join it when the pool has a slot for each (else they decode
        # in the next step, retracting as usual); they come back from it as running.
        if shape.num_mixed_decode and self.running_batch.check_decode_mem():
            batch.mix_with_running(self.running_batch.reqs)
            self.running_batch.reqs = []
        return batch

    def _update_running_batch(self) -> None:
        batch = self.running_batch
        if not batch.check_decode_mem():
            retracted = batch.retract_decode()
            self.new_token_ratio.on_retract(batch.reqs)
            self.num_retracted_reqs += len(retracted)
            self.waiting_queue = retracted + self.waiting_queue
            logger.info(
                "retracted %d requests; new_token_ratio %.3f",
                len(retracted),
                self.new_token_ratio.value,
            )
        else:
            self.new_token_ratio.decay()
        batch.prepare_for_decode()

    def process_batch_result(self, batch: ScheduleBatch, logits_output: Any, next_ids: Any) -> None:
        if batch.forward_mode.is_extend():
            chunked = self.chunked_req
            self.output_processor.process_extend(batch, logits_output, next_ids, chunked)
            new_running = [r for r in batch.reqs if not r.finished() and r is not chunked]
            self.running_batch.reqs.extend(new_running)
            if batch.num_mixed_decode:
                self.count_decode_step(batch.num_mixed_decode)
        else:
            self.output_processor.process_decode(batch, logits_output, next_ids)
            self.count_decode_step(len(batch.reqs))
            self.running_batch.filter_batch()

    # ------------------------------------------------------------------ state
    def load(self) -> tuple[int, int]:
        """(requests, tokens) this scheduler holds: the DP controller's load measure."""
        reqs = self.waiting_queue + self.running_batch.reqs
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        free, evictable = self.ctx.allocator.available_size(), self.tree_cache.evictable_size()
        waiting_tokens = sum(len(r.origin_input_ids) for r in self.waiting_queue)
        return len(reqs), self.max_total_num_tokens - free - evictable + waiting_tokens

    def is_idle(self) -> bool:
        return (
            not self.waiting_queue
            and self.running_batch.is_empty()
            and self.chunked_req is None
            and not self.finished_outside_batch
        )

    def flush_cache(self) -> bool:
        """Drop the whole prefix cache; only when idle (else False)."""
        if not self.is_idle():
            return False
        self.tree_cache.reset()
        self.ctx.allocator.clear()
        self.ctx.req_to_token_pool.clear()
        return True

    def check_memory(self, check_duplicates: bool = True) -> None:
        """When idle, every KV slot must be free or in the cache tree, and every row free.
        ``check_duplicates`` also looks for double frees (a sort of the free list)."""
        if not self.is_idle():
            return
        free, evictable = self.ctx.allocator.available_size(), self.tree_cache.evictable_size()
        if free + evictable != self.max_total_num_tokens:
            raise RuntimeError(
                f"KV slot leak: free {free} + evictable {evictable} != {self.max_total_num_tokens}"
            )
        free_slots = self.ctx.allocator.free_slots if check_duplicates else None
        if free_slots is not None and free_slots.unique().numel() != free_slots.numel():
            raise RuntimeError("KV slot double free: a slot is in the free list twice")
        pool = self.ctx.req_to_token_pool
        if pool.available_size() != pool.size or self.tree_cache.protected_size() != 0:
            raise RuntimeError("request row leak or cache tree still locked while idle")

    def get_internal_state(self) -> dict:
        pool = self.model_runner.token_to_kv_pool
        free, evictable = self.ctx.allocator.available_size(), self.tree_cache.evictable_size()
        eplb = self.model_runner.eplb
        return {
            "dp_rank": self.dp_rank,
            "num_running_reqs": len(self.running_batch.reqs),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_chunked_reqs": int(self.chunked_req is not None),
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_running_requests": self.max_running_requests,
            "num_used_tokens": self.max_total_num_tokens - free - evictable,
            "num_free_tokens": free,
            "num_evictable_tokens": evictable,
            "num_protected_tokens": self.tree_cache.protected_size(),
            "token_usage": (self.max_total_num_tokens - free) / self.max_total_num_tokens,
            "num_retracted_reqs": self.num_retracted_reqs,
            "num_prefill_burst_holds": self.burst.num_holds,
            "num_wave_prefill_batches": self.burst.num_wave_batches,
            "num_spread_prefill_batches": self.burst.num_spread_batches,
            "num_forward_steps": self.num_forward_steps,
            "num_idle_forward_steps": self.model_runner.num_idle_forward_steps,
            "num_eplb_rebalances": 0 if eplb is None else eplb.num_rebalances,
            "new_token_ratio": self.new_token_ratio.value,
            **self.token_counts.state(),
            **self._overlap_step_counts(),
            "overlap": self._overlap_info(),
            # Read by SGLang's benchmark clients.
            "dp_size": self.server_args.dp_size if self.enable_dp_attention else 1,
            "effective_max_running_requests_per_dp": self.max_running_requests,
            "last_gen_throughput": self.last_gen_throughput,
            "memory_usage": {
                "weight": round(self.model_runner.weight_bytes / 2**30, 3),
                "kvcache": round(self.max_total_num_tokens * pool.bytes_per_token() / 2**30, 3),
                "token_capacity": self.max_total_num_tokens,
            },
        }

    def _overlap_info(self) -> dict:
        """--overlap-mode, and under auto the policy's choices and cost model (the same on
        every rank) and this rank's all-to-all bytes and seconds since start-up."""
        overlap = getattr(self.model_runner, "step_overlap", None)
        if overlap is None:
            return {"overlap_mode": self.server_args.overlap_mode}
        info = overlap.info()
        if overlap.policy is not None:
            info["all_to_all_this_rank"] = dict(overlap.all_to_all)
        return info

    def _overlap_step_counts(self) -> dict:
        """Forwards run with and without two-batch overlap, and with single-batch and dual-batch
        overlap, by local forward mode (a DBO step counts as a non-TBO one too)."""
        counts = getattr(self.model_runner, "step_counts", {})
        keys = ("num_tbo_steps", "num_non_tbo_steps", "num_sbo_steps", "num_dbo_steps")
        out: dict[str, dict[str, int]] = {key: {} for key in keys}
        for (overlap, mode), n in sorted(counts.items()):
            wheres = ["num_tbo_steps" if overlap == "tbo" else "num_non_tbo_steps"]
            if overlap in ("sbo", "dbo"):
                wheres.append(f"num_{overlap}_steps")
            for where in wheres:
                out[where][mode] = out[where].get(mode, 0) + n
        return out
