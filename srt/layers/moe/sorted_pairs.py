"""A batch's (token, slot) pairs sorted by local expert: the one sort every expert kernel but
the C one starts from (the grouped GEMM and the loop in ``expert_compute``, the row blocks of
``fused_moe_triton``)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SortedPairs(NamedTuple):
    local: torch.Tensor  # [P] int64, each pair's local expert; E_local for none of ours
    order: torch.Tensor  # [P], the pair of each sorted row
    sorted_local: torch.Tensor  # [P], local[order], ascending


def sort_pairs(topk_ids: torch.Tensor, start: int, num_local_experts: int) -> SortedPairs:
    """The pairs ``p = token·top_k + slot`` of ``topk_ids`` [T, top_k] (global ids) in a stable
    sort by local expert ``topk_ids - start``. Every pair is kept, those of no local expert
    (other ranks' and -1) last: their count is the device's to know, and cutting them off would
    synchronise with it."""
    local = topk_ids.flatten().long() - start  # [P]
    local = local.masked_fill((local < 0) | (local >= num_local_experts), num_local_experts)
    order = torch.argsort(local, stable=True)  # [P]
    return SortedPairs(local, order, local.index_select(0, order))


def expert_ends(sorted_local: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """The end row of each local expert in ``sorted_local`` [P] (int32 [E_local]), found on
    the device: ``bincount``'s output size depends on the values, so it synchronises."""
    experts = torch.arange(1, num_local_experts + 1, device=sorted_local.device)
    return torch.searchsorted(sorted_local, experts).to(torch.int32)
