"""The CPU kernels as torch ops: ``srt::panel_linear``, ``srt::fused_experts``,
``srt::select_experts``, ``srt::rms_norm``, ``srt::fused_add_rms_norm`` and ``srt::rope`` (the
attention ones in ``attention_ops.py``).

Each op is registered with ``torch.library.custom_op`` (a schema, a name in the profiler, a
fake implementation that ``torch.compile`` traces with) and its implementation checks its
arguments (``checks.py``) before calling the C code. The module's functions are what the layers
call. They go through torch's dispatcher where something watches the call: while
``torch.compile`` traces, and while the profiler records. Elsewhere they call the same checked
implementation directly: the dispatcher's round trip into Python costs 10-25 µs a call on this
project's CPUs (measured with a no-op custom op), against a decode step's 10 or so kernel calls
per layer of a few µs to a few hundred each.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from srt.layers.cpu_kernels import checks
from srt.layers.cpu_kernels.build import load_library

# Per thread, the experts kernel's work buffer, grown as needed and kept (see cpu_kernels.c).
_work = threading.local()
# The CPU graph being captured (``srt.model_executor.cpu_graph``): it records every C call.
recorder = None


def _lib():
    lib = load_library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (see srt.layers.cpu_kernels)")
    return lib if recorder is None else recorder.library(lib)


def work_buffer_in_use() -> torch.Tensor | None:
    """This thread's work buffer as it stands (a CPU graph keeps the one its calls point into)."""
    return getattr(_work, "buffer", None)


def panel_width() -> int:
    """P, the number of output columns in one panel of a packed weight."""
    return _lib().panel_width


def _observed() -> bool:
    """Whether a call should go through torch's dispatcher (see the module docstring)."""
    return torch.compiler.is_compiling() or torch._C._autograd._profiler_enabled()


def _status(op: str, status: int) -> None:
    if status:
        raise checks.index_error(op, status)


def _op(name: str, impl: Callable, fake: Callable, mutates: tuple[str, ...] = ()):
    """Registers ``srt::name`` (schema from impl's annotations; ``mutates``: the arguments it
    writes) and returns its overload."""
    torch.library.custom_op(f"srt::{name}", impl, mutates_args=mutates, device_types="cpu")
    torch.library.register_fake(f"srt::{name}", fake)
    return getattr(torch.ops.srt, name).default


# --- panel_linear: x [n, K] · Wᵀ from W's panels -------------------------------------------


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _work_buffer(numel: int) -> torch.Tensor:
    """This thread's float32 work buffer of at least ``numel`` elements (the GEMMs' bf16
    activations widened, the experts' intermediate products)."""
    buffer = getattr(_work, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _work.buffer = torch.empty(max(numel, 1), dtype=torch.float32)
    return buffer


def _act_work(x: torch.Tensor, numel: int) -> int:
    """The work buffer's address, with room for ``numel`` floats where ``x`` is bf16 (widened
    there); float32 needs none."""
    return _work_buffer(numel if x.dtype != torch.float32 else 0).data_ptr()


def _panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    scales: torch.Tensor | None = None,
    group: int = 0,
) -> torch.Tensor:
    checks.check_panel_linear(x, panels, out_features, panel_width(), scales, group)
    out = x.new_empty(x.shape[0], out_features)
    rows, k_dim = x.shape
    _lib().srt_panel_linear(
        checks.ACT_TYPES[x.dtype], x.data_ptr(), rows, k_dim, checks.WEIGHT_TYPES[panels.dtype],
        panels.data_ptr(), _ptr(scales), group, out_features, out.data_ptr(),
        _act_work(x, rows * (k_dim + out_features)),
    )  # fmt: skip
    return out


def _panel_linear_fake(x, panels, out_features, scales=None, group=0):
    checks.check_panel_linear(x, panels, out_features, panels.shape[2], scales, group)
    return x.new_empty(x.shape[0], out_features)


_panel_linear_op = _op("panel_linear", _panel_linear, _panel_linear_fake)


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int | None = None,
    scales: torch.Tensor | None = None,
    group: int = 0,
) -> torch.Tensor:
    """``x [n, K]`` (float32 or bfloat16) times a weight ``[N, K]`` transposed, from its panels
    ``[ceil(N / P), K, P]`` (N: ``out_features``, else every panel's columns): ``[n, N]`` of
    x's dtype, summed in float32. Panels are float32, bfloat16 or float8_e4m3fn; fp8 panels
    come with their ``scales`` (``pack_scales``) and the K ``group`` each scale covers."""
    args = (x.contiguous(), panels, out_features or panels.shape[0] * panels.shape[2])
    args = (*args, scales, group)
    return _panel_linear_op(*args) if _observed() else _panel_linear(*args)


# --- fused_experts: Σ_k weight · expert(x) over this rank's experts ------------------------


