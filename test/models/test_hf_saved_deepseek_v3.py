"""A DeepSeek-V3 checkpoint as transformers' ``save_pretrained`` writes it: its config has no
``topk_method`` / ``scoring_func`` (transformers routes every DeepseekV3 with sigmoid scores, a
correction bias and grouped top-k). srt must route it the same way, at tp 1 and under DP
attention with two-batch overlap."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.model_driver import ModelDriver
from transformers import AutoConfig, AutoModelForCausalLM

import srt

PROMPTS = [[5, 77, 300, 12, 9, 401, 33, 2, 18], [101, 7], [44, 45, 46, 200, 310, 17]]
NEW_TOKENS = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def saved_path(tiny_models, tmp_path_factory) -> str:
    source = Path(tiny_models["tiny-deepseek-v3"])
    config = AutoConfig.from_pretrained(source)
    for name in ("topk_method", "scoring_func"):
        delattr(config, name)
    model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32)
    out = tmp_path_factory.mktemp("hf-saved-deepseek-v3")
    model.save_pretrained(out)
    for tokenizer_file in source.glob("tokenizer*"):
        shutil.copy(tokenizer_file, out)
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3"
    assert "topk_method" not in saved and "scoring_func" not in saved
    return str(out)


@pytest.fixture(scope="module")
def hf_reference(saved_path) -> list[tuple[list[int], list[float]]]:
    """Per prompt: HF's greedy tokens and the logprob of each."""
    model = AutoModelForCausalLM.from_pretrained(saved_path, dtype=torch.float32).eval()
    reference = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, tokens, logprobs = list(prompt), [], []
            for _ in range(NEW_TOKENS):
                row = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                tokens.append(int(row.argmax()))
                logprobs.append(float(row[tokens[-1]]))
                ids.append(tokens[-1])
            reference.append((tokens, logprobs))
    return reference


def test_single_rank_matches_hf(saved_path, hf_reference):
    driver = ModelDriver(saved_path)
    logits = driver.prefill(PROMPTS)
    for step in range(NEW_TOKENS):
        logprobs = torch.log_softmax(logits.float(), -1)
        for i, (tokens, ref) in enumerate(hf_reference):
            assert int(logprobs[i].argmax()) == tokens[step], f"prompt {i} step {step}"
            assert abs(float(logprobs[i, tokens[step]]) - ref[step]) <= TOLERANCE
        if step + 1 < NEW_TOKENS:
            logits = driver.decode([tokens[step] for tokens, _ in hf_reference])


@pytest.mark.slow  # two rank processes
def test_dp_attention_two_batch_overlap_matches_hf(saved_path, hf_reference):
    engine = srt.Engine(
        model_path=saved_path, dtype="float32", max_total_tokens=1024, tp_size=2, dp_size=2,
        enable_dp_attention=True, moe_a2a_backend="torch", enable_two_batch_overlap=True,
        tbo_decode_token_threshold=0, tbo_prefill_token_threshold=0,
    )  # fmt: skip
    try:
        params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=params, return_logprob=True)
        counts = engine.get_server_info()["internal_states"]
    finally:
        engine.shutdown()
    for i, (out, (tokens, ref)) in enumerate(zip(outputs, hf_reference)):
        assert out["output_ids"] == tokens, f"prompt {i}"
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, ref)) <= TOLERANCE, f"prompt {i}"
    assert all(sum(s["num_tbo_steps"].values()) > 0 for s in counts), counts
