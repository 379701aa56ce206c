"""CUDA graphs for decode (SGLang's ``CudaGraphRunner``).

A decode step launches thousands of small kernels; replayed from a CUDA graph it costs one
launch. At start-up the runner captures the model's decode forward once per batch-size bucket
(``--cuda-graph-bs``, up to ``--cuda-graph-max-bs``) over static input buffers; a step then
copies its inputs into the buffers, pads the batch to its bucket and replays the bucket's graph.

- Padding rows decode a dummy token: request row 0 with one key, their K/V written to slot 0
  (the pool's dummy slot), their logits dropped.
- What the forward reads must live in the buffers: the Triton attention backend's decode
  metadata is the batch's own ``req_pool_indices`` and ``seq_lens`` (no host values), and the
  two-batch-overlap children of a decode batch are views of its buffers, so both micro-batches
  are captured in one graph (SGLang captures TBO the same way). Whether a bucket runs split is
  the bucket's own plan (outputs are exact either way).
- DP attention: when every group decodes (or is idle) and the largest group's batch fits a
  bucket, every rank replays that bucket: each group pads its batch to it, an idle group runs
  padding rows only, so each graph's DP padding (every group at the bucket: MAX_LEN) and its
  collectives are the same on every rank. The decision is read off the MLP sync, which every
  rank shares, so no rank replays while another runs eagerly.
- Single-batch overlap is captured with its combine stream forked and joined inside the
  graph (events), on the low_latency dispatcher's fixed-shape blocked combine.
- Not captured, so decoded eagerly: extend batches, batches above the largest bucket, the
  ``normal`` all-to-all (``--deepep-mode normal``: its split sizes are host values, which a
  graph would freeze; ``auto`` decodes with ``low_latency``, as SGLang's DeepEP rule),
  ``--overlap-mode auto`` (it times each step), and attention backends whose decode metadata
  is built from host values (``torch_native``).

On CPU a graph is a recorded forward (``cpu_graph.CpuGraph``) over the same static buffers,
replayed by the same logic, on one rank; each is captured by its bucket's first decode (a
``CpuGraphError`` there turns them off). With ``eager=True`` "capture" keeps the callable and
"replay" runs it over the same static buffers: the runner's logic (buckets, padding, buffer
filling, output slicing) is tested that way with DP attention on CPU.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.batch_overlap.step_split import plan_split, settle_split
from srt.layers.logits_processor import LogitsProcessorOutput
from srt.model_executor.cpu_graph import LazyCpuGraph
from srt.model_executor.dp_sync import DpSyncInfo, SyncRow, apply_dp_sync, dp_sync_info
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, StepSplit

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner


@dataclass
class _Graph:
    """One bucket: its static batch (views of the buffers) and how to run it."""

    batch: ForwardBatch
    run: Callable[[], LogitsProcessorOutput]


class CudaGraphRunner:
    def __init__(self, model_runner: ModelRunner, batch_sizes: list[int], eager: bool = False):
        # weak: the runner owns this one, and a cycle would keep a dropped runner's memory
        self._model_runner = weakref.ref(model_runner)
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        self.eager = eager
        if not eager and model_runner.device.type not in ("cuda", "cpu"):
            raise ValueError("decode graphs run on CUDA or CPU (eager=True replays eagerly)")
        self._init_buffers(model_runner.device)
        self.pool = None  # the graphs' shared memory pool
        self.num_replays = 0
        self.graphs: dict[int, _Graph] = {}
        for bs in reversed(self.batch_sizes):  # largest first: the others reuse its memory
            self.graphs[bs] = self._capture(bs)

    def _init_buffers(self, device: torch.device) -> None:
        zeros = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.input_ids, self.positions = zeros(), zeros()
        self.req_pool_indices, self.out_cache_loc = zeros(), zeros()
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured batch size ≥ ``batch_size``; None above the largest."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def can_run(self, batch: ForwardBatch) -> bool:
        """Without DP attention: a decode batch that fits a bucket."""
        return (
            batch.forward_mode.is_decode()
            and batch.batch_size > 0
            and self.bucket(batch.batch_size) is not None
        )

    def dp_bucket(self, info: DpSyncInfo) -> int | None:
        """DP attention: the bucket every rank replays this step (the same everywhere, from
        the MLP sync's agreement), or None to run eagerly: every group decodes or is idle and
        the largest group's batch fits a bucket. Each group pads its batch to the bucket (an
        idle one runs padding rows only), so the captured DP padding holds."""
        if not info.global_forward_mode.is_decode():
            return None
        return self.bucket(max(info.global_num_tokens))

    def _static_batch(self, bs: int) -> ForwardBatch:
        r = self._model_runner()
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,  # host lengths: read by nothing a graph replays
            out_cache_loc=self.out_cache_loc[:bs],
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.token_to_kv_pool,
        )
        proposal = plan_split(batch, r.split_config)
        mode = r.step_overlap.fixed_mode(proposal is not None)  # graphs are off under auto
        if r.dp_attention:  # every group at this bucket: the agreement of such a step
            rows = [SyncRow.of(batch, proposal)] * r.parallel.attn_dp_size
            info = dp_sync_info(rows, r.parallel.attn_tp_size, r.split_config.rule)
            apply_dp_sync(batch, info, settle_split(mode, batch, proposal, info.split_tokens))
        else:
            batch.split = settle_split(mode, batch, proposal)
        r.prepare_forward(batch)
        return batch

    @torch.inference_mode()  # as the forward it replays: no autograd state in the graph
    def _capture(self, bs: int) -> _Graph:
        batch = self._static_batch(bs)
        model = self._model_runner().model
        run = lambda: model(batch.input_ids, batch.positions, batch)
        if self.eager:
            return _Graph(batch, run)
        if batch.input_ids.device.type == "cpu":  # recorded by the bucket's first decode
            return _Graph(batch, LazyCpuGraph(run))
        for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()
        self.pool = graph.pool()

        def replay() -> LogitsProcessorOutput:
            graph.replay()
            return output  # overwritten by the next replay: consumed before it

        return _Graph(batch, replay)

    def replay(self, batch: ForwardBatch | None, bs: int | None = None) -> LogitsProcessorOutput:
        """``batch``'s logits from bucket ``bs``'s graph (default: ``batch``'s own bucket;
        ``can_run`` or ``dp_bucket`` must have agreed). ``batch`` None: an idle DP group's
        step, padding rows only; its output has 0 rows."""
        n = 0 if batch is None else batch.batch_size
        bs = bs or self.bucket(n)
        graph = self.graphs[bs]
        self._fill(batch, n, bs)
        out = graph.run()
        self.num_replays += 1
        if batch is not None:  # the bucket's plan ran (its split point is the bucket's)
            batch.split = StepSplit(graph.batch.split.mode)
        logits = out.next_token_logits[:n]
        if logits.device.type == "cpu":  # as an eager step's: the caller's to keep
            logits = logits.clone()
        return LogitsProcessorOutput(next_token_logits=logits)

    def _fill(self, batch: ForwardBatch | None, n: int, bs: int) -> None:
        """The batch's inputs into rows [0, n) of the buffers; rows [n, bs) decode a dummy
        token (device copies only: no host synchronisation)."""
        if n:
            self._copy_inputs(batch, n)
        if n < bs:
            for buf in (self.input_ids, self.positions, self.req_pool_indices, self.out_cache_loc):
                buf[n:bs].zero_()
            self.seq_lens[n:bs].fill_(1)

    def _copy_inputs(self, batch: ForwardBatch, n: int) -> None:
        for buf, src in (
            (self.input_ids, batch.input_ids),
            (self.positions, batch.positions),
            (self.req_pool_indices, batch.req_pool_indices),
            (self.seq_lens, batch.seq_lens),
            (self.out_cache_loc, batch.out_cache_loc),
        ):
            buf[:n].copy_(src, non_blocking=True)