def _fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    start: int,
    w13_panels: torch.Tensor,
    w2_panels: torch.Tensor,
    w13_scales: torch.Tensor | None = None,
    w2_scales: torch.Tensor | None = None,
    group13: int = 0,
    group2: int = 0,
) -> torch.Tensor:
    checks.check_fused_experts(
        x, topk_weights, topk_ids, start, w13_panels, w2_panels, panel_width(),
        (w13_scales, w2_scales), (group13, group2),
    )  # fmt: skip
    out = torch.empty_like(x)
    num_experts, _, inter, _ = w2_panels.shape
    tokens, hidden = x.shape
    widened = 2 * tokens * hidden if x.dtype != torch.float32 else 0
    work = _work_buffer(topk_ids.numel() * (hidden + inter) + widened)
    status = _lib().srt_fused_experts(
        checks.ACT_TYPES[x.dtype], x.data_ptr(), tokens, hidden, topk_ids.data_ptr(),
        topk_weights.data_ptr(), topk_ids.shape[1], start, num_experts, inter,
        checks.WEIGHT_TYPES[w13_panels.dtype], w13_panels.data_ptr(), _ptr(w13_scales), group13,
        w2_panels.data_ptr(), _ptr(w2_scales), group2, out.data_ptr(), work.data_ptr(),
    )  # fmt: skip
    _status("fused_experts", status)
    return out


def _fused_experts_fake(
    x, topk_weights, topk_ids, start, w13_panels, w2_panels, s13=None, s2=None, g13=0, g2=0
):
    width = w2_panels.shape[3]
    checks.check_fused_experts(
        x, topk_weights, topk_ids, start, w13_panels, w2_panels, width, (s13, s2), (g13, g2)
    )
    return torch.empty_like(x)


_fused_experts_op = _op("fused_experts", _fused_experts, _fused_experts_fake)


