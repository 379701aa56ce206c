"""benchmark/offline/eplb_balance.py's table: the dense layers (no load) left out, the trivial
placement's imbalance and the balanced one's per number of redundant experts, and the rows the
printed table holds (the server part is test/eplb/test_eplb_server.py's sequence)."""

from __future__ import annotations

import pytest
import torch

from benchmark.offline.eplb_balance import balance_table, format_table


def test_the_table_compares_trivial_and_balanced():
    load = torch.tensor([[0, 0, 0, 0], [40, 30, 20, 10], [1, 1, 1, 1]])
    table = balance_table(load, ep_size=2, redundant=[0, 2], groups=1)
    assert table["layers"] == [1, 2]
    assert table["trivial"] == pytest.approx([70 / 50, 1.0])
    assert table["balanced, 0 redundant"] == pytest.approx([1.0, 1.0])
    assert table["balanced, 2 redundant"] == pytest.approx([1.0, 1.0])
    text = format_table(table).splitlines()
    assert text[0] == "| layer | trivial | balanced, 0 redundant | balanced, 2 redundant |"
    assert text[2] == "| 1 | 1.400 | 1.000 | 1.000 |"
    assert text[-1] == "| max | 1.400 | 1.000 | 1.000 |"
