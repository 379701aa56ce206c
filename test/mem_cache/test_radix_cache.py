"""RadixCache and ChunkCache on their own: match/insert/split/evict/lock, slot conservation."""

from __future__ import annotations

import torch

from srt.managers.schedule_batch import Req
from srt.mem_cache.allocator import TokenToKVPoolAllocator
from srt.mem_cache.chunk_cache import ChunkCache
from srt.mem_cache.memory_pool import ReqToTokenPool
from srt.mem_cache.radix_cache import RadixCache
from srt.sampling.sampling_params import SamplingParams

POOL = 64


def make_cache() -> tuple[RadixCache, TokenToKVPoolAllocator, ReqToTokenPool]:
    allocator = TokenToKVPoolAllocator(POOL)
    req_pool = ReqToTokenPool(4, 32, "cpu")
    return RadixCache(req_pool, allocator), allocator, req_pool


def insert_new(cache: RadixCache, allocator: TokenToKVPoolAllocator, key: list[int]) -> int:
    """Insert key with fresh slots, freeing the duplicates like a finished request does."""
    value = allocator.alloc(len(key))
    present = cache.insert(key, value)
    allocator.free(value[:present])
    return present


def conserved(cache: RadixCache, allocator: TokenToKVPoolAllocator) -> bool:
    free = allocator.free_slots
    no_dup = free.unique().numel() == free.numel()
    total = allocator.available_size() + cache.evictable_size() + cache.protected_size()
    return no_dup and total == POOL


def test_match_insert_and_split():
    cache, allocator, _ = make_cache()
    assert insert_new(cache, allocator, [1, 2, 3, 4, 5]) == 0
    indices, node = cache.match_prefix([1, 2, 3, 9])
    assert len(indices) == 3 and node.key == [1, 2, 3]  # the node was split at 3
    assert [c.key for c in node.children.values()] == [[4, 5]]
    assert insert_new(cache, allocator, [1, 2, 3, 7]) == 3
    assert insert_new(cache, allocator, [1, 2, 3, 4, 5]) == 5
    full, _ = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert full[:3].tolist() == indices.tolist() and len(full) == 5
    assert len(cache.match_prefix([2, 3])[0]) == 0
    assert cache.evictable_size() == 6 and cache.total_size() == 6
    assert conserved(cache, allocator)


def test_lock_protects_from_eviction():
    cache, allocator, _ = make_cache()
    insert_new(cache, allocator, [1, 2, 3, 4])
    insert_new(cache, allocator, [1, 2, 8, 9])
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # only the unlocked [8, 9] leaf goes
    assert len(cache.match_prefix([1, 2, 8, 9])[0]) == 2
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 4
    assert cache.evict(100) == 4 and allocator.available_size() == POOL
    assert conserved(cache, allocator)


def test_lru_eviction_order():
    cache, allocator, _ = make_cache()
    insert_new(cache, allocator, [1, 1])
    insert_new(cache, allocator, [2, 2])
    insert_new(cache, allocator, [3, 3])
    cache.match_prefix([1, 1])  # touch: [2, 2] is now the least recently used
    cache.evict(1)
    assert len(cache.match_prefix([2, 2])[0]) == 0
    assert len(cache.match_prefix([1, 1])[0]) == 2 and len(cache.match_prefix([3, 3])[0]) == 2
    assert conserved(cache, allocator)


def test_evict_cascades_to_parent_and_reset():
    cache, allocator, _ = make_cache()
    insert_new(cache, allocator, [5, 6, 7])
    insert_new(cache, allocator, [5, 6, 8])  # splits into [5, 6] -> {[7], [8]}
    assert cache.evict(4) == 4  # both leaves, then the parent that became a leaf
    assert cache.total_size() == 0 and allocator.available_size() == POOL
    insert_new(cache, allocator, [1, 2])
    cache.reset()
    assert cache.evictable_size() == 0 and len(cache.match_prefix([1, 2])[0]) == 0


def _req_with_slots(req_pool, allocator, cache, ids: list[int]) -> Req:
    """A request that matched its prefix and computed the rest into fresh slots."""
    req = Req("r", ids, SamplingParams(max_new_tokens=4))
    req.init_next_round_input(cache)
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = req_pool.alloc(1)[0]
    prefix = len(req.prefix_indices)
    req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
    req_pool.write(req.req_pool_idx, prefix, allocator.alloc(len(ids) - prefix))
    req.kv_len = len(ids)
    return req


def test_cache_finished_req_frees_duplicates_once():
    cache, allocator, req_pool = make_cache()
    a = _req_with_slots(req_pool, allocator, cache, [1, 2, 3, 4, 5])
    # b computed [1, 2, 3] itself although a inserts them first: duplicates.
    b = Req("b", [1, 2, 3, 9], SamplingParams())
    b.req_pool_idx = req_pool.alloc(1)[0]
    req_pool.write(b.req_pool_idx, 0, allocator.alloc(4))
    b.kv_len = 4
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    assert cache.total_size() == 6 and cache.protected_size() == 0
    assert req_pool.available_size() == 4 and conserved(cache, allocator)


def test_cache_unfinished_req_repoints_to_tree():
    cache, allocator, req_pool = make_cache()
    insert_new(cache, allocator, [1, 2, 3, 4])
    req = Req("c", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    req.return_logprob, req.logprob_start_len, req.input_logprobs_done = True, 0, False
    req.init_next_round_input(cache)  # logprobs from 0: no prefix reuse
    assert len(req.prefix_indices) == 0
    cache.inc_lock_ref(req.last_node)
    req.req_pool_idx = req_pool.alloc(1)[0]
    req_pool.write(req.req_pool_idx, 0, allocator.alloc(5))  # first chunk: 5 tokens
    req.kv_len = 5
    cache.cache_unfinished_req(req)
    tree_slots, _ = cache.match_prefix([1, 2, 3, 4, 5])
    assert req.prefix_indices.tolist() == tree_slots.tolist()
    assert req_pool.req_to_token[req.req_pool_idx, :5].tolist() == tree_slots.tolist()
    assert cache.protected_size() == 5 and conserved(cache, allocator)
    cache.cache_finished_req(req)
    assert cache.protected_size() == 0 and conserved(cache, allocator)


def test_chunk_cache_frees_everything():
    allocator, req_pool = TokenToKVPoolAllocator(POOL), ReqToTokenPool(2, 16, "cpu")
    cache = ChunkCache(req_pool, allocator)
    req = Req("d", [1, 2, 3], SamplingParams())
    req.init_next_round_input(cache)
    assert len(req.prefix_indices) == 0
    req.req_pool_idx = req_pool.alloc(1)[0]
    req_pool.write(req.req_pool_idx, 0, allocator.alloc(3))
    req.kv_len = 3
    cache.cache_unfinished_req(req)
    assert len(req.prefix_indices) == 3
    cache.cache_finished_req(req)
    assert allocator.available_size() == POOL and req_pool.available_size() == 2
    assert torch.equal(allocator.free_slots.sort().values, torch.arange(1, POOL + 1))
