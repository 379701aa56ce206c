"""``--enable-eplb``: the expert placement rebalanced while serving.

Every ``--eplb-rebalance-num-iterations`` forward steps, between two steps, every rank:
1. sums the load its MoE blocks counted since the last rebalance over the world (each rank
   counted the rows it routed), so that all hold the same load;
2. computes the same placement from it (``balanced_physical``: deterministic), its ranks' sets
   of experts arranged to move as few as possible (``keep_in_place``);
3. moves the expert weights: each slot whose expert changes takes it from a slot of its own
   rank that held it, or else receives it from the first slot that held it, one point-to-point
   message per (slot, tensor) in one batch over the EP group, in the same order on every rank;
4. writes the new weights into the same tensors (a captured CUDA graph keeps its pointers) and
   the new map into each block's ``ExpertDispatchMap`` (in place too).
Requests in flight go on: every copy of an expert holds the same weights, so what a token
computes does not depend on where its expert went.

The ranks agree on when by counting the forward steps, which they run in lock-step (under DP
attention, idle groups run idle forwards; without it, a group's ranks run the same batches).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from torch import nn

from srt.distributed.parallel_state import ParallelState
from srt.eplb.expert_distribution import ExpertDistributionRecorder
from srt.eplb.expert_location import ExpertLocation, balanced_physical, keep_in_place
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.moe_block import SparseMoeBlock

logger = logging.getLogger(__name__)


class EplbManager:
    def __init__(
        self,
        model: nn.Module,
        location: ExpertLocation,
        recorder: ExpertDistributionRecorder,
        parallel: ParallelState,
        interval: int,
        num_groups: int,
        num_nodes: int,
    ):
        self.blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        self.location, self.recorder, self.parallel = location, recorder, parallel
        self.interval, self.num_groups, self.num_nodes = interval, num_groups, num_nodes
        self.num_steps = 0
        self.num_rebalances = 0
        recorder.keep_window()

    def after_step(self) -> None:
        """Called after every forward step that ran (the same steps on every rank)."""
        self.num_steps += 1
        if self.num_steps % self.interval == 0:
            self.rebalance()

    def rebalance(self, load: torch.Tensor | None = None) -> bool:
        """Balance the placement for ``load`` [layers, experts] (default: the world's counts
        since the last rebalance) and move the experts; whether anything moved."""
        start = time.perf_counter()
        if load is None:
            load = self.recorder.take_window()
            if self.parallel.tp_size > 1:
                dist.all_reduce(load, group=self.parallel.world.cpu_group)
        if not load.any():
            return False
        slots, ep_size = self.location.num_physical, self.parallel.moe_ep_size
        old = self.location
        p2l = balanced_physical(load.double(), slots, ep_size, self.num_groups, self.num_nodes)
        nodes = self.num_nodes if ep_size % self.num_nodes == 0 else 1
        p2l = keep_in_place(old.placement.physical_to_logical, p2l, ep_size, nodes)
        new = ExpertLocation.from_physical(p2l, self.location.num_logical, ep_size)
        if torch.equal(new.placement.physical_to_logical, old.placement.physical_to_logical):
            return False
        moved = 0
        for block in self.blocks:
            layer = block.layer_id
            moved += self._move(block.experts, old, new, layer)
            block.dispatch_map.update(new.placement, layer)
            block.experts.local_experts = new.local_experts(layer, self.parallel.moe_ep_rank)
        self.location = new
        self.num_rebalances += 1
        logger.info(
            "EPLB: rebalance %d: %d expert slots of this rank took another expert, %.1f ms",
            self.num_rebalances, moved, (time.perf_counter() - start) * 1e3,
        )  # fmt: skip
        return True

    def _move(self, experts: FusedMoE, old: ExpertLocation, new: ExpertLocation, layer: int):
        """Layer ``layer``'s weights into the new placement; how many of this rank's slots
        changed expert."""
        old_p2l = old.placement.physical_to_logical[layer].tolist()
        new_p2l = new.placement.physical_to_logical[layer].tolist()
        if old_p2l == new_p2l:
            return 0
        n, me, ep = old.placement.slots_per_rank, self.parallel.moe_ep_rank, self.parallel.moe_ep
        tensors, group, P2P = experts.expert_tensors(), ep.device_group, dist.P2POp
        fresh = [torch.empty_like(t) for t in tensors]
        first = {}  # each expert's first slot in the old placement: where others get it
        for slot, expert in enumerate(old_p2l):
            first.setdefault(expert, slot)
        ops, local = [], []
        for slot, expert in enumerate(new_p2l):  # the same order on every rank
            dst = slot // n
            held = [s for s in range(dst * n, (dst + 1) * n) if old_p2l[s] == expert]
            if held:
                if dst == me:
                    local.append((slot - me * n, held[0] - me * n))
                continue
            src = first[expert] // n
            for i, t in enumerate(tensors):
                if dst == me:
                    ops.append(P2P(dist.irecv, fresh[i][slot - me * n], ep.ranks[src], group))
                if src == me:
                    ops.append(P2P(dist.isend, t[first[expert] - me * n], ep.ranks[dst], group))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        for to, frm in local:
            for i, t in enumerate(tensors):
                fresh[i][to].copy_(t[frm])
        for t, f in zip(tensors, fresh):
            t.copy_(f)
        experts.repack()
        mine = range(me * n, (me + 1) * n)
        return sum(old_p2l[s] != new_p2l[s] for s in mine)
