"""The attention kernels as torch ops, over the paged KV cache where it lies:
``srt::decode_attention``, ``srt::extend_attention`` and ``srt::store_kv`` (a step's keys and
values written into their slots). Registered and called as the GEMMs are (``ops.py``)."""

from __future__ import annotations

import torch

from srt.layers.cpu_kernels import checks, ops

# --- decode_attention and extend_attention ------------------------------------------------


def _cache_args(q, k_buf, v_buf, req_to_token) -> tuple:
    """The C functions' arguments from heads to num_slots, after q's pointer (which comes
    first) and the batch sizes (which the caller places after it)."""
    _, kv_heads, v_dim = v_buf.shape
    num_slots = min(k_buf.shape[0], v_buf.shape[0])
    return (
        q.data_ptr(), q.shape[1], q.shape[2], k_buf.data_ptr(), k_buf.stride(0),
        v_buf.data_ptr(), v_buf.stride(0), v_dim, kv_heads, req_to_token.data_ptr(),
        req_to_token.stride(0), *req_to_token.shape, num_slots,
    )  # fmt: skip


def _attention_out(q: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v_buf.shape[2])


def _decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    checks.check_decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale)
    out = _attention_out(q, v_buf)
    q_ptr, *cache = _cache_args(q, k_buf, v_buf, req_to_token)
    status = ops._lib().srt_decode_attention(
        checks.ACT_TYPES[q.dtype], q_ptr, q.shape[0], *cache, req_pool_indices.data_ptr(),
        seq_lens.data_ptr(), scale, out.data_ptr(),
    )  # fmt: skip
    ops._status("decode_attention", status)
    return out


def _decode_attention_fake(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale):
    checks.check_decode_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale)
    return _attention_out(q, v_buf)


_decode_attention_op = ops._op("decode_attention", _decode_attention, _decode_attention_fake)


def decode_attention(
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
    args = (
        q.contiguous(), k_buf, v_buf, req_to_token,
        req_pool_indices.to(torch.int64).contiguous(), seq_lens.to(torch.int64).contiguous(),
        scale,
    )  # fmt: skip
    return _decode_attention_op(*args) if ops._observed() else _decode_attention(*args)


def _extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    seqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    checks.check_extend_attention(q, k_buf, v_buf, req_to_token, seqs, scale)
    out = _attention_out(q, v_buf)
    q_ptr, *cache = _cache_args(q, k_buf, v_buf, req_to_token)
    status = ops._lib().srt_extend_attention(
        checks.ACT_TYPES[q.dtype], q_ptr, q.shape[0], seqs.shape[1], *cache,
        *(seqs[i].data_ptr() for i in range(4)), scale, out.data_ptr(),
    )  # fmt: skip
    ops._status("extend_attention", status)
    return out


def _extend_attention_fake(q, k_buf, v_buf, req_to_token, seqs, scale):
    checks.check_extend_attention(q, k_buf, v_buf, req_to_token, seqs, scale)
    return _attention_out(q, v_buf)


_extend_attention_op = ops._op("extend_attention", _extend_attention, _extend_attention_fake)


def extend_attention(
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
    args = (q.contiguous(), k_buf, v_buf, req_to_token, seqs, scale)
    return _extend_attention_op(*args) if ops._observed() else _extend_attention(*args)


# --- store_kv: a step's keys and values into their cache slots ------------------------------


def _store_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    loc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
) -> None:
    checks.check_store_kv(k, v, loc, k_cache, v_cache)
    num_slots = k_cache.shape[0] if v_cache is None else min(k_cache.shape[0], v_cache.shape[0])
    values = (None, 0, 0, None, 0) if v is None else (
        v.data_ptr(), v.stride(0), v.shape[1] * v.shape[2], v_cache.data_ptr(), v_cache.stride(0)
    )  # fmt: skip
    status = ops._lib().srt_store_kv(
        checks.ACT_TYPES[k.dtype], k.shape[0], loc.data_ptr(), num_slots, k.data_ptr(),
        k.stride(0), k.shape[1] * k.shape[2], k_cache.data_ptr(), k_cache.stride(0), *values,
    )  # fmt: skip
    ops._status("store_kv", status)


def _store_kv_fake(k, v, loc, k_cache, v_cache) -> None:
    checks.check_store_kv(k, v, loc, k_cache, v_cache)


_store_kv_op = ops._op("store_kv", _store_kv, _store_kv_fake, mutates=("k_cache", "v_cache"))


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor | None,
    loc: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
) -> None:
    """Writes token t's keys ``k [T, Hk, D]`` into slot ``loc[t]`` (int64) of ``k_cache
    [slots, Hk, D]``, and its values ``v`` into ``v_cache`` likewise (None, None: MLA, whose
    values are its keys' first columns), all of one dtype (float32 or bfloat16). Raises
    before writing anything when a slot lies outside the cache."""
    k = k if k.stride(-1) == 1 and k.stride(1) == k.shape[2] else k.contiguous()
    if v is not None and (v.stride(-1) != 1 or v.stride(1) != v.shape[2]):
        v = v.contiguous()
    args = (k, v, loc.to(torch.int64).contiguous(), k_cache, v_cache)
    _store_kv_op(*args) if ops._observed() else _store_kv(*args)
