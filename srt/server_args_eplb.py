"""The expert-placement flags of ``ServerArgs`` (SGLang's spellings), a dataclass of their own
that ``ServerArgs`` extends, and their checks: with the flags alone (``check_eplb``) and
against the model (``check_eplb_against_model``). The placement they ask for is built by
``srt.eplb.expert_location.expert_location_from_args``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from srt.server_args_choices import INIT_EXPERT_LOCATION_TRIVIAL as TRIVIAL
from srt.server_args_overlap import _arg


@dataclass
class EplbArgs:
    ep_num_redundant_experts: int = field(
        default=0,
        metadata=_arg(
            "expert placement",
            "Extra copies of experts: each MoE layer gets num_experts + N expert slots over "
            "the EP ranks (N a multiple of the EP size), the extra ones holding copies of the "
            "experts --init-expert-location makes hot. Needs --moe-a2a-backend torch.",
        ),
    )
    init_expert_location: str = field(
        default=TRIVIAL,
        metadata=_arg(
            "expert placement",
            "Where the experts start: trivial (expert slots in order, each rank a contiguous "
            "slice, copies after the originals), or a file (.json or .pt) holding "
            "logical_count [layers, experts] (what /dump_expert_distribution_record "
            "wrote: the experts are placed to balance that load, docs/eplb.md) or "
            "physical_to_logical_map [layers, slots] (a placement, used as it is).",
        ),
    )


def check_eplb(args: Any) -> None:
    """The flags alone: redundant experts need expert parallelism and must split evenly."""
    n = args.ep_num_redundant_experts
    asked = n != 0 or args.init_expert_location != TRIVIAL
    if n < 0:
        raise ValueError(f"--ep-num-redundant-experts {n}: must be ≥ 0")
    if not asked:
        return
    flag = "--ep-num-redundant-experts" if n else "--init-expert-location"
    if args.moe_a2a_backend != "torch" or args.tp_size < 2:
        raise ValueError(
            f"{flag}: expert placement needs expert parallelism (--moe-a2a-backend torch "
            "with --tp-size > 1)"
        )
    ep_size = args.parallel_config.moe_ep_size
    if n % ep_size:
        raise ValueError(
            f"--ep-num-redundant-experts {n}: the extra expert slots must split evenly over "
            f"the {ep_size} EP ranks"
        )
    path = args.init_expert_location
    if path != TRIVIAL and not Path(path).is_file():
        raise ValueError(f"--init-expert-location {path!r}: not 'trivial' and no such file")


def check_eplb_against_model(args: Any, hf_config: Any) -> None:
    """Redundant experts need a MoE model; a placement file must fit its shape (read here,
    at start-up, so that a wrong file fails before any rank starts)."""
    from srt.eplb.expert_location import expert_location_from_args

    if args.ep_num_redundant_experts == 0 and args.init_expert_location == TRIVIAL:
        return
    expert_location_from_args(args, hf_config)  # raises, naming the flag
