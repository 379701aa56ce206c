"""Linear layers with per-parameter weight loaders, ready for tensor parallelism.

Each layer owns the slice of the full weight that its rank holds; ``weight_loader`` receives the
full checkpoint tensor and copies the rank's slice, checking shapes. With ``tp_size == 1`` the
slice is the whole tensor.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import cpu_kernels


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(loaded.shape)}, "
            f"model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class PanelWeight(NamedTuple):
    """A ``[N, K]`` weight in the CPU kernels' panels."""

    panels: torch.Tensor
    out_features: int | None = None  # N, where it does not fill the last panel


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PanelWeight | None:
    """The weight ``[N, K]`` laid out for ``linear`` on CPU: in float32, the CPU kernels'
    panels (``srt.layers.cpu_kernels``: as fast as oneDNN for many rows, faster for the few rows
    of decode; any N, the last panel padded); else oneDNN's blocked layout (float32 without the
    kernels, or bf16); None where neither is available. oneDNN on CPU is several times faster
    than ``F.linear`` (MKL) at every batch size: MKL picks a GEMV-like kernel for one row and a
    poorly blocked one for a few, and on AMD processors keeps to AVX2; oneDNN's kernel also
    gives each row the same result whatever the batch, so split and unsplit batches agree bit
    for bit. Measured in ``docs/benchmarks.md``."""
    if cpu_kernels.can_pack(weight):
        return PanelWeight(cpu_kernels.pack_panels(weight), weight.shape[0])
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def padded_rows(num_rows: int) -> int:
    """oneDNN builds (JIT-compiles, a few ms) a kernel for every new row count and caches it:
    row counts past 16 are rounded up to a few buckets (at most 1/8 padding), so that a server
    meets each one once."""
    if num_rows <= 16:
        return num_rows
    step = 1 << max(3, num_rows.bit_length() - 4)
    return -(-num_rows // step) * step


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | PanelWeight | None = None,
) -> torch.Tensor:
    """``F.linear``, through the CPU kernels or oneDNN with the ``packed`` weight when there
    is one."""
    if isinstance(packed, PanelWeight) and x.dtype == torch.float32:
        rows = x.reshape(-1, x.shape[-1])
        out = cpu_kernels.panel_linear(rows, packed.panels, packed.out_features)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])
    if packed is None or isinstance(packed, PanelWeight) or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    pad = padded_rows(num_rows) - num_rows
    if pad:
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out[:num_rows].view(*x.shape[:-1], out.shape[-1])


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
    copy_checked(param, loaded, name or "parameter")


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        in_local, out_local = self.local_sizes()
        self.weight = nn.Parameter(torch.empty(out_local, in_local))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.packed_weight: torch.Tensor | PanelWeight | None = None  # set by prepare_for_cpu

    def local_sizes(self) -> tuple[int, int]:
        return self.input_size, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        copy_checked(param, loaded, name)

    def prepare_for_cpu(self) -> None:
        """Once loaded, on CPU: the weight laid out for ``linear`` (``pack_weight``)."""
        self.packed_weight = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, 0, 1)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks."""

    def __init__(self, input_size, output_size, bias=False, tp_rank=0, tp_size=1):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)

    def local_sizes(self) -> tuple[int, int]:
        return self.input_size, _divide(self.output_size, self.tp_size, "output size")

    def weight_loader(self, param, loaded, name=""):
        shard = param.shape[0]
        copy_checked(
            param,
            loaded.narrow(0, self.tp_rank * shard, shard)
            if loaded.shape[0] == shard * self.tp_size
            else loaded,
            name,
        )


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; the caller reduces the partial outputs."""

    def __init__(self, input_size, output_size, bias=False, tp_rank=0, tp_size=1):
        super().__init__(input_size, output_size, bias, tp_rank, tp_size)

    def local_sizes(self) -> tuple[int, int]:
        return _divide(self.input_size, self.tp_size, "input size"), self.output_size

    def weight_loader(self, param, loaded, name=""):
        if (
            param.dim() == 2
            and loaded.dim() == 2
            and loaded.shape[1] == param.shape[1] * self.tp_size
        ):
            loaded = loaded.narrow(1, self.tp_rank * param.shape[1], param.shape[1])
        copy_checked(param, loaded, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once (rank 0) so a sum over ranks adds it exactly once.
        bias = self.bias if self.tp_rank == 0 else None
        return linear(x, self.weight, bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored in one weight, e.g. gate_proj | up_proj.

    ``shard_id`` is the index of the checkpoint tensor in ``output_sizes``.
    """

    def __init__(self, input_size, output_sizes: list[int], bias=False, tp_rank=0, tp_size=1):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, name="", shard_id: int | None = None):
        if shard_id is None:  # a fused checkpoint tensor: split it into its parts
            for i, part in enumerate(loaded.split(self.output_sizes, dim=0)):
                self.weight_loader(param, part, name, i)
            return
        local = [_divide(s, self.tp_size, "output size") for s in self.output_sizes]
        full_shape = (self.output_sizes[shard_id], *param.shape[1:])
        if tuple(loaded.shape) != full_shape:
            copy_checked(param.new_empty(full_shape), loaded, name)  # raises, naming both
        offset, rows = sum(local[:shard_id]), local[shard_id]
        src = loaded.narrow(0, self.tp_rank * rows, rows)
        copy_checked(param.data.narrow(0, offset, rows), src, name)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj | k_proj | v_proj in one weight; KV heads are replicated when fewer than ranks."""

    def __init__(
        self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, tp_rank=0, tp_size=1
    ):
        if num_kv_heads >= tp_size:
            _divide(num_kv_heads, tp_size, "number of KV heads")
        elif tp_size % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size {tp_size} is not a multiple of the number "
                f"of KV heads ({num_kv_heads})"
            )
        self.head_dim = head_dim
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        self.num_heads = _divide(num_heads, tp_size, "number of attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        output = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, name="", shard_id: str | None = None):
        if shard_id is None:  # a fused checkpoint tensor: split it into q, k, v
            sizes = [self.total_heads[k] * self.head_dim for k in "qkv"]
            for key, part in zip("qkv", loaded.split(sizes, dim=0)):
                self.weight_loader(param, part, name, key)
            return
        full_shape = (self.total_heads[shard_id] * self.head_dim, *param.shape[1:])
        if tuple(loaded.shape) != full_shape:
            copy_checked(param.new_empty(full_shape), loaded, name)  # raises, naming both
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, rows = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        src = loaded.narrow(0, rank * rows, rows)
        copy_checked(param.data.narrow(0, offset, rows), src, name)
