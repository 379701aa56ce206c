"""bf16 on CPU: the tiny models loaded with ``--dtype bfloat16`` run their norms, rotary
embeddings and attention in the CPU kernels over a bf16 KV cache (the kernels widen as they read
and round each result once), and their logprobs stay within bf16's reach of HF transformers'
float32 run, as close as PyTorch's own bf16 path (the kernels off) gets, at prefill and at each
greedy decode step."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_outputs import PROMPTS
from helpers.model_driver import ModelDriver
from transformers import AutoModelForCausalLM

from srt.layers import cpu_kernels
from srt.layers.attention.cpu_backend import CpuAttnMetadata

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no CPU kernels here")
DECODE_STEPS = 3


def _run(path: str, prompts, tokens_per_step=None) -> list[torch.Tensor]:
    """Per step, srt's bf16 logprobs [B, V] (the prompts then the given or greedy tokens)."""
    driver = ModelDriver(path, dtype="bfloat16")
    assert driver.runner.token_to_kv_pool.dtype == torch.bfloat16
    logits, steps = driver.prefill(prompts), []
    for step in range(DECODE_STEPS + 1):
        steps.append(torch.log_softmax(logits.float(), -1))
        if step < DECODE_STEPS:
            tokens = tokens_per_step[step] if tokens_per_step else logits.argmax(-1).tolist()
            logits = driver.decode(tokens)
    return steps, driver


def _hf(path: str, prompts, tokens_per_step) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, steps = [list(p) for p in prompts], []
    with torch.no_grad():
        for step in range(DECODE_STEPS + 1):
            logits = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in ids])
            steps.append(torch.log_softmax(logits, -1))
            if step < DECODE_STEPS:
                for s, t in zip(ids, tokens_per_step[step]):
                    s.append(t)
    return steps


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_bf16_in_the_kernels_is_as_close_to_hf_float32_as_pytorchs_bf16(
    tiny_models, monkeypatch, name
):
    prompts = [PROMPTS[0], PROMPTS[2]]
    kernels, driver = _run(tiny_models[name], prompts)
    layer = driver.runner.model.model.layers[0]
    assert layer.input_layernorm.in_kernel and layer.input_layernorm.weight.dtype == torch.bfloat16
    driver.decode([1, 1])
    # the decode replayed its bucket's graph, captured over the kernels' attention metadata
    assert driver.runner.last_step_replayed_graph
    assert isinstance(driver.runner.graph_runner.graphs[2].batch.attn_metadata, CpuAttnMetadata)
    greedy = [s.argmax(-1).tolist() for s in kernels[:-1]]
    reference = _hf(tiny_models[name], prompts, greedy)
    monkeypatch.setenv("SRT_CPU_KERNELS", "0")
    cpu_kernels.load_library.cache_clear()
    try:
        pytorch, _ = _run(tiny_models[name], prompts, greedy)
    finally:
        monkeypatch.delenv("SRT_CPU_KERNELS")
        cpu_kernels.load_library.cache_clear()
    for step, (ours, theirs, ref) in enumerate(zip(kernels, pytorch, reference)):
        ours_diff = (ours - ref).abs().max().item()
        torch_diff = (theirs - ref).abs().max().item()
        assert ours_diff <= max(2 * torch_diff, 0.05), f"{name} step {step}: {ours_diff:.3f}"
