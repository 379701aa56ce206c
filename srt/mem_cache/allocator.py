"""Token-slot allocator over a KV pool (page size 1)."""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size (slot 0 is the padding dummy).

    Freed slots are parked in a list and joined to the free tensor only when an allocation
    needs them, so freeing costs O(freed) rather than O(pool size).
    """

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []
        self._num_released = 0

    @property
    def free_slots(self) -> torch.Tensor:
        self._merge()
        return self._free

    def available_size(self) -> int:
        return int(self._free.numel()) + self._num_released

    def _merge(self) -> None:
        if self._released:
            self._free = torch.cat((self._free, *self._released))
            self._released, self._num_released = [], 0

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > self._free.numel():
            if need_size > self.available_size():
                return None
            self._merge()
        select = self._free[:need_size]
        self._free = self._free[need_size:]
        return select

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self._released.append(free_index.to(self._free.device))
        self._num_released += int(free_index.numel())
