"""Loading errors name the flag or tensor; sharded checkpoints load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from srt.model_loader.config import ModelConfig
from srt.model_loader.loader import load_model
from srt.server_args import ServerArgs


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _load(path: Path):
    config = ModelConfig.from_server_args(ServerArgs(model_path=str(path), dtype="float32"))
    return load_model(config, "cpu")


def _edit_checkpoint(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_sharded_checkpoint_loads(qwen3_moe_path):
    assert (Path(qwen3_moe_path) / "model.safetensors.index.json").exists()
    model = _load(Path(qwen3_moe_path))
    assert model.model.layers[0].mlp.experts.w13_weight.abs().sum() > 0


def test_unknown_architecture(deepseek_v2_path, tmp_path):
    path = _copy(deepseek_v2_path, tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MysteryForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'MysteryForCausalLM'"):
        _load(path)


def test_misshaped_tensor_names_tensor_and_shapes(deepseek_v2_path, tmp_path):
    path = _copy(deepseek_v2_path, tmp_path / "m")
    name = "model.layers.0.self_attn.kv_b_proj.weight"

    def edit(tensors):
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)

    _edit_checkpoint(path, edit)
    with pytest.raises(
        ValueError, match=rf"{name}: checkpoint \(128, 33\), model expects \(128, 32\)"
    ):
        _load(path)


def test_missing_tensor_is_named(deepseek_v3_path, tmp_path):
    path = _copy(deepseek_v3_path, tmp_path / "m")
    _edit_checkpoint(path, lambda t: t.pop("model.layers.1.mlp.experts.3.down_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors .*model\.layers\.1\.mlp\.experts\.w2"):
        _load(path)


def test_unexpected_tensor_is_named(deepseek_v3_path, tmp_path):
    path = _copy(deepseek_v3_path, tmp_path / "m")
    _edit_checkpoint(path, lambda t: t.update({"model.extra_head.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"model\.extra_head\.weight \(2, 2\) matches no"):
        _load(path)


def test_missing_model_dir_names_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="--model-path"):
        _load(tmp_path / "absent")
