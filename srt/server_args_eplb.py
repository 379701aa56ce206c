"""The expert-placement (EPLB) flags of ``ServerArgs`` (SGLang's spellings), a dataclass of
their own that ``ServerArgs`` extends, and their checks: with the flags alone (``check_eplb``) and
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

    enable_eplb: bool = field(
        default=False,
        metadata=_arg(
            "expert placement",
            "Rebalance the experts while serving: every --eplb-rebalance-num-iterations "
            "forward steps, a placement balanced for the load routed since the last one, the "
            "weights moved between the EP ranks (docs/eplb.md). Needs --moe-a2a-backend torch.",
        ),
    )
    eplb_rebalance_num_iterations: int = field(
        default=1000,
        metadata=_arg("expert placement", "--enable-eplb: forward steps between two rebalances."),
    )


def check_eplb(args: Any) -> None:
    """The flags alone: redundant experts need expert parallelism and must split evenly."""
    n, every = args.ep_num_redundant_experts, args.eplb_rebalance_num_iterations
    if n < 0:
        raise ValueError(f"--ep-num-redundant-experts {n}: must be ≥ 0")
    if every < 1:
        raise ValueError(f"--eplb-rebalance-num-iterations {every}: must be ≥ 1")
    if every != 1000 and not args.enable_eplb:
        raise ValueError("--eplb-rebalance-num-iterations needs --enable-eplb")
    asked = [
        flag
        for flag, on in (
            ("--enable-eplb", args.enable_eplb),
            ("--ep-num-redundant-experts", n != 0),
            ("--init-expert-location", args.init_expert_location != TRIVIAL),
        )
        if on
    ]
    if not asked:
        return
    flag = asked[0]
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
    """Expert placement needs a MoE model; a placement file must fit its shape (read here,
    at start-up, so that a wrong file fails before any rank starts)."""
    from srt.eplb.expert_location import expert_location_from_args

    expert_location_from_args(args, hf_config)  # raises, naming the flag
