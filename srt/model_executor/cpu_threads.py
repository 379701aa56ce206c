"""Intra-op threads of a CPU rank, chosen per forward mode.

On CPU the HTTP server, the tokenizer and the detokenizer share the cores with the ranks. A
decode step of a small model is a chain of tiny ops, each split over OpenMP threads that wait
for each other at its end: when another process takes one of those threads' cores (it does
every step, to stream the step's tokens), every op waits for it, and the second thread buys
nothing anyway. Decode of such a model therefore leaves one core of the node that runs the
front end to those processes. A larger model's decode streams its weights from memory, where
every core adds bandwidth, so it keeps them all, as do prefill steps. Measured on 2 cores with
``benchmark/compare_peer.py``: see ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os

import torch

from srt.model_executor.forward_batch_info import ForwardMode
from srt.server_args import ServerArgs

# A rank whose weights are smaller than this decodes on one core fewer (see above).
SMALL_MODEL_BYTES = 64 << 20


class CpuThreads:
    def __init__(self, extend_threads: int, decode_threads: int):
        self.extend_threads, self.decode_threads = extend_threads, decode_threads
        self.current = torch.get_num_threads()

    @classmethod
    def from_server_args(cls, server_args: ServerArgs, model_bytes: int) -> CpuThreads | None:
        if server_args.device != "cpu":
            return None
        cores, ranks = len(os.sched_getaffinity(0)), server_args.num_ranks_per_node
        small = model_bytes < SMALL_MODEL_BYTES
        front_end = 1 if server_args.node_rank == 0 and small else 0
        decode = server_args.cpu_decode_threads or (cores - front_end) // ranks
        return cls(max(1, cores // ranks), max(1, decode))

    def apply(self, mode: ForwardMode) -> None:
        threads = self.decode_threads if mode.is_decode_or_idle() else self.extend_threads
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
