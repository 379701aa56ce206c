"""The placement of a model's experts over the EP ranks, and the map a MoE block applies to
its router's choices.

``ExpertLocation.physical_to_logical[layer, slot]`` names the logical expert that physical
slot ``slot`` of ``layer`` holds; slot ``s`` lives on EP rank ``s // num_local``. Every
logical expert has at least one slot in every layer; a hot one may have several (redundant
experts). The trivial placement is the contiguous slices of srt without EPLB, copies after
them (slot ``s`` holds expert ``s % num_logical``).

A MoE block routes as before, on logical ids; ``ExpertDispatchMap`` then picks one copy for
each (token, expert) pair and the dispatcher, the experts and the combine see physical ids
only. The pick spreads an expert's tokens evenly over its copies and is a pure function of the
token's row, the rank and the placement: a run is reproducible, and every copy holds the same
weights, so the output does not depend on which copy ran (up to the order of a float sum).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from srt.eplb.algorithm import (
    ExpertPlacement,
    imbalance,
    placement_from_physical,
    rank_load,
    rebalance_experts,
    trivial_placement,
)
from srt.server_args_choices import INIT_EXPERT_LOCATION_TRIVIAL


class ExpertDispatchMap:
    """One MoE layer's logical → physical map on the device, applied without a host
    synchronisation (a CUDA graph captures it)."""

    def __init__(self, logical_to_physical: torch.Tensor, counts: torch.Tensor, offset: int):
        self.table, self.counts = logical_to_physical, counts  # [E, R] slots, [E] how many
        self.offset = offset  # the EP rank: ranks with one token each start on other copies

    @classmethod
    def for_placement(cls, placement: ExpertPlacement, layer: int, offset: int, width: int):
        """Layer ``layer``'s map, its table ``width`` copies wide (-1 past an expert's last,
        never read), so that ``update`` can write any later placement into the same tensors."""
        table = torch.full((placement.logical_to_physical.shape[1], width), -1, dtype=torch.long)
        dispatch_map = cls(table, torch.zeros(table.shape[0], dtype=torch.long), offset)
        dispatch_map.update(placement, layer)
        return dispatch_map

    def update(self, placement: ExpertPlacement, layer: int) -> None:
        """In place (a captured CUDA graph keeps reading these tensors): ``placement``'s map."""
        l2p = placement.logical_to_physical[layer]
        if l2p.shape[1] > self.table.shape[1]:
            raise ValueError(
                f"{l2p.shape[1]} copies of an expert: the map holds at most {self.table.shape[1]}"
            )
        self.table.fill_(-1)
        self.table[:, : l2p.shape[1]].copy_(l2p)
        self.counts.copy_(placement.logical_replica_count[layer])

    def to(self, device: torch.device | str) -> ExpertDispatchMap:
        self.table, self.counts = self.table.to(device), self.counts.to(device)
        return self

    def __call__(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T, k] logical ids → [T, k] physical: row t takes copy ``(t + offset) % copies``."""
        rows = torch.arange(topk_ids.shape[0], device=topk_ids.device).unsqueeze(1)
        pick = (rows + self.offset) % self.counts[topk_ids]
        return self.table[topk_ids, pick]


@dataclass(frozen=True)
class ExpertLocation:
    """A model's placement (``ExpertPlacement``, every decoder layer a row; a dense layer's
    row is never read) and its number of logical experts."""

    placement: ExpertPlacement
    num_logical: int

    @classmethod
    def from_physical(cls, physical_to_logical: torch.Tensor, num_logical: int, ep_size: int):
        """Checked: every expert has a slot in every layer, the slots split over the ranks."""
        p2l = physical_to_logical.long()
        if p2l.dim() != 2:
            raise ValueError(f"a placement is [layers, slots], not {tuple(p2l.shape)}")
        if p2l.numel() and (int(p2l.min()) < 0 or int(p2l.max()) >= num_logical):
            raise ValueError(f"expert ids outside [0, {num_logical})")
        placement = placement_from_physical(p2l, num_logical, ep_size)
        for layer, counts in enumerate(placement.logical_replica_count):
            missing = torch.nonzero(counts == 0).flatten().tolist()
            if missing:
                raise ValueError(f"layer {layer} places no copy of experts {missing}")
        return cls(placement, num_logical)

    @classmethod
    def trivial(cls, layers: int, num_logical: int, redundant: int, ep_size: int):
        return cls(
            trivial_placement(layers, num_logical, num_logical + redundant, ep_size), num_logical
        )

    @property
    def num_physical(self) -> int:
        return self.placement.num_physical

    def local_experts(self, layer: int, ep_rank: int) -> list[int]:
        """The logical expert each of ``ep_rank``'s slots holds, in slot order."""
        n = self.placement.slots_per_rank
        return self.placement.physical_to_logical[layer, ep_rank * n : (ep_rank + 1) * n].tolist()

    def dispatch_map(
        self, layer: int, ep_rank: int, live: bool = False
    ) -> ExpertDispatchMap | None:
        """The layer's map, None where it is the identity (nothing to apply) unless ``live``
        (``--enable-eplb``: the placement changes while serving, so every layer has one, wide
        enough for any placement)."""
        p2l = self.placement.physical_to_logical[layer]
        if (
            not live
            and self.num_physical == self.num_logical
            and bool((p2l == torch.arange(self.num_logical)).all())
        ):
            return None
        width = self.num_physical - self.num_logical + 1 if live else None
        return ExpertDispatchMap.for_placement(
            self.placement, layer, ep_rank, width or self.placement.logical_to_physical.shape[2]
        )


