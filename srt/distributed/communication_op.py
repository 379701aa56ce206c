"""Collectives on a GroupCoordinator.

Tensors travel on the group's device group, Python objects on its gloo ``cpu_group``. Every
function returns at once when the group has one rank (no torch.distributed call), so single-rank
code runs the same path without a process group. The tensor collectives are not autograd-aware:
call them under ``torch.inference_mode()`` (as ModelRunner does).

gloo notes (torch 2.13 gloo; the code also targets older torch, ≥ 2.4):
- all-gather with unequal sizes aborts the process inside gloo, so ``all_gather_variable`` pads
  every rank to the largest size, gathers equal blocks and strips the padding.
- gloo's single-tensor all-gather accepts only the concatenated output ``[n * d0, ...]``, not
  the stacked ``[n, d0, ...]`` form; ``all_gather`` uses the former and reshapes.
- reduce-scatter: gloo has no native one (recent torch emulates ``reduce_scatter_tensor`` on gloo
  as all-reduce + chunk, older torch raises). On gloo srt does that emulation itself, on every
  torch version (``reduce_scatter_by_all_reduce``: all-reduce a copy, keep this rank's slice;
  twice the bytes of a true reduce-scatter). Other backends use ``reduce_scatter_padded``: the
  native reduce-scatter on blocks padded to the largest size when sizes vary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from srt.distributed.group_coordinator import GroupCoordinator

# torch 2.13 renamed the single-tensor collectives; older versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(group: GroupCoordinator, tensor: torch.Tensor) -> torch.Tensor:
    """Sum over the group, in place; returns ``tensor``."""
    if group.world_size == 1:
        return tensor
    dist.all_reduce(tensor, group=group.device_group)
    return tensor


def all_gather(group: GroupCoordinator, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's tensor (equal shapes) along ``dim``, in group-rank order."""
    if group.world_size == 1:
        return tensor
    dim = dim % tensor.dim()
    n, first = group.world_size, tensor.shape[0]
    # The concatenated output form: gloo rejects the stacked [n, *shape] form.
    out = tensor.new_empty((n * first, *tensor.shape[1:]))
    _all_gather_single(out, tensor.contiguous(), group=group.device_group)
    if dim == 0:
        return out
    return out.view(n, *tensor.shape).movedim(0, dim).flatten(dim, dim + 1)


def pad_to(tensor: torch.Tensor, length: int, dim: int = 0) -> torch.Tensor:
    """``tensor`` zero-padded along ``dim`` to ``length`` (itself when already that long)."""
    missing = length - tensor.shape[dim]
    if missing < 0:
        raise ValueError(f"cannot pad size {tensor.shape[dim]} down to {length}")
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim)


def all_gather_sizes(group: GroupCoordinator, size: int) -> list[int]:
    """Every rank's ``size``, in group-rank order (one small gloo all-gather)."""
    return [row[0] for row in all_gather_ints(group, [size])]


def all_gather_ints(group: GroupCoordinator, values: Sequence[int]) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank), in group-rank order: one small
    all-gather on the gloo ``cpu_group``, so it never waits behind device traffic."""
    if group.world_size == 1:
        return [list(values)]
    local = torch.tensor(list(values), dtype=torch.int64)
    out = torch.zeros(group.world_size * local.numel(), dtype=torch.int64)
    _all_gather_single(out, local, group=group.cpu_group)
    return out.view(group.world_size, -1).tolist()


def all_gather_variable(
    group: GroupCoordinator,
    tensor: torch.Tensor,
    sizes: Sequence[int] | None = None,
    dim: int = 0,
) -> torch.Tensor:
    """Concatenate along ``dim`` tensors whose size there differs per rank. ``sizes``: every
    rank's size in group order (exchanged over the cpu group when None)."""
    if group.world_size == 1:
        return tensor
    dim = dim % tensor.dim()
    sizes = list(sizes) if sizes is not None else all_gather_sizes(group, tensor.shape[dim])
    _check_sizes(group, tensor.shape[dim], sizes)
    longest = max(sizes)
    if longest == 0:
        return tensor
    gathered = all_gather(group, pad_to(tensor, longest, dim), dim)
    blocks = gathered.split(longest, dim=dim)
    return torch.cat([b.narrow(dim, 0, n) for b, n in zip(blocks, sizes)], dim=dim)


