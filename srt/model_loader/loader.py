"""Build a model from its HF directory: class from the registry, weights from safetensors."""

from __future__ import annotations

import torch
from torch import nn

from srt.distributed.parallel_state import ParallelState
from srt.layers.quantization.config import finish_fp8, prepare_fp8
from srt.model_loader.config import ModelConfig
from srt.model_loader.weight_utils import iterate_safetensors
from srt.models.model_context import ModelOptions
from srt.models.registry import get_model_class


def load_model(
    model_config: ModelConfig,
    device: str | torch.device,
    parallel: ParallelState | None = None,
    options: ModelOptions | None = None,
) -> nn.Module:
    """Build the model of this rank (``parallel``: its groups, default one rank; ``options``:
    the server flags that shape it) and load its shard of every weight from the full
    checkpoint (block-FP8 weights as the config says: ``srt.layers.quantization``)."""
    model_class = get_model_class(model_config.architecture)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with torch.device(device):
            model = model_class(model_config.hf_config, parallel, options)
    finally:
        torch.set_default_dtype(previous)
    quant, stacked = model_config.quantization, model.weight_mapping().stacked
    prepare_fp8(model, quant, stacked)
    model.load_weights(iterate_safetensors(model_config.model_path))
    finish_fp8(model, quant, stacked)
    return model.eval()