# ------------------------------------------------------------------------------ from flags
def model_experts(hf_config: Any) -> tuple[int, int, int]:
    """(layers, logical experts per MoE layer, expert groups) of a MoE model's config."""
    experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "n_routed_experts", None
    )
    groups = getattr(hf_config, "n_group", None) or 1
    return hf_config.num_hidden_layers, experts or 0, groups


def load_placement_file(path: str) -> dict[str, torch.Tensor]:
    """A .json or .pt file's ``logical_count`` and/or ``physical_to_logical_map``."""
    if Path(path).suffix == ".json":
        raw = json.loads(Path(path).read_text())
    else:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    keys = {"logical_count", "physical_to_logical_map"} & set(raw)
    if not isinstance(raw, dict) or not keys:
        raise ValueError("it holds neither logical_count nor physical_to_logical_map")
    return {key: torch.as_tensor(raw[key]) for key in keys}


def balanced_physical(load: torch.Tensor, slots: int, ep_size: int, groups: int, nodes: int):
    """``rebalance_experts``'s placement of ``load``, but in the layers where the trivial one
    has the lower imbalance (the greedy is not optimal with copies), the trivial one."""
    balanced = rebalance_experts(load, slots, ep_size=ep_size, num_groups=groups, num_nodes=nodes)
    trivial = trivial_placement(load.shape[0], load.shape[1], slots, ep_size)
    worse = imbalance(rank_load(balanced, load)) > imbalance(rank_load(trivial, load))
    return torch.where(
        worse.unsqueeze(1), trivial.physical_to_logical, balanced.physical_to_logical
    )


def keep_in_place(old: torch.Tensor, new: torch.Tensor, ep_size: int, nodes: int) -> torch.Tensor:
    """``new`` [layers, slots] rearranged to move as few experts as possible from ``old``
    without changing any rank's load: the ranks' sets of experts go, within each node, to the
    ranks that already hold most of them (greedily, largest overlap first), and inside a rank
    an expert it held keeps its slot."""
    layers, slots = new.shape
    n, per_node = slots // ep_size, ep_size // nodes
    out = new.clone()
    for layer in range(layers):
        was = [old[layer, r * n : (r + 1) * n].tolist() for r in range(ep_size)]
        sets = [new[layer, r * n : (r + 1) * n].tolist() for r in range(ep_size)]
        for node in range(nodes):
            ranks = range(node * per_node, (node + 1) * per_node)
            overlap = sorted(
                ((-_common(sets[p], was[r]), p, r) for p in ranks for r in ranks),
            )
            placed, filled = set(), set()
            for _, p, r in overlap:
                if p not in placed and r not in filled:
                    placed.add(p)
                    filled.add(r)
                    out[layer, r * n : (r + 1) * n] = torch.tensor(_in_place(sets[p], was[r]))
    return out


def _common(a: list[int], b: list[int]) -> int:
    return sum((Counter(a) & Counter(b)).values())


def _in_place(experts: list[int], was: list[int]) -> list[int]:
    """``experts`` in slot order, each that ``was`` held in the slot it held it in."""
    out: list[int | None] = [None] * len(was)
    left = []
    for e in experts:
        spot = next((i for i, w in enumerate(was) if w == e and out[i] is None), None)
        if spot is None:
            left.append(e)
        else:
            out[spot] = e
    free = iter(i for i, e in enumerate(out) if e is None)
    for e in left:
        out[next(free)] = e
    return out


def expert_location_from_args(args: Any, hf_config: Any) -> ExpertLocation | None:
    """The placement ``--ep-num-redundant-experts`` and ``--init-expert-location`` ask for
    (``--enable-eplb`` starts from it), None without any of them; a ValueError naming the
    flag when it cannot be made for this model."""
    redundant, source = args.ep_num_redundant_experts, args.init_expert_location
    if redundant == 0 and source == INIT_EXPERT_LOCATION_TRIVIAL and not args.enable_eplb:
        return None
    layers, experts, groups = model_experts(hf_config)
    if not experts:
        raise ValueError(
            "--enable-eplb / --ep-num-redundant-experts / --init-expert-location: not a MoE model"
        )
    ep_size = args.parallel_config.moe_ep_size
    if source == INIT_EXPERT_LOCATION_TRIVIAL:
        return ExpertLocation.trivial(layers, experts, redundant, ep_size)
    flag = f"--init-expert-location {source}"
    try:
        found = load_placement_file(source)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{flag}: {e}") from e
    slots = experts + redundant
    if "physical_to_logical_map" in found:
        p2l = found["physical_to_logical_map"].long()
        if tuple(p2l.shape) != (layers, slots):
            raise ValueError(
                f"{flag}: physical_to_logical_map is {tuple(p2l.shape)}, this model and "
                f"--ep-num-redundant-experts {redundant} need ({layers}, {slots})"
            )
    else:
        load = found["logical_count"].double()
        if load.dim() == 3:  # SGLang's per-rank counts [ranks, layers, experts]: their sum
            load = load.sum(0)
        if tuple(load.shape) != (layers, experts):
            raise ValueError(
                f"{flag}: logical_count is {tuple(load.shape)}, this model has ({layers}, "
                f"{experts}) (layers, experts)"
            )
        p2l = balanced_physical(load, slots, ep_size, groups, args.nnodes)
    try:
        return ExpertLocation.from_physical(p2l, experts, ep_size)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from e
