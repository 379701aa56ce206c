"""The CPU attention kernels (``srt.layers.cpu_kernels``): decode and extend attention over the
paged KV cache equal attention computed in float64 from the gathered slots (decode for
grouped-query and MLA layouts; extend causal, after cached prefixes) and give a token the same
bits whatever batch it comes in (extend: also wherever its sequence was split); the C rotary
embedding equals PyTorch's for both layouts, shares its table between layers of equal
frequencies, grows it past the model's range and refuses negative positions."""

from __future__ import annotations

import math

import pytest
import torch

from srt.layers import cpu_kernels
from srt.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the kernels"
)
SLOTS, ROWS, CONTEXT = 600, 12, 80


def _reference(q, k_buf, v_buf, table, rows, lens, scale) -> torch.Tensor:
    out = []
    for b in range(q.shape[0]):
        slots = table[rows[b], : lens[b]]
        group = q.shape[1] // k_buf.shape[1]
        key = k_buf[slots].repeat_interleave(group, 1).double()  # [L, H, D]
        value = v_buf[slots].repeat_interleave(group, 1).double()
        probs = (torch.einsum("hd,lhd->hl", q[b].double(), key) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", probs, value).float())
    return torch.stack(out)


def _cache(kv_heads: int, dim: int, v_dim: int, mla: bool):
    torch.manual_seed(dim + kv_heads)
    k_buf = torch.randn(SLOTS, kv_heads, dim)
    v_buf = k_buf[..., :v_dim] if mla else torch.randn(SLOTS, kv_heads, v_dim)
    table = torch.randint(1, SLOTS, (ROWS, CONTEXT))
    return k_buf, v_buf, table


@pytest.mark.parametrize(
    "heads,kv_heads,dim,v_dim,mla",
    [
        (16, 4, 64, 64, False),
        (12, 12, 32, 32, False),
        (20, 2, 72, 72, False),
        (4, 4, 16, 16, False),
        (16, 1, 96, 64, True),
    ],  # fmt: skip
)
def test_decode_attention_equals_reference(heads, kv_heads, dim, v_dim, mla):
    k_buf, v_buf, table = _cache(kv_heads, dim, v_dim, mla)
    rows = torch.tensor([3, 0, 7, 11, 5])
    lens = torch.tensor([1, CONTEXT, 17, 33, 64])  # a sequence of one token included
    q = torch.randn(5, heads, dim)
    scale = 1 / math.sqrt(dim)
    out = cpu_kernels.decode_attention(q, k_buf, v_buf, table, rows, lens, scale)
    assert out.shape == (5, heads, v_dim)
    expected = _reference(q, k_buf, v_buf, table, rows, lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_decode_attention_gives_a_sequence_the_same_bits_in_any_batch():
    k_buf, v_buf, table = _cache(4, 64, 64, mla=False)
    rows, lens = torch.arange(ROWS), torch.randint(1, CONTEXT, (ROWS,))
    q = torch.randn(ROWS, 16, 64)
    run = lambda s: cpu_kernels.decode_attention(  # noqa: E731
        q[s], k_buf, v_buf, table, rows[s], lens[s], 0.125
    )
    whole = run(slice(None))
    assert torch.equal(whole, torch.cat([run(slice(0, 5)), run(slice(5, None))]))
    assert torch.equal(whole, torch.cat([run(slice(i, i + 1)) for i in range(ROWS)]))


def _extend_reference(q, k_buf, v_buf, table, seqs, scale) -> torch.Tensor:
    out = torch.empty(q.shape[0], q.shape[1], v_buf.shape[2])
    for row, prefix, new, start in seqs.t().tolist():
        slots, group = table[row, : prefix + new], q.shape[1] // k_buf.shape[1]
        key = k_buf[slots].repeat_interleave(group, 1).double()  # [L, H, D]
        value = v_buf[slots].repeat_interleave(group, 1).double()
        scores = torch.einsum("thd,lhd->htl", q[start : start + new].double(), key) * scale
        causal = torch.arange(prefix + new)[None, :] <= prefix + torch.arange(new)[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[start : start + new] = torch.einsum("htl,lhd->thd", probs, value).float()
    return out


def _extend_seqs(rows: list[int], prefix: list[int], new: list[int]) -> torch.Tensor:
    starts = [sum(new[:i]) for i in range(len(new))]
    return torch.tensor([rows, prefix, new, starts])


@pytest.mark.parametrize(
    "heads,kv_heads,dim,v_dim",
    [(10, 2, 64, 64), (12, 12, 32, 32), (20, 2, 72, 72), (4, 4, 16, 16), (8, 1, 128, 96)],
)
def test_extend_attention_equals_reference(heads, kv_heads, dim, v_dim):
    torch.manual_seed(dim + heads)
    k_buf, v_buf = torch.randn(SLOTS, kv_heads, dim), torch.randn(SLOTS, kv_heads, v_dim)
    table = torch.randperm(SLOTS)[:600].view(4, 150).repeat(2, 1)  # rows share slots: fine
    # One token, prefixes at and around the 64-key blocks, a sequence longer than two blocks.
    seqs = _extend_seqs([3, 0, 7, 1, 5, 2], [0, 5, 17, 0, 63, 64], [1, 70, 33, 130, 2, 65])
    q = torch.randn(int(seqs[2].sum()), heads, dim)
    scale = 1 / math.sqrt(dim)
    out = cpu_kernels.extend_attention(q, k_buf, v_buf, table, seqs, scale)
    expected = _extend_reference(q, k_buf, v_buf, table, seqs, scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_extend_attention_gives_a_token_the_same_bits_however_its_sequence_is_split():
    torch.manual_seed(0)
    k_buf, v_buf = torch.randn(SLOTS, 2, 64), torch.randn(SLOTS, 2, 64)
    table = torch.randperm(SLOTS)[:400].view(2, 200)
    q = torch.randn(190, 10, 64)
    run = lambda rows, prefix, new, q_rows: cpu_kernels.extend_attention(  # noqa: E731
        q[q_rows], k_buf, v_buf, table, _extend_seqs(rows, prefix, new), 0.125
    )
    whole = run([0, 1], [0, 10], [130, 60], slice(None))
    # The first sequence cut at token 50 (its tail then has a prefix of 50) and batched apart.
    head = run([0], [0], [50], slice(0, 50))
    tail = run([0, 1], [50, 10], [80, 60], slice(50, None))
    assert torch.equal(whole, torch.cat([head, tail]))
    assert torch.equal(whole[130:], run([1], [10], [60], slice(130, None)))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("params", [{"rope_theta": 10000.0}, YARN])
def test_rope_in_c_equals_pytorch(neox, params):
    rope = RotaryEmbedding(32, 256, params, is_neox_style=neox)
    qkv = torch.randn(6, 7, 48)  # q and k below are views into it, as after a fused projection
    q, k = qkv[:, :4, 8:40], qkv[:, 6:, 16:]
    positions = torch.tensor([0, 1, 63, 255, 5000, 17])  # 5000: past the first table
    expected = rope(positions, q, k)
    rope.prepare_for_cpu()
    other_layer = RotaryEmbedding(32, 256, params, is_neox_style=neox)
    other_layer.prepare_for_cpu()
    assert other_layer.cos_sin_table is rope.cos_sin_table  # one table for equal frequencies
    assert rope.cos_sin_table.table.shape == (256, 32)  # the model's range at first
    got = rope(positions, q, k)
    assert rope.cos_sin_table.table.shape == (5001, 32)  # grown past 5000
    for out, ref in zip(got, expected):
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="negative position"):
        rope(torch.tensor([3, -1]), q[:2], k[:2])


def _widened_then_rounded(kernel, *tensors):
    """The float32 kernel over the bf16 tensors widened, its output rounded to bf16: what the
    bf16 kernels must give bit for bit (they widen as they read and compute in float32)."""
    return kernel(*(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)).bfloat16()


def test_bf16_attention_is_the_float32_kernel_on_its_values_rounded_once():
    k_buf, v_buf, table = (t.bfloat16() if t.is_floating_point() else t
                           for t in _cache(2, 64, 48, mla=False))  # fmt: skip
    q = torch.randn(5, 8, 64).bfloat16()
    rows, lens = torch.tensor([3, 0, 7, 11, 5]), torch.tensor([1, CONTEXT, 17, 33, 64])
    decode = lambda q, k, v: cpu_kernels.decode_attention(q, k, v, table, rows, lens, 0.125)  # noqa: E731
    out = decode(q, k_buf, v_buf)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _widened_then_rounded(decode, q, k_buf, v_buf))
    expected = _reference(q.float(), k_buf.float(), v_buf.float(), table, rows, lens, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    seqs = _extend_seqs([3, 0, 7], [0, 5, 63], [1, 70, 2])
    q = torch.randn(73, 8, 64).bfloat16()
    extend = lambda q, k, v: cpu_kernels.extend_attention(q, k, v, table, seqs, 0.125)  # noqa: E731
    assert torch.equal(extend(q, k_buf, v_buf), _widened_then_rounded(extend, q, k_buf, v_buf))
    with pytest.raises(ValueError, match="k_buf must be a 3-d torch.bfloat16"):
        cpu_kernels.decode_attention(q[:5], k_buf.float(), v_buf, table, rows, lens, 0.125)


@pytest.mark.parametrize("neox", [True, False])
def test_bf16_rope_is_the_float32_kernel_rounded_once(neox):
    rope = RotaryEmbedding(32, 256, {"rope_theta": 10000.0}, is_neox_style=neox)
    rope.prepare_for_cpu()
    qkv = torch.randn(6, 7, 48).bfloat16()
    q, k = qkv[:, :4, 8:40], qkv[:, 6:, 16:]
    positions = torch.tensor([0, 1, 63, 255, 300, 17])
    got = rope(positions, q, k)
    expected = rope(positions, q.float(), k.float())
    for out, ref in zip(got, expected):
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref.bfloat16())
