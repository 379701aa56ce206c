"""Generate, check and simulate a pipeline schedule, with MindSpeed's flags:

    python -m pipeline --schedules-method dualpipev --pipeline-model-parallel-size 4 \\
        --num-micro-batches 10 --dualpipev-dw-detach --picture dualpipev.png

Prints each rank's actions (``--actions``), bubble and peak live activations for the given
per-chunk costs, and the bubble formula of the method for comparison."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.schedules import add_schedule_args, schedule_from_args
from pipeline.simulator import Costs, check, simulate


def formula(args: argparse.Namespace, c: Costs) -> str:
    pp = args.pipeline_model_parallel_size
    if args.schedules_method == "1f1b":
        return f"(PP-1)(F+B) = {(pp - 1) * (c.F + c.B):g}"
    if args.schedules_method == "vpp":
        return f"(PP-1)(F+B) per chunk = {(pp - 1) * (c.F + c.B):g}"
    fb = c.FB if c.FB is not None else c.F + c.B
    if args.dualpipev_dw_detach:
        return f"(PP-1)(F&B+B-3W) = {(pp - 1) * (fb + c.B - 3 * c.W):g}"
    return f"(PP-1)(F&B+B-W)-F = {(pp - 1) * (fb + c.B - c.W) - c.F:g}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_schedule_args(p, pp=4, n=8)
    for name, default in (("F", 1.0), ("B", 2.0), ("W", 1.0), ("p2p", 0.0), ("a2a", 0.0)):
        p.add_argument(f"--cost-{name.lower()}", type=float, default=default)
    p.add_argument("--cost-fb", type=float, default=None, help="an F&B pair (default F + B)")
    p.add_argument("--actions", action="store_true", help="print every rank's actions")
    p.add_argument("--picture", type=Path, default=None, help="write the timeline PNG here")
    args = p.parse_args(argv)
    try:
        schedule = schedule_from_args(args)
    except ValueError as e:
        p.error(str(e))
    check(schedule)
    costs = Costs(args.cost_f, args.cost_b, args.cost_w, args.cost_fb, args.cost_p2p, args.cost_a2a)
    timeline = simulate(schedule, costs)
    if args.actions:
        for rank, actions in enumerate(schedule.ranks):
            print(f"rank {rank}: " + " ".join(map(str, actions)))
    bubbles = [round(b, 3) for b in timeline.bubbles()]
    print(f"{schedule.name}: makespan {timeline.makespan:g}, bubble per rank {bubbles}, "
          f"formula {formula(args, costs)}")  # fmt: skip
    print(f"peak live activations per rank: {timeline.peak_activations()}")
    if args.picture:
        from pipeline.draw import draw

        draw(timeline, args.picture)
        print(f"picture: {args.picture}")


if __name__ == "__main__":
    main()
