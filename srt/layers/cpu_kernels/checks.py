"""What each CPU kernel requires of its arguments, checked before the C code runs.

The kernels read and write through raw pointers, so a mis-shaped checkpoint or a bug upstream
would otherwise become an out-of-bounds access inside the server. One function per op checks
what is cheap to check from metadata: devices, dtypes, ranks, shapes against each other,
contiguity, the head grouping. Each failure raises a ``ValueError`` naming the op and the
argument. The index ranges that depend on the data (the rows, lengths and slots the attention
kernels follow, rope's positions) are checked by the C code itself, before it writes anything,
and reported through ``index_error``. The fake implementations call the same functions, so a
bad call also fails while ``torch.compile`` traces it.
"""

from __future__ import annotations

import torch


def _fail(op: str, argument: str, problem: str) -> None:
    raise ValueError(f"srt::{op}: {argument} {problem}")


def _tensor(
    op: str, name: str, t: torch.Tensor, dtype: torch.dtype, dims: int, contiguous: bool = True
) -> None:
    # is_cpu and dim() rather than device.type and shape: these run on every call of a decode
    # step, and the attributes that build Python objects cost several times more.
    if not t.is_cpu or t.dtype != dtype or t.dim() != dims:
        _fail(op, name, f"must be a {dims}-d {dtype} CPU tensor, not {t.dim()}-d {t.dtype} "
              f"on {t.device}")  # fmt: skip
    if contiguous and not t.is_contiguous():
        _fail(op, name, "must be contiguous")


def _equal(op: str, name: str, what: str, value: int, expected: int) -> None:
    if value != expected:
        _fail(op, name, f"has {what} {value}, expected {expected}")


# The weight dtypes the GEMM kernels read, with the code the C functions take for each.
WEIGHT_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}
# The activation (and KV cache) dtypes the norm, rope and attention kernels take.
ACT_TYPES = {torch.float32: 0, torch.bfloat16: 1}


def _act_dtype(op: str, name: str, t: torch.Tensor) -> torch.dtype:
    if t.dtype not in ACT_TYPES:
        _fail(op, name, f"has dtype {t.dtype}; the kernel takes {list(ACT_TYPES)}")
    return t.dtype


def _check_weight(
    op: str, name: str, panels: torch.Tensor, dims: int, scales: torch.Tensor | None, group: int
) -> None:
    """panels [..., K, P] of a WEIGHT_TYPES dtype, contiguous; fp8 panels come with scales
    [..., ceil(K / group), P] float32 (group ≥ 1), the other dtypes without."""
    if panels.dtype not in WEIGHT_TYPES:
        _fail(op, name, f"has dtype {panels.dtype}; the kernels read {list(WEIGHT_TYPES)}")
    _tensor(op, name, panels, panels.dtype, dims)
    if panels.dtype != torch.float8_e4m3fn:
        if scales is not None:
            _fail(op, f"{name}'s scales", f"are given for {panels.dtype} panels")
        return
    if scales is None or group < 1:
        _fail(op, f"{name}'s scales", "and a group ≥ 1 are required for fp8 panels")
    _tensor(op, f"{name}'s scales", scales, torch.float32, dims)
    *lead, k_dim, width = panels.shape
    expected = (*lead, -(-k_dim // group), width)
    if tuple(scales.shape) != expected:
        _fail(op, f"{name}'s scales", f"{tuple(scales.shape)} are not {expected} (group {group})")


def check_panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    panel_width: int,
    scales: torch.Tensor | None = None,
    group: int = 0,
) -> None:
    """x [n, K] float32 or bfloat16, contiguous; panels [ceil(N / P), K, P] (with scales for
    fp8, see ``_check_weight``); 0 < N ≤ panels · P."""
    op = "panel_linear"
    _tensor(op, "x", x, _act_dtype(op, "x", x), 2)
    _check_weight(op, "panels", panels, 3, scales, group)
    num_panels, k_dim, width = panels.shape
    _equal(op, "panels", "panel width", width, panel_width)
    _equal(op, "x", "columns", x.shape[1], k_dim)
    if not 0 < out_features <= num_panels * width:
        _fail(op, "out_features", f"{out_features} is outside (0, {num_panels * width}]")


def check_fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    start: int,
    w13_panels: torch.Tensor,
    w2_panels: torch.Tensor,
    panel_width: int,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    groups: tuple[int, int] = (0, 0),
) -> None:
    """x [T, H] float32 or bfloat16; topk_weights (float32), topk_ids (int64) [T, topk]; w13_panels
    [E, 2I / P, H, P]; w2_panels [E, H / P, I, P], of one dtype (fp8 with their scales, see
    ``_check_weight``); all contiguous; start ≥ 0."""
    op = "fused_experts"
    _tensor(op, "x", x, _act_dtype(op, "x", x), 2)
    _tensor(op, "topk_weights", topk_weights, torch.float32, 2)
    _tensor(op, "topk_ids", topk_ids, torch.int64, 2)
    _check_weight(op, "w13_panels", w13_panels, 4, scales[0], groups[0])
    _check_weight(op, "w2_panels", w2_panels, 4, scales[1], groups[1])
    if w13_panels.dtype != w2_panels.dtype:
        _fail(op, "w2_panels", f"are {w2_panels.dtype}, w13_panels {w13_panels.dtype}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        _fail(op, "topk_ids", f"{tuple(topk_ids.shape)}, topk_weights "
              f"{tuple(topk_weights.shape)} and x {tuple(x.shape)} disagree")  # fmt: skip
    hidden = x.shape[1]
    num_experts, down_panels, inter, width = w2_panels.shape
    _equal(op, "w2_panels", "panel width", width, panel_width)
    _equal(op, "w13_panels", "panel width", w13_panels.shape[3], panel_width)
    _equal(op, "w13_panels", "experts", w13_panels.shape[0], num_experts)
    _equal(op, "w13_panels", "columns (2 · intermediate)", w13_panels.shape[1] * width, 2 * inter)
    _equal(op, "w13_panels", "rows (hidden)", w13_panels.shape[2], hidden)
    _equal(op, "w2_panels", "columns (hidden)", down_panels * width, hidden)
    if start < 0:
        _fail(op, "start", f"{start} is negative")


