"""The bundled trained checkpoints (``launch/train_tiny_models.py``) answer arithmetic they
never saw, in float32, bf16 and fp8 quantized at load, and answer it token for token the same
with TP 2 + DP attention + two-batch overlap forced on, and with single-batch overlap. A fixed
sample of the held-out problems; the full
set is ``benchmark/offline/eval_accuracy.py``'s."""

from __future__ import annotations

import random

import pytest
from arith_data import chat_answer, parse_answer, split_problems
from make_tiny_models import BUNDLED_MODELS, bundled_model_path

import srt

pytestmark = pytest.mark.slow  # starts engines

SAMPLE = random.Random(7).sample(split_problems()[1], 16)
PARAMS = {"temperature": 0, "max_new_tokens": 10}
DP2 = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "moe_a2a_backend": "torch"}
LAYOUTS = {
    "tp2-dp-attention-tbo": DP2
    | {
        "enable_two_batch_overlap": True,
        "tbo_decode_token_threshold": 0,
        "tbo_prefill_token_threshold": 0,
    },
    "tp2-sbo": {"tp_size": 2, "moe_a2a_backend": "torch", "enable_single_batch_overlap": True},
}


def prompts(tokenizer) -> list[str]:
    """Zero-shot completions, then the same problems as chat turns."""
    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.chat_question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for p in SAMPLE
    ]
    return [p.question for p in SAMPLE] + chat


def run(name: str, **kwargs) -> list[dict]:
    kwargs = {"dtype": "float32"} | kwargs
    engine = srt.Engine(model_path=bundled_model_path(name), **kwargs)
    try:
        return engine.generate(prompts(engine.tokenizer), PARAMS)
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def single_rank() -> dict[str, list[dict]]:
    return {name: run(name) for name in BUNDLED_MODELS}


@pytest.mark.parametrize("name", BUNDLED_MODELS)
def test_answers_problems_it_never_saw(name, single_rank):
    """All 16 right, zero-shot and in chat (the full held-out set is measured by
    benchmark/offline/eval_accuracy.py: docs/accuracy.md)."""
    assert_all_right(single_rank[name])


@pytest.mark.parametrize("weights", [{"dtype": "bfloat16"}, {"quantization": "fp8"}])
@pytest.mark.parametrize("name", BUNDLED_MODELS)
def test_answers_them_in_bf16_and_fp8(name, weights):
    assert_all_right(run(name, **weights))


def assert_all_right(outs: list[dict]) -> None:
    plain = [parse_answer(o["text"]) for o in outs[: len(SAMPLE)]]
    chat = [chat_answer(o["text"]) for o in outs[len(SAMPLE) :]]
    for got in (plain, chat):
        right = sum(a == p.answer for a, p in zip(got, SAMPLE))
        assert right == len(SAMPLE), (got, [p.answer for p in SAMPLE])


# Each checkpoint in one layout, each layout with one of them: exactness of every layout ×
# family is the model-level tests' (test_tbo_model, test_sbo_model), and DeepSeek-V3 under
# DP attention + TBO is compared with transformers in test_hf_saved_deepseek_v3.
@pytest.mark.parametrize(
    "name, layout",
    [("arith-qwen3-moe", "tp2-dp-attention-tbo"), ("arith-deepseek-v3", "tp2-sbo")],
)
def test_same_answers_in_every_layout(name, layout, single_rank):
    outs = run(name, **LAYOUTS[layout])
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in single_rank[name]]


@pytest.mark.parametrize("name", ["arith-deepseek-v3"])
def test_at_least_four_experts_in_use(name):
    """Every MoE layer routes held-out prompts to at least four experts, each taking at least
    5 % of the picks (counted on transformers' model, whose routers return their choices).
    arith-qwen3-moe does not: its routers settled on two to four experts per layer despite the
    load-balancing loss (docs/accuracy.md)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    picks = {}

    def counter(layer: str):
        def hook(module, inputs, outputs):
            indices = outputs[-1].flatten()
            picks[layer] = picks.get(layer, 0) + torch.bincount(indices, minlength=8)

        return hook

    for layer, module in model.named_modules():
        if layer.endswith("mlp.gate"):
            module.register_forward_hook(counter(layer))
    text = "\n".join(p.equation for p in split_problems()[1][:200])
    with torch.no_grad():
        model(**tokenizer(text, return_tensors="pt"))
    assert picks, "no MoE layer found"
    for layer, counts in picks.items():
        shares = counts / counts.sum()
        assert int((shares >= 0.05).sum()) >= 4, (layer, shares.tolist())
