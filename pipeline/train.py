"""Train the small MoE model through a pipeline schedule, one process per rank (gloo), with
MindSpeed's flags; and the single-process reference it must equal.

    python -m pipeline.train --schedules-method dualpipev --pipeline-model-parallel-size 2 \\
        --num-micro-batches 8 --dualpipev-dw-detach --steps 3

Prints each step's loss and time, and, with ``--check``, the largest relative difference of
the loss, of every parameter's gradient after the first step and of the weights after the last
against the reference. ``--expert-model-parallel-size EP`` spreads each stage's experts over
EP ranks (PP × EP processes, each EP rank its own micro-batches); ``--moe-fb-overlap`` runs each
F&B pair's forward and backward interleaved at their all-to-alls; ``--evaluate`` adds, after
training, one more batch's loss by a forward-only step through the schedule (no backward, no
gradient touched), compared too under ``--check``. ``--rank R --dist-init-addr
HOST:PORT`` runs one rank of a multi-node run (rank 0 prints the summary).
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.ep import EPGroup
from pipeline.executor import RankExecutor, check_message_tags
from pipeline.model import ModelConfig, build_model, loss_fn, split_stages
from pipeline.report import print_summary, summarize
from pipeline.schedules import DEFAULT_DW_DETACH, add_schedule_args, make_schedule


@dataclass(frozen=True)
class TrainConfig:
    method: str = "1f1b"
    pp: int = 2
    num_microbatches: int = 4
    vpp: int = 1
    dw_detach: bool = DEFAULT_DW_DETACH
    ep: int = 1  # EP group size at each pipeline position (each EP rank runs its own data)
    fb_overlap: bool = False
    steps: int = 3
    microbatch_size: int = 2
    seq_len: int = 8
    lr: float = 0.05
    seed: int = 0
    evaluate: bool = False  # after training, the next batch's loss by a forward-only step
    model: ModelConfig = ModelConfig()

    def schedule(self):
        return make_schedule(self.method, self.pp, self.num_microbatches, self.vpp, self.dw_detach)


def batches(cfg: TrainConfig, step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The step's micro-batches of token ids and their next-token labels, ``num_microbatches``
    for each EP rank in rank order (the same on every rank and in the reference)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + step)
    shape = (cfg.num_microbatches * cfg.ep, cfg.microbatch_size, cfg.seq_len + 1)
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
            loss = loss_fn(model(x), y, len(ids))
            loss.backward()
            total += float(loss.detach())
        out["losses"].append(total)
        if step == 0:
            out["grads"] = {
                n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
            }
        opt.step()
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    if cfg.evaluate:
        ids, labels = batches(cfg, cfg.steps)
        with torch.no_grad():
            out["eval_losses"] = [
                float(loss_fn(model(x), y, len(ids))) for x, y in zip(ids, labels)
            ]
    return out


EXPERT_PARAMS = (".moe.w1", ".moe.w2", ".moe.w3")  # split over the EP group; the rest replicated


def train_rank(rank: int, world: int, init_method: str, cfgs: list[TrainConfig],
               gather: bool = False) -> list[dict] | list[list[dict]] | None:  # fmt: skip
    """This rank's part of each run of ``cfgs`` (one process group for all; global rank
    ``d·PP + r`` is pipeline rank r of EP rank d). ``gather``: rank 0 returns every rank's
    results (``[rank][run]``), the others None."""
    torch.set_num_threads(1)  # one core's worth per rank: the ranks share the machine
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        pp, ep = cfgs[0].pp, cfgs[0].ep
        # per pipeline position: two payload groups (one per link direction) and the counts'
        groups = [[dist.new_group([d * pp + r for d in range(ep)]) for _ in range(3)]
                  if ep > 1 else [] for r in range(pp)]  # fmt: skip
        out = [_train(rank, cfg, groups[rank % pp]) for cfg in cfgs]
        if not gather:
            return out
        every = [None] * world if rank == 0 else None
        dist.gather_object(out, every, dst=0)
        return every
    finally:
        # nothing may hold a process group past its destruction: a gloo device that lives
        # on to the interpreter's exit aborts it there
        gc.collect()
        dist.destroy_process_group()


def host_clock() -> str:
    """Which clock ``time.perf_counter`` reads: the kernel's boot id (Linux; the processes of
    one machine, network namespaces included, share it), else the host's name and pid (no
    other rank is assumed to share it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{socket.gethostname()}:{os.getpid()}"


