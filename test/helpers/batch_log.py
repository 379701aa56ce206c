"""The scheduler's batch log lines (SGLang's format), parsed: every field, in SGLang's order."""

from __future__ import annotations

import re

_INT, _FLOAT = r"(\d+)", r"(\d+\.\d\d)"
PREFILL_LINE = re.compile(
    rf"Prefill batch, #new-seq: {_INT}, #new-token: {_INT}, #cached-token: {_INT}, "
    rf"token usage: {_FLOAT}, #running-req: {_INT}, #queue-req: {_INT}, "
    rf"#pending-token: {_INT}, (?:cuda|cpu) graph: (True|False), "
    rf"input throughput \(token/s\): {_FLOAT}$",
    re.M,
)
DECODE_LINE = re.compile(
    rf"Decode batch, #running-req: {_INT}, #token: {_INT}, token usage: {_FLOAT}, "
    rf"(?:cuda|cpu) graph: (True|False), gen throughput \(token/s\): {_FLOAT}, "
    rf"#queue-req: {_INT}$",
    re.M,
)


def prefill_lines(log: str) -> list[tuple[int, ...]]:
    """(new seqs, new tokens, cached tokens, running, queued, pending tokens) of each line."""
    return [tuple(int(m[i]) for i in (1, 2, 3, 5, 6, 7)) for m in PREFILL_LINE.finditer(log)]


def decode_lines(log: str) -> list[tuple]:
    """(running, KV tokens, token usage, graph replayed, tokens/s, queued) of each line."""
    return [
        (int(m[1]), int(m[2]), float(m[3]), m[4] == "True", float(m[5]), int(m[6]))
        for m in DECODE_LINE.finditer(log)
    ]