def fused_experts(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    start: int,
    w13_panels: torch.Tensor,
    w2_panels: torch.Tensor,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    groups: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """Σ_k weight · expert(x) over this rank's experts ``[start, start + E)``, ``[T, H]`` of x's
    dtype (float32 or bfloat16; summed in float32); ids outside that range (other ranks'
    experts, or -1) add nothing. fp8 panels come with the ``scales`` of w13 and w2
    (``pack_scales``) and the K ``groups`` they cover."""
    args = (
        hidden_states.contiguous(),
        topk_weights.to(torch.float32).contiguous(),
        topk_ids.to(torch.int64).contiguous(),
        start,
        w13_panels,
        w2_panels,
        *scales,
        *groups,
    )
    return _fused_experts_op(*args) if _observed() else _fused_experts(*args)


# --- select_experts: the router's top-k ---------------------------------------------------


def _select_experts(
    logits: torch.Tensor,
    top_k: int,
    sigmoid: bool,
    renormalize: bool,
    groups: int,
    topk_group: int,
    scaling: float,
    bias: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    window: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_select_experts(logits, top_k, groups, topk_group, bias, (counts, window))
    tokens, experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int64)
    _lib().srt_select_experts(
        checks.ACT_TYPES[logits.dtype], logits.data_ptr(), tokens, experts, experts, _ptr(bias),
        int(sigmoid), top_k, groups, topk_group, int(renormalize), scaling, weights.data_ptr(),
        ids.data_ptr(), _ptr(counts), _ptr(window),
    )  # fmt: skip
    return weights, ids


def _select_experts_fake(logits, top_k, sigmoid, renormalize, groups, topk_group, scaling,
                         bias=None, counts=None, window=None):  # fmt: skip
    checks.check_select_experts(logits, top_k, groups, topk_group, bias, (counts, window))
    return logits.new_empty(logits.shape[0], top_k, dtype=torch.float32), logits.new_empty(
        logits.shape[0], top_k, dtype=torch.int64
    )


_select_experts_op = _op(
    "select_experts", _select_experts, _select_experts_fake, mutates=("counts", "window")
)


def select_experts(
    logits: torch.Tensor,
    cfg,
    bias: torch.Tensor | None = None,
    counts: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for ``logits [T, E]`` (float32 or bfloat16) under ``cfg`` (a
    ``srt.layers.moe.topk.TopKConfig``), as ``srt.layers.moe.topk.select_experts`` makes it:
    weights [T, top_k] float32 and ids [T, top_k] int64, best first. Each of ``counts`` (at
    most two int64 [E] rows: the expert-distribution recorder's) gains one per choice."""
    if cfg.scoring_func not in ("softmax", "sigmoid"):
        raise ValueError(f"unsupported scoring function {cfg.scoring_func!r}")
    grouped = bool(cfg.num_expert_group and cfg.topk_group and cfg.num_expert_group > 1)
    args = (
        logits.contiguous(), cfg.top_k, cfg.scoring_func == "sigmoid", cfg.renormalize,
        cfg.num_expert_group if grouped else 0, cfg.topk_group if grouped else 0,
        float(cfg.routed_scaling_factor), None if bias is None else bias.float(), *counts,
    )  # fmt: skip
    return _select_experts_op(*args) if _observed() else _select_experts(*args)


# --- rms_norm and fused_add_rms_norm ---------------------------------------------------------


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x's rows of dim as the kernel reads them: (tensor, rows, inner, ld), row i at element
    (i / inner) · ld + (i % inner) · dim, so that blocks of inner contiguous rows may lie at a
    stride (the heads of a split QKV output); anything more irregular is copied. Read from the
    strides on a decode step's path (a reshape costs as much as the kernel there)."""
    dim = x.shape[-1]
    if x.dim() == 2 and x.stride(1) == 1:
        return x, x.shape[0], 1, x.stride(0)
    if x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == dim:
        return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0)
    lead = x.reshape(x.shape[0], -1, dim) if x.dim() > 1 else x.reshape(1, 1, dim)
    if lead.stride(2) != 1 or lead.stride(1) != dim:
        lead = lead.contiguous()
    return lead, lead.shape[0] * lead.shape[1], lead.shape[1], lead.stride(0)


def _empty_like(x: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of x's shape and dtype (``torch.empty(x.shape, ...)`` costs twice
    as much on a decode step's path)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _norm_into(x, residual, total, weight, eps, out) -> None:
    lead, rows, inner, ld = _rows(x)
    _lib().srt_rms_norm(
        checks.ACT_TYPES[x.dtype], lead.data_ptr(), rows, inner, ld, x.shape[-1],
        None if residual is None else residual.data_ptr(),
        None if total is None else total.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
    )  # fmt: skip


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    checks.check_rms_norm(x, weight, eps, None)
    out = _empty_like(x)
    _norm_into(x, None, None, weight, eps, out)
    return out


def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    checks.check_rms_norm(x, weight, eps, residual)
    out, total = _empty_like(x), _empty_like(x)
    _norm_into(x, residual.contiguous(), total, weight, eps, out)
    return out, total


def _rms_norm_fake(x, weight, eps):
    checks.check_rms_norm(x, weight, eps, None)
    return torch.empty(x.shape, dtype=x.dtype)


def _fused_add_rms_norm_fake(x, residual, weight, eps):
    checks.check_rms_norm(x, weight, eps, residual)
    return torch.empty(x.shape, dtype=x.dtype), torch.empty(x.shape, dtype=x.dtype)


_rms_norm_op = _op("rms_norm", _rms_norm, _rms_norm_fake)
_fused_add_rms_norm_op = _op("fused_add_rms_norm", _fused_add_rms_norm, _fused_add_rms_norm_fake)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF's RMSNorm over the last dimension of ``x`` (``[..., dim]``, float32 or bfloat16, the
    weight and residual of the same dtype): norm(x), or with ``residual`` (norm(x + residual),
    x + residual), in float32 with each result rounded to the dtype where HF's rounds it.
    ``x`` may be a view whose rows of ``dim`` are not contiguous with each other (the heads of a
    split QKV output)."""
    if residual is None:
        return _rms_norm_op(x, weight, eps) if _observed() else _rms_norm(x, weight, eps)
    args = (x, residual, weight, eps)
    return _fused_add_rms_norm_op(*args) if _observed() else _fused_add_rms_norm(*args)


# --- rope --------------------------------------------------------------------------------------


def _rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool
) -> torch.Tensor:
    checks.check_rope(x, positions, cos_sin)
    tokens, heads, rot = x.shape
    out = x.new_empty(tokens, heads, rot)
    status = _lib().srt_rope(
        checks.ACT_TYPES[x.dtype], x.data_ptr(), tokens, heads, x.stride(0), x.stride(1), rot,
        positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0], int(neox), out.data_ptr(),
    )  # fmt: skip
    _status("rope", status)
    return out


def _rope_fake(x, positions, cos_sin, neox):
    checks.check_rope(x, positions, cos_sin)
    return torch.empty(x.shape, dtype=x.dtype)


_rope_op = _op("rope", _rope, _rope_fake)


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, neox: bool
) -> torch.Tensor:
    """Rotary embedding of ``x [T, H, rot]`` (float32 or bfloat16, computed in float32; a view
    whose last dimension is contiguous is read where it lies) at ``positions [T]`` (int64),
    from ``cos_sin [rows, rot]`` (per position, the cosines of the rot/2 frequencies, then
    their sines): a new ``[T, H, rot]``. Raises ``PositionOutsideTable`` when a position lies
    outside the table."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    args = (x, positions, cos_sin, neox)
    return _rope_op(*args) if _observed() else _rope(*args)
