"""Train the small MoE model through a pipeline schedule, one process per rank (gloo), with
MindSpeed's flags; and the single-process reference it must equal.

    python -m pipeline.train --schedules-method dualpipev --pipeline-model-parallel-size 2 \\
        --num-micro-batches 8 --dualpipev-dw-detach --steps 3

Prints each step's loss and time, and, with ``--check``, the largest relative difference of
the loss, of every parameter's gradient after the first step and of the weights after the last
against the reference. ``--moe-fb-overlap`` (a forward and a backward interleaved at their
all-to-all points) is not built yet and is refused.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.executor import RankExecutor
from pipeline.model import ModelConfig, build_model, loss_fn, split_stages
from pipeline.schedules import add_schedule_args, make_schedule
from pipeline.simulator import Costs, simulate


@dataclass(frozen=True)
class TrainConfig:
    method: str = "1f1b"
    pp: int = 2
    num_microbatches: int = 4
    vpp: int = 1
    dw_detach: bool = False
    steps: int = 3
    microbatch_size: int = 2
    seq_len: int = 8
    lr: float = 0.05
    seed: int = 0
    model: ModelConfig = ModelConfig()

    def schedule(self):
        return make_schedule(self.method, self.pp, self.num_microbatches, self.vpp, self.dw_detach)


def batches(cfg: TrainConfig, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The step's micro-batches of token ids and their next-token labels (the same on every
    rank and in the reference)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    shape = (cfg.num_microbatches, cfg.microbatch_size, cfg.seq_len + 1)
    tokens = torch.randint(0, cfg.model.vocab, shape, generator=gen)
    return list(tokens[:, :, :-1]), list(tokens[:, :, 1:])


def reference(cfg: TrainConfig) -> dict:
    """One process, the micro-batches one by one: losses, first gradients, final weights."""
    model = build_model(cfg.model, cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    out = {"losses": [], "grads": {}}
    for step in range(cfg.steps):
        opt.zero_grad()
        ids, labels = batches(cfg, step)
        total = 0.0
        for x, y in zip(ids, labels):
            loss = loss_fn(model(x), y, cfg.num_microbatches)
            loss.backward()
            total += float(loss.detach())
        out["losses"].append(total)
        if step == 0:
            out["grads"] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
        opt.step()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def train_rank(rank: int, world: int, init_method: str, cfgs: list[TrainConfig]) -> list[dict]:
    """This rank's part of each run of ``cfgs`` (one process group for all)."""
    torch.set_num_threads(1)  # one core's worth per rank: the ranks share the machine
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        return [_train(rank, cfg) for cfg in cfgs]
    finally:
        dist.destroy_process_group()


def _train(rank: int, cfg: TrainConfig) -> dict:
    """Its stages' first gradients and final weights by parameter name, each step's loss share
    and time, and its computations' intervals per step."""
    schedule = cfg.schedule()
    model = build_model(cfg.model, cfg.seed)
    stages = split_stages(model, schedule.num_stages)
    mine = {s: stages[s] for s, r in enumerate(schedule.stage_rank) if r == rank}
    ids_of_mine = {id(p) for st in mine.values() for p in st.parameters()}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in ids_of_mine]
    opt = torch.optim.SGD([p for _, p in named], lr=cfg.lr)
    shape = (cfg.microbatch_size, cfg.seq_len, cfg.model.hidden)
    executor = RankExecutor(schedule, rank, mine, shape)
    out = {"losses": [], "seconds": [], "grads": {}, "spans": []}
    for step in range(cfg.steps):
        opt.zero_grad()
        dist.barrier()
        start = time.perf_counter()
        record = executor.step(*batches(cfg, step))
        out["seconds"].append(time.perf_counter() - start)
        out["losses"].append(record.loss)
        out["spans"].append([(name, t0 - start, t1 - start) for name, t0, t1 in record.spans])
        if step == 0:
            out["grads"] = {n: p.grad.numpy().copy() for n, p in named if p.grad is not None}
        opt.step()
    out["weights"] = {n: p.detach().numpy().copy() for n, p in named}
    return out


def _main(rank: int, world: int, init_method: str, cfgs: list[TrainConfig], results) -> None:
    results.put((rank, train_rank(rank, world, init_method, cfgs)))


