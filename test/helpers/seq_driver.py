"""SeqDriver: a set of sequences on one ModelRunner, and the ForwardBatches a scheduler would
build for them (extend new prompts, decode every sequence), without a scheduler.

Steps are plain data so that a multi-rank test and its single-rank reference replay the same
script: ``("extend", prompts, logprob_start)`` adds sequences (``logprob_start``: None, or the
first position whose input logprob is wanted), ``("decode",)`` decodes every sequence with
fixed tokens, ``None`` is no batch (idle). Extends on top of cached tokens:
``("continue", chunks)`` extends the first ``len(chunks)`` sequences by those tokens (the next
chunk of a chunked prefill); ``("shared", [(source, prefix_len, tokens), ...])`` adds sequences
whose first ``prefix_len`` KV slots are those of sequence ``source`` (a radix-cache hit).
"""

from __future__ import annotations

import torch

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner


def decode_tokens(step: int, num_seqs: int, salt: int) -> list[int]:
    return [(13 * step + 7 * i + 3 * salt) % 500 + 1 for i in range(num_seqs)]


class SeqDriver:
    def __init__(self, runner: ModelRunner, salt: int = 0):
        self.runner, self.salt = runner, salt
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.step = 0

    def batch(self, action: tuple) -> ForwardBatch:
        self.step += 1
        if action[0] == "extend":
            return self._extend(action[1], action[2])
        if action[0] == "continue":
            return self._continue(action[1])
        if action[0] == "shared":
            return self._shared(action[1])
        return self._decode(decode_tokens(self.step, len(self.rows), self.salt))

    def _make(self, mode, rows, lens, input_ids, positions, loc, **extra) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(lens, dtype=torch.int64),
            seq_lens_cpu=list(lens),
            out_cache_loc=loc,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            **extra,
        )

    def _extend(self, prompts: list[list[int]], logprob_start: int | None) -> ForwardBatch:
        r = self.runner
        rows = r.req_to_token_pool.alloc(len(prompts))
        lens = [len(p) for p in prompts]
        loc = r.token_to_kv_pool_allocator.alloc(sum(lens))
        start = 0
        for row, n in zip(rows, lens):
            r.req_to_token_pool.write(row, 0, loc[start : start + n])
            start += n
        self.rows, self.lens = self.rows + rows, self.lens + lens
        extra = {}
        if logprob_start is not None:
            starts = [min(logprob_start, n) for n in lens]
            extra = {"return_logprob": True, "extend_logprob_start_lens_cpu": starts}
        return self._make(
            ForwardMode.EXTEND,
            rows,
            lens,
            [t for p in prompts for t in p],
            [i for n in lens for i in range(n)],
            loc,
            extend_prefix_lens_cpu=[0] * len(prompts),
            extend_seq_lens_cpu=list(lens),
            **extra,
        )

    def _extend_on_prefix(
        self, rows: list[int], prefixes: list[int], chunks: list[list[int]]
    ) -> ForwardBatch:
        r = self.runner
        new = [len(c) for c in chunks]
        loc = r.token_to_kv_pool_allocator.alloc(sum(new))
        start = 0
        for row, prefix, n in zip(rows, prefixes, new):
            r.req_to_token_pool.write(row, prefix, loc[start : start + n])
            start += n
        lens = [p + n for p, n in zip(prefixes, new)]
        return self._make(
            ForwardMode.EXTEND,
            rows,
            lens,
            [t for c in chunks for t in c],
            [p + i for p, n in zip(prefixes, new) for i in range(n)],
            loc,
            extend_prefix_lens_cpu=list(prefixes),
            extend_seq_lens_cpu=new,
        )

    def _continue(self, chunks: list[list[int]]) -> ForwardBatch:
        k = len(chunks)
        batch = self._extend_on_prefix(self.rows[:k], self.lens[:k], chunks)
        self.lens[:k] = [n + len(c) for n, c in zip(self.lens[:k], chunks)]
        return batch

    def _shared(self, items: list[tuple[int, int, list[int]]]) -> ForwardBatch:
        r = self.runner
        rows = r.req_to_token_pool.alloc(len(items))
        for row, (source, prefix, _) in zip(rows, items):
            slots = r.req_to_token_pool.req_to_token[self.rows[source], :prefix]
            r.req_to_token_pool.write(row, 0, slots.clone())
        batch = self._extend_on_prefix(rows, [p for _, p, _ in items], [c for _, _, c in items])
        self.rows += rows
        self.lens += [p + len(c) for _, p, c in items]
        return batch

    def _decode(self, tokens: list[int]) -> ForwardBatch:
        r = self.runner
        loc = r.token_to_kv_pool_allocator.alloc(len(tokens))
        positions = list(self.lens)
        for i, row in enumerate(self.rows):
            r.req_to_token_pool.write(row, self.lens[i], loc[i : i + 1])
        self.lens = [n + 1 for n in self.lens]
        return self._make(ForwardMode.DECODE, self.rows, self.lens, tokens, positions, loc)