def check_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> None:
    """x [..., dim] float32 or bfloat16 (any strides); weight [dim] contiguous and residual
    shaped as x, both of x's dtype."""
    op = "rms_norm" if residual is None else "fused_add_rms_norm"
    dtype = _act_dtype(op, "x", x)
    if not x.is_cpu or x.dim() == 0:
        _fail(op, "x", f"must be a CPU tensor of 1 or more dims, not {tuple(x.shape)} on "
              f"{x.device}")  # fmt: skip
    _tensor(op, "weight", weight, dtype, 1)
    _equal(op, "weight", "size", weight.shape[0], x.shape[-1])
    if not eps >= 0:
        _fail(op, "eps", f"{eps} is not ≥ 0")
    if residual is not None:
        _tensor(op, "residual", residual, dtype, x.dim(), contiguous=False)
        if residual.shape != x.shape:
            _fail(op, "residual", f"{tuple(residual.shape)} is not x's {tuple(x.shape)}")


def _check_cache(op: str, q: torch.Tensor, k_buf, v_buf, req_to_token) -> None:
    """q [rows, H, D]; keys [slots, Hk, D] and values [slots, Hk, Dv] with H % Hk == 0, heads
    contiguous (a view of the keys' first columns is fine: MLA), all float32 or all bfloat16;
    req_to_token int64 [R, L] with contiguous rows."""
    dtype = _act_dtype(op, "q", q)
    _tensor(op, "q", q, dtype, 3)
    _tensor(op, "k_buf", k_buf, dtype, 3, contiguous=False)
    _tensor(op, "v_buf", v_buf, dtype, 3, contiguous=False)
    _tensor(op, "req_to_token", req_to_token, torch.int64, 2, contiguous=False)
    heads, dim = q.shape[1:]
    kv_heads, v_dim = v_buf.shape[1:]
    _equal(op, "k_buf", "head dim", k_buf.shape[2], dim)
    _equal(op, "k_buf", "heads", k_buf.shape[1], kv_heads)
    if kv_heads == 0 or heads % kv_heads:
        _fail(op, "q", f"has {heads} heads, not a multiple of the cache's {kv_heads}")
    if k_buf.stride(2) != 1 or k_buf.stride(1) != dim or v_buf.stride(2) != 1:
        _fail(op, "k_buf", "and v_buf must have contiguous heads")
    if v_buf.stride(1) != v_dim and kv_heads > 1:
        _fail(op, "v_buf", "must have contiguous heads")
    if req_to_token.stride(1) != 1:
        _fail(op, "req_to_token", "must have contiguous rows")


def check_decode_attention(
    q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale: float
) -> None:
    """The cache as ``_check_cache``; req_pool_indices and seq_lens int64 [B], contiguous."""
    op = "decode_attention"
    _check_cache(op, q, k_buf, v_buf, req_to_token)
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        _tensor(op, name, t, torch.int64, 1)
        _equal(op, name, "length", t.shape[0], q.shape[0])


def check_extend_attention(q, k_buf, v_buf, req_to_token, seqs, scale: float) -> None:
    """The cache as ``_check_cache``; seqs int64 [4, B] with contiguous rows."""
    op = "extend_attention"
    _check_cache(op, q, k_buf, v_buf, req_to_token)
    _tensor(op, "seqs", seqs, torch.int64, 2, contiguous=False)
    _equal(op, "seqs", "rows", seqs.shape[0], 4)
    if seqs.stride(1) != 1:
        _fail(op, "seqs", "must have contiguous rows")


