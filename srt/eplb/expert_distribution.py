"""The expert-distribution recorder (SGLang's ``stat`` mode): how many tokens each MoE layer's
router sent to each logical expert, counted on the device as the router decides.

Each rank counts the rows its MoE blocks route (its own chunk of tokens under an all-to-all;
with ``--moe-a2a-backend none`` every rank routes every token, so only rank 0 counts). A DP
group's ranks handle the start, stop and dump messages at the same step, so a dump sums the
group's counts with one collective of that group; the tokenizer manager sums the groups'.

On CPU the count runs only while recording (it costs a call per layer; where the experts run
in the C kernels, the router's kernel counts as it chooses: ``rows``). Where decode runs from
graphs (CUDA, and CPU decode graphs) it always runs, so that the graphs capture it (one
``index_add_`` per layer, or the router's count, no host sync); start zeroes the counts
there, and stop keeps what they held.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from srt.distributed.parallel_state import ParallelState


class ExpertDistributionRecorder:
    def __init__(self, num_layers: int, num_experts: int, parallel: ParallelState):
        device = parallel.device
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.long, device=device)
        self.always = torch.device(device).type == "cuda"
        self.counts_here = parallel.config.moe_a2a_backend != "none" or parallel.rank == 0
        self.group = parallel.attn_tp.cpu_group if parallel.attn_tp_size > 1 else None
        self.recording = False
        self.stopped: torch.Tensor | None = None  # what stop kept, until the next start
        self.window: torch.Tensor | None = None  # --enable-eplb: counts since the last rebalance

    @property
    def active(self) -> bool:
        """Whether a MoE block records this step's routing."""
        return self.counts_here and (self.recording or self.always or self.window is not None)

    def rows(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The count rows [E] that one layer's choices go to (the CPU router counts itself)."""
        counts = (self.counts[layer],) if self.recording or self.always else ()
        return counts if self.window is None else (*counts, self.window[layer])

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count one layer's [T, k] logical choices."""
        ids = topk_ids.flatten()
        ones = torch.ones_like(ids)
        for row in self.rows(layer):
            row.index_add_(0, ids, ones)

    def keep_window(self) -> None:
        """Count into a window of its own too, which ``take_window`` empties (``--enable-eplb``:
        the routes' recording stays the user's)."""
        self.window = torch.zeros_like(self.counts)

    def take_window(self) -> torch.Tensor:
        """This rank's counts since the last take, on the host; the window starts again."""
        counts = self.window.cpu()  # a copy on CUDA; on CPU the clone below makes it one
        counts = counts.clone() if counts is self.window else counts
        self.window.zero_()
        return counts

    def start(self) -> None:
        self.counts.zero_()
        self.stopped, self.recording = None, True

    def stop(self) -> None:
        if self.recording:
            self.stopped = self.counts.clone()
        self.recording = False

    def dump(self) -> list[list[int]]:
        """The counts since start (up to stop, if it came), summed over this DP group's ranks:
        ``logical_count`` [layers, experts], as ``--init-expert-location`` reads it."""
        counts = (self.counts if self.stopped is None else self.stopped).cpu()
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)
        return counts.tolist()
