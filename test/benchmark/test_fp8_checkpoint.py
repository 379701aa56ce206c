"""benchmark.common.fp8_checkpoint: block-FP8 copies of the tiny checkpoints in the published
format, their exact dequantized copies, the directory HF transformers loads as the reference,
and ``make_random_model.py --quantization fp8``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from benchmark.common import fp8_checkpoint
from benchmark.common.fp8_checkpoint import (
    dequantize_checkpoint,
    dequantize_weight,
    hf_reference_dir,
    published_modules_to_not_convert,
    quantize_checkpoint,
)
from benchmark.offline.make_random_model import make_mid_size_model
from srt.layers.quantization import fp8
from srt.model_loader.weight_utils import iterate_safetensors

# Written by hand from the published checkpoints, independent of the module's own rule.
LINEAR_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj"}
LINEAR_NAMES |= {"kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj", "down_proj"}
SIDE_FILES = ["generation_config.json", "special_tokens_map.json", "tokenizer.json"]
SIDE_FILES += ["tokenizer_config.json"]


def _tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return dict(iterate_safetensors(str(model_dir)))


def _config(model_dir: str | Path) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _expect_quantized(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEAR_NAMES


def _assert_format(src: dict, dst: dict, block: tuple[int, int]) -> int:
    """Every Linear weight e4m3 with its float32 scale grid, everything else untouched; returns
    how many weights were quantized."""
    scales = {k for k in dst if k.endswith(".weight_scale_inv")}
    assert set(dst) - scales == set(src)
    for name, tensor in src.items():
        if not _expect_quantized(name):
            assert dst[name].dtype == tensor.dtype and torch.equal(dst[name], tensor), name
            continue
        n, k = tensor.shape
        scale = dst[name + "_scale_inv"]
        assert dst[name].dtype == torch.float8_e4m3fn and dst[name].shape == tensor.shape
        assert scale.dtype == torch.float32
        assert scale.shape == (-(-n // block[0]), -(-k // block[1])), name
    assert {k.removesuffix("_scale_inv") for k in scales} == set(filter(_expect_quantized, src))
    return len(scales)


def test_quantize_writes_the_published_format(deepseek_v3_path, tmp_path):
    # 16 × 16 blocks: kv_a_proj_with_mqa [40, 64] and q_a_proj [24, 64] end in partial blocks.
    dst = quantize_checkpoint(deepseek_v3_path, str(tmp_path / "fp8"), (16, 16))
    src_tensors, dst_tensors = _tensors(deepseek_v3_path), _tensors(dst)
    attn = "model.layers.0.self_attn"
    assert dst_tensors[f"{attn}.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 4)
    assert dst_tensors[f"{attn}.q_a_proj.weight_scale_inv"].shape == (2, 4)
    # 3 layers of 5 MLA weights, 3 dense + 2 × (8 routed + 1 shared) × 3 MLP weights
    assert _assert_format(src_tensors, dst_tensors, (16, 16)) == 15 + 3 + 54
    for kept in ["weight", "e_score_correction_bias"]:  # the router
        assert dst_tensors[f"model.layers.1.mlp.gate.{kept}"].dtype == torch.float32
    cfg = _config(dst)
    assert cfg.pop("quantization_config") == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [16, 16],
    }
    assert cfg == _config(deepseek_v3_path)
    assert sorted(p.name for p in Path(dst).iterdir()) == sorted(
        SIDE_FILES + ["config.json", "model.safetensors"]
    )
    for name in SIDE_FILES:
        assert (Path(dst) / name).read_bytes() == (Path(deepseek_v3_path) / name).read_bytes()


def test_quantize_keeps_shards_index_and_modules_to_not_convert(qwen3_moe_path, tmp_path):
    skip = published_modules_to_not_convert(_config(qwen3_moe_path))
    layer = ["input_layernorm", "mlp.gate", "post_attention_layernorm"]
    assert skip == ["lm_head"] + [f"model.layers.{i}.{m}" for i in range(3) for m in layer]
    custom = skip + ["model.layers.1.self_attn"]
    dst = Path(quantize_checkpoint(qwen3_moe_path, str(tmp_path / "fp8"), (32, 32), custom))
    assert _config(dst)["quantization_config"]["modules_to_not_convert"] == custom
    dst_tensors = _tensors(dst)
    assert dst_tensors["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32
    assert dst_tensors["model.layers.1.self_attn.q_norm.weight"].dtype == torch.float32
    assert dst_tensors["model.layers.2.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(dst_tensors)
    for key, file in index["weight_map"].items():
        with safe_open(str(dst / file), framework="pt") as f:
            assert key in f.keys()
    total = sum(t.numel() * t.element_size() for t in dst_tensors.values())
    assert index["metadata"]["total_size"] == total


def test_quantize_refuses_a_quantized_checkpoint(deepseek_v3_path, tmp_path):
    dst = quantize_checkpoint(deepseek_v3_path, str(tmp_path / "fp8"), (16, 16))
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(dst, str(tmp_path / "again"))


def test_round_trip_within_the_e4m3_error():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 2, 200)[:, None]
    w[128:, 256:] = 0  # an all-zero (partial) block: scale 1, zeros back
    q, scale_inv = fp8.quantize_blocks(w, (128, 128))
    back = dequantize_weight(q, scale_inv, (128, 128))
    per_element = scale_inv.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # e4m3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal spacing 2^-9 of the scale
    bound = torch.maximum(w.abs() * 2**-4, per_element * 2**-10)
    assert ((back - w).abs() <= bound).all()
    assert scale_inv[1, 2] == 1 and (back[128:, 256:] == 0).all()
    assert (back - w).abs().max() > 0  # it did round


def test_dequantized_copy_is_exact(deepseek_v3_path, tmp_path):
    block = (16, 16)
    fp8_dir = quantize_checkpoint(deepseek_v3_path, str(tmp_path / "fp8"), block)
    plain = dequantize_checkpoint(fp8_dir, str(tmp_path / "plain"))
    stored, copied = _tensors(fp8_dir), _tensors(plain)
    assert _config(plain) == _config(deepseek_v3_path)
    assert set(copied) == {k for k in stored if not k.endswith("_scale_inv")}
    for name, tensor in copied.items():
        if stored[name].dtype != torch.float8_e4m3fn:
            assert torch.equal(tensor, stored[name])
            continue
        q, s = stored[name], stored[name + "_scale_inv"]
        n, k = q.shape
        assert torch.equal(tensor, fp8.dequantize(q, fp8.row_scales(s, n, k, block, 8), 8))
        by_block = torch.empty(n, k)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                rows, cols = slice(16 * i, 16 * i + 16), slice(16 * j, 16 * j + 16)
                by_block[rows, cols] = q[rows, cols].float() * s[i, j]
        assert torch.equal(tensor, by_block), name


def _hf_logits(model_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 42, 100, 7, 3, 200]])).logits


def test_hf_reference_is_a_dequantized_copy_for_partial_blocks(deepseek_v3_path, tmp_path):
    fp8_dir = quantize_checkpoint(deepseek_v3_path, str(tmp_path / "fp8"), (16, 16))
    ref = hf_reference_dir(fp8_dir, str(tmp_path / "refs"))
    assert ref == str(tmp_path / "refs" / "fp8-dequantized")
    assert "quantization_config" not in _config(ref)
    assert torch.equal(
        _tensors(ref)["lm_head.weight"], _tensors(deepseek_v3_path)["lm_head.weight"]
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="HF keeps FP8 weights on a GPU")
def test_hf_dequantizes_whole_blocks_exactly_on_cpu(qwen3_moe_path, tmp_path):
    pytest.importorskip("accelerate")  # HF's FP8 loader requires it
    skip = published_modules_to_not_convert(_config(qwen3_moe_path))
    fp8_dir = quantize_checkpoint(qwen3_moe_path, str(tmp_path / "fp8"), (32, 32), skip)
    assert hf_reference_dir(fp8_dir, str(tmp_path / "refs")) == fp8_dir
    plain = dequantize_checkpoint(fp8_dir, str(tmp_path / "plain"))
    assert torch.equal(_hf_logits(fp8_dir), _hf_logits(plain))


def test_command_line_round_trip(qwen3_moe_path, tmp_path, monkeypatch):
    for command, src, dst in [
        ("quantize", qwen3_moe_path, "fp8"),
        ("dequantize", str(tmp_path / "fp8"), "plain"),
    ]:
        monkeypatch.setattr(sys, "argv", ["fp8_checkpoint", command, src, str(tmp_path / dst)])
        fp8_checkpoint.main()
    quant = _config(tmp_path / "fp8")["quantization_config"]
    assert quant["weight_block_size"] == [128, 128] and "lm_head" in quant["modules_to_not_convert"]
    assert _config(tmp_path / "plain") == _config(qwen3_moe_path)


# small: 3 layers × (4 attention + 12 experts × 3); deepseek-v3: 4 × 5 MLA, 3 dense, 3 MoE
# layers × (16 routed + 1 shared) × 3.
@pytest.mark.parametrize("preset, num_quantized", [("small", 120), ("deepseek-v3", 176)])
def test_make_random_model_writes_fp8(preset, num_quantized, tmp_path):
    plain = make_mid_size_model(str(tmp_path / "plain"), preset)
    fp8_dir = make_mid_size_model(str(tmp_path / "fp8"), preset, quantization="fp8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp8", "plain"]  # no leftovers
    cfg = _config(fp8_dir)
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert ("modules_to_not_convert" in cfg["quantization_config"]) == (preset == "small")
    assert _assert_format(_tensors(plain), _tensors(fp8_dir), (128, 128)) == num_quantized
    ref = hf_reference_dir(fp8_dir, str(tmp_path / "refs"))
    rounded = _tensors(ref)
    for name, weight in _tensors(plain).items():  # the reference: the weights, rounded once
        assert (rounded[name] - weight).abs().max() <= weight.abs().max() * 2**-4
    want, got = _hf_logits(plain), _hf_logits(ref)
    assert got.isfinite().all()
    assert torch.corrcoef(torch.stack([want.flatten(), got.flatten()]))[0, 1] > 0.9


def test_make_random_model_fp8_copy(tmp_path, monkeypatch):
    """``--fp8-copy`` keeps the checkpoint and writes beside it what ``--quantization fp8``
    writes alone; with ``--quantization`` it is refused."""
    from benchmark.offline import make_random_model

    argv = ["make_random_model.py", "--preset", "small", "--out-dir", str(tmp_path / "plain")]
    monkeypatch.setattr(sys, "argv", [*argv, "--fp8-copy", str(tmp_path / "copy")])
    make_random_model.main()
    fp8_dir = make_mid_size_model(str(tmp_path / "fp8"), "small", quantization="fp8")
    assert "quantization_config" not in _config(tmp_path / "plain")
    assert _config(tmp_path / "copy") == _config(fp8_dir)
    copy, alone = _tensors(tmp_path / "copy"), _tensors(fp8_dir)
    assert copy.keys() == alone.keys()
    for key, tensor in copy.items():  # bit for bit (e4m3 NaNs compare as bytes)
        assert torch.equal(tensor.view(torch.uint8), alone[key].view(torch.uint8)), key
    monkeypatch.setattr(sys, "argv", [*argv, "--fp8-copy", "x", "--quantization", "fp8"])
    with pytest.raises(SystemExit):
        make_random_model.main()
