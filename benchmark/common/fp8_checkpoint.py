"""Block-FP8 copies of a model directory in the published format (DeepSeek-V3, Qwen3-*-FP8), and
their dequantized copies: the reference HF transformers loads where it cannot dequantize itself.

``config.json`` gains ``quantization_config``; every Linear weight ``X.weight`` of the attention,
the dense MLPs and the experts (routed and shared) is stored float8_e4m3fn beside a float32
``X.weight_scale_inv [ceil(N / bn), ceil(K / bk)]``. As in DeepSeek-V3's release, embeddings,
``lm_head``, norms, routers (``mlp.gate``) and ``e_score_correction_bias`` keep their dtype.

    python -m benchmark.common.fp8_checkpoint quantize SRC DST
    python -m benchmark.common.fp8_checkpoint dequantize SRC DST
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from srt.layers.quantization import fp8
from srt.layers.quantization.config import not_converted

SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
INDEX_FILE = "model.safetensors.index.json"
# Kept in their dtype (as are norms): embeddings, output heads (MTP's too), the MoE routers.
NEVER_QUANTIZED = ("embed_tokens", "lm_head", "head", "gate", "shared_expert_gate")


def is_quantized(name: str, tensor: torch.Tensor, modules_to_not_convert: list[str]) -> bool:
    """Whether ``quantize_checkpoint`` stores ``name`` as FP8: a 2-D Linear weight outside the
    modules the format keeps (``NEVER_QUANTIZED``, norms) and ``modules_to_not_convert``."""
    if not name.endswith(".weight") or tensor.ndim != 2:
        return False
    module = name.removesuffix(".weight")
    last = module.rpartition(".")[2]
    if last in NEVER_QUANTIZED or "norm" in last:
        return False
    return not not_converted(module, modules_to_not_convert)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _open_shards(src: Path) -> dict:
    """Each safetensors file of ``src``, by name, opened for reading."""
    return {p.name: safe_open(str(p), framework="pt") for p in sorted(src.glob("*.safetensors"))}


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, chat template...: everything but weights and config."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        skip = path.suffix == ".safetensors" or path.name in (INDEX_FILE, "config.json")
        if path.is_file() and not skip:
            shutil.copy2(path, dst / path.name)


def _write_shards(src: Path, dst: Path, convert) -> None:
    """Writes each shard of ``src`` to ``dst`` as ``convert(tensors, holder)`` makes it (``holder``:
    each key's open shard, as a weight and its scale may lie in two), and the index if any."""
    handles = _open_shards(src)
    holder = {key: handle for handle in handles.values() for key in handle.keys()}
    weight_map, total = {}, 0
    for name, handle in handles.items():
        out = convert({key: handle.get_tensor(key) for key in handle.keys()}, holder)
        save_file(out, str(dst / name), {"format": "pt"})
        weight_map |= dict.fromkeys(out, name)
        total += sum(t.numel() * t.element_size() for t in out.values())
    if (src / INDEX_FILE).exists():
        _write_json(dst / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def quantize_checkpoint(
    src_dir: str,
    dst_dir: str,
    block: tuple[int, int] = (128, 128),
    modules_to_not_convert: list[str] | None = None,
) -> str:
    """Writes ``src_dir``'s model to ``dst_dir`` in the block-FP8 format (``quantize_blocks``
    rounds each weight); ``modules_to_not_convert`` (module names, kept whole with their
    submodules) goes into the config as Qwen3-FP8 writes it. Returns ``dst_dir``."""
    src, dst = Path(src_dir), Path(dst_dir)
    cfg = _read_json(src / "config.json")
    if "quantization_config" in cfg:
        raise ValueError(f"{src_dir} is already quantized ({cfg['quantization_config']})")
    skip = list(modules_to_not_convert or [])

    def convert(tensors: dict[str, torch.Tensor], _holder) -> dict[str, torch.Tensor]:
        out = {}
        for key, tensor in tensors.items():
            if is_quantized(key, tensor, skip):
                out[key], out[key + SCALE_SUFFIX] = fp8.quantize_blocks(tensor, block)
            else:
                out[key] = tensor
        return out

    _copy_side_files(src, dst)
    _write_shards(src, dst, convert)
    quant = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"}
    cfg["quantization_config"] = quant | {"weight_block_size": list(block)}
    if modules_to_not_convert is not None:
        cfg["quantization_config"]["modules_to_not_convert"] = skip
    _write_json(dst / "config.json", cfg)  # written last: its presence means complete
    return str(dst)


def dequantize_weight(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]):
    """One stored FP8 weight as float32: ``float(q) · scale`` of its block, edge blocks partial."""
    rows, cols = q.shape[-2:]
    return fp8.dequantize(q, fp8.row_scales(scale_inv, rows, cols, block, block[1]), block[1])


def dequantize_checkpoint(src_dir: str, dst_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Writes a plain copy of the FP8 checkpoint ``src_dir``: every FP8 weight dequantized to
    ``dtype`` (exact in float32), its scale dropped, the other tensors unchanged, and no
    ``quantization_config``. Returns ``dst_dir``."""
    src, dst = Path(src_dir), Path(dst_dir)
    cfg = _read_json(src / "config.json")
    block = tuple(cfg.pop("quantization_config")["weight_block_size"])

    def convert(tensors: dict[str, torch.Tensor], holder) -> dict[str, torch.Tensor]:
        out = {}
        for key, tensor in tensors.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            if tensor.dtype == fp8.FP8_DTYPE:
                scale = holder[key + SCALE_SUFFIX].get_tensor(key + SCALE_SUFFIX)
                tensor = dequantize_weight(tensor, scale, block).to(dtype)
            out[key] = tensor
        return out

    _copy_side_files(src, dst)
    _write_shards(src, dst, convert)
    _write_json(dst / "config.json", cfg)
    return str(dst)


def published_modules_to_not_convert(cfg: dict) -> list[str] | None:
    """The ``modules_to_not_convert`` the published FP8 release of ``cfg``'s architecture lists:
    Qwen3-*-FP8 name ``lm_head`` and each layer's norms and router; DeepSeek-V3 lists none."""
    if not cfg["model_type"].startswith("qwen3"):
        return None
    per_layer = ("input_layernorm", "mlp.gate", "post_attention_layernorm")
    layers = range(cfg["num_hidden_layers"])
    return ["lm_head"] + [f"model.layers.{i}.{m}" for i in layers for m in per_layer]


def _hf_dequantizes_exactly(fp8_dir: Path, block: tuple[int, int]) -> bool:
    """HF transformers (5.x) dequantizes FP8 weights itself only with accelerate installed and no
    CUDA or XPU device, and takes a weight's block from its scale grid (``N // grid_rows``): it
    refuses partial edge blocks, or splits them wrongly (200 rows on a grid of 2: two of 100)."""
    import transformers.utils as hf_utils

    device = torch.cuda.is_available() or hf_utils.is_torch_xpu_available()
    if device or not hf_utils.is_accelerate_available():
        return False
    slices = [h.get_slice(key) for h in _open_shards(fp8_dir).values() for key in h.keys()]
    shapes = [s.get_shape() for s in slices if s.get_dtype() == "F8_E4M3"]
    return not any(rows % block[0] or cols % block[1] for rows, cols in shapes)


def hf_reference_dir(fp8_dir: str, tmp_dir: str) -> str:
    """The directory HF transformers loads (``dtype=torch.float32``) as the exact reference of
    the FP8 checkpoint ``fp8_dir``: ``fp8_dir`` itself where HF dequantizes it exactly (CPU only,
    whole blocks), else a dequantized float32 copy under ``tmp_dir`` (made once)."""
    src = Path(fp8_dir)
    block = tuple(_read_json(src / "config.json")["quantization_config"]["weight_block_size"])
    if _hf_dequantizes_exactly(src, block):
        return fp8_dir
    dst = Path(tmp_dir) / f"{src.name}-dequantized"
    if not (dst / "config.json").exists():
        dequantize_checkpoint(fp8_dir, str(dst))
    return str(dst)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["quantize", "dequantize"])
    parser.add_argument("src_dir")
    parser.add_argument("dst_dir")
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128], help="quantize only")
    args = parser.parse_args()
    if args.command == "dequantize":
        print(dequantize_checkpoint(args.src_dir, args.dst_dir))
        return
    skip = published_modules_to_not_convert(_read_json(Path(args.src_dir) / "config.json"))
    print(quantize_checkpoint(args.src_dir, args.dst_dir, tuple(args.block), skip))


if __name__ == "__main__":
    main()
