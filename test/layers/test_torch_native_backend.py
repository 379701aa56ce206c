"""The batched extend attention (length groups, one SDPA call each) and the batched decode
attention (query heads of one KV head as rows) equal attention computed sequence by sequence
over the same paged KV cache, with and without cached prefixes, and so does the cpu backend
(the C kernels in float32, which it is shown to run; SDPA for other dtypes and MLA's extend);
and the grouped experts equal the per-expert loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.forward_batches import extend_batch

from srt.layers import cpu_kernels
from srt.layers.activation import silu_and_mul
from srt.layers.attention.cpu_backend import CpuAttnBackend, CpuAttnMetadata
from srt.layers.attention.torch_native_backend import (
    MAX_PADDING_RATIO,
    TorchNativeAttnBackend,
    TorchNativeMetadata,
    group_extend,
)
from srt.layers.moe.expert_kernel import ExpertKernel
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.radix_attention import RadixAttention
from srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

HEADS, KV_HEADS, DIM = 4, 2, 8
NEEDS_KERNELS = pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
BACKENDS = [
    pytest.param(TorchNativeAttnBackend, id="torch_native"),
    pytest.param(CpuAttnBackend, id="cpu", marks=NEEDS_KERNELS),
]


def test_group_extend_bounds_padding_and_covers_every_sequence():
    prefix = [0, 0, 5, 0, 0, 7, 0]
    new = [100, 98, 3, 1, 2, 9, 100]
    groups = group_extend(prefix, new)
    assert sorted(i for g in groups for i in g) == list(range(len(new)))
    for g in groups:
        assert len({prefix[i] > 0 for i in g}) == 1  # causal and masked groups never mix
        real = sum(new[i] * (prefix[i] + new[i]) for i in g)
        padded = len(g) * max(new[i] for i in g) * max(prefix[i] + new[i] for i in g)
        assert len(g) == 1 or padded <= MAX_PADDING_RATIO * real
    assert len(group_extend([0] * 8, [64] * 8)) == 1  # equal prompts: one call


def _reference(q, k_buf, v_buf, table, prefix, new, layer):
    out, start = [], 0
    for row, (p, n) in enumerate(zip(prefix, new)):
        slots = table[row, : p + n]
        key = k_buf[slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        value = v_buf[slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        pos = torch.arange(p + n)
        mask = pos[None, :] <= pos[p:, None]
        query = q[start : start + n].transpose(0, 1)
        o = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=layer.scaling)
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize(
    "prefix,new,v_dim",
    [
        ([0, 0, 0], [5, 5, 5], DIM),
        ([0, 0, 0, 0], [13, 1, 5, 21], DIM),
        ([4, 0, 9, 2], [3, 6, 1, 7], DIM),
        ([4, 0, 9, 2], [3, 6, 1, 7], DIM // 2),  # values narrower than keys: padded
    ],
)
def test_extend_attention_equals_per_sequence(prefix, new, v_dim, backend_class):
    torch.manual_seed(0)
    pool = MHATokenToKVPool(256, torch.float32, KV_HEADS, DIM, 1, "cpu", v_head_dim=v_dim)
    req_pool = ReqToTokenPool(8, 64, "cpu")
    rows = req_pool.alloc(len(new))
    slot = 1
    for row, (p, n) in enumerate(zip(prefix, new)):
        req_pool.write(rows[row], 0, torch.arange(slot, slot + p + n))
        slot += p + n
    for layer_buf in (pool.k_buffer[0], pool.v_buffer[0]):
        layer_buf[1:slot] = torch.randn(slot - 1, KV_HEADS, layer_buf.shape[-1])
    new_slots = torch.cat([req_pool.req_to_token[rows[i], p : p + n]
                           for i, (p, n) in enumerate(zip(prefix, new))])  # fmt: skip
    total = sum(new)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(new),
        input_ids=torch.zeros(total, dtype=torch.int64),
        positions=torch.zeros(total, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor([p + n for p, n in zip(prefix, new)]),
        seq_lens_cpu=[p + n for p, n in zip(prefix, new)],
        out_cache_loc=new_slots,
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=new,
    )
    layer = RadixAttention(HEADS, DIM, DIM**-0.5, KV_HEADS, 0, v_head_dim=v_dim)
    q, k = torch.randn(total, HEADS, DIM), torch.randn(total, KV_HEADS, DIM)
    v = torch.randn(total, KV_HEADS, v_dim)
    backend = backend_class()
    backend.init_forward_metadata(batch)
    out = backend.forward_extend(q, k, v, layer, batch)
    table = req_pool.req_to_token[rows]
    expected = _reference(q, pool.k_buffer[0], pool.v_buffer[0], table, prefix, new, layer)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_class", BACKENDS)
@pytest.mark.parametrize("kv_heads", [1, KV_HEADS, HEADS])
def test_decode_attention_equals_per_sequence(kv_heads, backend_class):
    torch.manual_seed(0)
    seq_lens = [5, 1, 12, 7]
    pool = MHATokenToKVPool(64, torch.float32, kv_heads, DIM, 1, "cpu")
    req_pool = ReqToTokenPool(8, 32, "cpu")
    rows = req_pool.alloc(len(seq_lens))
    slots = torch.randperm(63)[: sum(seq_lens)] + 1  # scattered over the pool
    start = 0
    for row, n in zip(rows, seq_lens):
        req_pool.write(row, 0, slots[start : start + n])
        start += n
    for layer_buf in (pool.k_buffer[0], pool.v_buffer[0]):
        layer_buf[1:] = torch.randn(layer_buf.shape[0] - 1, kv_heads, DIM)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=len(seq_lens),
        input_ids=torch.zeros(len(seq_lens), dtype=torch.int64),
        positions=torch.tensor(seq_lens) - 1,
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens,
        out_cache_loc=torch.zeros(0, dtype=torch.int64),
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
    )
    layer = RadixAttention(HEADS, DIM, DIM**-0.5, kv_heads, 0)
    q = torch.randn(len(seq_lens), HEADS, DIM)
    backend = backend_class()
    backend.init_forward_metadata(batch)
    out = backend.forward_decode(q, None, None, layer, batch, save_kv_cache=False)
    group = HEADS // kv_heads
    for i, row in enumerate(rows):
        table = req_pool.req_to_token[row, : seq_lens[i]]
        key = pool.k_buffer[0][table].transpose(0, 1).repeat_interleave(group, 0)  # [H, L, D]
        value = pool.v_buffer[0][table].transpose(0, 1).repeat_interleave(group, 0)
        expected = F.scaled_dot_product_attention(q[i][:, None], key, value, scale=layer.scaling)
        torch.testing.assert_close(out[i], expected[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hidden,inter", [(16, 8), (12, 6)])  # grouped GEMM / looped fallback
def test_grouped_experts_equal_per_expert_loop(hidden, inter):
    torch.manual_seed(0)
    moe = FusedMoE(8, hidden, inter, ep_rank=1, ep_size=2)  # experts 4..7 are local
    torch.nn.init.normal_(moe.w13_weight)
    torch.nn.init.normal_(moe.w2_weight)
    x = torch.randn(10, hidden)
    ids = torch.randint(0, 8, (10, 3))
    ids[0] = torch.tensor([0, 1, 2])  # a token with no local expert
    weights = torch.rand(10, 3)
    expected = torch.zeros(10, hidden)
    for t in range(10):
        for j in range(3):
            e = int(ids[t, j]) - 4
            if 0 <= e < 4:
                act = silu_and_mul(moe.w13_weight[e] @ x[t])
                expected[t] += weights[t, j] * (moe.w2_weight[e] @ act)
    torch.testing.assert_close(moe(x, weights, ids), expected, atol=1e-4, rtol=1e-4)
    grouped = hidden % 4 == 0 and inter % 4 == 0  # rows of whole 16-byte units
    assert moe.kernel is (ExpertKernel.GROUPED_MM if grouped else ExpertKernel.LOOP)


def _pools(dtype: torch.dtype, mla: bool):
    if mla:  # kv_lora_rank 16, rope 8: values are the first columns of the keys
        return MLATokenToKVPool(64, dtype, 16, 8, 1, "cpu"), ReqToTokenPool(16, 32, "cpu")
    return MHATokenToKVPool(64, dtype, KV_HEADS, DIM, 1, "cpu"), ReqToTokenPool(16, 32, "cpu")


@NEEDS_KERNELS
@pytest.mark.parametrize(
    "dtype,mla,mode,kernels",
    [
        (torch.float32, False, ForwardMode.DECODE, True),
        (torch.float32, False, ForwardMode.EXTEND, True),
        (torch.float32, True, ForwardMode.DECODE, True),
        (torch.float32, True, ForwardMode.EXTEND, False),  # MLA's extend expands its latent
        (torch.bfloat16, False, ForwardMode.DECODE, True),
        (torch.bfloat16, False, ForwardMode.EXTEND, True),
        (torch.float16, False, ForwardMode.DECODE, False),  # the kernels: float32 or bfloat16
        (torch.float16, False, ForwardMode.EXTEND, False),
    ],
)
def test_cpu_backend_runs_the_kernels_where_they_apply(dtype, mla, mode, kernels):
    batch = extend_batch([2, 0, 5], [3, 4, 1], mode)  # request rows 10, 11, 12
    batch.token_to_kv_pool, batch.req_to_token_pool = _pools(dtype, mla)
    CpuAttnBackend().init_forward_metadata(batch)
    meta = batch.attn_metadata
    assert isinstance(meta, CpuAttnMetadata if kernels else TorchNativeMetadata)
    if kernels and mode == ForwardMode.EXTEND:  # [row, prefix, new, first row of q] columns
        assert meta.extend_seqs.tolist() == [[10, 11, 12], [2, 0, 5], [3, 4, 1], [0, 3, 7]]


def test_cpu_backend_refused_without_the_kernels(monkeypatch):
    try:
        monkeypatch.setenv("SRT_CPU_KERNELS", "0")
        cpu_kernels.load_library.cache_clear()
        with pytest.raises(RuntimeError, match="needs the CPU kernels"):
            CpuAttnBackend()
    finally:
        monkeypatch.delenv("SRT_CPU_KERNELS")
        cpu_kernels.load_library.cache_clear()
