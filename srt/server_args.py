"""ServerArgs: every flag srt supports, its argparse table, validation and derived values.

The dataclass is the single source: ``add_cli_args`` generates the parser from the fields and
their metadata, and ``srt.Engine(**kwargs)`` takes the same field names.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DEVICE_CHOICES = ["auto", "cpu", "cuda"]
SCHEDULE_POLICY_CHOICES = ["fcfs", "lpm"]


def _arg(group: str, help: str, **kwargs: Any) -> dict[str, Any]:
    return {"group": group, "help": help, **kwargs}


def default_model_path() -> str:
    """The bundled tiny Qwen3-MoE, built (a few MB, no network) on first use."""
    from make_tiny_models import ensure_tiny_models

    return ensure_tiny_models()["tiny-qwen3-moe"]


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: str | None = field(
        default=None,
        metadata=_arg("model", "HF model directory; default: the bundled tiny Qwen3-MoE."),
    )
    tokenizer_path: str | None = field(
        default=None, metadata=_arg("model", "Tokenizer directory; default: --model-path.")
    )
    dtype: str = field(
        default="auto",
        metadata=_arg("model", "Weight and activation dtype.", choices=DTYPE_CHOICES),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_arg("model", "KV cache dtype; auto follows --dtype.", choices=DTYPE_CHOICES),
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
    # Memory and scheduling
    max_total_tokens: int | None = field(
        default=None,
        metadata=_arg("memory", "KV cache size in tokens; default: from --mem-fraction-static."),
    )
    mem_fraction_static: float | None = field(
        default=None,
        metadata=_arg(
            "memory",
            "Fraction of device memory for weights and KV cache (CUDA: total; CPU: of the "
            "memory available at start-up for the KV cache). Default 0.88 CUDA, 0.1 CPU.",
        ),
    )
    max_running_requests: int | None = field(
        default=None, metadata=_arg("memory", "Maximum requests decoding at once.")
    )
    max_prefill_tokens: int = field(
        default=16384, metadata=_arg("memory", "Maximum new tokens in one prefill batch.")
    )
    chunked_prefill_size: int | None = field(
        default=None,
        metadata=_arg(
            "memory",
            "Split prompts into chunks of this many tokens; -1 disables. Default 8192 "
            "(CUDA) or 2048 (CPU).",
        ),
    )
    schedule_policy: str = field(
        default="fcfs",
        metadata=_arg(
            "memory",
            "Order of the waiting queue; lpm = longest prefix match first.",
            choices=SCHEDULE_POLICY_CHOICES,
        ),
    )
    disable_radix_cache: bool = field(
        default=False, metadata=_arg("memory", "Disable the radix prefix cache.")
    )
    # Parallelism
    tp_size: int = field(
        default=1,
        metadata=_arg(
            "parallel",
            "Tensor-parallel size: the number of rank processes (one node).",
            aliases=["--tp"],
        ),
    )
    # HTTP server
    host: str = field(default="127.0.0.1", metadata=_arg("server", "Address to listen on."))
    port: int = field(default=30000, metadata=_arg("server", "Port to listen on."))
    api_key: str | None = field(
        default=None,
        metadata=_arg("server", "Require 'Authorization: Bearer KEY' on every route but /health."),
    )
    served_model_name: str | None = field(
        default=None, metadata=_arg("server", "Model name on the OpenAI API; default: the path.")
    )
    log_level: str = field(
        default="info",
        metadata=_arg("logging", "Logging level.", choices=["debug", "info", "warning", "error"]),
    )

    def __post_init__(self) -> None:
        self.check_and_resolve()

    # ----------------------------------------------------------------------------------
    def check_and_resolve(self) -> None:
        """Validate every flag once and resolve the "auto" values."""
        if self.model_path is None:
            self.model_path = default_model_path()
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88 if self.device == "cuda" else 0.1
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if self.device == "cuda" else 2048
        self._check_ranges()

    def _check_ranges(self) -> None:
        def require(ok: bool, flag: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"--{flag.replace('_', '-')}: {msg}")

        require(0 < self.mem_fraction_static < 1, "mem_fraction_static", "must be in (0, 1)")
        require(
            self.max_total_tokens is None or self.max_total_tokens > 0,
            "max_total_tokens",
            "must be positive",
        )
        require(
            self.max_running_requests is None or self.max_running_requests > 0,
            "max_running_requests",
            "must be positive",
        )
        require(self.tp_size >= 1, "tp_size", "must be ≥ 1")
        require(self.max_prefill_tokens > 0, "max_prefill_tokens", "must be positive")
        require(
            self.chunked_prefill_size == -1 or self.chunked_prefill_size > 0,
            "chunked_prefill_size",
            "must be positive or -1",
        )
        require(
            self.context_length is None or self.context_length > 1, "context_length", "must be > 1"
        )
        for name, choices in (
            ("dtype", DTYPE_CHOICES),
            ("kv_cache_dtype", DTYPE_CHOICES),
            ("device", DEVICE_CHOICES[1:]),
            ("schedule_policy", SCHEDULE_POLICY_CHOICES),
        ):
            require(getattr(self, name) in choices, name, f"must be one of {choices}")

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.chunked_prefill_size != -1

    def check_against_model(self, hf_config: Any) -> None:
        """What needs the model's config: experts, heads and MLP sizes must split over the
        ranks. Raised at start-up, before any rank process starts."""
        from srt.distributed.parallel_state import ParallelConfig

        layout = ParallelConfig(tp_size=self.tp_size)
        flag = f"--tp-size {self.tp_size}"
        num_experts = getattr(hf_config, "num_experts", None) or getattr(
            hf_config, "n_routed_experts", None
        )
        if num_experts and self.tp_size > num_experts:
            raise ValueError(f"{flag}: more ranks than experts ({num_experts})")
        if num_experts and num_experts % layout.moe_ep_size:
            raise ValueError(f"{flag}: {num_experts} experts do not split over the EP ranks")
        sizes = {
            "num_attention_heads": getattr(hf_config, "num_attention_heads", None),
            "moe_intermediate_size": getattr(hf_config, "moe_intermediate_size", None),
            "intermediate_size": getattr(hf_config, "intermediate_size", None),
        }
        divisors = {"moe_intermediate_size": layout.moe_tp_size}
        for name, size in sizes.items():
            ranks = divisors.get(name, layout.attn_tp_size)
            if size and size % ranks:
                raise ValueError(f"{flag}: the model's {name} ({size}) is not divisible by {ranks}")
        kv_heads = getattr(hf_config, "num_key_value_heads", None)
        if kv_heads and kv_heads % self.tp_size and self.tp_size % kv_heads:
            raise ValueError(
                f"{flag}: the model's num_key_value_heads ({kv_heads}) neither divides nor is "
                f"a multiple of the tensor-parallel size"
            )

    # ----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in dataclasses.fields(ServerArgs):
            meta = dict(f.metadata)
            group = meta.pop("group")
            if group not in groups:
                groups[group] = parser.add_argument_group(group)
            flags = ["--" + f.name.replace("_", "-"), *meta.pop("aliases", [])]
            if f.type in ("bool", bool):
                groups[group].add_argument(*flags, action="store_true", **meta)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            groups[group].add_argument(*flags, type=kind, default=f.default, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)