def measure_p2p(cfg: TrainConfig, rank: int, peers: list[int], repeats: int = 3,
                burst: int = 8) -> float:  # fmt: skip
    """One activation's time from a pipeline rank to its neighbour on a busy link: pipeline
    rank 2i sends ``burst`` of them back to back to rank 2i + 1, which acknowledges; the time
    per message (median over the repeats; a lone message on an idle link would ride the
    link's burst allowance), the largest over the world's pairs."""
    r = rank % cfg.pp
    msgs = [torch.zeros(cfg.microbatch_size, cfg.seq_len, cfg.model.hidden) for _ in range(burst)]
    ack, times = torch.zeros(1), []
    if r ^ 1 < cfg.pp:
        peer = peers[r ^ 1]
        for _ in range(repeats):
            start = time.perf_counter()
            if r % 2 == 0:
                for work in [dist.isend(m, peer, tag=i) for i, m in enumerate(msgs)]:
                    work.wait()
                dist.recv(ack, peer, tag=burst)
            else:
                for work in [dist.irecv(m, peer, tag=i) for i, m in enumerate(msgs)]:
                    work.wait()
                dist.send(ack, peer, tag=burst)
            times.append((time.perf_counter() - start) / burst)
    per_message = torch.tensor([statistics.median(times) if times else 0.0])
    dist.all_reduce(per_message, op=dist.ReduceOp.MAX)
    return float(per_message)


def _build(rank: int, cfg: TrainConfig, ep: EPGroup) -> tuple[list, RankExecutor]:
    """This rank's named parameters (its stages', experts sharded over ``ep``) and executor."""
    r, d = rank % cfg.pp, rank // cfg.pp
    schedule = cfg.schedule()
    model = build_model(cfg.model, cfg.seed)
    stages = split_stages(model, schedule.num_stages)
    mine = {s: stages[s] for s, owner in enumerate(schedule.stage_rank) if owner == r}
    for stage in mine.values():
        for block in stage.blocks:
            block.moe.shard(ep)
    ids_of_mine = {id(p) for st in mine.values() for p in st.parameters()}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in ids_of_mine]
    shape = (cfg.microbatch_size, cfg.seq_len, cfg.model.hidden)
    peers = [d * cfg.pp + q for q in range(cfg.pp)]
    executor = RankExecutor(schedule, r, mine, shape, peers, cfg.fb_overlap,
                            num_total=cfg.num_microbatches * cfg.ep)  # fmt: skip
    return named, executor


