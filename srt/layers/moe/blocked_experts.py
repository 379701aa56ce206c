"""Single-batch overlap's routed experts in two halves (``FusedMoE.up_project_blocks`` /
``down_project_block``): the experts' computation (``expert_compute``) with the gated
up-projection of every (row, slot) pair run at once, then each block's down-projection on the
pairs of its experts only (blocks are contiguous ranges of local experts,
``single_batch_overlap.block_ranges``), giving either each row's weighted sum over the block
(the row wire, low_latency) or each of the block's pairs' weighted output (the pair wire,
normal).
"""

from __future__ import annotations

import torch

from srt.layers.moe.expert_compute import ExpertCompute
from srt.layers.overlap.single_batch_overlap import (
    DownGemmOverlapArgs,
    RowSumOverlapArgs,
    block_ranges,
)


class BlockedProjection:
    """One dispatch's up-projected pairs, awaiting their down-projection block by block."""

    def __init__(
        self,
        compute: ExpertCompute,
        args: DownGemmOverlapArgs | RowSumOverlapArgs,
        num_experts: int,
    ):
        self.compute, self.args = compute, args
        self.ranges = block_ranges(num_experts, args.num_blocks)

    def down(self, index: int) -> torch.Tensor:
        """Block ``index``'s down-projection: ``[R, H]`` row sums (row wire) or ``[P_b, H]``
        pair outputs in the order of ``args`` (pair wire)."""
        experts, args = self.ranges[index], self.args
        if isinstance(args, RowSumOverlapArgs):
            return self.compute.row_sums(experts)
        return self.compute.pair_outputs(experts, args.pair_rows[index], args.pair_slots[index])
