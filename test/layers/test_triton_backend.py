"""The triton attention backend equals the PyTorch backend (SDPA) over the same paged
KV cache: decode and extend, multi-head, grouped-query, values narrower than keys and MLA's
absorbed form (one latent KV head, values a view of the keys); ragged lengths, cached prefixes,
lengths that cross the kernels' tiles, request rows out of order and scattered slots. Decode
launched twice on the same tensors follows new lengths copied into them (CUDA-graph replay).

Without CUDA the kernels run in Triton's interpreter, which must be on before they are defined.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from srt.layers.radix_attention import RadixAttention  # noqa: E402
from srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS, ROWS, CONTEXT = 160, 8, 48
# Compiled tl.dot takes no operand dim under 16 (fp16) / 8 (fp32); the interpreter takes any,
# so there small tiles cross with short sequences.
MIN_TILE = 16 if torch.cuda.is_available() else 1
# (heads, kv_heads, key dim, value dim, mla): MHA, GQA, Dv < Dk with a non-power-of-two key,
# MLA absorbed (kv_lora_rank 16 + rope 8; values the latent's first 16 columns).
LAYOUTS = {
    "mha": (2, 2, 8, 8, False),
    "gqa": (4, 2, 16, 16, False),
    "narrow_v": (4, 2, 24, 8, False),
    "mla": (4, 1, 24, 16, True),
}


def _setup(layout: str, seq_lens: list[int]):
    """A filled pool, a request table whose rows are out of order and whose slots are scattered,
    and the layer."""
    heads, kv_heads, dim, v_dim, mla = LAYOUTS[layout]
    torch.manual_seed(len(seq_lens) + sum(seq_lens))
    if mla:
        pool = MLATokenToKVPool(SLOTS, torch.float32, v_dim, dim - v_dim, 1, DEVICE)
        pool.kv_buffer[0][1:] = torch.randn(SLOTS, 1, dim)
    else:
        pool = MHATokenToKVPool(SLOTS, torch.float32, kv_heads, dim, 1, DEVICE, v_dim)
        pool.k_buffer[0][1:] = torch.randn(SLOTS, kv_heads, dim)
        pool.v_buffer[0][1:] = torch.randn(SLOTS, kv_heads, v_dim)
    req_pool = ReqToTokenPool(ROWS, CONTEXT, DEVICE)
    rows = torch.randperm(ROWS)[: len(seq_lens)].tolist()
    slots = (torch.randperm(SLOTS)[: sum(seq_lens)] + 1).tolist()
    for row, n in zip(rows, seq_lens):
        req_pool.write(row, 0, torch.tensor(slots[:n], device=DEVICE))
        slots = slots[n:]
    layer = RadixAttention(heads, dim, dim**-0.5, kv_heads, 0, v_head_dim=v_dim)
    return pool, req_pool, rows, layer


def _batch(mode, pool, req_pool, rows, prefix, new) -> ForwardBatch:
    seq_lens = [p + n for p, n in zip(prefix, new)]
    table = req_pool.req_to_token
    locs = [table[r, p : p + n] for r, p, n in zip(rows, prefix, new)]
    total = sum(new)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.zeros(total, dtype=torch.int64, device=DEVICE),
        positions=torch.zeros(total, dtype=torch.int64, device=DEVICE),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
        seq_lens_cpu=seq_lens,
        out_cache_loc=torch.cat(locs) if locs else table.new_zeros(0),
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
        extend_prefix_lens_cpu=prefix if mode.is_extend() else None,
        extend_seq_lens_cpu=new if mode.is_extend() else None,
    )


def _new_kv(pool, layer, tokens: int):
    """New tokens' keys and values, in the layout the layer passes them."""
    k = torch.randn(tokens, layer.num_kv_heads, layer.head_dim, device=DEVICE)
    if isinstance(pool, MLATokenToKVPool):
        return k, k[..., : layer.v_head_dim]
    return k, torch.randn(tokens, layer.num_kv_heads, layer.v_head_dim, device=DEVICE)


def _tile(size: int | None) -> int | None:
    return size and max(size, MIN_TILE)


def _run(backend, batch, q, k, v, layer, save: bool) -> torch.Tensor:
    batch.attn_backend = backend
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, layer, batch, save_kv_cache=save)


def _compare(triton_backend, mode, layout, prefix, new):
    """The triton backend (writing the new tokens' KV) against the PyTorch backend reading it."""
    pool, req_pool, rows, layer = _setup(layout, [p + n for p, n in zip(prefix, new)])
    q = torch.randn(sum(new), layer.num_heads, layer.head_dim, device=DEVICE)
    k, v = _new_kv(pool, layer, sum(new))
    out = _run(triton_backend, _batch(mode, pool, req_pool, rows, prefix, new), q, k, v, layer,
               save=True)  # fmt: skip
    native = TorchNativeAttnBackend()
    expected = _run(native, _batch(mode, pool, req_pool, rows, prefix, new), q, k, v, layer,
                    save=False)  # fmt: skip
    assert out.shape == (sum(new), layer.num_heads, layer.v_head_dim)
    assert (out - expected).abs().max().item() <= 2e-5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "seq_lens,splits,block_n",
    [
        ([1, 9, 40, 17, 5], 8, 4),  # five sequences; ranges of 5 keys cross 4-key tiles
        ([33, 2, 1], 1, 32),  # one split: 33 keys cross a 32-key tile
        ([13, 7], 3, None),  # a split count that does not divide; default tiles
    ],
)
def test_decode_equals_torch_native(layout, seq_lens, splits, block_n):
    backend = TritonAttnBackend(num_kv_splits=splits, block_n=_tile(block_n))
    _compare(backend, ForwardMode.DECODE, layout, [n - 1 for n in seq_lens], [1] * len(seq_lens))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "prefix,new,block",
    [
        ([0, 0, 0], [5, 1, 9], 4),  # no prefix; one token; 9 new rows cross 4-row tiles
        ([4, 0, 9, 2, 20], [3, 6, 1, 7, 13], 4),  # ragged prefixes, five sequences
        ([0, 16], [17, 1], 16),  # 17 = one tile + 1, in rows and in keys
        ([5, 0], [2, 30], None),  # default tiles
    ],
)
def test_extend_equals_torch_native(layout, prefix, new, block):
    backend = TritonAttnBackend(block_n=_tile(block), block_m=_tile(block))
    _compare(backend, ForwardMode.EXTEND, layout, prefix, new)


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_decode_follows_lengths_copied_into_the_same_tensors(layout):
    """A captured decode is replayed on the same tensors with new values: the kernels must read
    lengths and rows on the device, with nothing cached from the first call."""
    pool, req_pool, rows, layer = _setup(layout, [30, 30, 30])
    backend = TritonAttnBackend(num_kv_splits=4, block_n=_tile(4))
    batch = _batch(ForwardMode.DECODE, pool, req_pool, rows, [2, 20, 9], [1, 1, 1])
    q = torch.randn(3, layer.num_heads, layer.head_dim, device=DEVICE)
    _run(backend, batch, q, None, None, layer, save=False)
    new_rows, lens = [rows[2], rows[0], rows[1]], [30, 1, 14]
    batch.req_pool_indices.copy_(torch.tensor(new_rows))
    batch.seq_lens.copy_(torch.tensor(lens))
    out = backend.forward(q, None, None, layer, batch, save_kv_cache=False)
    fresh = _batch(ForwardMode.DECODE, pool, req_pool, new_rows, [n - 1 for n in lens], [1] * 3)
    expected = _run(TorchNativeAttnBackend(), fresh, q, None, None, layer, save=False)
    assert (out - expected).abs().max().item() <= 2e-5


def test_decode_metadata_reads_no_device_tensor_and_empty_batches_launch_nothing():
    pool, req_pool, _, layer = _setup("gqa", [])
    backend = TritonAttnBackend()
    assert backend.static_decode_metadata
    batch = _batch(ForwardMode.DECODE, pool, req_pool, [], [], [])
    on_meta = torch.empty(4, dtype=torch.int64, device="meta")  # any read would raise
    batch.req_pool_indices, batch.seq_lens, batch.batch_size = on_meta, on_meta, 4
    backend.init_forward_metadata(batch)
    for mode in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.IDLE):
        batch = _batch(mode, pool, req_pool, [], [], [])
        q = torch.empty(0, layer.num_heads, layer.head_dim, device=DEVICE)
        k, v = _new_kv(pool, layer, 0)
        assert _run(backend, batch, q, k, v, layer, save=True).shape == (0, 4, layer.v_head_dim)


def test_expanded_mla_layer_is_refused():
    pool, req_pool, rows, _ = _setup("mla", [3])
    layer = RadixAttention(4, 24, 0.2, 4, 0, v_head_dim=16, kv_from_cache=lambda rows: rows)
    batch = _batch(ForwardMode.EXTEND, pool, req_pool, rows, [0], [3])
    q, k = torch.randn(3, 4, 24, device=DEVICE), torch.randn(3, 1, 24, device=DEVICE)
    with pytest.raises(RuntimeError, match="absorbed"):
        _run(TritonAttnBackend(), batch, q, k, k[..., :16], layer, save=True)