def _train(rank: int, cfg: TrainConfig, groups: list) -> dict:
    """Its stages' first gradients and final weights by parameter name (EP rank 0 reports them
    for its group: the experts gathered, the rest summed over the group), each step's loss
    share, time, computations' intervals, peak activations and bytes exchanged."""
    d, n = rank // cfg.pp, cfg.num_microbatches
    ep = EPGroup(d, cfg.ep, tuple(groups[:2]), groups[2] if groups else None)
    group = groups[0] if groups else None
    named, executor = _build(rank, cfg, ep)
    opt = torch.optim.SGD([p for _, p in named], lr=cfg.lr)
    out = {"losses": [], "seconds": [], "grads": {}, "spans": [], "peak_bytes": [],
           "peak_chunks": [], "a2a_bytes": [], "sends": [], "receives": [],
           "clock": host_clock(), "p2p": measure_p2p(cfg, rank, executor.peers)}  # fmt: skip
    for step in range(cfg.steps):
        opt.zero_grad()
        ids, labels = batches(cfg, step)
        dist.barrier()
        before, start = ep.bytes_exchanged, time.perf_counter()
        record = executor.step(ids[d * n : (d + 1) * n], labels[d * n : (d + 1) * n])
        out["seconds"].append(time.perf_counter() - start)
        out["a2a_bytes"].append(ep.bytes_exchanged - before)
        out["losses"].append(record.loss)
        out["spans"].append([(name, t0 - start, t1 - start) for name, t0, t1 in record.spans])
        out["sends"].append(record.sends)  # on the host's clock: compared across ranks
        out["receives"].append(record.receives)
        out["peak_bytes"].append(record.peak_bytes)
        out["peak_chunks"].append(record.peak_chunks)
        if group is not None:  # data parallel over the EP group: sum the replicated gradients
            for name, p in named:
                if p.grad is not None and not name.endswith(EXPERT_PARAMS):
                    dist.all_reduce(p.grad, group=group)
        if step == 0:
            out["grads"] = _report(named, group, d, lambda p: p.grad)
        opt.step()
    out["handovers"] = executor.threads.num_yields if executor.threads else 0
    if cfg.evaluate:
        out.update(_evaluate(cfg, executor, named, d))
    executor.close()
    out["weights"] = _report(named, group, d, lambda p: p.detach())
    return out


def _evaluate(cfg: TrainConfig, executor: RankExecutor, named, d: int) -> dict:
    """A forward-only step over the batch after the last: each micro-batch's loss share by its
    index in the batch (on the last stage's rank), and whether every gradient stayed as it was."""
    n = cfg.num_microbatches
    ids, labels = batches(cfg, cfg.steps)
    before = [None if p.grad is None else p.grad.clone() for _, p in named]
    record = executor.step(ids[d * n : (d + 1) * n], labels[d * n : (d + 1) * n], True)
    kept = all(p.grad is None if g is None else torch.equal(g, p.grad)
               for g, (_, p) in zip(before, named))  # fmt: skip
    return {"eval_losses": {d * n + mb: loss for mb, loss in record.losses.items()},
            "eval_grads_kept": kept}  # fmt: skip


def _report(named, group, d: int, get) -> dict:
    """``get(p)`` by name on EP rank 0, experts gathered from the group; nothing elsewhere."""
    out = {}
    for name, p in named:
        value = get(p)
        if value is None:
            continue
        if group is not None and name.endswith(EXPERT_PARAMS):
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts)
        if d == 0:
            out[name] = value.numpy().copy()
    return out


def _main(rank: int, world: int, init_method: str, cfgs: list[TrainConfig], results) -> None:
    results.put((rank, train_rank(rank, world, init_method, cfgs)))


def run(cfgs: list[TrainConfig]) -> list[list[dict]]:
    """Per run of ``cfgs`` (all of one PP and EP), every rank's result: one spawned process per
    rank on this machine, for all the runs."""
    pp, ep = cfgs[0].pp, cfgs[0].ep
    if any((cfg.pp, cfg.ep) != (pp, ep) for cfg in cfgs):
        raise ValueError("the runs of one launch share their pipeline and EP sizes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_main, args=(r, pp * ep, init_method, cfgs, results))
             for r in range(pp * ep)]  # fmt: skip
    for p in procs:
        p.start()
    out = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return [[out[r][i] for r in range(pp * ep)] for i in range(len(cfgs))]


def max_relative_difference(ranks: list[dict], ref: dict) -> dict[str, float]:
    """Loss, first gradients and final weights of the ranks against the reference; with
    ``evaluate``, each micro-batch's evaluation loss too (``eval_loss``)."""

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
    if "eval_losses" in ref:
        got = {mb: loss for r in ranks for mb, loss in r["eval_losses"].items()}
        if sorted(got) != list(range(len(ref["eval_losses"]))):
            raise AssertionError(f"evaluation losses of micro-batches {sorted(got)} only")
        out["eval_loss"] = max(abs(got[mb] - b) / abs(b) for mb, b in enumerate(ref["eval_losses"]))
    return out


