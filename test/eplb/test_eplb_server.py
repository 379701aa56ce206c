"""EPLB through the server, as an SGLang user runs it: record the expert distribution over
HTTP on a two-rank DP-attention server, dump it, and start a second server whose placement is
balanced from that dump with two redundant experts and rebalanced live under load: its greedy
answers are the first's."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers.server_process import assert_pool_full, running_server, server_info, wait_idle

pytestmark = pytest.mark.slow  # starts two servers of two ranks

PROMPTS = ["37+45=", "91-38=", "12+7=", "60-59="]
EP2 = ("--tp", "2", "--dp", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch")


def greedy(url: str) -> list[str]:
    body = {"text": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    response = httpx.post(url + "/generate", json=body, timeout=120.0)
    response.raise_for_status()
    return [out["text"] for out in response.json()]


def test_record_dump_then_serve_and_rebalance_from_the_dump(qwen3_moe_path, tmp_path):
    """Server one records and dumps; server two starts from the balanced dump with two copies
    and rebalances every 4 forward steps under 4 concurrent clients: every request answers as
    server one did, both rebalances and copies ran, and every KV slot comes back."""
    with running_server(qwen3_moe_path, *EP2) as server:
        url = server.url
        before = httpx.post(url + "/dump_expert_distribution_record")
        assert before.status_code == 200
        assert not any(any(row) for row in before.json()["logical_count"])  # nothing yet
        assert httpx.post(url + "/start_expert_distribution_record").status_code == 200
        want = greedy(url)
        assert httpx.post(url + "/stop_expert_distribution_record").status_code == 200
        greedy(url)  # after stop: not counted
        dump = httpx.post(url + "/dump_expert_distribution_record")
        assert dump.status_code == 200, dump.text
    counts = dump.json()["logical_count"]
    config = json.loads((Path(qwen3_moe_path) / "config.json").read_text())
    assert len(counts) == config["num_hidden_layers"]
    assert all(len(row) == config["num_experts"] for row in counts)
    totals = {sum(row) for row in counts}
    assert len(totals) == 1  # every token passes every MoE layer
    (total,) = totals
    assert total > 0 and total % config["num_experts_per_tok"] == 0
    path = tmp_path / "dump.json"
    path.write_text(dump.text)
    flags = ("--ep-num-redundant-experts", "2", "--init-expert-location", str(path))
    live = ("--enable-eplb", "--eplb-rebalance-num-iterations", "4")
    with running_server(qwen3_moe_path, *EP2, *flags, *live) as server:
        assert greedy(server.url) == want  # the balanced placement, before any rebalance
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: greedy(server.url), range(12)))
        assert answers == [want] * 12
        wait_idle(server.url)
        states = server_info(server.url)["internal_states"]
        assert sum(state["num_eplb_rebalances"] for state in states) >= 2
        for state in states:
            assert_pool_full(state)
