"""The scheduler's batch log, in SGLang's format: a line for every prefill batch and a line every
``--decode-log-interval`` decoding steps, at INFO, written by the first rank of each attention-TP
group (the rank that talks to the tokenizer: one writer per DP group under DP attention)::

    Prefill batch, #new-seq: 2, #new-token: 61, #cached-token: 0, token usage: 0.00,
        #running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False,
        input throughput (token/s): 1024.50
    Decode batch, #running-req: 2, #token: 71, token usage: 0.02, cpu graph: True,
        gen throughput (token/s): 37.29, #queue-req: 0

(each one line). ``#token`` and ``token usage`` count the KV slots that hold requests' tokens:
neither free nor evictable from the prefix cache. A prefill line counts the batch's prompt
tokens (``#new-token``), the prefix-cache hits of its requests (``#cached-token``), the requests
already running and those left waiting, the prompt tokens not yet computed (``#pending-token``:
the waiting requests' and a chunked prompt's rest) and its tokens over the time since the last
prefill line. A decode line counts the requests of the step that ends an interval and the
tokens decoded in the interval over its wall time. A step counts when it decodes: a decode
batch, or a prefill that carried the running requests' decode (a mixed batch). The graph field
says whether the step replayed a CUDA graph (``cuda graph`` on CUDA, ``cpu graph`` on CPU, as
SGLang names it; srt captures graphs for decode steps only)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class SchedulerBatchLog:
    """Mixin of ``Scheduler``: the batch log and ``last_gen_throughput``."""

    def _init_batch_log(self) -> None:
        runner = self.model_runner
        self.writes_batch_log = runner.parallel.attn_tp_rank == 0
        self.graph_label = "cuda graph" if runner.device.type == "cuda" else "cpu graph"
        now = time.perf_counter()
        self.last_prefill_log_time = now
        # Decode tokens per second over the last --decode-log-interval decoding steps.
        self.last_gen_throughput = 0.0
        self.gen_window: tuple[float, int, int] = (now, 0, 0)  # start, steps, tokens

    def _kv_tokens_in_use(self) -> tuple[int, float]:
        free, evictable = self.ctx.allocator.available_size(), self.tree_cache.evictable_size()
        used = self.max_total_num_tokens - free - evictable
        return used, used / self.max_total_num_tokens

    def log_prefill_batch(self, num_reqs: int) -> None:
        """After admission (the waiting queue and the chunked request updated, the batch's
        tokens counted by ``token_counts.on_prefill``), before the batch's KV is allocated."""
        now = time.perf_counter()
        counts = self.token_counts
        new_tokens, cached = counts.last_prefill_compute, counts.last_prefill_cache
        throughput = new_tokens / max(now - self.last_prefill_log_time, 1e-9)
        self.last_prefill_log_time = now
        if not self.writes_batch_log or not logger.isEnabledFor(logging.INFO):
            return
        pending = sum(len(r.origin_input_ids) + len(r.output_ids) for r in self.waiting_queue)
        chunked = self.chunked_req
        if chunked is not None:
            computed = len(chunked.prefix_indices) + chunked.extend_input_len
            pending += len(chunked.origin_input_ids) + len(chunked.output_ids) - computed
        _, usage = self._kv_tokens_in_use()
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, #pending-token: %d, %s: False, "
            "input throughput (token/s): %.2f",
            num_reqs,
            new_tokens,
            cached,
            usage,
            len(self.running_batch.reqs),
            len(self.waiting_queue),
            pending,
            self.graph_label,
            throughput,
        )

    def count_decode_step(self, num_reqs: int) -> None:
        """A step that decoded ``num_reqs`` requests (one token each) has been processed; every
        --decode-log-interval such steps, the throughput of the interval and its log line."""
        self.token_counts.decode += num_reqs  # /metrics
        start, steps, tokens = self.gen_window
        steps, tokens = steps + 1, tokens + num_reqs
        if steps < self.server_args.decode_log_interval:
            self.gen_window = (start, steps, tokens)
            return
        now = time.perf_counter()
        self.last_gen_throughput = tokens / max(now - start, 1e-9)
        self.gen_window = (now, 0, 0)
        if not self.writes_batch_log:
            return
        used, usage = self._kv_tokens_in_use()
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %s: %s, "
            "gen throughput (token/s): %.2f, #queue-req: %d",
            num_reqs,
            used,
            usage,
            self.graph_label,
            self.model_runner.last_step_replayed_graph,
            self.last_gen_throughput,
            len(self.waiting_queue),
        )