SHAPE_DEFAULTS = {"num_layers": 8, "hidden_size": 32, "moe_intermediate_size": 48,
                  "num_experts": 8, "micro_batch_size": 2, "seq_length": 8, "steps": 3}  # fmt: skip


def add_shape_args(p: argparse.ArgumentParser, **defaults: int) -> None:
    """The model's and the run's sizes (``--num-layers`` ... ``--steps``), shared with the
    emulated-cluster benchmark, which passes them on (``shape_argv``)."""
    for dest, default in {**SHAPE_DEFAULTS, **defaults}.items():
        p.add_argument("--" + dest.replace("_", "-"), type=int, default=default)


def shape_argv(args: argparse.Namespace) -> list[str]:
    return [x for d in SHAPE_DEFAULTS for x in ("--" + d.replace("_", "-"), str(getattr(args, d)))]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_schedule_args(p, pp=2, n=4)
    p.add_argument("--moe-fb-overlap", action="store_true",
                   help="run each F&B pair's forward and backward interleaved at their "
                   "all-to-alls (dualpipev)")  # fmt: skip
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="EP group size at each pipeline position (ranks: PP × EP)")  # fmt: skip
    add_shape_args(p)
    p.add_argument("--evaluate", action="store_true",
                   help="after training, the next batch's loss by a forward-only step")  # fmt: skip
    p.add_argument("--check", action="store_true", help="compare with the one-process run")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--rank", type=int, help="run this global rank only (one process per node)")
    p.add_argument("--dist-init-addr", help="HOST:PORT of rank 0, with --rank")
    args = p.parse_args(argv)
    pp, v = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.moe_fb_overlap and args.schedules_method != "dualpipev":
        p.error("--moe-fb-overlap overlaps the F&B pairs of --schedules-method dualpipev; "
                f"{args.schedules_method} has none")  # fmt: skip
    stages = 2 * pp if args.schedules_method == "dualpipev" else pp * v
    if args.num_layers % stages:
        p.error(f"--num-layers {args.num_layers} must be a multiple of the {stages} stages")
    if ep < 1 or args.num_experts % ep:
        p.error(f"--num-experts {args.num_experts} must split over "
                f"--expert-model-parallel-size {ep}")  # fmt: skip
    if (args.rank is None) != (args.dist_init_addr is None):
        p.error("--rank and --dist-init-addr go together")
    model = ModelConfig(layers=args.num_layers, hidden=args.hidden_size, experts=args.num_experts,
                        intermediate=args.moe_intermediate_size)  # fmt: skip
    cfg = TrainConfig(args.schedules_method, pp, args.num_micro_batches, v,
                      args.dualpipev_dw_detach, ep, args.moe_fb_overlap, args.steps,
                      args.micro_batch_size, args.seq_length, evaluate=args.evaluate,
                      model=model)  # fmt: skip
    try:
        check_message_tags(cfg.schedule())  # refused here, not in every rank's process
    except ValueError as e:
        p.error(str(e))
    if args.rank is None:
        ranks = run([cfg])[0]
    else:
        every = train_rank(args.rank, pp * ep, f"tcp://{args.dist_init_addr}", [cfg], True)
        if every is None:
            return
        ranks = [results[0] for results in every]
    summary = summarize(cfg, ranks)
    print_summary(summary)
    if args.evaluate:
        summary["eval_loss"] = sum(x for r in ranks for x in r["eval_losses"].values())
        print(f"evaluation loss (forward only, the batch after the last step): "
              f"{summary['eval_loss']:.6f}")  # fmt: skip
    if args.check:
        summary["check"] = max_relative_difference(ranks, reference(cfg))
        print(f"max relative difference to one process: {summary['check']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f)


if __name__ == "__main__":
    main()