def check_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """x [T, H, rot] float32 or bfloat16 with its last dimension contiguous, rot even;
    positions int64 [T]; cos_sin [rows, rot] float32; both contiguous."""
    op = "rope"
    _tensor(op, "x", x, _act_dtype(op, "x", x), 3, contiguous=False)
    _tensor(op, "positions", positions, torch.int64, 1)
    _tensor(op, "cos_sin", cos_sin, torch.float32, 2)
    if x.stride(2) != 1:
        _fail(op, "x", "must have a contiguous last dimension")
    _equal(op, "positions", "length", positions.shape[0], x.shape[0])
    _equal(op, "cos_sin", "columns", cos_sin.shape[1], x.shape[2])
    if x.shape[2] % 2:
        _fail(op, "x", f"has an odd rotary dim {x.shape[2]}")


def check_store_kv(k, v, loc, k_cache, v_cache) -> None:
    """k [T, H, D] with contiguous heads (rows at a stride), k_cache [slots, H, D] of k's dtype
    (float32 or bfloat16) with contiguous slots' rows; v and v_cache likewise, or both None;
    loc int64 [T], contiguous."""
    op = "store_kv"
    dtype = _act_dtype(op, "k", k)
    _tensor(op, "loc", loc, torch.int64, 1)
    if (v is None) != (v_cache is None):
        _fail(op, "v", "and v_cache must be given together")
    for name, new, cache in (("k", k, k_cache), ("v", v, v_cache))[: 1 if v is None else 2]:
        _tensor(op, name, new, dtype, 3, contiguous=False)
        _tensor(op, f"{name}_cache", cache, dtype, 3, contiguous=False)
        _equal(op, name, "tokens", new.shape[0], loc.shape[0])
        if tuple(new.shape[1:]) != tuple(cache.shape[1:]):
            _fail(op, name, f"rows {tuple(new.shape[1:])} are not the cache's "
                  f"{tuple(cache.shape[1:])}")  # fmt: skip
        for t in (new, cache):
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                _fail(op, name, "and its cache must have contiguous heads")


def check_select_experts(logits, top_k: int, groups: int, topk_group: int, bias, counts) -> None:
    """logits [T, E] float32 or bfloat16, contiguous; 1 ≤ top_k ≤ E (≤ the experts of the
    chosen groups, where E is split into ``groups`` > 1 groups, ``topk_group`` of them chosen);
    bias float32 [E]; each of ``counts`` int64 [E]; all contiguous."""
    op = "select_experts"
    _tensor(op, "logits", logits, _act_dtype(op, "logits", logits), 2)
    experts = logits.shape[1]
    if groups > 1 and (experts % groups or not 1 <= topk_group <= groups):
        _fail(op, "groups", f"{groups} (choosing {topk_group}) do not split {experts} experts")
    chosen = experts * topk_group // groups if groups > 1 else experts
    if not 1 <= top_k <= chosen:
        _fail(op, "top_k", f"{top_k} is outside [1, {chosen}]")
    named = [("bias", bias, torch.float32)] + [("counts", c, torch.int64) for c in counts]
    for name, t, dtype in named:
        if t is not None:
            _tensor(op, name, t, dtype, 1)
            _equal(op, name, "length", t.shape[0], experts)


# The C kernels' index checks (csrc/cpu_kernels.h): per op, status code → (argument, problem).
_INDEX_ERRORS = {
    "decode_attention": {
        -2: ("req_pool_indices", "holds a row outside req_to_token"),
        -3: ("seq_lens", "holds a length outside [1, req_to_token's width]"),
        -4: ("req_to_token", "holds a slot outside the KV cache in a sequence's row"),
    },
    "extend_attention": {
        -2: ("seqs", "holds a row outside req_to_token"),
        -3: ("seqs", "holds a prefix + extend length outside [0, req_to_token's width]"),
        -4: ("req_to_token", "holds a slot outside the KV cache in a sequence's row"),
        -5: ("seqs", "places a sequence's queries outside q's rows"),
    },
    "rope": {-6: ("positions", "holds a position outside the cos/sin table")},
    "store_kv": {-4: ("loc", "holds a slot outside the KV cache")},
    "gather_rows": {-7: ("indices", "hold a row outside the table")},
}


def index_error(op: str, status: int) -> Exception:
    """The exception for a kernel's nonzero status: out of memory or a failed index check."""
    if status == -1:
        return MemoryError(f"srt::{op}: out of memory for the kernel's own buffers")
    argument, problem = _INDEX_ERRORS[op][status]
    error = PositionOutsideTable if status == -6 else ValueError
    return error(f"srt::{op}: {argument} {problem}")


class PositionOutsideTable(ValueError):
    """rope: a position past the end of the cos/sin table (the caller grows the table)."""
