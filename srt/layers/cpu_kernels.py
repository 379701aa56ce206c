"""CPU kernels in C for float32: a linear layer over weights packed in panels
(``panel_linear``), the routed experts of a MoE layer in one call (``fused_experts``) and
RMSNorm with its residual add (``rms_norm``), all in ``cpu_kernels.c``; decode attention over the
paged KV cache (``decode_attention``) and rotary embedding (``rope``), in ``cpu_attention.c``;
causal extend attention over the same cache (``extend_attention``), in
``cpu_extend_attention.c``.

The C files are compiled on first use with the machine's C compiler for the machine's own
instruction set, into a cache directory keyed by the source, the compiler and the processor
(``$XDG_CACHE_HOME/srt/kernels``, else ``~/.cache/srt/kernels``). Where there is no compiler,
the processor lacks AVX2 (x86 with AVX2 and FMA, or AVX-512, is what its register blocks are
sized for), or ``SRT_CPU_KERNELS=0`` is set, ``load_library`` returns None and the layers
keep their PyTorch (oneDNN) paths. It links OpenMP, which resolves to the runtime torch has already
loaded, so the kernel's threads are torch's threads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cpu_kernels.c", "cpu_attention.c", "cpu_extend_attention.c")
]
HEADER = Path(__file__).with_suffix(".h")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# Per thread, the kernel's work buffer, grown as needed and kept (see the C file).
_work = threading.local()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "srt" / "kernels"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compile(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join(
            [*(f.read_text() for f in (HEADER, *SOURCES)), " ".join(CFLAGS), version, _cpu_flags()]
        ).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Ranks starting together each compile to a file of their own and rename it into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, no compiler, no AVX2; logged once)."""
    if os.environ.get("SRT_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: CPU kernels off, layers run in PyTorch")
        return None
    try:
        lib = ctypes.CDLL(str(_compile(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("CPU kernels not built (%s): layers run in PyTorch", detail)
        return None
    if not lib.srt_kernel_is_fast():
        logger.info("no AVX2/AVX-512 on this CPU: CPU kernels off, layers run in PyTorch")
        return None
    lib.srt_fused_experts_f32.restype = ctypes.c_int
    lib.srt_fused_experts_f32.argtypes = [_ptr, _i64, _i64, _ptr, _ptr] + [_i64] * 4 + [_ptr] * 4
    lib.srt_panel_width.restype = ctypes.c_int64
    lib.srt_panel_width.argtypes = []
    lib.srt_panel_linear_f32.restype = None
    lib.srt_panel_linear_f32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr]
    lib.srt_rms_norm_f32.restype = None
    lib.srt_rms_norm_f32.argtypes = [_ptr] + [_i64] * 4 + [_ptr] * 3 + [ctypes.c_float, _ptr]
    lib.srt_decode_attention_f32.restype = ctypes.c_int
    lib.srt_decode_attention_f32.argtypes = (
        [_ptr] + [_i64] * 3 + [_ptr, _i64, _ptr] + [_i64] * 3 + [_ptr, _i64, _ptr, _ptr]
        + [ctypes.c_float, _ptr]
    )  # fmt: skip
    lib.srt_extend_attention_f32.restype = ctypes.c_int
    lib.srt_extend_attention_f32.argtypes = (
        [_ptr] + [_i64] * 3 + [_ptr, _i64, _ptr] + [_i64] * 3 + [_ptr, _i64] + [_ptr] * 4
        + [ctypes.c_float, _ptr]
    )  # fmt: skip
    lib.srt_rope_f32.restype = ctypes.c_int
    lib.srt_rope_f32.argtypes = [_ptr] + [_i64] * 5 + [_ptr, _ptr, _i64, ctypes.c_int, _ptr]
    return lib


def can_pack(lib: ctypes.CDLL, weight: torch.Tensor) -> bool:
    """Whether a weight ``[N, K]`` (or stacked ``[E, N, K]``) fits the kernels: float32 on
    CPU. The experts' kernel also needs N to fill whole panels (``fills_panels``)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def fills_panels(lib: ctypes.CDLL, weight: torch.Tensor) -> bool:
    """Whether N is a whole number of panels (no padded columns)."""
    return weight.shape[-2] % lib.srt_panel_width() == 0


def pack_panels(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` → ``[..., ceil(N / P), K, P]`` for the kernels' panels of ``P`` columns:
    each panel's columns contiguous per k; columns past N (the last panel's) zero."""
    *lead, n, k = weight.shape
    p = lib.srt_panel_width()
    padded = -(-n // p) * p
    weight = weight.detach()
    if padded != n:
        weight = torch.cat((weight, weight.new_zeros(*lead, padded - n, k)), dim=-2)
    return weight.reshape(*lead, padded // p, p, k).transpose(-1, -2).contiguous()


def fused_experts(
    lib: ctypes.CDLL,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    start: int,
    w13_panels: torch.Tensor,
    w2_panels: torch.Tensor,
) -> torch.Tensor:
    """Σ_k weight · expert(x) over this rank's experts ``[start, start + E)``, ``[T, H]``."""
    x = hidden_states.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    num_experts, _, inter, _ = w2_panels.shape
    work = _work_buffer(ids.numel() * (x.shape[1] + inter))
    status = lib.srt_fused_experts_f32(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        ids.data_ptr(),
        weights.data_ptr(),
        ids.shape[1],
        start,
        num_experts,
        inter,
        w13_panels.data_ptr(),
        w2_panels.data_ptr(),
        out.data_ptr(),
        work.data_ptr(),
    )
    _check_memory(status, "CPU expert kernel: out of memory for its work buffers")
    return out


def _check_memory(status: int, message: str) -> None:
    """The kernels return -1 where a buffer of their own could not be allocated."""
    if status:
        raise MemoryError(message)


def _work_buffer(numel: int) -> torch.Tensor:
    buffer = getattr(_work, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _work.buffer = torch.empty(max(numel, 1), dtype=torch.float32)
    return buffer


def panel_linear(
    lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, out_features: int | None = None
) -> torch.Tensor:
    """``x [n, K]`` times a weight ``[N, K]`` transposed, from its panels
    ``[ceil(N / P), K, P]`` (N: ``out_features``, else every panel's columns): ``[n, N]``."""
    x = x.contiguous()
    num_panels, k_dim, width = panels.shape
    out = x.new_empty(x.shape[0], out_features or num_panels * width)
    lib.srt_panel_linear_f32(
        x.data_ptr(), x.shape[0], k_dim, panels.data_ptr(), out.shape[1], out.data_ptr()
    )
    return out


def rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF's RMSNorm over the last dimension of float32 ``x`` (``[..., dim]``): norm(x), or with
    ``residual`` (norm(x + residual), x + residual). ``x`` may be a view whose rows of ``dim``
    are not contiguous with each other (the heads of a split QKV output); anything more
    irregular is copied first."""
    dim = x.shape[-1]
    lead = x.reshape(x.shape[0], -1, dim) if x.dim() > 1 else x.reshape(1, 1, dim)
    if lead.stride(2) != 1 or lead.stride(1) != dim:
        lead = lead.contiguous()
    out = torch.empty(lead.shape, dtype=x.dtype)
    total = None
    if residual is not None:
        residual = residual.contiguous()
        total = torch.empty_like(out)
    lib.srt_rms_norm_f32(
        lead.data_ptr(),
        lead.shape[0] * lead.shape[1],
        lead.shape[1],
        lead.stride(0),
        dim,
        None if residual is None else residual.data_ptr(),
        None if total is None else total.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
    )
    out = out.view(x.shape)
    return out if residual is None else (out, total.view(x.shape))


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode query per sequence, ``q [B, H, D]``, over its ``seq_lens[b]`` (≥ 1) cached
    tokens, read in place: keys ``k_buf [slots, Hk, D]``, values ``v_buf [slots, Hk, Dv]`` (a
    view of the keys' first columns is fine: MLA), the slots in row ``req_pool_indices[b]`` of
    ``req_to_token``. Returns ``[B, H, Dv]``."""
    q = q.contiguous()
    batch, heads, dim = q.shape
    _check_cache_layout(k_buf, v_buf, req_to_token, dim, "decode_attention")
    _, kv_heads, v_dim = v_buf.shape
    rows = req_pool_indices.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = q.new_empty(batch, heads, v_dim)
    status = lib.srt_decode_attention_f32(
        q.data_ptr(), batch, heads, dim,
        k_buf.data_ptr(), k_buf.stride(0), v_buf.data_ptr(), v_buf.stride(0), v_dim, kv_heads,
        req_to_token.data_ptr(), req_to_token.stride(0), rows.data_ptr(), lens.data_ptr(),
        scale, out.data_ptr(),
    )  # fmt: skip
    _check_memory(status, "CPU decode attention: out of memory for its score buffers")
    return out


def _check_cache_layout(k_buf, v_buf, req_to_token, dim: int, name: str) -> None:
    kv_heads, v_dim = v_buf.shape[1:]
    if k_buf.stride(2) != 1 or k_buf.stride(1) != dim or v_buf.stride(2) != 1:
        raise ValueError(f"{name}: KV buffers must have contiguous heads")
    if v_buf.stride(1) != v_dim and kv_heads > 1:
        raise ValueError(f"{name}: value heads must be contiguous")
    if req_to_token.dtype != torch.int64 or req_to_token.stride(1) != 1:
        raise ValueError(f"{name}: req_to_token must be int64 with contiguous rows")


def extend_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' cached ones, read in place:
    ``q [T, H, D]`` holds each sequence's new tokens in turn; ``seqs [4, B]`` (int64) holds, per
    sequence, its row of ``req_to_token``, its cached prefix length, its number of new tokens
    and its first row of ``q``. The new tokens' keys and values must already be in the cache
    (``k_buf [slots, Hk, D]``, ``v_buf [slots, Hk, Dv]``). Returns ``[T, H, Dv]``."""
    if seqs.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[0] != 4 or seqs.stride(1) != 1:
        raise ValueError("extend_attention: seqs must be int64 [4, B] with contiguous rows")
    q = q.contiguous()
    tokens, heads, dim = q.shape
    _check_cache_layout(k_buf, v_buf, req_to_token, dim, "extend_attention")
    _, kv_heads, v_dim = v_buf.shape
    out = q.new_empty(tokens, heads, v_dim)
    status = lib.srt_extend_attention_f32(
        q.data_ptr(), seqs.shape[1], heads, dim,
        k_buf.data_ptr(), k_buf.stride(0), v_buf.data_ptr(), v_buf.stride(0), v_dim, kv_heads,
        req_to_token.data_ptr(), req_to_token.stride(0),
        *(seqs[i].data_ptr() for i in range(4)), scale, out.data_ptr(),
    )  # fmt: skip
    _check_memory(status, "CPU extend attention: out of memory for its tiles")
    return out


def rope(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    neox: bool,
) -> torch.Tensor | None:
    """Rotary embedding of float32 ``x [T, H, rot]`` (a view whose last dimension is
    contiguous is read where it lies) at ``positions [T]`` (int64), from ``cos_sin [rows, rot]``
    (per position, the cosines of the rot/2 frequencies, then their sines). Returns a new
    ``[T, H, rot]``, or None when a position lies outside the table."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, heads, rot = x.shape
    out = torch.empty(tokens, heads, rot, dtype=x.dtype)
    status = lib.srt_rope_f32(
        x.data_ptr(), tokens, heads, x.stride(0), x.stride(1), rot,
        positions.data_ptr(), cos_sin.data_ptr(), cos_sin.shape[0], int(neox), out.data_ptr(),
    )  # fmt: skip
    return None if status else out
