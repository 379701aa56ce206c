"""The cache used with ``--disable-radix-cache``: the radix cache's interface without sharing.

A request's slots belong to it alone and are freed when it finishes. Between chunks of a chunked
prefill, the computed part becomes the request's prefix (its own slots).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from srt.mem_cache.radix_cache import MatchResult

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool


class ChunkCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        device: str | torch.device = "cpu",
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.device = device
        self._empty = torch.empty(0, dtype=torch.int64, device=device)

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int]) -> MatchResult:
        return MatchResult(self._empty, None)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        return 0

    def inc_lock_ref(self, node: object) -> None:
        pass

    def dec_lock_ref(self, node: object) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cache_finished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        self.allocator.free(self.req_to_token_pool.req_to_token[row, : req.kv_len].clone())
        self.req_to_token_pool.free(row)
        req.req_pool_idx, req.last_node, req.kv_len = None, None, 0

    def cache_unfinished_req(self, req: Req) -> None:
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : req.kv_len].clone()
