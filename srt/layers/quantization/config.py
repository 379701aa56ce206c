"""Which precision a checkpoint's weights come in, from its ``quantization_config`` and
``--quantization``, and the model-wide steps that follow from it: fp8 storage before loading
(``prepare_fp8``), and after loading MLA's dequantized ``kv_b_proj`` or the online quantization
of a bf16 / float32 checkpoint (``finish_fp8``).

srt loads block-FP8 checkpoints as DeepSeek-V3 and the Qwen3 FP8 releases publish them
(``quant_method: fp8``, e4m3, dynamic activation scales, ``weight_block_size``) and unquantized
ones; any other ``quant_method`` is refused at start-up."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn

SUPPORTED = (
    "srt loads block-FP8 checkpoints (quant_method fp8, fmt e4m3, dynamic activations, "
    "weight_block_size) and unquantized float32/bf16/fp16 ones, which --quantization fp8 "
    "quantizes at load"
)


@dataclass(frozen=True)
class Fp8Config:
    """Block-FP8 weights in blocks of ``block`` (rows, columns): read from the checkpoint
    (``from_checkpoint``) or quantized at load; ``ignored``: the checkpoint's
    ``modules_to_not_convert``."""

    block: tuple[int, int] = (128, 128)
    from_checkpoint: bool = False
    ignored: tuple[str, ...] = ()


def quantization_from(config: dict | None, flag: str | None, where: str) -> Fp8Config | None:
    """The precision of a checkpoint (``config``: its ``quantization_config``, ``where``: its
    path for the messages) served with ``--quantization flag``; None: unquantized. Raises
    ValueError for a format srt does not load."""
    if config is None:
        return Fp8Config() if flag == "fp8" else None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{where}: quantization_config quant_method {method!r} is not supported; {SUPPORTED}"
        )
    problems = {
        "fmt": (config.get("fmt", "e4m3"), "e4m3"),
        "activation_scheme": (config.get("activation_scheme", "dynamic"), "dynamic"),
    }
    for key, (value, expected) in problems.items():
        if value != expected:
            raise ValueError(
                f"{where}: quantization_config {key} {value!r} is not supported "
                f"(only {expected!r}); {SUPPORTED}"
            )
    block = config.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(b > 0 for b in block)):
        raise ValueError(
            f"{where}: quantization_config weight_block_size {block!r} is not two "
            f"positive sizes (per-tensor fp8 is not supported); {SUPPORTED}"
        )
    ignored = tuple(config.get("modules_to_not_convert") or ())
    return Fp8Config((int(block[0]), int(block[1])), True, ignored)


@runtime_checkable
class Fp8Capable(Protocol):
    """A layer that can hold block-FP8 weights (the linear layers, the routed experts)."""

    def use_fp8(self, block: tuple[int, int]) -> None: ...

    def quantize_loaded(self, block: tuple[int, int]) -> None: ...

    def finish_fp8(self) -> None: ...


def _checkpoint_names(name: str, stacked: Iterable[tuple[str, str, object]]) -> set[str]:
    """The checkpoint module names that load into module ``name`` (``q_proj`` for qkv_proj)."""
    names = {name}
    for param_part, ckpt_part, _ in stacked:
        if name.endswith(f".{param_part}"):
            names.add(name[: -len(param_part)] + ckpt_part)
    return names


def not_converted(name: str, entries: Iterable[str]) -> bool:
    """Whether module ``name`` is left unquantized by ``modules_to_not_convert`` ``entries``,
    read as HF transformers reads them: an entry (a regular expression) matching from the start
    of the name up to a dot or its end, or a plain suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(f"(?:{e}){boundary}", name) or name.endswith(e) for e in entries)


def _fp8_layers(model: nn.Module, config: Fp8Config, stacked) -> list[nn.Module]:
    """The layers that hold fp8 weights: every ``Fp8Capable`` one but those the config lists
    as not converted (all the checkpoint tensors of a fused layer, or none of them)."""
    layers = []
    for name, module in model.named_modules():
        if not isinstance(module, Fp8Capable):
            continue
        skipped = [not_converted(n, config.ignored) for n in _checkpoint_names(name, stacked)]
        if any(skipped) != all(skipped):
            raise ValueError(
                f"modules_to_not_convert leaves part of the fused layer {name} in "
                "fp8: srt fuses its checkpoint tensors into one weight"
            )
        if not any(skipped):
            layers.append(module)
    return layers


def prepare_fp8(model: nn.Module, config: Fp8Config | None, stacked) -> None:
    """Before loading a block-FP8 checkpoint: fp8 storage in every layer that takes it
    (``stacked``: the model's fused names, ``WeightMapping.stacked``)."""
    if config is not None and config.from_checkpoint:
        for layer in _fp8_layers(model, config, stacked):
            layer.use_fp8(config.block)


def finish_fp8(model: nn.Module, config: Fp8Config | None, stacked) -> None:
    """Once loaded: dense weights where a model reads them as matrices (``finish_fp8`` of a
    layer), or, for ``--quantization fp8`` on an unquantized checkpoint, every layer
    quantized."""
    if config is None:
        return
    for layer in _fp8_layers(model, config, stacked):
        if config.from_checkpoint:
            layer.finish_fp8()
        else:
            layer.quantize_loaded(config.block)
