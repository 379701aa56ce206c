"""ModelConfig: the HF config plus what srt derives from it (dtype, context length, EOS)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from srt.layers.quantization.config import Fp8Config, quantization_from

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(name: str, hf_config: PretrainedConfig) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, str):
        ckpt = _DTYPES.get(ckpt, torch.float32)
    return ckpt if ckpt in _DTYPES.values() else torch.float32


def _eos_token_ids(model_path: str, hf_config: PretrainedConfig) -> set[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            ids = json.load(f).get("eos_token_id", ids)
    if ids is None:
        return set()
    return {ids} if isinstance(ids, int) else set(ids)


@dataclass
class ModelConfig:
    model_path: str
    hf_config: PretrainedConfig
    architecture: str
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    context_len: int
    vocab_size: int
    eos_token_ids: set[int]
    quantization: Fp8Config | None = None  # block-FP8 weights (checkpoint or online)

    @classmethod
    def from_server_args(cls, server_args) -> ModelConfig:
        path = server_args.model_path
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"--model-path {path}: no config.json found")
        hf_config = AutoConfig.from_pretrained(path)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{path}/config.json names no architecture")
        dtype = _resolve_dtype(server_args.dtype, hf_config)
        kv_dtype = (
            dtype if server_args.kv_cache_dtype == "auto" else _DTYPES[server_args.kv_cache_dtype]
        )
        max_pos = getattr(hf_config, "max_position_embeddings", 4096)
        context_len = server_args.context_length or max_pos
        quant = quantization_from(
            getattr(hf_config, "quantization_config", None), server_args.quantization, path
        )
        return cls(
            path,
            hf_config,
            archs[0],
            dtype,
            kv_dtype,
            context_len,
            hf_config.vocab_size,
            _eos_token_ids(path, hf_config),
            quant,
        )

    @property
    def is_mla(self) -> bool:
        return getattr(self.hf_config, "kv_lora_rank", None) is not None

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers
