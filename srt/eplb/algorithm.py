"""DeepSeek's EPLB placement algorithm: from each layer's per-expert load, which logical expert
each physical slot holds.

A *logical* expert is one of the model's experts; a *physical* expert is one copy of it in one
slot on one EP rank; the ``num_physical - num_logical`` extra copies are the *redundant*
experts. The slots split evenly over the ranks: slot ``p`` lives on rank
``p // (num_physical // ep_size)``, and ranks ``[n * ep_size // num_nodes, ...)`` form node
``n``. Tokens routed to a logical expert are assumed to split evenly among its copies.

``rebalance_experts`` follows the hierarchical policy when the expert groups (DeepSeek-V3's
grouped routing) divide evenly over the nodes, so that a group's tokens stay on one node:
1. pack the groups onto the nodes, each node the same number of groups, balancing node load;
2. within each node, give one more copy at a time to the expert with the highest load per
   copy, until the node's slots are full;
3. pack each node's copies onto its ranks, each rank the same number of slots, heaviest copy
   first onto the lightest rank with room.
Otherwise it runs the same steps as one node with one group (the global policy). Every step is
greedy and deterministic: ties go to the lowest index.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    """Every layer's map between logical experts and physical slots."""

    physical_to_logical: torch.Tensor  # [num_layers, num_physical] long
    # [num_layers, num_logical, max_replicas] long: the expert's slots ascending, -1 padded
    logical_to_physical: torch.Tensor
    logical_replica_count: torch.Tensor  # [num_layers, num_logical] long
    ep_size: int

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size


def _check_sizes(num_logical: int, num_physical: int, ep_size: int) -> None:
    if ep_size < 1 or num_logical < 1:
        raise ValueError(f"ep_size ({ep_size}) and num_logical ({num_logical}) must be positive")
    if num_physical < num_logical:
        raise ValueError(
            f"num_physical ({num_physical}) must be at least num_logical ({num_logical})"
        )
    if num_physical % ep_size:
        raise ValueError(
            f"num_physical ({num_physical}) must be a multiple of ep_size ({ep_size}): "
            "every rank holds the same number of physical experts"
        )


def placement_from_physical(
    physical_to_logical: torch.Tensor, num_logical: int, ep_size: int
) -> ExpertPlacement:
    """The ``ExpertPlacement`` of ``physical_to_logical`` [num_layers, num_physical]."""
    p2l = physical_to_logical.detach().to("cpu", torch.long)
    num_layers, num_physical = p2l.shape
    _check_sizes(num_logical, num_physical, ep_size)
    counts = torch.zeros(num_layers, num_logical, dtype=torch.long)
    counts.scatter_add_(1, p2l, torch.ones_like(p2l))
    # Slots sorted by (logical expert, slot); a slot's replica index is its position in that
    # order minus where its expert's run of slots begins.
    order = torch.sort(p2l, dim=1, stable=True).indices
    sorted_logical = p2l.gather(1, order)
    starts = counts.cumsum(1) - counts
    replica = torch.arange(num_physical).expand(num_layers, -1) - starts.gather(1, sorted_logical)
    max_replicas = int(counts.max()) if counts.numel() else 0
    l2p = torch.full((num_layers, num_logical, max_replicas), -1, dtype=torch.long)
    layers = torch.arange(num_layers).unsqueeze(1).expand_as(order)
    l2p[layers, sorted_logical, replica] = order
    return ExpertPlacement(p2l, l2p, counts, ep_size)


def trivial_placement(
    num_layers: int, num_logical: int, num_physical: int, ep_size: int
) -> ExpertPlacement:
    """Slot ``p`` holds logical expert ``p % num_logical`` in every layer: with no redundant
    experts, each rank holds a contiguous slice of the experts (what srt places today)."""
    _check_sizes(num_logical, num_physical, ep_size)
    p2l = (torch.arange(num_physical) % num_logical).expand(num_layers, -1)
    return placement_from_physical(p2l, num_logical, ep_size)


def _balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split each row's items (``weight`` [rows, n]) into ``num_packs`` packs of ``n //
    num_packs`` items: heaviest first, each onto the lightest pack that still has room.
    Returns each item's (pack, position within the pack), both [rows, n]."""
    rows, n = weight.shape
    capacity = n // num_packs
    order = torch.sort(weight, dim=1, descending=True, stable=True).indices
    pack_load = torch.zeros(rows, num_packs, dtype=weight.dtype)
    pack_size = torch.zeros(rows, num_packs, dtype=torch.long)
    pack = torch.empty(rows, n, dtype=torch.long)
    position = torch.empty(rows, n, dtype=torch.long)
    row = torch.arange(rows)
    for item in order.T:
        chosen = pack_load.masked_fill(pack_size >= capacity, float("inf")).argmin(1)
        pack[row, item] = chosen
        position[row, item] = pack_size[row, chosen]
        pack_load[row, chosen] += weight[row, item]
        pack_size[row, chosen] += 1
    return pack, position


