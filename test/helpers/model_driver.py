"""Drives a ModelRunner directly (no scheduler): prefill a set of prompts, then decode steps.

Used by model tests as the thinnest path from token ids to logits.
"""

from __future__ import annotations

import torch

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


class ModelDriver:
    def __init__(self, model_path: str, **server_args):
        kwargs = {"dtype": "float32", "max_total_tokens": 4096, "max_running_requests": 32}
        kwargs.update(server_args)
        self.runner = ModelRunner(ServerArgs(model_path=model_path, **kwargs))
        self.rows: list[int] = []
        self.lens: list[int] = []

    def _batch(self, mode, input_ids, positions, out_loc, **extend) -> ForwardBatch:
        r = self.runner

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=r.device)

        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(self.rows),
            input_ids=ids(input_ids),
            positions=ids(positions),
            req_pool_indices=ids(self.rows),
            seq_lens=ids(self.lens),
            seq_lens_cpu=list(self.lens),
            out_cache_loc=out_loc,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
            **extend,
        )

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Fresh sequences; returns the last-token logits [B, V]."""
        r = self.runner
        self.rows = r.req_to_token_pool.alloc(len(prompts))
        self.lens = [len(p) for p in prompts]
        loc = r.token_to_kv_pool_allocator.alloc(sum(self.lens))
        start = 0
        for row, n in zip(self.rows, self.lens):
            r.req_to_token_pool.write(row, 0, loc[start : start + n])
            start += n
        batch = self._batch(
            ForwardMode.EXTEND,
            [t for p in prompts for t in p],
            [i for n in self.lens for i in range(n)],
            loc,
            extend_prefix_lens_cpu=[0] * len(prompts),
            extend_seq_lens_cpu=list(self.lens),
        )
        return r.forward_step(batch).next_token_logits

    def decode(self, tokens: list[int]) -> torch.Tensor:
        r = self.runner
        loc = r.token_to_kv_pool_allocator.alloc(len(tokens))
        positions = list(self.lens)
        for i, row in enumerate(self.rows):
            r.req_to_token_pool.write(row, self.lens[i], loc[i : i + 1])
        self.lens = [n + 1 for n in self.lens]
        batch = self._batch(ForwardMode.DECODE, tokens, positions, loc)
        return r.forward_step(batch).next_token_logits
