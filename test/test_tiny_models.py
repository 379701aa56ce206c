from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from make_tiny_models import MODEL_NAMES, bundled_model_path, make_tiny_models
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from srt.server_args import ServerArgs

PROMPTS = [
    "The quick brown",
    "What is the capital",
    "Once upon a time",
    "Numbers: 1 2 3",
    "The doctor told him",
    "Scientists measured",
    "Hello! Hi",
    "def add(a, b):",
]


def _checkpoint_keys(model_dir: Path) -> set[str]:
    keys = set()
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def _load_hf(model_dir: str):
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def test_generator_is_deterministic(tiny_models: dict[str, str], tmp_path: Path) -> None:
    fresh = make_tiny_models(str(tmp_path))
    assert list(fresh) == MODEL_NAMES
    for name in MODEL_NAMES:
        cached, rebuilt = Path(tiny_models[name]), Path(fresh[name])
        files = sorted(p.name for p in cached.iterdir())
        assert files == sorted(p.name for p in rebuilt.iterdir())
        for fname in files:
            assert (cached / fname).read_bytes() == (rebuilt / fname).read_bytes(), (name, fname)


def test_only_builds_the_same_bytes(tiny_models: dict[str, str], tmp_path: Path) -> None:
    name = "tiny-deepseek-v3"
    (path,) = make_tiny_models(str(tmp_path), [name]).values()
    for f in Path(tiny_models[name]).iterdir():
        assert f.read_bytes() == (Path(path) / f.name).read_bytes(), f.name


def test_launcher_defaults_to_the_bundled_model(tiny_models: dict[str, str]) -> None:
    """The launcher fills in the bundled model; the library itself requires a model path."""
    from launch_server import parse_args

    assert parse_args([]).model_path == bundled_model_path("arith-qwen3-moe")
    assert parse_args(["--model-path", tiny_models["tiny-deepseek-v3"]]).model_path.endswith("v3")
    with pytest.raises(ValueError, match="--model-path is required"):
        ServerArgs()


def test_checkpoint_uses_released_tensor_names(tiny_models: dict[str, str]) -> None:
    qwen = Path(tiny_models["tiny-qwen3-moe"])
    index = json.loads((qwen / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert set(index["weight_map"]) == _checkpoint_keys(qwen)
    assert {
        "model.layers.0.mlp.experts.7.gate_proj.weight",
        "model.layers.2.mlp.gate.weight",
        "model.layers.1.self_attn.q_norm.weight",
    } <= _checkpoint_keys(qwen)
    v2 = _checkpoint_keys(Path(tiny_models["tiny-deepseek-v2"]))
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"} <= v2
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in v2
    v3 = _checkpoint_keys(Path(tiny_models["tiny-deepseek-v3"]))
    assert {
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.experts.0.up_proj.weight",
    } <= v3


def test_tokenizer_round_trips_and_matches_config(tiny_models: dict[str, str]) -> None:
    model_dir = tiny_models["tiny-qwen3-moe"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == config["eos_token_id"]
    assert tok.bos_token is None and len(tok) <= config["vocab_size"]
    for text in [*PROMPTS, "Unseen wörds, ünïcode ✓ and\nnew lines."]:
        assert tok.decode(tok(text).input_ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_loads_in_transformers_and_generates(tiny_models: dict[str, str], name: str) -> None:
    model, info = _load_hf(tiny_models[name])
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    tok = AutoTokenizer.from_pretrained(tiny_models[name])
    continuations = set()
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            logits = model(ids).logits
            assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
            assert torch.isfinite(logits).all()
            out = model.generate(ids, max_new_tokens=4, do_sample=False)
            continuations.add(tuple(out[0, ids.shape[1] :].tolist()))
    assert len(continuations) >= 4  # greedy output depends on the prompt
