"""The gated (SwiGLU) MLP used by dense layers and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from srt.layers.activation import SiluAndMul
from srt.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, tp_rank=tp_rank, tp_size=tp_size
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, tp_rank=tp_rank, tp_size=tp_size
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
