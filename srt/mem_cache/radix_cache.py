"""Radix tree over token ids → KV slots (page size 1), shared across requests.

Every node holds a run of tokens (``key``) and their KV slots (``value``). A node is protected
while any request that matched through it holds a lock (``lock_ref > 0``); unlocked leaves are
evicted in LRU order and their slots go back to the allocator. The tree owns the slots it holds:
a slot is either free in the allocator, owned by the tree, or owned by exactly one running
request (the part of its sequence that is not in the tree yet).
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from srt.managers.schedule_batch import Req
    from srt.mem_cache.allocator import TokenToKVPoolAllocator
    from srt.mem_cache.memory_pool import ReqToTokenPool

_clock = itertools.count()


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time")

    def __init__(self, parent: TreeNode | None = None):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = next(_clock)

    def touch(self) -> None:
        self.last_access_time = next(_clock)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access_time < other.last_access_time


class MatchResult(NamedTuple):
    indices: torch.Tensor  # [prefix_len] int64 KV slots of the matched prefix
    last_node: TreeNode  # the deepest node of the match (lock it while the slots are used)


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class RadixCache:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        device: str | torch.device = "cpu",
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.value = torch.empty(0, dtype=torch.int64, device=self.device)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable_size = 0
        self._protected_size = 0

    # ------------------------------------------------------------------ lookup and insert
    def match_prefix(self, key: list[int]) -> MatchResult:
        """The longest cached prefix of ``key``; splits a node when the match ends inside it."""
        node, values = self.root, []
        node.touch()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.touch()
            n = _common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            node, key = child, key[n:]
        indices = torch.cat(values) if values else self.root.value
        return MatchResult(indices, node)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Insert ``key`` → ``value``; returns how many leading tokens were already present
        (their slots in ``value`` are duplicates the caller still owns and must free)."""
        node, prefix_len = self.root, 0
        node.touch()
        while key and key[0] in node.children:
            child = node.children[key[0]]
            child.touch()
            n = _common_len(child.key, key)
            if n < len(child.key):
                child = self._split(child, n)
            prefix_len += n
            node, key, value = child, key[n:], value[n:]
        if key:
            self._add_leaf(node, key, value)
        return prefix_len

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child`` after its first ``n`` tokens; returns the new upper node."""
        upper = TreeNode(child.parent)
        upper.key, upper.value = child.key[:n], child.value[:n]
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key, child.value = child.key[n:], child.value[n:]
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor) -> None:
        leaf = TreeNode(parent)
        leaf.key, leaf.value = list(key), value.clone()
        parent.children[key[0]] = leaf
        self._evictable_size += len(key)

    # ------------------------------------------------------------------ locking
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix cache: lock_ref below zero"
            node = node.parent

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    # ------------------------------------------------------------------ eviction
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, least recently used first
        (fewer when not enough are evictable). Returns the number freed."""
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def total_size(self) -> int:
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
        return total

    # ------------------------------------------------------------------ requests
    def cache_finished_req(self, req: Req) -> None:
        """Hand a finished request's KV to the tree, free its duplicates and its row."""
        row = req.req_pool_idx
        token_ids = req.all_ids()[: req.kv_len]
        kv_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
        new_prefix_len = self.insert(token_ids, kv_indices)
        self.allocator.free(kv_indices[len(req.prefix_indices) : new_prefix_len])
        self.req_to_token_pool.free(row)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.last_node, req.kv_len = None, None, 0

    def cache_unfinished_req(self, req: Req) -> None:
        """After a chunk: insert what is computed so far and point the request at the tree's
        slots, so its next chunk extends a locked prefix."""
        row = req.req_pool_idx
        token_ids = req.all_ids()[: req.kv_len]
        kv_indices = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
        old_prefix_len = len(req.prefix_indices)
        new_prefix_len = self.insert(token_ids, kv_indices)
        self.allocator.free(kv_indices[old_prefix_len:new_prefix_len])
        indices, last_node = self.match_prefix(token_ids)
        assert len(indices) == len(token_ids), "radix cache: inserted key not matched"
        self.req_to_token_pool.write(row, old_prefix_len, indices[old_prefix_len:])
        self.inc_lock_ref(last_node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node = indices, last_node
