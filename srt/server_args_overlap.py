"""The overlap flags of ``ServerArgs`` (``--overlap-mode`` and the TBO / SBO / DBO flags), a
dataclass of their own that ``ServerArgs`` extends. Their validation is
``srt.server_args_checks.check_overlap``; the modes they let steps run,
``ServerArgs.overlap_modes``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from srt.server_args_choices import OVERLAP_MODE_CHOICES


def _arg(group: str, help: str, **kwargs: Any) -> dict[str, Any]:
    """A flag's argparse metadata: its help group, its help, and any other argparse keyword."""
    return {"group": group, "help": help, **kwargs}


@dataclass
class OverlapArgs:
    overlap_mode: str | None = field(
        default=None,
        metadata=_arg(
            "overlap",
            "off, tbo (two-batch overlap), sbo (single-batch overlap), dbo (dual-batch "
            "overlap: micro-batch threads, docs/dual_batch_overlap.md) or auto: each step "
            "runs the one of off / tbo / sbo its measured cost predicts fastest "
            "(docs/overlap.md). Default: off, or what --enable-two-batch-overlap / "
            "--enable-single-batch-overlap / --enable-dbo ask for.",
            choices=OVERLAP_MODE_CHOICES,
        ),
    )
    enable_two_batch_overlap: bool = field(
        default=False,
        metadata=_arg(
            "overlap",
            "Split each batch in two micro-batches and interleave their MoE layers, so one "
            "computes while the other's all-to-all is in flight (--overlap-mode tbo).",
        ),
    )
    tbo_token_distribution_threshold: float = field(
        default=0.48,
        metadata=_arg(
            "overlap",
            "Cut one prompt in two when the balanced split leaves a micro-batch under this "
            "share of the tokens; in [0, 0.5], 0 turns the two-chunk split off.",
        ),
    )
    tbo_decode_token_threshold: int | None = field(
        default=None,
        metadata=_arg(
            "overlap",
            "Decode batches under this many tokens (per DP group) run unsplit; 0: all. "
            "Default 32 with tbo; with auto, none (the cost model decides above a given one).",
        ),
    )
    tbo_prefill_token_threshold: int | None = field(
        default=None,
        metadata=_arg(
            "overlap",
            "Prefill batches under this many tokens (per DP group) run unsplit; 0: all. "
            "Default 512 with tbo; with auto, none (the cost model decides above a given one).",
        ),
    )
    enable_single_batch_overlap: bool = field(
        default=False,
        metadata=_arg(
            "overlap",
            "Inside one batch, launch the MoE combine block by block as the experts' "
            "down-projections finish, and run shared experts while the dispatch is in flight "
            "(--overlap-mode sbo). Needs --moe-a2a-backend torch with --tp-size > 1 (any "
            "--deepep-mode).",
        ),
    )
    enable_dbo: bool = field(
        default=False,
        metadata=_arg(
            "overlap",
            "Dual-batch overlap (vLLM's): run the plain model forward once per micro-batch, "
            "each in its own thread, handing over at yields inside the all-to-all "
            "(--overlap-mode dbo). Needs --moe-a2a-backend torch with --tp-size > 1.",
        ),
    )
    dbo_decode_token_threshold: int = field(
        default=32,
        metadata=_arg(
            "overlap",
            "Dual-batch overlap: decode batches under this many tokens run unsplit (under DP "
            "attention: if any group's batch does, none splits).",
        ),
    )
    dbo_prefill_token_threshold: int = field(
        default=512,
        metadata=_arg(
            "overlap",
            "Dual-batch overlap: batches with a prefill under this many tokens run unsplit "
            "(under DP attention: if any group's batch does, none splits).",
        ),
    )
    sbo_num_blocks: int | None = field(
        default=None,
        metadata=_arg(
            "overlap",
            "Blocks of local experts for single-batch overlap's combine; default: "
            "min(4, local experts).",
        ),
    )
    sbo_communication_sms: int | None = field(
        default=None,
        metadata=_arg(
            "overlap",
            "CUDA: SMs left to single-batch overlap's combine (its nccl CTAs) while the "
            "down-projection GEMMs run on the others; default 3, 32 on Blackwell.",
        ),
    )
    enable_operation_profile: bool = field(
        default=False,
        metadata=_arg(
            "overlap",
            "Wrap every layer operation in a torch.profiler record_function marker (also: "
            "environment SRT_OPERATION_PROFILE=1, srt.server_args_debug).",
        ),
    )
