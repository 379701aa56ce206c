"""The emulated-cluster report: a Markdown table per link rate and mode, and two plots
(throughput and step time vs link rate, per overlap mode), from ``emulated_cluster.py``'s
points."""

from __future__ import annotations

from pathlib import Path

from benchmark.cluster.emulated_network import parse_rate


def _rows(point: dict) -> list[tuple]:
    """(mode, batch, prefill tokens, off / on prefill ms, off / on decode ms, speed-ups,
    hidden fractions) for TBO, SBO and DBO."""
    rows = []
    for mode in ("tbo", "sbo", "dbo"):
        runs = point.get(mode, [])
        for on in (r for r in runs if r["variant"].endswith("_on")):
            off = next(
                r for r in runs
                if r["variant"].endswith("_off") and r["batch_size"] == on["batch_size"]
            )  # fmt: skip
            rows.append((
                mode.upper(), on["batch_size"], on["batch_size"] * on["input_len"],
                off["prefill_latency"] * 1e3, on["prefill_latency"] * 1e3,
                off["median_decode_latency"] * 1e3, on["median_decode_latency"] * 1e3,
                on["prefill_speedup"], on["decode_speedup"],
                on["prefill_hidden_fraction"], on["decode_hidden_fraction"],
            ))  # fmt: skip
    return rows


def markdown(points: list[dict]) -> str:
    lines = [
        "| link | mode | batch | prefill tokens | prefill off / on (ms) | decode off / on (ms) "
        "| prefill × | decode × | hidden prefill / decode |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for point in points:
        for m, b, pt, p0, p1, d0, d1, ps, ds, ph, dh in _rows(point):
            lines.append(
                f"| {point['rate']} | {m} | {b} | {pt} | {p0:.1f} / {p1:.1f} | {d0:.1f} / "
                f"{d1:.1f} | {ps:.2f} | {ds:.2f} | {ph:.0%} / {dh:.0%} |"
            )
    serving = [p for p in points if "serving" in p]
    if serving:
        lines += ["", "| link | serving mode | output tok/s | total tok/s | mean TTFT (ms) "
                  "| auto's steps |", "|---|---|---:|---:|---:|---|"]  # fmt: skip
        for point in serving:
            for mode, rec in point["serving"].items():
                steps = rec.get("overlap", {}).get("num_steps", {})
                chosen = ", ".join(f"{key} {n}" for key, n in steps.items())
                lines.append(
                    f"| {point['rate']} | {mode} | {rec['output_throughput']:.1f} | "
                    f"{rec['total_throughput']:.1f} | {rec['mean_ttft_ms']:.1f} | {chosen} |"
                )
    return "\n".join(lines) + "\n"


def _rate_gbit(rate: str) -> float:
    return float("nan") if rate == "unshaped" else parse_rate(rate) / 1e9


def plot(points: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shaped = [p for p in points if p["rate"] != "unshaped"]
    if not shaped:
        return
    xs = [_rate_gbit(p["rate"]) for p in shaped]
    batch = max(r[1] for r in _rows(shaped[0]))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (idx_off, idx_on, what) in zip(axes, ((3, 4, "prefill"), (5, 6, "decode"))):
        for mode in ("TBO", "SBO"):
            rows = [next(r for r in _rows(p) if r[0] == mode and r[1] == batch) for p in shaped]
            if mode == "TBO":
                ax.plot(xs, [r[idx_off] for r in rows], "o-", label="overlap off")
            ax.plot(xs, [r[idx_on] for r in rows], "o-", label=mode)
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_ylabel(f"{what} step time (ms)")
        ax.set_title(f"{what}, batch {batch} per node")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, key in (
        ("off", "off"),
        ("TBO", "tbo"),
        ("SBO", "sbo"),
        ("DBO", "dbo"),
        ("auto", "auto"),
    ):
        ys = [p.get("serving", {}).get(key, {}).get("output_throughput") for p in shaped]
        if all(y is not None for y in ys):
            ax.plot(xs, ys, "o-", label=mode)
    ax.set_xlabel("link rate (Gbit/s)")
    ax.set_ylabel("serving output throughput (tok/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


def write_report(points: list[dict], out: Path) -> None:
    (out / "results.md").write_text(markdown(points))
    try:
        plot(points, out)
    except ImportError as e:
        print(f"no plots ({e}): pip install -e '.[bench]'")
