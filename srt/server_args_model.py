"""The model flags of ``ServerArgs`` (which checkpoint, its precision, the device), a dataclass
of their own that ``ServerArgs`` extends; ``srt.model_loader.config.ModelConfig`` resolves
them against the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field

from srt.server_args_choices import (
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    QUANTIZATION_CHOICES,
    VALUE_ALIASES,
)
from srt.server_args_overlap import _arg


@dataclass
class ModelArgs:
    model_path: str | None = field(
        default=None,
        metadata=_arg(
            "model",
            "HF model directory (the launcher and benchmarks serve the bundled tiny Qwen3-MoE "
            "when it is left out).",
        ),
    )
    tokenizer_path: str | None = field(
        default=None, metadata=_arg("model", "Tokenizer directory; default: --model-path.")
    )
    dtype: str = field(
        default="auto",
        metadata=_arg(
            "model",
            "Weight and activation dtype; half and float (SGLang's and vLLM's spellings) are "
            "float16 and float32.",
            choices=[*DTYPE_CHOICES, *VALUE_ALIASES["dtype"]],
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_arg(
            "model",
            "KV cache dtype; auto follows --dtype; bf16 (SGLang's spelling) is bfloat16.",
            choices=[*DTYPE_CHOICES, *VALUE_ALIASES["kv_cache_dtype"]],
        ),
    )
    context_length: int | None = field(
        default=None,
        metadata=_arg("model", "Maximum context length; default: the model config's."),
    )
    device: str = field(
        default="auto",
        metadata=_arg("model", "Device; auto picks cuda when available.", choices=DEVICE_CHOICES),
    )
    random_seed: int = field(default=0, metadata=_arg("model", "Seed of the unseeded sampler."))
    quantization: str | None = field(
        default=None,
        metadata=_arg(
            "model",
            "Weight quantization. fp8: block-FP8 (e4m3 weights, a float32 scale per 128 × 128 "
            "block; on CPU weight-only, on GPU W8A8 from sm89). Read from the checkpoint's "
            "quantization_config without the flag; on a bf16 or float32 checkpoint fp8 "
            "quantizes the weights at load. docs/quantization.md.",
            choices=QUANTIZATION_CHOICES,
        ),
    )
