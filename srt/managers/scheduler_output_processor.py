"""After a forward: append sampled tokens, collect logprobs, finish requests, build outputs."""

from __future__ import annotations

from typing import Any

import torch

from srt.layers.logits_processor import LogitsProcessorOutput
from srt.layers.sampler import get_token_logprobs, get_top_logprobs
from srt.managers.io_struct import BatchTokenIDOutput
from srt.managers.schedule_batch import (
    Req,
    ScheduleBatch,
    finish_abort,
    finish_length,
    finish_stop,
)


class SchedulerOutputProcessor:
    """``stream_interval``: the server's (--stream-interval), for requests that set none."""

    def __init__(self, tree_cache: Any, tokenizer: Any, stream_interval: int = 1):
        self.tree_cache, self.tokenizer = tree_cache, tokenizer
        self.stream_interval = stream_interval

    # ------------------------------------------------------------------ per step
    def process_extend(
        self,
        batch: ScheduleBatch,
        logits_output: LogitsProcessorOutput,
        next_token_ids: torch.Tensor,
        chunked_req: Req | None,
    ) -> None:
        """A prefill step: prompt logprobs for every request; the sampled token only for the
        requests whose last chunk this was (the chunked one is cached and waits)."""
        if batch.return_logprob:
            self._add_input_logprobs(batch, logits_output.input_token_logits)
        done = [r is not chunked_req for r in batch.reqs]
        self._add_output_tokens(batch, logits_output, next_token_ids, done)
        for req in batch.reqs:
            if req is chunked_req:
                self.tree_cache.cache_unfinished_req(req)
            elif req.finished():
                self.tree_cache.cache_finished_req(req)

    def process_decode(
        self, batch: ScheduleBatch, logits_output: LogitsProcessorOutput, next_ids: torch.Tensor
    ) -> None:
        self._add_output_tokens(batch, logits_output, next_ids, [True] * len(batch.reqs))
        for req in batch.reqs:
            if req.finished():
                self.tree_cache.cache_finished_req(req)

    def _add_output_tokens(
        self,
        batch: ScheduleBatch,
        logits_output: LogitsProcessorOutput,
        next_token_ids: torch.Tensor,
        mask: list[bool],
    ) -> None:
        ids = next_token_ids.tolist()
        logits = logits_output.next_token_logits
        token_lps = tops = None
        if batch.return_logprob:
            token_lps = get_token_logprobs(logits, next_token_ids).tolist()
            tops = get_top_logprobs(logits, [r.top_logprobs_num for r in batch.reqs])
        for i, req in enumerate(batch.reqs):
            if not mask[i]:
                continue
            req.input_logprobs_done = True
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = finish_length(0)
                continue
            req.output_ids.append(ids[i])
            if req.return_logprob:
                req.output_token_logprobs.append((token_lps[i], ids[i]))
                if req.top_logprobs_num > 0:
                    req.output_top_logprobs.append(list(zip(*tops[i])))
            if req.grammar is not None:
                self._advance_grammar(req, ids[i])
            req.check_finished(self.tokenizer)

    @staticmethod
    def _advance_grammar(req: Req, token_id: int) -> None:
        """The sampled token moves the request's grammar on; a complete grammar (the token is
        a stop token it allowed) finishes the request, whatever ignore_eos says."""
        if not req.grammar.accept_token(token_id):
            req.finished_reason = finish_abort(f"token {token_id} does not follow the grammar")
        elif req.grammar.is_terminated():
            req.finished_reason = finish_stop(token_id)

    def _add_input_logprobs(self, batch: ScheduleBatch, input_logits: torch.Tensor | None) -> None:
        offset = 0
        for i, req in enumerate(batch.reqs):
            start = batch.extend_logprob_start_lens[i]
            num_rows = batch.extend_lens[i] - start
            rows = None if input_logits is None else input_logits[offset : offset + num_rows]
            offset += num_rows
            if not req.input_logprobs_done:
                self._req_input_logprobs(req, rows, batch.prefix_lens[i] + start)

    def _req_input_logprobs(self, req: Req, rows: torch.Tensor | None, first_pos: int) -> None:
        """Row j holds the logits at position first_pos + j, predicting token first_pos + j + 1.
        Keep the predictions of prompt tokens at or after logprob_start_len."""
        prompt = req.origin_input_ids
        if req.logprob_start_len == 0 and not req.input_token_logprobs:
            req.input_token_logprobs.append((None, prompt[0]))
            if req.top_logprobs_num > 0:
                req.input_top_logprobs.append(None)
        if rows is None or rows.shape[0] == 0:
            return
        targets = list(range(first_pos + 1, first_pos + 1 + rows.shape[0]))
        keep = [j for j, t in enumerate(targets) if req.logprob_start_len <= t < len(prompt)]
        if not keep:
            return
        rows = rows[keep]
        token_ids = [prompt[targets[j]] for j in keep]
        index = torch.tensor(token_ids, dtype=torch.int64, device=rows.device)
        values = get_token_logprobs(rows, index).tolist()
        req.input_token_logprobs.extend(zip(values, token_ids))
        if req.top_logprobs_num > 0:
            tops = get_top_logprobs(rows, [req.top_logprobs_num] * len(keep))
            req.input_top_logprobs.extend(list(zip(*t)) for t in tops)

    # ------------------------------------------------------------------ messages
    def build_output(self, reqs: list[Req]) -> BatchTokenIDOutput | None:
        """The news for requests that stream or have finished; advances their send offsets."""
        reqs = [r for r in reqs if r.finished() or (r.stream and self._has_news(r))]
        if not reqs:
            return None
        out = BatchTokenIDOutput(
            rids=[r.rid for r in reqs],
            finished_reasons=[r.finished_reason for r in reqs],
            output_ids=[r.output_ids[r.sent_output_len :] for r in reqs],
            skip_special_tokens=[r.sampling_params.skip_special_tokens for r in reqs],
            spaces_between_special_tokens=[
                r.sampling_params.spaces_between_special_tokens for r in reqs
            ],
            no_stop_trim=[r.sampling_params.no_stop_trim for r in reqs],
            prompt_tokens=[len(r.origin_input_ids) for r in reqs],
            completion_tokens=[len(r.output_ids) for r in reqs],
            cached_tokens=[r.cached_tokens for r in reqs],
        )
        for r in reqs:
            self._add_logprob_deltas(out, r)
            r.sent_output_len = len(r.output_ids)
        return out

    def _has_news(self, req: Req) -> bool:
        """A streamed request is sent its first token at once, then every ``stream_interval``
        tokens (its own, else the server's; every step by default)."""
        unsent = len(req.output_ids) - req.sent_output_len
        interval = req.sampling_params.stream_interval or self.stream_interval
        return unsent >= interval or (unsent > 0 and req.sent_output_len == 0)

    @staticmethod
    def _add_logprob_deltas(out: BatchTokenIDOutput, req: Req) -> None:
        a, b = req.sent_input_lp_len, req.sent_output_lp_len
        out.input_token_logprobs.append(req.input_token_logprobs[a:])
        out.input_top_logprobs.append(req.input_top_logprobs[a:])
        out.output_token_logprobs.append(req.output_token_logprobs[b:])
        out.output_top_logprobs.append(req.output_top_logprobs[b:])
        req.sent_input_lp_len = len(req.input_token_logprobs)
        req.sent_output_lp_len = len(req.output_token_logprobs)
