"""Block-FP8 checkpoints, written in the published format from the tiny models: srt's fp32
logprobs equal HF transformers' on the exactly dequantized weights (HF itself mis-reads partial
blocks, so it loads the dequantized copy) at prefill and at each greedy decode step, for 128 ×
128 blocks (every tiny weight one partial block) and small odd blocks (several per weight, a
partial one at each edge); the weights stay e4m3 in memory; TP 2 + DP attention + expert
parallelism with TBO, SBO and DBO forced equal the single-rank run; online ``--quantization
fp8`` quantizes an unquantized checkpoint; bad checkpoints are refused naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.engine_outputs import PROMPTS, assert_same_outputs, run_engine
from helpers.model_driver import ModelDriver
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from benchmark.common.fp8_checkpoint import dequantize_checkpoint, quantize_checkpoint
from srt.layers.quantization.fp8 import FP8_DTYPE
from srt.model_executor.weight_bytes import WeightBytes

DECODE_STEPS = 4
TOLERANCE = 1e-4
BLOCKS = {"128": (128, 128), "16x48": (16, 48)}
# Kept dense by --quantization fp8 (its model reads the weight as a matrix): an fp8 checkpoint
# with it in modules_to_not_convert holds what online quantization makes of the others.
NOT_CONVERTED = {"dense-kv_b": ["kv_b_proj"]}


@pytest.fixture(scope="module")
def fp8_models(tiny_models, tmp_path_factory):
    """(name, block) → (fp8 checkpoint, its dequantized float32 copy), written on first use."""
    root, made = tmp_path_factory.mktemp("fp8"), {}

    def get(name: str, block: str = "128") -> tuple[str, str]:
        if (name, block) not in made:
            out, skip = str(root / f"{name}-{block}"), NOT_CONVERTED.get(block)
            q = quantize_checkpoint(tiny_models[name], out, BLOCKS.get(block, (128, 128)), skip)
            made[name, block] = (q, dequantize_checkpoint(q, str(root / f"{name}-{block}-f32")))
        return made[name, block]

    return get


def _hf_steps(path: str, prompts: list[list[int]]):
    """Per step, HF's logprobs [B, V] and greedy tokens, the prompts decoded one by one."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, steps = [list(p) for p in prompts], []
    with torch.no_grad():
        for _ in range(DECODE_STEPS + 1):
            logits = torch.stack([model(torch.tensor([s])).logits[0, -1] for s in ids])
            tokens = logits.argmax(-1).tolist()
            steps.append((torch.log_softmax(logits, -1), tokens))
            for s, t in zip(ids, tokens):
                s.append(t)
    return steps


CELLS = [
    ("tiny-qwen3-moe", "128"),
    ("tiny-qwen3-moe", "16x48"),
    ("tiny-deepseek-v2", "16x48"),
    ("tiny-deepseek-v3", "128"),
    ("tiny-deepseek-v3", "16x48"),
]


@pytest.mark.parametrize("name, block", CELLS)
def test_fp8_logprobs_equal_hf_on_the_dequantized_weights(fp8_models, name, block):
    fp8_dir, reference_dir = fp8_models(name, block)
    prompts = [PROMPTS[0], PROMPTS[2]]
    reference = _hf_steps(reference_dir, prompts)
    driver = ModelDriver(fp8_dir)
    model = driver.runner.model
    assert model.model.layers[0].self_attn.o_proj.weight.dtype == FP8_DTYPE
    assert any(p.dtype == FP8_DTYPE and p.dim() == 3 for p in model.parameters())  # experts
    logits = driver.prefill(prompts)
    for step, (ref_logprobs, tokens) in enumerate(reference):
        ours = torch.log_softmax(logits.float(), -1)
        diff = (ours - ref_logprobs).abs().max().item()
        assert diff <= TOLERANCE, f"{name} {block} step {step}: max diff {diff:.2e}"
        assert ours.argmax(-1).tolist() == tokens
        if step < DECODE_STEPS:
            logits = driver.decode(tokens)


