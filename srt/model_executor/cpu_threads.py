"""Intra-op threads of a CPU rank, chosen per step.

On CPU the HTTP server, the tokenizer and the detokenizer share the cores with the ranks. A
decode step that reads few weights is a chain of small ops, each split over OpenMP threads
that wait for each other at its end: when another process takes one of those threads' cores
(it does every step, to stream the step's tokens), every op waits for it, and the last thread
buys little anyway. Such a step therefore leaves one core of the node that runs the front end
to those processes. A step that streams many weights from memory gains bandwidth from every
core, so it keeps them all.

What a step reads is counted in float32 bytes whatever the weights' dtype: the C kernels
turn bf16 and fp8 weights into float32 in registers, so a step's time falls less than its bytes
(one core streamed 2.4 G float32 weights a second, 4.2 G bf16 and 6.2 G fp8: a 16384 × 2048
weight, one row, cold caches).

What a decode step reads is not the model's size: of the routed experts it reads at most
``sequences × top_k`` experts' worth (``WeightBytes.read_by``), so a mixture of experts that is
large in all decodes a few sequences like a small model, and a batch of many like a large one.
Measured on 2 cores with ``benchmark/serving/compare_peer.py``: ``docs/benchmarks_history.md``,
round 8.

A prefill (or mixed) step leaves that core too when it reads as few weights and its work (its
tokens times the weight bytes one token reads) is small, a prompt or two of a small model: the
last thread saves little there, and such a step comes when a stream ends and the next request
arrives, the front end's busiest moment. On 2 cores (small model, one 128-token prompt with
15 requests decoding) it took 3.8 ms on both cores offline and 4.5 ms on one; serving 16
streams, 5-13 ms on both (up to 9.5 ms of it waiting for a core), 4.0-4.6 ms on one. A lone
prompt arriving with the rest of a burst took 16-22 ms on both, 5-9 ms on one
(``docs/benchmarks_history.md``, round 19). More prompts, or a larger model, keep every core.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from srt.model_executor.forward_batch_info import ForwardMode
from srt.model_executor.weight_bytes import WeightBytes
from srt.server_args import ServerArgs

# A decode step reading fewer weight bytes than this runs on one core fewer (see above).
SMALL_MODEL_BYTES = 64 << 20
# A prefill or mixed step reading as few does too while tokens × bytes per token are under this.
SMALL_EXTEND_WORK = 512 << 20
# GOMP_SPINCOUNT for the ranks (see limit_openmp_spin): about 0.1 ms of spinning.
OPENMP_SPIN_COUNT = "1000"


def limit_openmp_spin(environ: dict[str, str] | None = None) -> bool:
    """Give the processes started from now on (the CPU ranks) libgomp's short spin. An
    OpenMP thread that waits, at a barrier or for the next parallel region, spins
    GOMP_SPINCOUNT times before it sleeps; at libgomp's default a worker burned about 8 ms of
    CPU after every parallel region on a 2-core AVX-512 host (1000: 0.07 ms). The front end
    streams tokens on those cores: a worker spinning after a prefill takes the core it would
    run on, and one spinning at a barrier holds the core its preempted partner could resume
    on, so the whole step waits. Served at 32 streams (small model), the longest prefill step
    of a run was 36-54 ms with 1000 (six runs), 68-89 ms at the default and 61-70 ms with
    10 000 (three each). Ops issued back to back (microseconds apart) still find the worker
    spinning. Left alone where GOMP_SPINCOUNT or OMP_WAIT_POLICY is set; returns whether it
    was set. This governs torch's own OpenMP threads; the C kernels run on a team of their own
    (``srt/layers/cpu_kernels/csrc/cpu_pool.c``), whose workers spin by the clock instead."""
    environ = os.environ if environ is None else environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    return True


@dataclass(kw_only=True)
class CpuThreads:
    """Intra-op threads per kind of step: ``lean_decode_threads`` for decode steps that read
    under SMALL_MODEL_BYTES, ``decode_threads`` for the others; ``lean_extend_threads`` for
    prefill and mixed steps that read as few and do less work than SMALL_EXTEND_WORK,
    ``extend_threads`` for the others."""

    extend_threads: int
    decode_threads: int
    lean_extend_threads: int
    lean_decode_threads: int
    weights: WeightBytes
    current: int = field(default_factory=torch.get_num_threads, init=False)

    @classmethod
    def from_server_args(cls, server_args: ServerArgs, weights: WeightBytes) -> CpuThreads | None:
        if server_args.device != "cpu":
            return None
        cores, ranks = len(os.sched_getaffinity(0)), server_args.num_ranks_per_node
        front_end = 1 if server_args.node_rank == 0 else 0
        full, lean = max(1, cores // ranks), max(1, (cores - front_end) // ranks)
        decode, lean_decode = full, lean
        if server_args.cpu_decode_threads:  # every decode step, whatever it reads
            decode = lean_decode = server_args.cpu_decode_threads
        return cls(
            extend_threads=full,
            decode_threads=decode,
            lean_extend_threads=lean,
            lean_decode_threads=lean_decode,
            weights=weights,
        )

    def threads_for(self, mode: ForwardMode, sequences: int, tokens: int = 0) -> int:
        """``tokens``: the step's (prefill and mixed steps; decode steps go by ``sequences``)."""
        if not mode.is_decode_or_idle():
            reads = self.weights.read_by(tokens)
            if reads < SMALL_MODEL_BYTES and tokens * self.weights.read_by(1) < SMALL_EXTEND_WORK:
                return self.lean_extend_threads
            return self.extend_threads
        if self.weights.read_by(sequences) < SMALL_MODEL_BYTES:
            return self.lean_decode_threads
        return self.decode_threads

    def leaves_front_end_a_core(self, max_sequences: int) -> bool:
        """Every decode step (up to ``max_sequences``) runs on fewer threads than prefill, so
        the front end has a core of its own while the model decodes."""
        return self.threads_for(ForwardMode.DECODE, max_sequences) < self.extend_threads

    def apply(self, mode: ForwardMode, sequences: int, tokens: int = 0) -> None:
        threads = self.threads_for(mode, sequences, tokens)
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads
