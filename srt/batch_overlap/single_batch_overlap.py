"""Single-batch overlap (SBO): hide the MoE all-to-all inside one batch.

- Combine / down-GEMM: the local experts are cut into ``num_blocks`` contiguous blocks; their
  up-projections run first, then each block's down-projection, and as soon as a block is done
  its share of the combine is launched as its own async all-to-all, while the next block
  computes. ``combine_b`` waits for all of them. Every rank launches the same number of block
  collectives (blocks are counted in local experts, the same on every rank), possibly empty.
- Shared experts: they run while the dispatch (``dispatch_shared_overlap``) or the combine
  (``combine_shared_overlap``) is in flight: the plain operations list places them between the
  ``_a`` and ``_b`` halves.

Wire of a blocked combine: one row per (token, local expert) pair, already multiplied by its
routing weight, instead of one per (token, rank); a token with two experts in different blocks
of one rank comes back in two rows. Both sides know the layout without exchanging counts: the
receiver from the ids it got (``DownGemmOverlapArgs``: its pairs by block, rows in the order it
received them, slots in top-k order), the sender from the ids it sent (``CombineOverlapArgs``:
per block, which of its tokens each returning row belongs to, and how many rows each rank
returns), because both use the same blocks.

On CUDA the same code runs with the collectives on the communication library's own stream; a
dedicated alternate stream with an SM split and the DeepEP / DeepGEMM signal path are not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SboFlags:
    """Which overlaps a step runs (SGLang's names)."""

    enabled: bool = False
    combine_down_gemm_overlap: bool = False
    combine_shared_overlap: bool = False
    dispatch_shared_overlap: bool = False

    @property
    def fuse_shared_experts_inside_sbo(self) -> bool:
        return self.combine_shared_overlap or self.dispatch_shared_overlap

    @classmethod
    def from_options(cls, enabled: bool) -> SboFlags:
        """On: blocked combine, and shared experts under the dispatch (they need only the
        router's input, and the dispatch is the shorter wait to fill in a decode step)."""
        if not enabled:
            return cls()
        return cls(True, True, False, True)


def default_num_blocks(num_local_experts: int) -> int:
    """Enough blocks for the first combines to run under the later down-projections, few
    enough that each collective carries a useful share: 4, or one per expert when fewer."""
    return max(1, min(4, num_local_experts))


def partition_blocks(num_local_experts: int, num_blocks: int) -> torch.Tensor:
    """Block index of each local expert: ``num_blocks`` contiguous, near-equal blocks (the
    first ones one expert larger); a block may be empty only when blocks outnumber experts."""
    if num_blocks < 1:
        raise ValueError(f"--sbo-num-blocks must be ≥ 1, got {num_blocks}")
    return torch.arange(num_local_experts) * num_blocks // max(1, num_local_experts)


@dataclass
class DownGemmOverlapArgs:
    """Receiver side: per block, the (row, top-k slot) pairs of its experts in row-major order
    and how many of them came from each source rank (the block's combine send splits)."""

    num_blocks: int
    pair_rows: list[torch.Tensor]
    pair_slots: list[torch.Tensor]
    send_splits: list[list[int]]


@dataclass
class CombineOverlapArgs:
    """Sender side: per block, the token each returning row adds to, and how many rows each
    rank returns (the block's combine receive splits)."""

    num_blocks: int
    token_idx: list[torch.Tensor]
    recv_splits: list[list[int]]


def compute_overlap_args(
    num_blocks: int,
    num_local_experts: int,
    ep_rank: int,
    ep_size: int,
    sent_topk_ids: torch.Tensor,
    recv_topk_ids: torch.Tensor,
    recv_splits: list[int],
) -> tuple[CombineOverlapArgs, DownGemmOverlapArgs]:
    """``sent_topk_ids`` [T, k]: this rank's tokens' global expert ids (-1: none);
    ``recv_topk_ids`` [R, k]: the received rows' ids, -1 where not this rank's; rows grouped by
    source rank, ``recv_splits`` of them from each."""
    device = sent_topk_ids.device
    block_of = partition_blocks(num_local_experts, num_blocks).to(device)
    # Receiver: pairs of each block, row-major (rows by source rank, then slot).
    local = recv_topk_ids.long() - ep_rank * num_local_experts
    valid = (recv_topk_ids >= 0) & (local >= 0) & (local < num_local_experts)
    recv_block = torch.where(valid, block_of[local.clamp(0, num_local_experts - 1)], -1)
    source = torch.repeat_interleave(
        torch.arange(ep_size, device=device), torch.tensor(recv_splits, device=device)
    )  # [R] source rank of each row
    rows, slots, sends = [], [], []
    for b in range(num_blocks):
        r, k = (recv_block == b).nonzero(as_tuple=True)
        rows.append(r)
        slots.append(k)
        sends.append(torch.bincount(source[r], minlength=ep_size).tolist())
    # Sender: the same pairs as seen from the tokens, by destination rank, then token, slot.
    ids = sent_topk_ids.long()
    dest = torch.div(ids, num_local_experts, rounding_mode="floor")
    sent_block = torch.where(ids >= 0, block_of[(ids % num_local_experts).clamp(min=0)], -1)
    token_idx, recvs = [], []
    num_tokens, top_k = ids.shape
    flat = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)
    for b in range(num_blocks):
        mask = sent_block == b
        key = dest[mask] * (num_tokens * top_k) + flat[mask]
        order = torch.argsort(key)
        token_idx.append(torch.div(flat[mask][order], top_k, rounding_mode="floor"))
        recvs.append(torch.bincount(dest[mask], minlength=ep_size).tolist())
    return (
        CombineOverlapArgs(num_blocks, token_idx, recvs),
        DownGemmOverlapArgs(num_blocks, rows, slots, sends),
    )