def run(cfgs: list[TrainConfig]) -> list[list[dict]]:
    """Per run of ``cfgs`` (all of one PP), every rank's result: one spawned process per rank
    on this machine, for all the runs."""
    pp = cfgs[0].pp
    if any(cfg.pp != pp for cfg in cfgs):
        raise ValueError("the runs of one launch share their pipeline size")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_main, args=(r, pp, init_method, cfgs, results))
             for r in range(pp)]  # fmt: skip
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [[out[r][i] for r in range(pp)] for i in range(len(cfgs))]


def max_relative_difference(ranks: list[dict], ref: dict) -> dict[str, float]:
    """Loss, first gradients and final weights of the ranks against the reference."""

    def rel(a, b) -> float:
        b = torch.as_tensor(b)
        return float((torch.as_tensor(a) - b).abs().max() / b.abs().max().clamp_min(1e-12))

    losses = [sum(r["losses"][i] for r in ranks) for i in range(len(ref["losses"]))]
    out = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))}
    for key in ("grads", "weights"):
        merged = {n: v for r in ranks for n, v in r[key].items()}
        if set(merged) != set(ref[key]):
            raise AssertionError(
                f"{key}: ranks hold {sorted(set(merged) ^ set(ref[key]))} unlike the reference"
            )
        out[key] = max(rel(merged[n], ref[key][n]) for n in ref[key])
    return out


def bubble_report(cfg: TrainConfig, ranks: list[dict], step: int) -> list[tuple[float, float]]:
    """Per rank, (measured bubble, simulated bubble) of ``step`` in seconds: the step's time
    minus the rank's computing time, against the simulator's bubble for the step's median
    costs of F, B (whole) and W (a split backward's share)."""
    by_kind: dict[str, list[float]] = {"F": [], "B": [], "Bi": [], "W": []}
    for r in ranks:
        for name, t0, t1 in r["spans"][step]:
            by_kind[name.split("@")[0].rstrip("0123456789")].append(t1 - t0)
    med = {k: statistics.median(v) if v else 0.0 for k, v in by_kind.items()}
    whole = med["B"] or med["Bi"] + med["W"]
    timeline = simulate(cfg.schedule(), Costs(F=med["F"], B=whole, W=med["W"]))
    out = []
    for r, predicted in zip(ranks, timeline.bubbles()):
        busy = sum(t1 - t0 for _, t0, t1 in r["spans"][step])
        out.append((max(x["seconds"][step] for x in ranks) - busy, predicted))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_schedule_args(p, pp=2, n=4)
    p.add_argument("--moe-fb-overlap", action="store_true")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--check", action="store_true", help="compare with the one-process run")
    args = p.parse_args(argv)
    if args.moe_fb_overlap:
        p.error("--moe-fb-overlap: the forward/backward overlap is not built yet")
    pp, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    stages = 2 * pp if args.schedules_method == "dualpipev" else pp * v
    if args.num_layers % stages:
        p.error(f"--num-layers {args.num_layers} must be a multiple of the {stages} stages")
    cfg = TrainConfig(args.schedules_method, pp, args.num_micro_batches, v,
                      args.dualpipev_dw_detach, args.steps,
                      model=ModelConfig(layers=args.num_layers))  # fmt: skip
    try:
        cfg.schedule()
    except ValueError as e:
        p.error(str(e))
    ranks = run([cfg])[0]
    for step in range(cfg.steps):
        loss = sum(r["losses"][step] for r in ranks)
        seconds = max(r["seconds"][step] for r in ranks)
        print(f"step {step}: loss {loss:.6f}, {seconds * 1e3:.1f} ms")
    for rank, (measured, predicted) in enumerate(bubble_report(cfg, ranks, cfg.steps - 1)):
        print(f"rank {rank}: bubble {measured * 1e3:.1f} ms measured, "
              f"{predicted * 1e3:.1f} ms simulated from the step's median costs")  # fmt: skip
    if args.check:
        diff = max_relative_difference(ranks, reference(cfg))
        print(f"max relative difference to one process: {diff}")


if __name__ == "__main__":
    main()
