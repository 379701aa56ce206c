"""bench_mixed_step times a decode step, a prefill and the two in one MIXED batch."""

from __future__ import annotations

import re

from benchmark.offline.bench_mixed_step import main

LINE = re.compile(r"^(D|P|M|M expanded) +median +([\d.]+) ms +rounds +([\d. ]+)$")


def test_prints_each_kind_of_step(deepseek_v3_path, capsys):
    main(["--model-path", deepseek_v3_path, "--running", "3", "--new", "1", "--input-len", "6",
          "--rounds", "3", "--no-mla-split"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    rows = {m.group(1): m.group(3).split() for m in map(LINE.match, lines) if m}
    assert set(rows) == {"D", "P", "M", "M expanded"}
    assert all(len(values) == 2 for values in rows.values())  # the warm-up round left out
    assert lines[-1].startswith("M / (P + D) ")
