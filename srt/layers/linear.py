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
from srt.layers.quantization import fp8
from srt.layers.quantization.fp8 import FP8_DTYPE


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """Copies a checkpoint tensor into a parameter (or its slice) of the same shape. An fp8
    tensor goes only into an fp8 parameter and back: converting one into the other would drop
    or miss its block scales, a wrong answer without an error."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(loaded.shape)}, "
            f"model expects {tuple(param.shape)}"
        )
    if (param.dtype == FP8_DTYPE) != (loaded.dtype == FP8_DTYPE):
        expected = "an fp8 weight (quantization_config fp8)" if param.dtype == FP8_DTYPE else (
            f"{param.dtype} (no fp8 quantization_config covers it)"
        )  # fmt: skip
        raise ValueError(f"checkpoint tensor {name} is {loaded.dtype}; srt expects {expected}")
    param.data.copy_(loaded)


class PanelWeight(NamedTuple):
    """A ``[N, K]`` weight in the CPU kernels' panels (fp8: with its packed scales and the K
    group each covers)."""

    panels: torch.Tensor
    out_features: int | None = None  # N, where it does not fill the last panel
    scales: torch.Tensor | None = None
    group: int = 0


def pack_weight(
    weight: torch.Tensor, scale: torch.Tensor | None = None, group: int = 0
) -> torch.Tensor | PanelWeight | None:
    """The weight ``[N, K]`` laid out for ``linear`` on CPU: the CPU kernels' panels, for
    float32, bf16 and fp8 weights (``scale``: its per-row scales with ``group``,
    ``srt.layers.quantization.fp8``) (``srt.layers.cpu_kernels``: as fast as oneDNN for many
    rows, faster for the few rows of decode; any N, the last panel padded); without the
    kernels, oneDNN's blocked layout (float32, or bf16 where the processor has oneDNN's bf16
    instructions); None where neither is available (``F.linear``; fp8 without the kernels:
    ``linear`` dequantizes). oneDNN on CPU is several times faster
    than ``F.linear`` (MKL) at every batch size: MKL picks a GEMV-like kernel for one row and a
    poorly blocked one for a few, and on AMD processors keeps to AVX2; oneDNN's kernel also
    gives each row the same result whatever the batch, so split and unsplit batches agree bit
    for bit. Measured in ``docs/benchmarks.md``."""
    if cpu_kernels.can_pack(weight):
        panels = cpu_kernels.pack_panels(weight)
        scales = None if scale is None else cpu_kernels.pack_scales(scale)
        return PanelWeight(panels, weight.shape[0], scales, group)
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    except RuntimeError:  # oneDNN's bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT
        return None


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
    scale: torch.Tensor | None = None,
    group: int = 0,
) -> torch.Tensor:
    """``F.linear``, through the CPU kernels or oneDNN with the ``packed`` weight when there
    is one. An fp8 ``weight`` comes with its per-row ``scale`` and ``group``."""
    if isinstance(packed, PanelWeight):
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype not in cpu_kernels.ACT_TYPES:
            rows = rows.to(torch.float32)
        out = cpu_kernels.panel_linear(rows, packed.panels, packed.out_features, *packed[2:])
        if bias is not None:
            out += bias
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
    if weight.dtype == FP8_DTYPE:
        return fp8_linear(x, weight, scale, group, bias)
    if packed is None or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    pad = padded_rows(num_rows) - num_rows
    if pad:
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out[:num_rows].view(*x.shape[:-1], out.shape[-1])


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` times an fp8 ``weight`` ``[N, K]`` with per-row ``scale``, without the CPU
    kernels' panels: on CUDA the Triton kernels (W8A8 from sm89, weight-only below:
    ``fp8_triton.fp8_linear``); elsewhere the weight dequantized to ``x``'s dtype for the
    call."""
    if x.is_cuda:
        from srt.layers.quantization import fp8_triton  # triton: imported on first use

        return fp8_triton.fp8_linear(x, weight, scale, group, bias)
    return F.linear(x, fp8.dequantize(weight, scale, group).to(x.dtype), bias)


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
        # fp8 (``use_fp8``, ``quantize_loaded``): per-row scales, their K group, the blocks.
        self.weight_scale_inv: nn.Parameter | None = None
        self.weight_group = 0
        self.fp8_block: tuple[int, int] | None = None
        # A layer whose weight its model reads as a matrix (MLA's kv_b_proj, split into its
        # absorbed parts) keeps it dense: an fp8 checkpoint's is dequantized at load.
        self.keep_dense = False

    def local_sizes(self) -> tuple[int, int]:
        return self.input_size, self.output_size

    def full_rows(self, shard_id=None) -> int:
        """The rows of the checkpoint tensor that loads as ``shard_id``."""
        return self.output_size

    def local_parts(self) -> list[int]:
        """This rank's rows of each checkpoint tensor fused into the weight, in order."""
        return [self.weight.shape[0]]

    @property
    def input_shard(self) -> int | None:
        """The width of this rank's share of the input dimension, where it is split."""
        return None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        copy_checked(param, loaded, name)

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Before loading an fp8 checkpoint: the weight as e4m3 and ``weight_scale_inv`` as
        per-row scales (``srt.layers.quantization.fp8``), expanded from the checkpoint's blocks
        of ``block`` when they load."""
        n, k = self.weight.shape
        self.fp8_block = block
        self.weight_group = fp8.group_for(block[1], self.input_shard)
        q = torch.empty(n, k, dtype=FP8_DTYPE, device=self.weight.device)
        scale = torch.empty(n, fp8.num_groups(k, self.weight_group), device=q.device)
        self._set_fp8(q, scale, self.weight.dtype)
        self.weight_scale_inv.weight_loader = self.scale_loader

    def _set_fp8(self, q: torch.Tensor, scale: torch.Tensor, dense_dtype: torch.dtype) -> None:
        self.dense_dtype = dense_dtype
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight_scale_inv = nn.Parameter(scale.to(torch.float32), requires_grad=False)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str, *shard) -> None:
        """A checkpoint's block scales ``[ceil(N / bn), ceil(K / bk)]`` → this rank's rows of the
        per-row scales, through ``weight_loader`` as the weight's rows go."""
        rows, (bn, bk) = self.full_rows(*shard), self.fp8_block
        grid = (-(-rows // bn), -(-self.input_size // bk))
        if tuple(loaded.shape) != grid:
            raise ValueError(
                f"{name} has a scale grid {tuple(loaded.shape)}, expected {grid} "
                f"for a [{rows}, {self.input_size}] weight in {bn}×{bk} blocks"
            )
        per_row = fp8.row_scales(loaded, rows, self.input_size, self.fp8_block, self.weight_group)
        self.weight_loader(param, per_row, name, *shard)

    def finish_fp8(self) -> None:
        """Once loaded: a ``keep_dense`` layer's fp8 weight dequantized to the model's dtype."""
        if self.keep_dense and self.weight_scale_inv is not None:
            dense = fp8.dequantize(self.weight, self.weight_scale_inv, self.weight_group)
            self.weight = nn.Parameter(dense.to(self.dense_dtype), requires_grad=False)
            self.weight_scale_inv = None

    def quantize_loaded(self, block: tuple[int, int]) -> None:
        """Online fp8 (``--quantization fp8`` on a bf16 or float32 checkpoint): the loaded
        weight quantized in ``block``'s format, this rank's shard of each fused part on its
        own (on one rank, the blocks an fp8 checkpoint of the same weights holds)."""
        if self.keep_dense:
            return
        self.fp8_block = block
        self.weight_group = fp8.group_for(block[1], self.input_shard)
        parts = self.weight.data.split(self.local_parts())
        quantized = [fp8.quantize_rows(part, block, self.weight_group) for part in parts]
        q, scale = (torch.cat(t) for t in zip(*quantized))
        self._set_fp8(q, scale, self.weight.dtype)

    def prepare_for_cpu(self) -> None:
        """Once loaded, on CPU: the weight laid out for ``linear`` (``pack_weight``)."""
        self.packed_weight = pack_weight(self.weight, self.weight_scale_inv, self.weight_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(
            x, self.weight, bias, self.packed_weight, self.weight_scale_inv, self.weight_group
        )


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

    @property
    def input_shard(self) -> int | None:
        return self.input_size // self.tp_size if self.tp_size > 1 else None

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
        return self._linear(x, self.bias if self.tp_rank == 0 else None)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored in one weight, e.g. gate_proj | up_proj.

    ``shard_id`` is the index of the checkpoint tensor in ``output_sizes``.
    """

    def __init__(self, input_size, output_sizes: list[int], bias=False, tp_rank=0, tp_size=1):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_rank, tp_size)

    def full_rows(self, shard_id: int | None = None) -> int:
        return self.output_size if shard_id is None else self.output_sizes[shard_id]

    def local_parts(self) -> list[int]:
        return [size // self.tp_size for size in self.output_sizes]

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

    def full_rows(self, shard_id: str | None = None) -> int:
        heads = self.total_heads
        return (heads[shard_id] if shard_id else sum(heads.values())) * self.head_dim

    def local_parts(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]

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
