"""Rotary position embedding: default and YaRN frequencies, NeoX (half-split) and GPT-J
(interleaved pairs) layouts.

On CPU in float32 with the CPU kernels built, a layer's rotation is one C call per tensor
(``cpu_kernels.rope``) reading cosines and sines from a table per position, shared by every
layer of the same frequencies and grown when a position lies past its end; its entries are
the values the PyTorch path computes for that position."""

from __future__ import annotations

import math

import torch
from torch import nn

from srt.layers import cpu_kernels

# Shared cos/sin tables, by (frequencies, attention factor): [positions, rotary_dim].
_COS_SIN_TABLES: dict[tuple, torch.Tensor] = {}


def rope_parameters(config) -> dict:
    """The HF config's rope settings (``rope_parameters`` in transformers 5, else the legacy
    ``rope_scaling`` plus ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_factor(rope_parameters: dict | None) -> float:
    """DeepSeek multiplies the softmax scale by mscale² when YaRN has ``mscale_all_dim``."""
    params = rope_parameters or {}
    if params.get("rope_type", params.get("type")) != "yarn" or not params.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2


def _yarn_inv_freq(
    dim: int, base: float, params: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or max_position / params["original_max_position_embeddings"]
    orig = params["original_max_position_embeddings"]
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        rope_parameters: dict | None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        params = dict(rope_parameters or {})
        base = float(params.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(rotary_dim, base, params, max_position)
        elif rope_type == "default":
            inv_freq = 1.0 / base ** (
                torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            )
            self.attention_factor = 1.0
        else:
            raise ValueError(f"unsupported rope type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        self.in_kernel = False  # set by pack_weights where the CPU kernels rotate
        self.table_key: tuple | None = None  # this embedding's entry in _COS_SIN_TABLES

    def pack_weights(self) -> None:
        """Once loaded, on CPU: rotate float32 tensors in C (``cpu_kernels.rope``)."""
        if self.inv_freq.device.type == "cpu":
            self.in_kernel = cpu_kernels.available()
            self.table_key = (tuple(self.inv_freq.tolist()), self.attention_factor)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, rotary_dim]; k [T, Hk, rotary_dim]."""
        if self.in_kernel and q.dtype == k.dtype == torch.float32:
            return self._rotate_in_c(positions.to(torch.int64).contiguous(), q, k)
        cos, sin = self._cos_sin(positions.to(torch.float32))
        cos, sin = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, rotary_dim / 2] at float positions [T]."""
        freqs = positions[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def _rotate_in_c(self, positions, q, k) -> tuple[torch.Tensor, torch.Tensor]:
        table = _COS_SIN_TABLES.get(self.table_key)
        for _ in range(2):  # the second time with a table that covers every position
            if table is not None:
                try:
                    return (
                        cpu_kernels.rope(q, positions, table, self.is_neox_style),
                        cpu_kernels.rope(k, positions, table, self.is_neox_style),
                    )
                except cpu_kernels.PositionOutsideTable:
                    pass
            table = _COS_SIN_TABLES[self.table_key] = self._table(positions, table)
        raise ValueError(f"rotary embedding: negative position {int(positions.min())}")

    def _table(self, positions: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
        """A table covering ``positions``: the model's own range at first (at most 4096
        positions), then at least twice the old one."""
        rows = min(self.max_position, 4096) if old is None else 2 * old.shape[0]
        rows = max(rows, int(positions.max()) + 1 if positions.numel() else 0)
        cos, sin = self._cos_sin(torch.arange(rows, dtype=torch.float32))
        return torch.cat((cos, sin), dim=-1).contiguous()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.is_neox_style:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