def _replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill ``num_slots`` slots with copies of each row's experts (``weight`` [rows, n]): one
    each, then one more at a time for the expert with the highest load per copy. Returns each
    slot's expert [rows, num_slots] and each expert's copy count [rows, n]."""
    rows, n = weight.shape
    slot_expert = torch.empty(rows, num_slots, dtype=torch.long)
    slot_expert[:, :n] = torch.arange(n)
    counts = torch.ones(rows, n, dtype=torch.long)
    row = torch.arange(rows)
    for slot in range(n, num_slots):
        hottest = (weight / counts).argmax(1)
        slot_expert[:, slot] = hottest
        counts[row, hottest] += 1
    return slot_expert, counts


def rebalance_experts(
    load: torch.Tensor,
    num_physical: int,
    *,
    ep_size: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> ExpertPlacement:
    """A balanced placement of ``load`` [num_layers, num_logical] (tokens routed to each
    logical expert, non-negative) over ``num_physical`` slots on ``ep_size`` ranks, which span
    ``num_nodes`` nodes; the experts form ``num_groups`` contiguous groups of equal size."""
    if load.dim() != 2:
        raise ValueError(f"load must be [num_layers, num_logical], got shape {tuple(load.shape)}")
    load = load.detach().to("cpu", torch.float64)
    if not torch.isfinite(load).all() or (load < 0).any():
        raise ValueError("load must be finite and non-negative")
    num_layers, num_logical = load.shape
    _check_sizes(num_logical, num_physical, ep_size)
    if num_groups < 1 or num_logical % num_groups:
        raise ValueError(f"num_groups ({num_groups}) must divide num_logical ({num_logical})")
    if num_nodes < 1 or ep_size % num_nodes:
        raise ValueError(f"num_nodes ({num_nodes}) must divide ep_size ({ep_size})")
    if num_groups % num_nodes:
        num_groups = num_nodes = 1  # the global policy

    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = num_logical // num_nodes
    slots_per_node = num_physical // num_nodes
    ranks_per_node = ep_size // num_nodes

    # 1. Groups onto nodes. Node-major order ("meta" index) lays node n's experts out at
    # [n * experts_per_node, (n + 1) * experts_per_node), each group contiguous.
    group_load = load.view(num_layers, num_groups, group_size).sum(2)
    node, position = _balanced_packing(group_load, num_nodes)
    group_start = (node * groups_per_node + position) * group_size
    meta_of_logical = (group_start.unsqueeze(2) + torch.arange(group_size)).flatten(1)
    logical_of_meta = meta_of_logical.argsort(1)  # the inverse permutation

    # 2. Copies within each node (one row per (layer, node)).
    meta_load = load.gather(1, logical_of_meta).view(-1, experts_per_node)
    copy_expert, copy_count = _replicate(meta_load, slots_per_node)

    # 3. Each node's copies onto its ranks, then into their rank's slots in packing order.
    copy_load = (meta_load / copy_count).gather(1, copy_expert)
    rank, position = _balanced_packing(copy_load, ranks_per_node)
    slot = rank * (slots_per_node // ranks_per_node) + position
    slot_expert = torch.empty_like(copy_expert).scatter_(1, slot, copy_expert)

    node_offset = (torch.arange(num_nodes) * experts_per_node).repeat(num_layers).unsqueeze(1)
    slot_meta = (slot_expert + node_offset).view(num_layers, num_physical)
    return placement_from_physical(logical_of_meta.gather(1, slot_meta), num_logical, ep_size)


def rank_load(placement: ExpertPlacement, load: torch.Tensor) -> torch.Tensor:
    """Each rank's load [num_layers, ep_size] under ``placement``: every logical expert's load
    (``load`` [num_layers, num_logical]) split evenly among its copies."""
    p2l = placement.physical_to_logical
    per_copy = load.detach().to("cpu", torch.float64) / placement.logical_replica_count
    slot_load = per_copy.gather(1, p2l)
    return slot_load.view(p2l.shape[0], placement.ep_size, placement.slots_per_rank).sum(2)


def imbalance(rank_load: torch.Tensor) -> torch.Tensor:
    """Each layer's max rank load over its mean rank load [num_layers] (1 is perfect balance;
    a layer with no load counts as balanced)."""
    mean = rank_load.mean(1)
    ratio = rank_load.max(1).values / mean
    return torch.where(mean > 0, ratio, torch.ones_like(ratio))
