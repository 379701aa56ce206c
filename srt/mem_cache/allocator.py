"""Token-slot allocator over a KV pool (page size 1)."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size (slot 0 is the padding dummy)."""

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > self.free_slots.numel():
            return None
        select = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return select

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.free_slots = torch.cat((self.free_slots, free_index.to(self.free_slots.device)))
