"""``create_dispatcher``: the token dispatcher for ``--moe-a2a-backend`` and ``--deepep-mode``.

Build one per micro-batch (TBO builds two): each instance owns its buffers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ProcessGroup

from srt.layers.moe.token_dispatcher.auto import TorchA2AAutoDispatcher
from srt.layers.moe.token_dispatcher.base import TokenDispatcher
from srt.layers.moe.token_dispatcher.blocked_combine import BlockedCombine
from srt.layers.moe.token_dispatcher.low_latency import TorchA2ALowLatencyDispatcher
from srt.layers.moe.token_dispatcher.normal import TorchA2ANormalDispatcher
from srt.layers.moe.token_dispatcher.standard import StandardDispatcher
from srt.layers.moe.token_dispatcher.torch_a2a import DUPLEX_MIN_BYTES
from srt.server_args_choices import (
    DEEPEP_MODE_CHOICES,
    DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK,
    MOE_A2A_BACKEND_CHOICES,
    NO_DEEPEP,
)


def create_dispatcher(
    backend: str,
    deepep_mode: str = "auto",
    *,
    groups: Sequence[ProcessGroup] = (),
    ep_rank: int = 0,
    ep_size: int = 1,
    num_experts: int = 0,
    top_k: int = 0,
    hidden_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    max_dispatch_tokens_per_rank: int = DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK,
    device: torch.device | str = "cpu",
    duplex_min_bytes: int = DUPLEX_MIN_BYTES,
    sbo_num_blocks: int | None = None,
    sbo_communication_sms: int | None = None,
    counts_group: ProcessGroup | None = None,
    combine_group: ProcessGroup | None = None,
    tag: int = 0,
) -> TokenDispatcher:
    """``groups``: the EP process group, or two over the same ranks for full duplex on gloo,
    used for exchanges whose largest link carries ≥ ``duplex_min_bytes`` (see ``torch_a2a``).
    ``sbo_num_blocks``: single-batch overlap's blocked combine, in every mode;
    ``sbo_communication_sms`` and ``combine_group``: its SM split and its nccl group on CUDA
    (see ``single_batch_overlap``); ``counts_group``: where the normal mode exchanges its
    counts (see there); ``tag``: the micro-batch index (ragged messages, see ``ragged``).
    Everything but ``backend`` and ``deepep_mode`` is ignored for
    ``none``."""
    if deepep_mode not in DEEPEP_MODE_CHOICES:
        raise ValueError(f"--deepep-mode {deepep_mode!r} is not one of {DEEPEP_MODE_CHOICES}")
    if backend == "none":
        return StandardDispatcher()
    if backend == "deepep":
        raise ValueError(NO_DEEPEP)
    if backend != "torch":
        raise ValueError(f"--moe-a2a-backend {backend!r} is not one of {MOE_A2A_BACKEND_CHOICES}")
    common = (groups, ep_rank, ep_size, num_experts, top_k, hidden_size, dtype)
    modes: list[TorchA2ANormalDispatcher | TorchA2ALowLatencyDispatcher] = []
    if deepep_mode != "low_latency":
        modes.append(TorchA2ANormalDispatcher(*common, duplex_min_bytes, counts_group, tag))
    if deepep_mode != "normal":
        modes.append(
            TorchA2ALowLatencyDispatcher(
                *common, max_dispatch_tokens_per_rank, device, duplex_min_bytes, tag
            )
        )
    if sbo_num_blocks:
        blocked = BlockedCombine(
            sbo_num_blocks,
            modes[0].layout,
            modes[0].fmt,
            modes[0].exchange,
            device,
            sbo_communication_sms,
            combine_group,
        )
        for mode in modes:
            mode.enable_blocked(blocked)  # one dispatch at a time: they can share it
    return modes[0] if len(modes) == 1 else TorchA2AAutoDispatcher(*modes)
