"""Memory pools: request → token-slot table, and the paged KV caches (page size 1).

Slot 0 of every KV buffer is a dummy that padded tokens write to; real slots are 1..size.
Buffers are allocated uninitialised (so an unused pool costs no resident memory) except slot 0,
which readers use for padding and must hold finite values.
"""

from __future__ import annotations

import abc

import torch


class ReqToTokenPool:
    """Maps (request row, position) → KV slot index."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device):
        self.size = size
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select

    def free(self, index: int | list[int]) -> None:
        if isinstance(index, int):
            self.free_slots.append(index)
        else:
            self.free_slots.extend(index)

    def write(self, row: int, start: int, locs: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(locs)] = locs

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    buf[0].zero_()
    return buf


class KVCache(abc.ABC):
    """Per-layer KV storage indexed by slot."""

    size: int
    dtype: torch.dtype
    layer_num: int
    # Whether a layer's value buffer is the first columns of its key buffer (MLA's latent).
    values_in_keys: bool = False

    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None: ...

    @abc.abstractmethod
    def bytes_per_token(self) -> int: ...


class MHATokenToKVPool(KVCache):
    """Separate K and V buffers per layer: [size + 1, num_kv_heads, head_dim]."""

    def __init__(self, size, dtype, head_num, head_dim, layer_num, device, v_head_dim=None):
        self.size, self.dtype, self.layer_num = size, dtype, layer_num
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.k_buffer = [
            _buffer((size + 1, head_num, head_dim), dtype, device) for _ in range(layer_num)
        ]
        self.v_buffer = [
            _buffer((size + 1, head_num, self.v_head_dim), dtype, device) for _ in range(layer_num)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id, loc, cache_k, cache_v) -> None:
        self.k_buffer[layer_id][loc] = cache_k.to(self.dtype)
        self.v_buffer[layer_id][loc] = cache_v.to(self.dtype)

    def bytes_per_token(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return self.layer_num * self.head_num * (self.head_dim + self.v_head_dim) * elem


class MLATokenToKVPool(KVCache):
    """One latent buffer per layer: [size + 1, 1, kv_lora_rank + qk_rope_head_dim].

    The key is the whole row (compressed kv, then the rotated k_pe); the value is a view of the
    first ``kv_lora_rank`` columns, so MLA attention with absorbed weights reads one buffer.
    """

    values_in_keys = True

    def __init__(self, size, dtype, kv_lora_rank, qk_rope_head_dim, layer_num, device):
        self.size, self.dtype, self.layer_num = size, dtype, layer_num
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_buffer = [
            _buffer((size + 1, 1, kv_lora_rank + qk_rope_head_dim), dtype, device)
            for _ in range(layer_num)
        ]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer_id, loc, cache_k, cache_v) -> None:
        # cache_k holds the full latent row; cache_v is a view of it and needs no write.
        self.kv_buffer[layer_id][loc] = cache_k.to(self.dtype)

    def bytes_per_token(self) -> int:
        elem = torch.finfo(self.dtype).bits // 8
        return self.layer_num * (self.kv_lora_rank + self.qk_rope_head_dim) * elem
