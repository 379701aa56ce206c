"""Start-up validation of the parallel layout, the overlap flags and the layout against the
model (SGLang's rules); every error names its flags. Each check takes the ``ServerArgs`` being
checked, and some resolve values in it (``ep_size``, DP attention off with one DP group).
Called once by ``ServerArgs.check_and_resolve`` and by ``ServerArgs.check_against_model``."""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

from srt.server_args_choices import (
    ATTENTION_BACKEND_CHOICES,
    DEFAULT_BURST_CHUNK_SIZE,
    DEVICE_CHOICES,
    DTYPE_CHOICES,
    GRAMMAR_BACKEND_CHOICES,
    LOAD_BALANCE_CHOICES,
    NO_DEEPEP,
    OVERLAP_MODE_CHOICES,
    SCHEDULE_POLICY_CHOICES,
    TOOL_CALL_PARSER_CHOICES,
    VALUE_ALIASES,
)

if TYPE_CHECKING:
    from srt.server_args import ServerArgs

logger = logging.getLogger("srt.server_args")
DEFAULT_CUDA_GRAPH_MAX_BS = 64
DEFAULT_CPU_GRAPH_MAX_BS = 16


def normalize_spellings(args: ServerArgs) -> None:
    """SGLang's other spellings of some values (``VALUE_ALIASES``: ``--dtype half``,
    ``--load-balance-method total_tokens``, ...) replaced by srt's names."""
    for name, aliases in VALUE_ALIASES.items():
        value = getattr(args, name)
        setattr(args, name, aliases.get(value, value))


def check_ranges(args: ServerArgs) -> None:
    """Values out of range or not among a flag's choices."""

    def require(ok: bool, flag: str, msg: str) -> None:
        if not ok:
            raise ValueError(f"--{flag.replace('_', '-')}: {msg}")

    require(0 < args.mem_fraction_static < 1, "mem_fraction_static", "must be in (0, 1)")
    require(
        args.tool_call_parser in (None, *TOOL_CALL_PARSER_CHOICES),
        "tool_call_parser",
        f"must be one of {TOOL_CALL_PARSER_CHOICES}",
    )
    max_whitespace = args.constrained_json_max_whitespace_cnt
    require(
        max_whitespace is None or max_whitespace > 0,
        "constrained_json_max_whitespace_cnt",
        "must be at least 1",
    )
    require(
        args.max_total_tokens is None or args.max_total_tokens > 0,
        "max_total_tokens",
        "must be positive",
    )
    require(
        args.max_running_requests is None or args.max_running_requests > 0,
        "max_running_requests",
        "must be positive",
    )
    require(args.tp_size >= 1, "tp_size", "must be ≥ 1")
    require(args.stream_interval >= 1, "stream_interval", "must be ≥ 1")
    require(args.max_queued_requests >= 0, "max_queued_requests", "must be ≥ 0")
    require(args.watchdog_timeout > 0, "watchdog_timeout", "must be positive")
    require(
        args.cpu_decode_threads is None or args.cpu_decode_threads >= 1,
        "cpu_decode_threads",
        "must be ≥ 1",
    )
    require(
        args.cpu_decode_threads is None or args.device == "cpu",
        "cpu_decode_threads",
        "applies to --device cpu only",
    )
    require(args.max_prefill_tokens > 0, "max_prefill_tokens", "must be positive")
    require(args.prefill_burst_hold_ms >= 0, "prefill_burst_hold_ms", "must be ≥ 0")
    require(
        args.burst_chunk_size in (None, -1) or args.burst_chunk_size > 0,
        "burst_chunk_size",
        "must be positive or -1",
    )
    require(
        not (args.enable_mixed_chunk and args.disable_mixed_chunk),
        "disable_mixed_chunk",
        "cannot be given with --enable-mixed-chunk",
    )
    require(
        args.chunked_prefill_size == -1 or args.chunked_prefill_size > 0,
        "chunked_prefill_size",
        "must be positive or -1",
    )
    require(args.context_length is None or args.context_length > 1, "context_length", "must be > 1")
    for name, choices in (
        ("dtype", DTYPE_CHOICES),
        ("kv_cache_dtype", DTYPE_CHOICES),
        ("device", DEVICE_CHOICES[1:]),
        ("schedule_policy", SCHEDULE_POLICY_CHOICES),
        ("load_balance_method", LOAD_BALANCE_CHOICES),
        ("grammar_backend", GRAMMAR_BACKEND_CHOICES),
    ):
        require(getattr(args, name) in choices, name, f"must be one of {choices}")


