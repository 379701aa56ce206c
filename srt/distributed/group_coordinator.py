"""GroupCoordinator: one process group as seen from one rank."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class GroupCoordinator:
    """A group of ranks: ``device_group`` carries tensors (the world's backend), ``cpu_group``
    (always gloo) carries Python objects and metadata. Both are None for a one-rank group made
    without torch.distributed (``ParallelState.single_rank``)."""

    name: str
    ranks: tuple[int, ...]  # global ranks, in group order
    rank: int  # this process's global rank
    device_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    device: torch.device

    def __post_init__(self) -> None:
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in group {self.name} {self.ranks}")

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rank_in_group(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == self.ranks[0]

    @property
    def backend(self) -> str:
        """ "gloo", "nccl", … of the device group; "none" without torch.distributed."""
        if self.device_group is None:
            return "none"
        return str(dist.get_backend(self.device_group))


def new_group_coordinator(
    name: str,
    partition: list[list[int]],
    rank: int,
    device: torch.device,
    timeout: timedelta | None = None,
) -> GroupCoordinator:
    """Create the groups of ``partition`` (disjoint rank lists) and return the one holding
    ``rank``. Collective over the world: every rank must call it with the same partition, in the
    same order as its other calls to new_group."""
    mine: GroupCoordinator | None = None
    for ranks in partition:
        device_group = dist.new_group(ranks, timeout=timeout)
        cpu_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
        if rank in ranks:
            mine = GroupCoordinator(name, tuple(ranks), rank, device_group, cpu_group, device)
    if mine is None:
        raise ValueError(f"rank {rank} is in no {name} group of {partition}")
    return mine
