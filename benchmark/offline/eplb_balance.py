"""The balance EPLB reaches on a checkpoint, from load recorded as served: a server with expert
parallelism (``--tp N --moe-a2a-backend torch``) serves random prompts while the expert-
distribution recorder runs; from its dump, each MoE layer's imbalance (the busiest EP rank's
routed tokens over the mean, an expert's tokens split evenly over its copies) under the trivial
placement and under the balanced one (``srt.eplb``) with each number of redundant experts.

    python benchmark/offline/eplb_balance.py --model-path DIR --tp 4 --redundant 0 16 \\
        --num-prompts 64 --input-len 128 --output-len 16 --dump-out load.json

``--dump-out`` keeps the recorded load for ``--init-expert-location``. ``--load FILE`` reads a
load recorded before; ``--zipf S`` makes a synthetic one (no server)."""

from __future__ import annotations

import argparse
import json
import random
import shlex
from pathlib import Path

import httpx
import torch

from benchmark.common.server import ServerProcess
from srt.eplb.algorithm import imbalance, rank_load, trivial_placement
from srt.eplb.expert_location import ExpertLocation, balanced_physical


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="record the load serving this checkpoint")
    src.add_argument("--load", help="a dump already recorded (/dump_expert_distribution_record)")
    src.add_argument(
        "--zipf",
        type=float,
        help="no server: S, each layer's expert i of a shuffled order taking a load ∝ 1/(i+1)^S",
    )
    p.add_argument("--experts", type=int, default=64, help="--zipf: experts per layer")
    p.add_argument("--layers", type=int, default=8, help="--zipf: layers")
    p.add_argument("--groups", type=int, default=1, help="--load / --zipf: expert groups")
    p.add_argument("--tp", type=int, default=4, help="EP ranks")
    p.add_argument("--redundant", type=int, nargs="+", default=[0], help="redundant experts")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--srt-args", default="", help="more server flags, one string")
    p.add_argument("--dump-out", default=None, help="write the recorded load here (.json)")
    p.add_argument("--out", default=None, help="write the table here (.json)")
    return p.parse_args(argv)


def record_load(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    """Serve ``num_prompts`` random prompts with the recorder on; its dump."""
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": args.output_len, "ignore_eos": True},
    }
    flags = ("--tp", str(args.tp), "--moe-a2a-backend", "torch", *shlex.split(args.srt_args))
    with ServerProcess.running(args.model_path, *flags) as server:
        with httpx.Client(base_url=server.url, timeout=3600.0) as http:
            http.post("/start_expert_distribution_record").raise_for_status()
            http.post("/generate", json=body).raise_for_status()
            http.post("/stop_expert_distribution_record").raise_for_status()
            dump = http.post("/dump_expert_distribution_record")
            dump.raise_for_status()
    return dump.json()["logical_count"]


def balance_table(load: torch.Tensor, ep_size: int, redundant: list[int], groups: int) -> dict:
    """Per MoE layer (a layer with no load is a dense one, left out): the imbalance of the
    trivial placement and of the balanced one with each number of redundant experts."""
    layers = [i for i in range(load.shape[0]) if load[i].sum() > 0]
    load = load[layers].double()
    experts = load.shape[1]
    columns = {
        "trivial": imbalance(
            rank_load(trivial_placement(len(layers), experts, experts, ep_size), load)
        )
    }
    for r in redundant:
        p2l = balanced_physical(load, experts + r, ep_size, groups, 1)
        placement = ExpertLocation.from_physical(p2l, experts, ep_size).placement
        columns[f"balanced, {r} redundant"] = imbalance(rank_load(placement, load))
    return {"layers": layers, **{name: col.tolist() for name, col in columns.items()}}


def format_table(table: dict) -> str:
    names = [k for k in table if k != "layers"]
    lines = ["| layer | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for i, layer in enumerate(table["layers"]):
        lines.append(f"| {layer} | " + " | ".join(f"{table[n][i]:.3f}" for n in names) + " |")
    for stat, fn in (("mean", lambda v: sum(v) / len(v)), ("max", max)):
        lines.append(f"| {stat} | " + " | ".join(f"{fn(table[n]):.3f}" for n in names) + " |")
    return "\n".join(lines)


def zipf_load(s: float, layers: int, experts: int, seed: int) -> torch.Tensor:
    """Each layer: expert i of a seeded shuffle takes 1000 / (i + 1)^s."""
    gen = torch.Generator().manual_seed(seed)
    shares = 1000.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    return torch.stack([shares[torch.randperm(experts, generator=gen)] for _ in range(layers)])


def main() -> None:
    args = parse_args()
    groups = args.groups
    if args.zipf is not None:
        load = zipf_load(args.zipf, args.layers, args.experts, args.seed)
    elif args.load:
        load = torch.tensor(json.loads(Path(args.load).read_text())["logical_count"])
    else:
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        load = torch.tensor(record_load(args, config["vocab_size"]))
        groups = config.get("n_group") or 1
    if args.dump_out:
        Path(args.dump_out).write_text(json.dumps({"logical_count": load.tolist()}))
    table = balance_table(load, args.tp, args.redundant, groups)
    print(format_table(table))
    if args.out:
        Path(args.out).write_text(json.dumps(table))


if __name__ == "__main__":
    main()