def resolve_burst_prefill(args: ServerArgs) -> None:
    """--burst-chunk-size and --wave-prefill. The spread's chunk defaults to
    DEFAULT_BURST_CHUNK_SIZE on CPU where a prefill batch holds more, never under an overlap
    mode (it runs mixed batches unsplit); the wave defaults to on where the spread does (the
    two were measured together, docs/benchmarks_history.md, round 18) and a wave can exceed a batch.
    Explicit values must do something: a chunk under a batch, a wave budget above one."""
    batch = args.prefill_batch_tokens
    plain_cpu = args.device == "cpu" and args.overlap_mode == "off"
    spreads_by_default = plain_cpu and DEFAULT_BURST_CHUNK_SIZE < batch
    if args.burst_chunk_size is None:
        args.burst_chunk_size = DEFAULT_BURST_CHUNK_SIZE if spreads_by_default else -1
    elif args.burst_chunk_size >= batch:
        raise ValueError(
            f"--burst-chunk-size: must be under a prefill batch ({batch} tokens: "
            "--chunked-prefill-size, --max-prefill-tokens), or -1"
        )
    if args.wave_prefill is None:
        args.wave_prefill = spreads_by_default and args.max_prefill_tokens > batch
    elif args.wave_prefill and args.max_prefill_tokens <= batch:
        raise ValueError(
            f"--wave-prefill: a wave needs --max-prefill-tokens ({args.max_prefill_tokens}) "
            f"above a prefill batch ({batch} tokens, --chunked-prefill-size)"
        )


