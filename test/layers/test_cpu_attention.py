"""The CPU attention kernels (``srt.layers.cpu_kernels``): decode attention over the paged KV
cache equals attention computed in float64 from the gathered slots, for grouped-query and MLA
layouts, and gives a sequence the same bits whatever batch it comes in; the C rotary embedding
equals PyTorch's for both layouts, grows its table past the model's range and refuses negative
positions."""

from __future__ import annotations

import math

import pytest
import torch

from srt.layers import cpu_kernels
from srt.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(
    cpu_kernels.load_library() is None, reason="no C compiler to build the kernels"
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
    lib, scale = cpu_kernels.load_library(), 1 / math.sqrt(dim)
    out = cpu_kernels.decode_attention(lib, q, k_buf, v_buf, table, rows, lens, scale)
    assert out.shape == (5, heads, v_dim)
    expected = _reference(q, k_buf, v_buf, table, rows, lens, scale)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_decode_attention_gives_a_sequence_the_same_bits_in_any_batch():
    k_buf, v_buf, table = _cache(4, 64, 64, mla=False)
    rows, lens = torch.arange(ROWS), torch.randint(1, CONTEXT, (ROWS,))
    q = torch.randn(ROWS, 16, 64)
    lib = cpu_kernels.load_library()
    run = lambda s: cpu_kernels.decode_attention(  # noqa: E731
        lib, q[s], k_buf, v_buf, table, rows[s], lens[s], 0.125
    )
    whole = run(slice(None))
    assert torch.equal(whole, torch.cat([run(slice(0, 5)), run(slice(5, None))]))
    assert torch.equal(whole, torch.cat([run(slice(i, i + 1)) for i in range(ROWS)]))


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
    rope.pack_weights()
    assert rope.kernel is not None
    got = rope(positions, q, k)
    for out, ref in zip(got, expected):
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="negative position"):
        rope(torch.tensor([3, -1]), q[:2], k[:2])
