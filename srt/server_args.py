"""ServerArgs: every flag srt supports, its argparse table, validation and derived values.

The dataclass is the single source: ``add_cli_args`` generates the parser from the fields and
their metadata, and ``srt.Engine(**kwargs)`` takes the same field names.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from srt.server_args_checks import (
    check_cuda_graphs,
    check_gpus_per_node,
    check_model_layout,
    check_overlap,
    check_parallel,
    check_ranges,
    low_latency_fit,
    normalize_spellings,
    resolve_attention_backend,
    resolve_burst_prefill,
)
from srt.server_args_choices import (
    ATTENTION_BACKEND_CHOICES,
    BURST_QUIET_S,
    DEEPEP_MODE_CHOICES,
    DEFAULT_BURST_CHUNK_SIZE,
    DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK,
    GRAMMAR_BACKEND_CHOICES,
    LOAD_BALANCE_CHOICES,
    MOE_A2A_BACKEND_CHOICES,
    SCHEDULE_POLICY_CHOICES,
    TOOL_CALL_PARSER_CHOICES,
    VALUE_ALIASES,
)
from srt.server_args_debug import DebugArgs, apply_env_aliases, check_logging
from srt.server_args_eplb import EplbArgs, check_eplb, check_eplb_against_model
from srt.server_args_model import ModelArgs
from srt.server_args_overlap import OverlapArgs, _arg


@dataclass
class ServerArgs(DebugArgs, EplbArgs, OverlapArgs, ModelArgs):
    """Every flag: the model's, the overlap, the expert-placement and the logging ones
    (``ModelArgs``, ``OverlapArgs``, ``EplbArgs``, ``DebugArgs``), then these."""

    # Kernels and CUDA graphs
    attention_backend: str = field(
        default="auto",
        metadata=_arg(
            "kernels",
            "Paged attention: triton (CUDA), cpu (srt's C kernels on CPU, float32 or bfloat16; "
            "other dtypes and MLA's extend on SDPA) or torch_native (PyTorch's SDPA, any device). "
            "auto: triton on CUDA, cpu on CPU where its kernels build, else torch_native.",
            choices=ATTENTION_BACKEND_CHOICES,
        ),
    )
    # fmt: off
    disable_cuda_graph: bool = field(default=False, metadata=_arg("kernels", "Decode eagerly "
        "instead of from graphs (CUDA graphs; on CPU, one rank's recorded decode)."))
    cuda_graph_max_bs: int | None = field(default=None, metadata=_arg("kernels", "Largest "
        "decode batch replayed from a graph (default 64; on CPU 16)."))
    cuda_graph_bs: list[int] | None = field(
        default=None,
        metadata=_arg("kernels", "Decode batch sizes captured (default: 1, 2, 4, 8, then by 8; "
                      "on CPU 1 to 8, then by 4).", nargs="+"),
    )
    # fmt: on
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
    enable_mixed_chunk: bool = field(
        default=False,
        metadata=_arg(
            "memory",
            "Run the running requests' decode in the same batch as a prefill (one mixed "
            "batch) instead of in a step of its own after it; the prefill's budget "
            "(--chunked-prefill-size, --max-prefill-tokens) leaves room for their tokens. "
            "On by default on CPU without an overlap mode (docs/benchmarks.md); "
            "--disable-mixed-chunk turns it off.",
        ),
    )
    disable_mixed_chunk: bool = field(
        default=False,
        metadata=_arg(
            "memory",
            "Run every prefill in a batch of its own, the running requests decoding in the "
            "step after it: turns off the CPU default of --enable-mixed-chunk.",
        ),
    )
    prefill_burst_hold_ms: float = field(
        default=50.0,
        metadata=_arg(
            "memory",
            "While requests decode and new ones are still arriving (the last one less than "
            f"{BURST_QUIET_S * 1e3:g} ms ago), hold their prefill, up to this long after the "
            "oldest of them arrived, so that a burst is prefilled at once and the running "
            "requests pay one gap, not one per fragment; never when the waiting prompts fill a "
            "prefill batch (a wave's: --wave-prefill). 0 prefills whatever has arrived at once.",
        ),
    )
    burst_chunk_size: int | None = field(
        default=None,
        metadata=_arg(
            "memory",
            "While requests decode (fewer than this many) and the waiting prompts need more "
            "than one prefill batch (or one is mid-chunk), prefill them in mixed batches of at "
            "most this many new tokens, the running requests decoding in each, so that their "
            "streams go on through the burst, unless a wave takes them (--wave-prefill); -1: "
            "in prefill batches back to back. Default "
            f"{DEFAULT_BURST_CHUNK_SIZE} on CPU without an overlap mode where a prefill batch "
            "holds more, else -1.",
        ),
    )
    wave_prefill: bool | None = field(
        default=None,
        metadata=_arg(
            "memory",
            "While more requests wait than decode and their prompts (none over a prefill "
            "batch) need more than one prefill batch, prefill them in one batch of up to "
            "--max-prefill-tokens, so that only the few running streams wait for it; needs "
            "--max-prefill-tokens above --chunked-prefill-size. --no-wave-prefill: in prefill "
            "batches (spread where --burst-chunk-size is set). Default: on where "
            f"--burst-chunk-size defaults to {DEFAULT_BURST_CHUNK_SIZE} and "
            "--max-prefill-tokens allows it.",
        ),
    )
    disable_radix_cache: bool = field(
        default=False, metadata=_arg("memory", "Disable the radix prefix cache.")
    )
    cpu_decode_threads: int | None = field(
        default=None,
        metadata=_arg(
            "memory",
            "CPU: intra-op threads of each rank in decode steps. Default: the rank's share "
            "of the cores, less one core per node for the HTTP server and detokenizer when "
            "the step reads under 64 MiB of weights per rank (a mixture of experts counts "
            "only the experts its sequences can reach); prefill uses the rank's share.",
        ),
    )
    # Parallelism
    tp_size: int = field(
        default=1,
        metadata=_arg(
            "parallel",
            "Tensor-parallel size: the number of rank processes, over all nodes.",
            aliases=["--tp", "--tensor-parallel-size"],
        ),
    )
    dp_size: int = field(
        default=1,
        metadata=_arg(
            "parallel",
            "Attention data-parallel groups (with --enable-dp-attention); tp-size // dp-size "
            "ranks shard attention inside each group.",
            aliases=["--dp", "--data-parallel-size"],
        ),
    )
    enable_dp_attention: bool = field(
        default=False,
        metadata=_arg(
            "parallel",
            "Data-parallel attention: each of --dp-size groups serves its own requests and "
            "the MoE runs over all ranks. Off when --dp-size is 1.",
        ),
    )
    enable_dp_lm_head: bool = field(
        default=False,
        metadata=_arg(
            "parallel",
            "Shard the LM head over the attention-TP group instead of all ranks (no gather "
            "of hidden states across DP groups). Needs --enable-dp-attention.",
        ),
    )
    load_balance_method: str = field(
        default="round_robin",
        metadata=_arg(
            "parallel",
            "How the data-parallel controller picks a DP group for a request: round_robin; "
            "shortest_queue (fewest running and waiting requests; SGLang's total_requests); "
            "minimum_tokens (fewest tokens in use or waiting, then fewest requests; SGLang's "
            "total_tokens). auto (SGLang's default) is round_robin: SGLang picks by the "
            "PD-disaggregation role, and srt serves without disaggregation.",
            choices=[*LOAD_BALANCE_CHOICES, *VALUE_ALIASES["load_balance_method"]],
        ),
    )
    ep_size: int | None = field(
        default=None,
        metadata=_arg(
            "parallel",
            "Expert-parallel size; default tp-size with an all-to-all backend, else 1 "
            "(experts TP-sharded).",
            aliases=["--ep", "--expert-parallel-size"],
        ),
    )
    moe_a2a_backend: str = field(
        default="none",
        metadata=_arg(
            "parallel",
            "MoE token all-to-all: none (gather hidden states, TP/EP-sharded experts), torch "
            "(torch.distributed all-to-all, in DeepEP's modes: --deepep-mode); deepep is refused: "
            "srt has no DeepEP dispatcher yet.",
            choices=MOE_A2A_BACKEND_CHOICES,
        ),
    )
    deepep_mode: str = field(
        default="auto",
        metadata=_arg(
            "parallel",
            "All-to-all mode: normal (exact split sizes), low_latency (fixed-capacity "
            "buffers), auto (normal for prefill, low_latency for decode).",
            choices=DEEPEP_MODE_CHOICES,
        ),
    )
    max_dispatch_tokens_per_rank: int = field(
        default=DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK,
        metadata=_arg(
            "parallel",
            "low_latency capacity: tokens one rank may send to another in one dispatch.",
        ),
    )
    nnodes: int = field(default=1, metadata=_arg("parallel", "Number of nodes."))
    node_rank: int = field(
        default=0, metadata=_arg("parallel", "This node's rank (0 serves HTTP).")
    )
    dist_init_addr: str | None = field(
        default=None,
        metadata=_arg(
            "parallel",
            "HOST:PORT of node 0 for the multi-node rendezvous; srt also uses the next "
            "few ports on HOST.",
        ),
    )
    # HTTP server
    host: str = field(default="127.0.0.1", metadata=_arg("server", "Address to listen on."))
    port: int = field(default=30000, metadata=_arg("server", "Port to listen on."))
    api_key: str | None = field(
        default=None,
        metadata=_arg(
            "server", "Require 'Authorization: Bearer KEY' on every route but /health and /ready."
        ),
    )
    served_model_name: str | None = field(
        default=None, metadata=_arg("server", "Model name on the OpenAI API; default: the path.")
    )
    skip_server_warmup: bool = field(
        default=False,
        metadata=_arg(
            "server",
            "Open the port without the warm-up generation (by default a short greedy request "
            "per attention-DP group runs first, so the first user does not pay first-use costs).",
        ),
    )
    stream_interval: int = field(
        default=1,
        metadata=_arg(
            "server",
            "Stream a request's tokens every this many (its first token at once, the rest when "
            "it ends); a request's own stream_interval overrides it. Larger values cost the HTTP "
            "server and the detokenizer less CPU per token, at the price of burstier streams.",
        ),
    )
    max_queued_requests: int | None = field(
        default=None,
        metadata=_arg(
            "server",
            "Requests a server holds beyond what its running batches take (--max-running-"
            "requests per attention-DP group); a request over the bound gets 503 with "
            "Retry-After at once, and /ready fails while it is reached. Default: 4x the "
            "running batches' requests (the offline Engine: unbounded).",
        ),
    )
    watchdog_timeout: float = field(
        default=300.0,
        metadata=_arg(
            "server",
            "Seconds a scheduler iteration (a forward step, or the collectives of an idle one) "
            "may take; longer ends the server with an error naming the rank, the step and the "
            "silent peers. Collectives time out after it too.",
        ),
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata=_arg(
            "server",
            "Parse tool calls out of chat replies in this model family's format; chat requests "
            "with tools are refused without it.",
            choices=TOOL_CALL_PARSER_CHOICES,
        ),
    )
    # Structured output
    grammar_backend: str = field(
        default="xgrammar",
        metadata=_arg(
            "structured output",
            "Engine for regex / json_schema / ebnf constraints and response_format; none "
            "refuses constrained requests.",
            choices=GRAMMAR_BACKEND_CHOICES,
        ),
    )
    constrained_json_disable_any_whitespace: bool = field(
        default=False,
        metadata=_arg("structured output", "JSON constraints: compact output, no free whitespace."),
    )
    constrained_json_max_whitespace_cnt: int | None = field(
        default=None,
        metadata=_arg(
            "structured output",
            "JSON constraints: at most this many whitespace characters in a row (default: any).",
        ),
    )

    def __post_init__(self) -> None:
        self.check_and_resolve()

    # ----------------------------------------------------------------------------------
    def check_and_resolve(self) -> None:
        """Validate every flag once; resolve "auto" values, other spellings of values and
        environment aliases."""
        apply_env_aliases(self)
        normalize_spellings(self)
        if self.model_path is None:
            raise ValueError("--model-path is required: a Hugging Face model directory")
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.resolve_for_device()
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)
        if self.device == "cuda":
            check_gpus_per_node(self)

    def resolve_for_device(self) -> None:
        """What ``check_and_resolve`` validates and resolves from the flags and the device
        alone, without looking at the machine (its kernels, its GPUs): docs/flags.md shows
        these defaults for each device (``srt.server_args_doc``)."""
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88 if self.device == "cuda" else 0.1
        self._resolve_batch_limits()
        check_ranges(self)
        check_logging(self)
        check_parallel(self)
        check_overlap(self)
        check_eplb(self)
        resolve_burst_prefill(self)
        check_cuda_graphs(self)

    def _resolve_batch_limits(self) -> None:
        """Defaults of --chunked-prefill-size and --max-running-requests. Under --deepep-mode
        low_latency every batch must fit the fixed-capacity buffers, so they default to what
        fits --max-dispatch-tokens-per-rank (explicit values that do not fit are refused)."""
        chunk, running = (8192, 2048) if self.device == "cuda" else (2048, 256)
        if self.moe_a2a_backend == "torch" and self.deepep_mode == "low_latency":
            fit = low_latency_fit(self)
            chunk, running = max(1, min(chunk, fit)), max(1, min(running, fit))
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = chunk
        if self.max_running_requests is None:
            self.max_running_requests = running
        if self.max_queued_requests is None:
            self.max_queued_requests = 4 * self.max_running_requests * self.num_running_groups

    @property
    def mixes_decode_into_prefill(self) -> bool:
        """Whether a prefill carries the running requests' decode (a MIXED batch): as
        --enable-mixed-chunk / --disable-mixed-chunk say, else on CPU without an overlap mode
        (docs/benchmarks_history.md, round 17)."""
        if self.enable_mixed_chunk or self.disable_mixed_chunk:
            return self.enable_mixed_chunk
        return self.device == "cpu" and self.overlap_mode == "off"

    @property
    def num_running_groups(self) -> int:
        """Schedulers with a running batch of their own: the attention-DP groups."""
        return max(1, self.dp_size) if self.enable_dp_attention else 1

    @property
    def num_ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def parallel_config(self):
        from srt.distributed.parallel_state import ParallelConfig

        return ParallelConfig(
            self.tp_size,
            self.dp_size,
            self.enable_dp_attention,
            self.moe_a2a_backend,
            self.ep_size,
        )

    @property
    def overlap_modes(self) -> tuple[str, ...]:
        """The overlap modes steps may run: the chosen one, or under auto every one this layout
        has an all-to-all for (``off`` first)."""
        if self.overlap_mode != "auto":
            return (self.overlap_mode,)
        tbo = self.moe_a2a_backend != "none" or self.enable_dp_attention
        sbo = self.moe_a2a_backend != "none" and self.tp_size > 1
        return ("off", *(["tbo"] if tbo else []), *(["sbo"] if sbo else []))

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.chunked_prefill_size != -1

    @property
    def prefill_batch_tokens(self) -> int:
        """New tokens one prefill batch may hold."""
        if self.enable_chunked_prefill:
            return min(self.max_prefill_tokens, self.chunked_prefill_size)
        return self.max_prefill_tokens

    def check_against_model(self, hf_config: Any) -> None:
        """What needs the model's config: experts, heads and MLP sizes must split over the
        ranks. Raised at start-up, before any rank process starts."""
        check_model_layout(self, hf_config)
        check_eplb_against_model(self, hf_config)

    # ----------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        groups: dict[str, argparse._ArgumentGroup] = {}
        bases = (OverlapArgs, EplbArgs, DebugArgs)
        later = [{f.name for f in dataclasses.fields(base)} for base in bases]
        # the base classes' flags (their fields come first) after the others in --help
        order = lambda f: next((i + 1 for i, names in enumerate(later) if f.name in names), 0)
        for f in sorted(dataclasses.fields(ServerArgs), key=order):
            meta = dict(f.metadata)
            group = meta.pop("group")
            if group not in groups:
                groups[group] = parser.add_argument_group(group)
            flags = ["--" + f.name.replace("_", "-"), *meta.pop("aliases", [])]
            if f.type in ("bool", bool):
                groups[group].add_argument(*flags, action="store_true", **meta)
                continue
            if f.type == "bool | None":  # --x / --no-x; None: resolved at start-up
                groups[group].add_argument(*flags, action=argparse.BooleanOptionalAction, **meta)
                continue
            kind = {"int": int, "float": float, "list[int]": int}.get(
                str(f.type).replace(" | None", ""), str
            )
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
