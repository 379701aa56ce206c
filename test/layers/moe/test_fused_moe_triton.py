"""The Triton fused MoE against a per-(token, slot) loop, and its block alignment.

Without a GPU the kernels run in Triton's interpreter (numpy), so every case is tiny."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

pytest.importorskip("triton")

from srt.layers.moe.fused_moe import FusedMoE  # noqa: E402
from srt.layers.moe.fused_moe_triton import (  # noqa: E402
    MoEKernelConfig,
    fused_experts_triton,
    moe_align_block_size,
)
from srt.utils.sync_guard import forbid_host_sync  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_EXPERTS, NUM_LOCAL, START, TOP_K = 8, 4, 4, 2
HIDDEN, INTER = 40, 48  # no multiples of 32: N and K tails in both projections
SMALL = MoEKernelConfig(block_m=16, block_n=32, block_k=32)


def _topk_ids(num_tokens: int, seed: int = 0, empty_expert: int = START + 2) -> torch.Tensor:
    """Distinct ids per token, about half of them another rank's, none of ``empty_expert``;
    every other token's first slot is ``START`` so that expert fills several blocks."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([e for e in range(NUM_EXPERTS) if e not in (START, empty_expert)])
    ids = torch.full((num_tokens, TOP_K), START, dtype=torch.long)
    for t in range(num_tokens):
        first = t % 2  # odd tokens: two random experts, even ones START and one random
        ids[t, first:] = choices[torch.randperm(len(choices), generator=gen)[: TOP_K - first]]
    return ids.to(DEVICE)


def _reference(x, w13, w2, topk_weights, topk_ids, start):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k]) - start
            if 0 <= e < w13.shape[0]:
                gate, up = (w13[e] @ x[t]).chunk(2)
                out[t] += topk_weights[t, k] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("num_tokens", [0, 1, 7, 40])
def test_matches_reference(num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(DEVICE)
    w13 = (torch.randn(NUM_LOCAL, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).to(DEVICE)
    w2 = (torch.randn(NUM_LOCAL, HIDDEN, INTER, generator=gen) / INTER**0.5).to(DEVICE)
    topk_weights = torch.rand(num_tokens, TOP_K, generator=gen).to(DEVICE)
    topk_ids = _topk_ids(num_tokens, seed=num_tokens)
    with forbid_host_sync(DEVICE):
        out = fused_experts_triton(x, w13, w2, topk_weights, topk_ids, START, config=SMALL)
    expected = _reference(x, w13, w2, topk_weights, topk_ids, START)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_block_size_override_and_default_config():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, HIDDEN, generator=gen).to(DEVICE)
    w13 = torch.randn(NUM_LOCAL, 2 * INTER, HIDDEN, generator=gen).to(DEVICE) / HIDDEN**0.5
    w2 = torch.randn(NUM_LOCAL, HIDDEN, INTER, generator=gen).to(DEVICE) / INTER**0.5
    weights, ids = torch.rand(3, TOP_K, generator=gen).to(DEVICE), _topk_ids(3, seed=1)
    expected = _reference(x, w13, w2, weights, ids, START)
    for kwargs in ({}, {"block_size": 32}):
        out = fused_experts_triton(x, w13, w2, weights, ids, START, **kwargs)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_float16_matches_fused_moe():
    """16-bit inputs (float16: the interpreter's tl.dot cannot read bfloat16) against FusedMoE."""
    torch.manual_seed(0)
    moe = FusedMoE(NUM_EXPERTS, HIDDEN, INTER, ep_rank=1, ep_size=2)
    moe.w13_weight.data.normal_(0, HIDDEN**-0.5)
    moe.w2_weight.data.normal_(0, INTER**-0.5)
    x, weights, ids = torch.randn(9, HIDDEN), torch.rand(9, TOP_K), _topk_ids(9, seed=2)
    expected = moe(x, weights, ids.cpu())
    w13, w2 = (w.data.to(DEVICE, torch.float16) for w in (moe.w13_weight, moe.w2_weight))
    x16 = x.to(DEVICE, torch.float16)
    out = fused_experts_triton(x16, w13, w2, weights.to(DEVICE), ids, moe.start, config=SMALL)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), expected, atol=1e-2, rtol=1e-2)


def _check_alignment(topk_ids, block, num_local, start):
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block, num_local, start)
    num_pairs = topk_ids.numel()
    max_padded = -(-(num_pairs + num_local * (block - 1)) // block) * block
    assert sorted_ids.shape == (max_padded,) and sorted_ids.dtype == torch.int32
    assert expert_ids.shape == (max_padded // block,) and expert_ids.dtype == torch.int32
    assert num_post.shape == (1,) and num_post.dtype == torch.int32
    local = (topk_ids.flatten() - start).tolist()
    ids, experts, end = sorted_ids.tolist(), expert_ids.tolist(), int(num_post)
    assert end % block == 0 and all(i == num_pairs for i in ids[end:])
    assert all(e == -1 for e in experts[end // block :])
    placed = [i for i in ids if i != num_pairs]
    assert sorted(placed) == [p for p, e in enumerate(local) if 0 <= e < num_local]
    for b in range(end // block):
        pairs = [i for i in ids[b * block : (b + 1) * block] if i != num_pairs]
        assert pairs and all(local[p] == experts[b] for p in pairs)  # homogeneous, not empty
    assert experts[: end // block] == sorted(experts[: end // block])


@pytest.mark.parametrize("num_tokens,block", [(0, 16), (1, 16), (7, 4), (40, 16), (40, 64)])
def test_align_places_every_local_pair_once(num_tokens, block):
    _check_alignment(_topk_ids(num_tokens, seed=num_tokens), block, NUM_LOCAL, START)


def test_align_all_local_and_none_local():
    ids = _topk_ids(9, seed=3)
    _check_alignment(ids, 4, NUM_EXPERTS, 0)  # one rank: every pair local
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids % START, 4, NUM_LOCAL, START)
    assert int(num_post) == 0 and (expert_ids == -1).all() and (sorted_ids == 18).all()


def test_align_shapes_do_not_depend_on_values():
    shapes = {
        tuple(t.shape for t in moe_align_block_size(ids, 16, NUM_LOCAL, START))
        for ids in (_topk_ids(7, seed=s) for s in range(3))
    } | {tuple(t.shape for t in moe_align_block_size(_topk_ids(7) * 0, 16, NUM_LOCAL, START))}
    assert len(shapes) == 1


def test_align_does_not_sync():
    ids = _topk_ids(40)
    with forbid_host_sync(DEVICE):
        moe_align_block_size(ids, 16, NUM_LOCAL, START)
