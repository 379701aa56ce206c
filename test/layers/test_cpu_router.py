"""The router's top-k and the KV cache's write in the CPU kernels (``cpu_kernels.select_experts``,
``cpu_kernels.store_kv``): the same choice as PyTorch's ``select_experts`` for every routing
DeepSeek and Qwen use, counted as the recorder counts; a token's choice independent of its
batch; exactly the given slots written."""

from __future__ import annotations

import pytest
import torch

from srt.layers import cpu_kernels
from srt.layers.moe.topk import TopKConfig, select_experts

if not cpu_kernels.available():
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)

ROUTINGS = {  # name: (config, experts, with a correction bias)
    "qwen3": (TopKConfig(2, renormalize=True), 16, False),
    "mixtral, no renorm": (TopKConfig(3), 8, False),
    "deepseek-v2 groups": (TopKConfig(6, "softmax", False, 8, 3, 16.0), 64, False),
    "deepseek-v3": (TopKConfig(8, "sigmoid", True, 8, 4, 2.5), 256, True),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ROUTINGS)
def test_the_choice_is_pytorchs(name, dtype):
    cfg, experts, biased = ROUTINGS[name]
    torch.manual_seed(0)
    # Distinct logits, exact in bf16: where two choices tie, torch.topk's pick is its own.
    logits = (torch.stack([torch.randperm(experts) for _ in range(300)]) / 32 - 2).to(dtype)
    bias = torch.randn(experts) * 0.1 if biased else None
    counts = torch.zeros(experts, dtype=torch.int64)
    weights, ids = cpu_kernels.select_experts(logits, cfg, bias, (counts,))
    ref_weights, ref_ids = select_experts(logits, cfg, bias)
    order, ref_order = ids.sort(1), ref_ids.sort(1)
    assert torch.equal(order.values, ref_order.values)
    got, expected = weights.gather(1, order.indices), ref_weights.gather(1, ref_order.indices)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts, torch.bincount(ref_ids.flatten(), minlength=experts))
    scores = weights.diff(dim=1) if cfg.routed_scaling_factor == 1.0 else None
    assert scores is None or (scores <= 0).all()  # best first


def test_a_tokens_choice_does_not_depend_on_its_batch():
    cfg, experts, _ = ROUTINGS["deepseek-v3"]
    logits, bias = torch.randn(64, experts), torch.randn(experts)
    weights, ids = cpu_kernels.select_experts(logits, cfg, bias)  # parallel at this size
    for t in (0, 37, 63):
        alone = cpu_kernels.select_experts(logits[t : t + 1], cfg, bias)
        assert torch.equal(alone[0][0], weights[t]) and torch.equal(alone[1][0], ids[t])


def test_both_recorder_rows_count_and_ties_go_to_the_lower_id():
    counts, window = torch.zeros(4, dtype=torch.int64), torch.full((4,), 5, dtype=torch.int64)
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    weights, ids = cpu_kernels.select_experts(logits, TopKConfig(2), None, (counts, window))
    assert ids.tolist() == [[1, 2], [0, 1]]
    assert counts.tolist() == [1, 2, 1, 0] and window.tolist() == [6, 7, 6, 5]
    assert weights[1].tolist() == [0.25, 0.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 600])  # 600: the kernel's threads share the tokens
def test_store_kv_writes_exactly_its_slots(dtype, tokens):
    slots = 1000
    k_cache, v_cache = torch.randn(slots, 2, 32).to(dtype), torch.randn(slots, 2, 16).to(dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(tokens, 2 * 32 + 2 * 16 + 8).to(dtype)  # v a strided view, as from QKV
    k, v = qkv[:, :64].reshape(tokens, 2, 32), qkv[:, 64:96].view(tokens, 2, 16)
    loc = torch.randperm(slots)[:tokens]
    cpu_kernels.store_kv(k, v, loc, k_cache, v_cache)
    before_k[loc], before_v[loc] = k, v
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    latent = torch.zeros(slots, 1, 40).to(dtype)  # MLA: the values are the keys' columns
    cpu_kernels.store_kv(qkv[:, None, :40], None, loc, latent, None)
    assert torch.equal(latent[loc, 0], qkv[:, :40]) and latent.count_nonzero() == tokens * 40
