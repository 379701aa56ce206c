"""Rotary position embedding: default and YaRN frequencies, NeoX (half-split) and GPT-J
(interleaved pairs) layouts.

On CPU in float32 or bfloat16 with the CPU kernels built, a layer's rotation is one C call per
tensor (``cpu_kernels.rope``) reading cosines and sines from a table per position
(``CosSinTable``), shared by every layer of the same frequencies and grown when a position lies
past its end; its entries are the values the PyTorch path computes for that position."""

from __future__ import annotations

import math
import weakref
from typing import ClassVar

import torch
from torch import nn

from srt.layers import cpu_kernels


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


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, rotary_dim / 2] at float positions [T]."""
    freqs = positions[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class CosSinTable:
    """The C rotation's table ``[positions, rotary_dim]``: per position the cosines of the
    rot/2 frequencies, then their sines, as ``cos_sin`` computes them. Every layer of a model
    has its own embedding of the same frequencies; they share one table (``shared``) rather
    than each hold and grow a copy (48 copies of 20 MiB at 40K positions, Qwen3-30B)."""

    # Tables by (frequencies, attention factor), alive while an embedding holds one.
    _by_frequencies: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()

    def __init__(self, inv_freq: torch.Tensor, attention_factor: float, rows: int):
        self.inv_freq, self.attention_factor = inv_freq, attention_factor
        self.table = self._build(rows)

    @classmethod
    def shared(cls, inv_freq: torch.Tensor, attention_factor: float, rows: int) -> CosSinTable:
        """The table of these frequencies, built with ``rows`` positions if none is."""
        key = (tuple(inv_freq.tolist()), attention_factor)
        table = cls._by_frequencies.get(key)
        if table is None:
            table = cls._by_frequencies[key] = cls(inv_freq, attention_factor, rows)
        return table

    def grow_to_cover(self, positions: torch.Tensor) -> None:
        """At least twice the rows, and past the largest of ``positions``."""
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"rotary embedding: negative position {int(positions.min())}")
        last = int(positions.max()) if positions.numel() else 0
        self.table = self._build(max(2 * self.table.shape[0], last + 1))

    def _build(self, rows: int) -> torch.Tensor:
        positions = torch.arange(rows, dtype=torch.float32)
        cos, sin = cos_sin(positions, self.inv_freq, self.attention_factor)
        return torch.cat((cos, sin), dim=-1).contiguous()


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
        self.cos_sin_table: CosSinTable | None = None  # set by prepare_for_cpu: C rotation

    def prepare_for_cpu(self) -> None:
        """Once loaded, on CPU: rotate float32 and bfloat16 tensors in C
        (``cpu_kernels.rope``), from a table of the model's own range of positions at first (at
        most 4096)."""
        if self.inv_freq.device.type == "cpu" and cpu_kernels.available():
            rows = min(self.max_position, 4096)
            self.cos_sin_table = CosSinTable.shared(self.inv_freq, self.attention_factor, rows)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, rotary_dim]; k [T, Hk, rotary_dim]."""
        if self.cos_sin_table is not None and q.dtype == k.dtype in cpu_kernels.ACT_TYPES:
            return self._rotate_in_c(positions.to(torch.int64).contiguous(), q, k)
        cos, sin = cos_sin(positions.to(torch.float32), self.inv_freq, self.attention_factor)
        cos, sin = cos.to(q.dtype)[:, None, :], sin.to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate_in_c(self, positions, q, k) -> tuple[torch.Tensor, torch.Tensor]:
        # The kernel checks every position against the table, so one past its end costs
        # nothing to find there; reading the largest position first would be a host read per
        # layer and step (5 µs each on CPU), and a host sync inside the forward.
        try:
            return self._rope_in_c(positions, q, k)
        except cpu_kernels.PositionOutsideTable:
            self.cos_sin_table.grow_to_cover(positions)
        return self._rope_in_c(positions, q, k)

    def _rope_in_c(self, positions, q, k) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.cos_sin_table.table
        return (
            cpu_kernels.rope(q, positions, table, self.is_neox_style),
            cpu_kernels.rope(k, positions, table, self.is_neox_style),
        )

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.is_neox_style:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
