"""The values srt's flags may take, in one place: ``ServerArgs`` passes them to argparse
(``choices=``); ``srt.server_args_checks`` and the layers that receive a flag's value validate
against them too (the offline ``Engine``'s keyword arguments bypass argparse). Also the flag
constants that the layers share with ``ServerArgs``."""

QUANTIZATION_CHOICES = ["fp8"]
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]
DEVICE_CHOICES = ["auto", "cpu", "cuda"]  # auto resolves to one of the others at start-up
ATTENTION_BACKEND_CHOICES = ["auto", "triton", "cpu", "torch_native"]
SCHEDULE_POLICY_CHOICES = ["fcfs", "lpm"]
LOAD_BALANCE_CHOICES = ["round_robin", "shortest_queue", "minimum_tokens"]
# SGLang's (and vLLM's) other spellings of some values: the flags accept them too, and
# ``srt.server_args_checks.normalize_spellings`` maps each to srt's name right after parsing, so
# the rest of srt sees one spelling. SGLang's --load-balance-method auto picks by the
# PD-disaggregation role (follow_bootstrap_room on a prefill server, else round_robin); srt
# serves without disaggregation, so its auto is round_robin.
VALUE_ALIASES = {
    "dtype": {"half": "float16", "float": "float32"},
    "kv_cache_dtype": {"bf16": "bfloat16"},
    "load_balance_method": {
        "auto": "round_robin",
        "total_requests": "shortest_queue",
        "total_tokens": "minimum_tokens",
    },
}
MOE_A2A_BACKEND_CHOICES = ["none", "torch", "deepep"]
DEEPEP_MODE_CHOICES = ["auto", "normal", "low_latency"]
OVERLAP_MODE_CHOICES = ["off", "tbo", "sbo", "dbo", "auto"]
TOOL_CALL_PARSER_CHOICES = ["qwen", "qwen25"]  # SGLang's names of the Qwen 2.5 / 3 format
GRAMMAR_BACKEND_CHOICES = ["xgrammar", "none"]
LOG_LEVEL_CHOICES = ["debug", "info", "warning", "error"]
LOG_REQUESTS_LEVEL_CHOICES = [0, 1, 2, 3]  # --log-requests-level: SGLang's levels

DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK = 128  # SGLang's default
# A burst has arrived once no request came for this long (BurstPolicy, --prefill-burst-hold-ms).
BURST_QUIET_S = 0.01
# --burst-chunk-size's default on CPU without an overlap mode.
DEFAULT_BURST_CHUNK_SIZE = 512
NO_DEEPEP = (
    "--moe-a2a-backend deepep: srt has no DeepEP dispatcher yet; --moe-a2a-backend torch runs "
    "DeepEP's normal / low_latency / auto modes (--deepep-mode) over torch.distributed"
)

INIT_EXPERT_LOCATION_TRIVIAL = "trivial"  # --init-expert-location: slots in expert order
