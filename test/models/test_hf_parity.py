"""srt's logits equal HF transformers' for the same tiny checkpoints (fp32), at prefill and at
each of 8 greedy decode steps, for a batch mixing prompt lengths."""

from __future__ import annotations

import pytest
import torch
from helpers.model_driver import ModelDriver
from transformers import AutoModelForCausalLM

PROMPTS = [
    [5, 77, 300, 12, 9, 401, 33, 2, 18, 250, 90, 71, 6],
    [101],
    [44, 45, 46, 200, 310],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
]
DECODE_STEPS = 8
TOLERANCE = 1e-4


def hf_greedy_logprobs(path: str, prompt: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, logprobs, tokens = list(prompt), [], []
    with torch.no_grad():
        for _ in range(DECODE_STEPS + 1):
            logits = model(torch.tensor([ids])).logits[0, -1]
            logprobs.append(torch.log_softmax(logits.float(), -1))
            tokens.append(int(logits.argmax()))
            ids.append(tokens[-1])
    return logprobs, tokens


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"])
def test_logprobs_match_hf(tiny_models, name):
    path = tiny_models[name]
    reference = [hf_greedy_logprobs(path, p) for p in PROMPTS]
    driver = ModelDriver(path)
    logits = driver.prefill(PROMPTS)
    for step in range(DECODE_STEPS + 1):
        ours = torch.log_softmax(logits.float(), -1).cpu()
        for i, (ref_logprobs, _) in enumerate(reference):
            diff = (ours[i] - ref_logprobs[step]).abs().max().item()
            assert diff <= TOLERANCE, f"{name} prompt {i} step {step}: max diff {diff:.2e}"
        if step < DECODE_STEPS:
            logits = driver.decode([tokens[step] for _, tokens in reference])