def test_fp8_weights_take_under_a_third_of_float32s(fp8_models, tiny_models):
    """Resident parameter bytes: e4m3 weights plus float32 per-row scales against float32."""
    fp8_dir, _ = fp8_models("tiny-deepseek-v3")
    fp8_bytes = WeightBytes.of(ModelDriver(fp8_dir).runner.model)
    fp32_bytes = WeightBytes.of(ModelDriver(tiny_models["tiny-deepseek-v3"]).runner.model)
    assert fp8_bytes.expert_bytes < 0.3 * fp32_bytes.expert_bytes


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v3"])
def test_online_fp8_equals_the_fp8_checkpoint_of_the_same_weights(tiny_models, fp8_models, name):
    """``--quantization fp8`` on the float32 checkpoint quantizes each checkpoint tensor in
    the blocks the fp8 checkpoint written from it holds: the same logits, bit for bit."""
    online = ModelDriver(tiny_models[name], quantization="fp8")
    layer = online.runner.model.model.layers[1]
    assert layer.self_attn.o_proj.weight.dtype == FP8_DTYPE
    assert layer.mlp.experts.w13_weight.dtype == FP8_DTYPE
    checkpoint = ModelDriver(fp8_models(name, "dense-kv_b")[0])
    assert torch.equal(online.prefill(PROMPTS[:2]), checkpoint.prefill(PROMPTS[:2]))


def _rewrite(src: str, dst: Path, change) -> str:
    """A copy of the checkpoint ``src`` with ``change(tensors, config)`` applied."""
    dst.mkdir()
    config = json.loads((Path(src) / "config.json").read_text())
    for f in Path(src).iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            change(tensors, config)
            save_file(tensors, dst / f.name)
        elif f.name != "config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def _bad_grid(tensors, config):
    if O_PROJ in tensors:  # the shard that holds it
        tensors[O_PROJ + "_scale_inv"] = torch.ones(3, 3)


def _dense_weight(tensors, config):
    if O_PROJ in tensors:
        tensors[O_PROJ] = tensors[O_PROJ].float()


def _awq(tensors, config):
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}


@pytest.mark.parametrize(
    "change, message",
    [
        (_bad_grid, f"{O_PROJ}_scale_inv has a scale grid \\(3, 3\\), expected \\(1, 1\\)"),
        (_dense_weight, f"checkpoint tensor {O_PROJ} is torch.float32; srt expects an fp8"),
        (_awq, "quant_method 'awq' is not supported; srt loads block-FP8"),
    ],
)
def test_bad_fp8_checkpoints_are_refused_naming_the_tensor(fp8_models, tmp_path, change, message):
    fp8_dir, _ = fp8_models("tiny-qwen3-moe")
    bad = _rewrite(fp8_dir, tmp_path / "bad", change)
    with pytest.raises(ValueError, match=message):
        ModelDriver(bad)


DP2 = dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="torch",
           deepep_mode="normal")  # fmt: skip
ALWAYS = {"tbo_decode_token_threshold": 0, "tbo_prefill_token_threshold": 0}
MODES = {
    "tbo": ("num_tbo_steps", dict(enable_two_batch_overlap=True, **ALWAYS)),
    "sbo": ("num_sbo_steps", dict(enable_single_batch_overlap=True)),
    "dbo": ("num_dbo_steps", dict(enable_dbo=True, dbo_decode_token_threshold=0,
                                  dbo_prefill_token_threshold=0)),
}  # fmt: skip


@pytest.fixture(scope="module")
def fp8_single_rank(fp8_models):
    return run_engine(fp8_models("tiny-deepseek-v3")[0])


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_fp8_tp2_dp_attention_ep_with_overlap_equals_single_rank(fp8_models, fp8_single_rank, mode):
    counter, flags = MODES[mode]
    outputs, states = run_engine(fp8_models("tiny-deepseek-v3")[0], with_state=True, **DP2, **flags)
    assert_same_outputs(outputs, fp8_single_rank)
    assert sum(n for s in states for n in s[counter].values()) > 0, states