def low_latency_fit(args: ServerArgs) -> int:
    """Tokens one step may bring under --deepep-mode low_latency: the capacity per rank times
    the attention-TP ranks a group's tokens are spread over."""
    dp = max(1, args.dp_size) if args.enable_dp_attention else 1
    return args.max_dispatch_tokens_per_rank * max(1, args.tp_size // dp)


def check_parallel(args: ServerArgs) -> None:
    """The parallel layout (SGLang's rules); errors name the flags."""
    tp, dp = args.tp_size, args.dp_size
    if dp < 1:
        raise ValueError("--dp-size: must be ≥ 1")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if tp % args.nnodes:
        raise ValueError(f"--tp-size {tp} must be divisible by --nnodes {args.nnodes}")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    if args.dist_init_addr:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr {args.dist_init_addr!r}: expected HOST:PORT")
    if args.enable_dp_attention and dp == 1:
        logger.warning("--enable-dp-attention with --dp-size 1 is plain TP: turned off")
        args.enable_dp_attention = False
    if dp > 1 and not args.enable_dp_attention:
        if args.nnodes > 1:
            raise ValueError(
                f"--dp-size {dp} over --nnodes {args.nnodes}: multi-node data parallelism "
                "needs --enable-dp-attention"
            )
        raise ValueError(
            f"--dp-size {dp} needs --enable-dp-attention (srt has no data-parallel "
            "replicas without DP attention)"
        )
    if args.enable_dp_attention and tp % dp:
        raise ValueError(f"--tp-size {tp} must be divisible by --dp-size {dp}")
    if args.enable_dp_lm_head and not args.enable_dp_attention:
        raise ValueError("--enable-dp-lm-head needs --enable-dp-attention")
    if args.moe_a2a_backend != "none":
        if args.ep_size not in (None, tp):
            raise ValueError(
                f"--moe-a2a-backend {args.moe_a2a_backend} splits experts over all ranks: "
                f"--ep-size must be --tp-size ({tp}), got {args.ep_size}"
            )
        args.ep_size = tp
    elif args.ep_size is None:
        args.ep_size = 1
    if args.ep_size < 1 or tp % args.ep_size:
        raise ValueError(f"--ep-size {args.ep_size} must divide --tp-size {tp}")
    if args.max_dispatch_tokens_per_rank < 1:
        raise ValueError("--max-dispatch-tokens-per-rank: must be positive")
    if args.moe_a2a_backend == "deepep":
        raise ValueError(NO_DEEPEP)
    if args.moe_a2a_backend == "torch" and args.deepep_mode == "low_latency":
        _check_low_latency_capacity(args)


def check_overlap(args: ServerArgs) -> None:
    _resolve_overlap_mode(args)
    if not 0 <= args.tbo_token_distribution_threshold <= 0.5:
        raise ValueError(
            f"--tbo-token-distribution-threshold {args.tbo_token_distribution_threshold}: "
            "must be in [0, 0.5]"
        )
    for flag in ("tbo_decode_token_threshold", "tbo_prefill_token_threshold"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be ≥ 0")
    no_a2a = args.moe_a2a_backend == "none"
    if args.overlap_mode == "tbo" and no_a2a and not args.enable_dp_attention:
        raise ValueError(
            "--enable-two-batch-overlap needs an all-to-all to hide: set --moe-a2a-backend "
            "torch, or --enable-dp-attention"
        )
    if args.overlap_modes == ("off",) and args.overlap_mode == "auto":
        raise ValueError(
            "--overlap-mode auto: this layout has no all-to-all to overlap; set "
            "--moe-a2a-backend torch (with --tp-size > 1), or --enable-dp-attention"
        )
    _check_single_batch_overlap(args)
    _check_dual_batch_overlap(args)


def _resolve_overlap_mode(args: ServerArgs) -> None:
    """--overlap-mode from itself or its three aliases; the aliases then mirror it. The TBO
    thresholds default to 32 / 512 under tbo and to 0 (none) under auto."""
    asked = [mode for mode, on in (("tbo", args.enable_two_batch_overlap),
                                   ("sbo", args.enable_single_batch_overlap),
                                   ("dbo", args.enable_dbo)) if on]  # fmt: skip
    if len(asked) > 1:
        raise ValueError(
            f"{' and '.join(_ALIASES[m] for m in asked)} exclude each other: choose one (or "
            "--overlap-mode auto, which picks per step)"
        )
    if args.overlap_mode is None:
        args.overlap_mode = asked[0] if asked else "off"
    if args.overlap_mode not in OVERLAP_MODE_CHOICES:
        raise ValueError(
            f"--overlap-mode {args.overlap_mode!r}: must be one of {OVERLAP_MODE_CHOICES}"
        )
    if asked and asked[0] != args.overlap_mode:
        raise ValueError(f"--overlap-mode {args.overlap_mode} and {_ALIASES[asked[0]]}: choose one")
    args.enable_two_batch_overlap = args.overlap_mode == "tbo"
    args.enable_single_batch_overlap = args.overlap_mode == "sbo"
    args.enable_dbo = args.overlap_mode == "dbo"
    auto = args.overlap_mode == "auto"
    if args.tbo_decode_token_threshold is None:
        args.tbo_decode_token_threshold = 0 if auto else 32
    if args.tbo_prefill_token_threshold is None:
        args.tbo_prefill_token_threshold = 0 if auto else 512


_ALIASES = {
    "tbo": "--enable-two-batch-overlap",
    "sbo": "--enable-single-batch-overlap",
    "dbo": "--enable-dbo",
}


def _check_dual_batch_overlap(args: ServerArgs) -> None:
    for flag in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')}: must be ≥ 0")
    if args.overlap_mode != "dbo":
        return
    if args.moe_a2a_backend != "torch" or args.tp_size < 2:
        raise ValueError(
            "--enable-dbo needs an all-to-all between ranks, where its micro-batches hand over: "
            "set --moe-a2a-backend torch and --tp-size > 1"
        )


def _check_single_batch_overlap(args: ServerArgs) -> None:
    sms = args.sbo_communication_sms
    sbo = "sbo" in args.overlap_modes
    for flag, value in (
        ("--sbo-num-blocks", args.sbo_num_blocks),
        ("--sbo-communication-sms", sms),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be ≥ 1")
        if value is not None and not sbo:
            raise ValueError(f"{flag} needs --overlap-mode sbo or auto (with an all-to-all)")
    if sms is not None and args.device != "cuda":
        raise ValueError(
            "--sbo-communication-sms splits a CUDA device's SMs; on CPU the combine runs in "
            "the communication library's threads (drop the flag)"
        )
    if args.overlap_mode != "sbo":
        return
    if args.moe_a2a_backend == "none":
        raise ValueError(
            "--enable-single-batch-overlap needs an all-to-all: set --moe-a2a-backend torch"
        )
    if args.tp_size < 2:
        raise ValueError(
            "--enable-single-batch-overlap needs an all-to-all between ranks: one rank "
            "(--tp-size 1) has none to overlap"
        )


def _check_low_latency_capacity(args: ServerArgs) -> None:
    """--deepep-mode low_latency sends every batch through fixed-capacity buffers: the
    largest batch a rank can split off must fit (``auto`` falls back to normal instead)."""
    attn_tp = args.tp_size // args.dp_size if args.enable_dp_attention else args.tp_size
    cap = args.max_dispatch_tokens_per_rank
    if not args.enable_chunked_prefill:
        raise ValueError(
            "--deepep-mode low_latency needs chunked prefill (a prompt's tokens must fit "
            "--max-dispatch-tokens-per-rank); set --chunked-prefill-size"
        )
    limits = {
        "--chunked-prefill-size": min(args.chunked_prefill_size, args.max_prefill_tokens),
        "--max-running-requests": args.max_running_requests,
    }
    for flag, tokens in limits.items():
        if -(-tokens // attn_tp) > cap:
            raise ValueError(
                f"--deepep-mode low_latency: {flag} {tokens} puts up to "
                f"{-(-tokens // attn_tp)} tokens on a rank, above "
                f"--max-dispatch-tokens-per-rank {cap}; lower {flag}, raise "
                "--max-dispatch-tokens-per-rank or use --deepep-mode auto"
            )


def check_gpus_per_node(args: ServerArgs) -> None:
    """nccl needs one GPU per rank: two ranks on one device fail at the first collective
    ("Duplicate GPU detected"), after every rank has loaded the model."""
    import torch

    gpus = torch.cuda.device_count()
    if args.num_ranks_per_node > gpus:
        raise ValueError(
            f"--tp-size {args.tp_size} over --nnodes {args.nnodes} puts "
            f"{args.num_ranks_per_node} ranks on this node, which has {gpus} CUDA device(s): "
            "nccl needs one GPU per rank (use --device cpu for more ranks)"
        )


def check_model_layout(args: ServerArgs, hf_config: Any) -> None:
    """What needs the model's config: experts, heads and MLP sizes must split over the
    ranks. Raised at start-up, before any rank process starts."""
    layout = args.parallel_config
    flag = f"--tp-size {args.tp_size}"
    num_experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "n_routed_experts", None
    )
    if num_experts and args.tp_size > num_experts:
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
    shared = (getattr(hf_config, "n_shared_experts", None) or 0) * (
        sizes["moe_intermediate_size"] or 0
    )
    if shared and args.moe_a2a_backend == "none" and shared % args.tp_size:
        # split over every rank (an all-to-all backend copies them to each rank instead)
        raise ValueError(
            f"{flag}: the shared experts' intermediate size ({shared}) is not divisible "
            f"by {args.tp_size}"
        )
    kv_heads = getattr(hf_config, "num_key_value_heads", None)
    attn_tp = layout.attn_tp_size
    if kv_heads and kv_heads % attn_tp and attn_tp % kv_heads:
        raise ValueError(
            f"{flag}: the model's num_key_value_heads ({kv_heads}) neither divides nor is "
            f"a multiple of the attention-TP size ({attn_tp})"
        )


def check_cuda_graphs(args: ServerArgs) -> None:
    """The decode graphs' batch sizes (``cuda_graph_batch_sizes``): CUDA graphs on CUDA,
    recorded decode graphs on CPU (``srt.model_executor.cpu_graph``)."""
    limit = args.max_running_requests
    if args.moe_a2a_backend == "torch":  # a graph decodes with low_latency, within its capacity
        limit = min(limit, low_latency_fit(args))
    sizes, max_bs = args.cuda_graph_bs, args.cuda_graph_max_bs
    cpu = args.device == "cpu"
    args.cuda_graph_bs = cuda_graph_batch_sizes(sizes, max_bs, limit, cpu)
    args.cuda_graph_max_bs = args.cuda_graph_bs[-1]


def resolve_attention_backend(backend: str, device: str) -> str:
    """``auto``: triton on CUDA where it imports, cpu on CPU where the CPU kernels are built,
    else torch_native. A named backend is refused where it cannot run."""
    if backend not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"--attention-backend must be one of {ATTENTION_BACKEND_CHOICES}")
    has_triton = importlib.util.find_spec("triton") is not None
    if backend == "auto" and device == "cuda":
        return "triton" if has_triton else "torch_native"
    if backend == "auto":
        return "cpu" if _cpu_kernels_available() else "torch_native"
    if backend == "cpu" and device != "cpu":
        raise ValueError("--attention-backend cpu runs the CPU kernels: it needs --device cpu")
    if backend == "cpu" and not _cpu_kernels_available():
        raise ValueError(
            "--attention-backend cpu: the CPU kernels are not built here (no C compiler, no "
            "AVX2, or SRT_CPU_KERNELS=0); --attention-backend torch_native runs without them"
        )
    if backend == "triton" and not has_triton:
        raise ValueError("--attention-backend triton: the triton package is not installed")
    if backend == "triton" and device == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        raise ValueError(
            "--attention-backend triton runs on CUDA (on CPU only under Triton's interpreter, "
            "TRITON_INTERPRET=1, for tests)"
        )
    return backend


def _cpu_kernels_available() -> bool:
    from srt.layers import cpu_kernels  # imported on CPU only: it builds the kernels

    return cpu_kernels.available()


def cuda_graph_batch_sizes(
    sizes: list[int] | None, max_bs: int | None, limit: int, cpu: bool = False
) -> list[int]:
    """The decode batch sizes captured: ``--cuda-graph-bs``, else 1, 2, 4, 8, then every 8 up
    to ``--cuda-graph-max-bs`` (default 64), never above ``limit``: ``--max-running-requests``
    and, with the torch all-to-all, what fits the low_latency capacity (a larger decode would
    fall back to the normal mode, whose sizes a graph cannot replay). On CPU every size up to
    8, then every 4 up to 16 by default: a padding row costs a CPU its compute and the
    experts it routes to, which may be two more experts' weights to read, and each graph holds
    its own activations; above 16 sequences the Python a graph saves is a small part of a
    step."""
    if sizes is not None and (not sizes or min(sizes) < 1):
        raise ValueError("--cuda-graph-bs: batch sizes must be ≥ 1")
    if max_bs is not None and max_bs < 1:
        raise ValueError("--cuda-graph-max-bs must be ≥ 1")
    default_max = DEFAULT_CPU_GRAPH_MAX_BS if cpu else DEFAULT_CUDA_GRAPH_MAX_BS
    if sizes is None or max_bs is not None:
        limit = min(max_bs or default_max, limit)
    if sizes is None:
        steps = (*range(1, 9), *range(12, limit + 1, 4)) if cpu else (1, 2, 4)
        steps = (*steps, *range(8, limit + 1, 8))
        return sorted({b for b in steps if b <= limit}) or [limit]
    if max(sizes) > limit:
        raise ValueError(
            f"--cuda-graph-bs {max(sizes)} is above --cuda-graph-max-bs, "
            f"--max-running-requests or the low_latency capacity ({limit})"
        )
    return sorted(set(sizes))