def reduce_scatter(group: GroupCoordinator, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum over the group and keep this rank's equal block of ``dim``; ``tensor`` is unchanged."""
    if group.world_size == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % group.world_size:
        raise ValueError(
            f"reduce_scatter: size {tensor.shape[dim]} is not divisible by the group size "
            f"{group.world_size}; use reduce_scatter_variable"
        )
    block = tensor.shape[dim] // group.world_size
    return reduce_scatter_variable(group, tensor, [block] * group.world_size, dim)


def reduce_scatter_variable(
    group: GroupCoordinator, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0
) -> torch.Tensor:
    """``tensor`` holds consecutive blocks of ``sizes`` along ``dim``, one per rank in group
    order; returns the sum over the group of this rank's block. ``tensor`` is unchanged.
    gloo: :func:`reduce_scatter_by_all_reduce`; other backends: :func:`reduce_scatter_padded`."""
    if group.world_size == 1:
        return tensor
    if group.backend == "gloo":
        return reduce_scatter_by_all_reduce(group, tensor, sizes, dim)
    return reduce_scatter_padded(group, tensor, sizes, dim)


def reduce_scatter_by_all_reduce(
    group: GroupCoordinator, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0
) -> torch.Tensor:
    """Reduce-scatter emulated as all-reduce of a copy + this rank's slice (any backend; 2x the
    bytes of a real reduce-scatter)."""
    dim, sizes = _check_split(group, tensor, sizes, dim)
    me = group.rank_in_group
    summed = all_reduce(group, tensor.clone(memory_format=torch.contiguous_format))
    return summed.narrow(dim, sum(sizes[:me]), sizes[me]).clone()


def reduce_scatter_padded(
    group: GroupCoordinator, tensor: torch.Tensor, sizes: Sequence[int], dim: int = 0
) -> torch.Tensor:
    """The backend's reduce-scatter on blocks padded to the largest size (nccl; gloo only on
    torch versions whose gloo has ``reduce_scatter_tensor``)."""
    dim, sizes = _check_split(group, tensor, sizes, dim)
    x, longest = tensor.movedim(dim, 0), max(sizes)
    if min(sizes) == longest:
        padded = x.contiguous()
    else:
        padded = torch.cat([pad_to(block, longest) for block in x.split(sizes)])
    out = x.new_empty((longest, *x.shape[1:]))
    _reduce_scatter_single(out, padded, group=group.device_group)
    return out[: sizes[group.rank_in_group]].movedim(0, dim)


def broadcast(group: GroupCoordinator, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy the tensor of group rank ``src`` into ``tensor`` on every rank (in place)."""
    if group.world_size == 1:
        return tensor
    src %= group.world_size
    dist.broadcast(tensor, src=group.ranks[src], group=group.device_group)
    return tensor


def broadcast_object(group: GroupCoordinator, obj: Any = None, src: int = 0) -> Any:
    """The picklable ``obj`` of group rank ``src``, on every rank (others pass anything)."""
    if group.world_size == 1:
        return obj
    src %= group.world_size
    box = [obj if group.rank_in_group == src else None]
    dist.broadcast_object_list(box, src=group.ranks[src], group=group.cpu_group)
    return box[0]


def all_gather_object(group: GroupCoordinator, obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in group-rank order."""
    if group.world_size == 1:
        return [obj]
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def _check_sizes(group: GroupCoordinator, local: int, sizes: list[int]) -> None:
    if len(sizes) != group.world_size:
        raise ValueError(f"{len(sizes)} sizes for a group of {group.world_size} ranks")
    if sizes[group.rank_in_group] != local:
        raise ValueError(
            f"this rank's size {local} != sizes[{group.rank_in_group}] = "
            f"{sizes[group.rank_in_group]}"
        )


def _check_split(
    group: GroupCoordinator, tensor: torch.Tensor, sizes: Sequence[int], dim: int
) -> tuple[int, list[int]]:
    dim, sizes = dim % tensor.dim(), list(sizes)
    if len(sizes) != group.world_size or sum(sizes) != tensor.shape[dim]:
        raise ValueError(
            f"reduce_scatter: sizes {sizes} do not split {tensor.shape[dim]} rows over "
            f"{group.world_size} ranks"
        )
    return dim, sizes
