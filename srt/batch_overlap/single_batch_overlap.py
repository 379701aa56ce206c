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
    device, nb, ep = sent_topk_ids.device, num_blocks, ep_size
    block_of = partition_blocks(num_local_experts, num_blocks).to(device)
    # Receiver: every (row, slot) pair of a local expert, row-major, then grouped by block
    # (a stable sort keeps the row-major order inside a block).
    local = recv_topk_ids.long() - ep_rank * num_local_experts
    valid = (recv_topk_ids >= 0) & (local >= 0) & (local < num_local_experts)
    rows, slots = valid.nonzero(as_tuple=True)
    blocks = block_of[local[rows, slots]]
    order = torch.argsort(blocks, stable=True)
    rows, slots, blocks = rows[order], slots[order], blocks[order]
    source = torch.repeat_interleave(
        torch.arange(ep, device=device), torch.tensor(recv_splits, device=device)
    )  # [R] source rank of each row
    sends = torch.bincount(blocks * ep + source[rows], minlength=nb * ep).view(nb, ep)
    sizes = sends.sum(dim=1).tolist()
    # Sender: the same pairs as seen from its tokens: by block, destination, token, slot.
    ids = sent_topk_ids.long()
    num_tokens, top_k = ids.shape
    chosen = ids >= 0
    flat = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)[chosen]
    ids = ids[chosen]
    dest = torch.div(ids, num_local_experts, rounding_mode="floor")
    sent_block = block_of[ids % num_local_experts]
    key = (sent_block * ep + dest) * (num_tokens * top_k) + flat
    token_idx = torch.div(flat[torch.argsort(key)], top_k, rounding_mode="floor")
    recvs = torch.bincount(sent_block * ep + dest, minlength=nb * ep).view(nb, ep)
    return (
        CombineOverlapArgs(nb, list(token_idx.split(recvs.sum(dim=1).tolist())), recvs.tolist()),
        DownGemmOverlapArgs(nb, list(rows.split(sizes)), list(slots.split(sizes)), sends.tolist()),
    )
