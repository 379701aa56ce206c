"""The emulated cluster's serving figures: the order servers run in and how a mode's bursts
are pooled (no processes)."""

from __future__ import annotations

import pytest

from benchmark.cluster import emulated_cluster, emulated_serving


def _burst(output_tokens: int, seconds: float, ttft: float, tpot: float) -> dict:
    return dict(duration=seconds, total_output_tokens=output_tokens, total_input_tokens=4 *
                output_tokens, completed=4, output_throughput=output_tokens / seconds,
                mean_ttft_ms=ttft, mean_tpot_ms=tpot)  # fmt: skip


def test_rounds_alternate_their_order():
    order = emulated_serving.round_order(["off", "tbo", "sbo", "auto"], 3)
    assert order == [
        ["off", "tbo", "sbo", "auto"], ["auto", "sbo", "tbo", "off"], ["off", "tbo", "sbo", "auto"],
    ]  # fmt: skip


def test_pool_weighs_bursts_by_length():
    runs = [
        {"bursts": [_burst(100, 1.0, 10.0, 5.0), _burst(100, 4.0, 30.0, 7.0)]},
        {"bursts": [_burst(200, 1.0, 20.0, 6.0)]},
    ]
    pooled = emulated_serving.pool_servers(runs)
    assert pooled["output_throughput"] == pytest.approx(400 / 6.0)  # not the median 100
    assert pooled["total_throughput"] == pytest.approx(2000 / 6.0)
    assert pooled["mean_ttft_ms"] == pytest.approx(20.0)
    assert pooled["mean_tpot_ms"] == pytest.approx(6.0)
    assert pooled["num_servers"] == 2
    assert pooled["burst_output_throughputs"] == [100.0, 25.0, 200.0]
    assert "overlap" not in pooled


def test_pool_sums_auto_steps():
    runs = [
        {"bursts": [_burst(10, 1.0, 1.0, 1.0)], "overlap": {"num_steps": {"decode/off": 3}}},
        {"bursts": [_burst(10, 1.0, 1.0, 1.0)],
         "overlap": {"num_steps": {"decode/off": 4, "decode/tbo": 1}}},
    ]  # fmt: skip
    pooled = emulated_serving.pool_servers(runs)
    assert pooled["overlap"]["num_steps"] == {"decode/off": 7, "decode/tbo": 1}
    assert len(pooled["overlap"]["per_server"]) == 2


@pytest.mark.parametrize("flag", ["--serving-servers", "--serving-output-len"])
def test_serving_counts_must_be_positive(capsys, flag):
    with pytest.raises(SystemExit):
        emulated_cluster.parse_args([flag, "0"])
    assert f"{flag} must be at least 1" in capsys.readouterr().err
