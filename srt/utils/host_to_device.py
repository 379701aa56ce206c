"""Host → device transfers of a step's metadata."""

from __future__ import annotations

import torch


def host_lists_to_device(
    lists: list[list[int]] | list[list[float]], dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Host lists as device tensors of ``dtype`` in one host → device transfer (one tensor
    built on the host, one copy, views split off on the device): a step's metadata costs one
    copy rather than one per field."""
    sizes = [len(xs) for xs in lists]
    flat = torch.tensor([x for xs in lists for x in xs], dtype=dtype)
    if torch.device(device).type != "cpu":
        flat = flat.to(device, non_blocking=True)
    return list(flat.split(sizes))
