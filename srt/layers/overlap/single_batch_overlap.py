"""Single-batch overlap (SBO): hide the MoE all-to-all inside one batch.

- Combine / down-GEMM: the local experts are cut into ``num_blocks`` contiguous blocks; their
  up-projections run first, then each block's down-projection, and as soon as a block is done
  its share of the combine is launched as its own async all-to-all, while the next block
  computes. ``combine_b`` waits for all of them. Every rank launches the same number of block
  collectives (blocks are counted in local experts, the same on every rank), possibly empty.
- Shared experts: they run while the dispatch is in flight (they need only the router's input,
  and the dispatch is the shorter wait to fill in a decode step): the plain operations list
  places them between ``dispatch_a`` and ``dispatch_b``.

Two wires for a blocked combine:
- Pair wire (``normal``, ``blocked_combine``): one row per (token, local expert) pair, already
  multiplied by its routing weight, instead of one per (token, rank); a token with two experts
  in different blocks of one rank comes back in two rows. Both sides know the layout without
  exchanging counts: the receiver from the ids it got (``DownGemmOverlapArgs``: its pairs by
  block, rows in the order it received them, slots in top-k order), the sender from the ids it
  sent (``CombineOverlapArgs``: per block, which of its tokens each returning row belongs to,
  and how many rows each rank returns), because both use the same blocks. Only the pairs
  travel, but the split sizes are host values (``compute_overlap_args`` reads them).
- Row wire (``low_latency``, ``fixed_blocked_combine``; ``RowSumOverlapArgs``): every block
  sends back the whole fixed ``[ep·C, H]`` buffer of the dispatch, each row carrying the
  weighted sum of its outputs from the block's experts (zero where none), with equal splits;
  the sender adds the blocks up. ``num_blocks`` times the bytes of the unblocked combine, and
  no host value anywhere: no synchronisation, capturable in a CUDA graph.

Where the block combines run (:func:`make_combine_stream`):
- CPU (gloo): each block's collective is launched from the calling thread and progresses in
  gloo's background threads while the next block's down-projection computes; ``combine_b``
  waits for each in turn and adds its rows into the tokens.
- CUDA: on an alternate, high-priority stream. After each block's down-projection the compute
  stream records an event; the alternate stream waits for it, launches the block's all-to-all
  (nccl orders it after the alternate stream), waits for it and adds the block's rows into the
  output, so the receive-side reduction leaves the compute stream too; ``combine_b`` makes the
  compute stream wait for the alternate one. The SMs are split (:class:`SmSplit`): the EP
  combine group is an nccl group limited to ``communicate`` CTAs (one per SM), and the blocked
  down-projection GEMMs leave those SMs free (cuBLASLt's SM carve-out).
The DeepEP / DeepGEMM signal path (combine kernels polling a per-block signal written by the
down GEMM) belongs to a DeepEP dispatcher, which srt does not have: ``--moe-a2a-backend deepep``
is refused at start-up, and SBO with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


def default_num_blocks(num_local_experts: int) -> int:
    """Enough blocks for the first combines to run under the later down-projections, few
    enough that each collective carries a useful share: 4, or one per expert when fewer."""
    return max(1, min(4, num_local_experts))


def partition_blocks(num_local_experts: int, num_blocks: int) -> torch.Tensor:
    """Block index of each local expert: ``num_blocks`` contiguous, near-equal blocks (the
    first ones one expert larger); a block may be empty only when blocks outnumber experts."""
    if num_blocks < 1:
        raise ValueError(f"--sbo-num-blocks must be ≥ 1, got {num_blocks}")
    return torch.arange(num_local_experts) * num_blocks // max(1, num_local_experts)


def block_ranges(num_local_experts: int, num_blocks: int) -> list[range]:
    """The local experts of each block of ``partition_blocks``, from the two counts alone (host
    integers, no tensor): expert e is in block ``e·num_blocks // num_local_experts``."""
    if num_blocks < 1:
        raise ValueError(f"--sbo-num-blocks must be ≥ 1, got {num_blocks}")
    e = max(1, num_local_experts)
    bounds = [min(num_local_experts, -(-b * e // num_blocks)) for b in range(num_blocks + 1)]
    return [range(bounds[b], bounds[b + 1]) for b in range(num_blocks)]


@dataclass(frozen=True)
class RowSumOverlapArgs:
    """Receiver side of the row wire (see the module docstring): block b's combine sends, for
    every dispatched row, the weighted sum of its outputs from the experts of
    ``block_ranges(E_local, num_blocks)[b]``; no layout to plan, so nothing but the count."""

    num_blocks: int


@dataclass
class DownGemmOverlapArgs:
    """Receiver side: per block, the (row, top-k slot) pairs of its experts in row-major order
    and how many of them came from each source rank (the block's combine send splits)."""

    num_blocks: int
    pair_rows: list[torch.Tensor]
    pair_slots: list[torch.Tensor]
    send_splits: list[list[int]]


@dataclass
class CombineOverlapArgs:
    """Sender side: per block, the token each returning row adds to, and how many rows each
    rank returns (the block's combine receive splits)."""

    num_blocks: int
    token_idx: list[torch.Tensor]
    recv_splits: list[list[int]]


def compute_overlap_args(
    num_blocks: int,
    num_local_experts: int,
    ep_rank: int,
    ep_size: int,
    sent_topk_ids: torch.Tensor,
    recv_topk_ids: torch.Tensor,
    recv_splits: list[int],
) -> tuple[CombineOverlapArgs, DownGemmOverlapArgs]:
    """``sent_topk_ids`` [T, k]: this rank's tokens' global expert ids (-1: none);
    ``recv_topk_ids`` [R, k]: the received rows' ids, -1 where not this rank's; rows grouped by
    source rank, ``recv_splits`` of them from each."""
    device, nb, ep = sent_topk_ids.device, num_blocks, ep_size
    block_of = partition_blocks(num_local_experts, num_blocks).to(device)
    # Receiver: every (row, slot) pair of a local expert, row-major, then grouped by block
    # (a stable sort keeps the row-major order inside a block).
    local = recv_topk_ids.long() - ep_rank * num_local_experts
    valid = (recv_topk_ids >= 0) & (local >= 0) & (local < num_local_experts)
    rows, slots = valid.nonzero(as_tuple=True)
    blocks = block_of[local[rows, slots]]
    order = torch.argsort(blocks, stable=True)
    rows, slots, blocks = rows[order], slots[order], blocks[order]
    source = torch.repeat_interleave(
        torch.arange(ep, device=device), torch.tensor(recv_splits, device=device)
    )  # [R] source rank of each row
    sends = torch.bincount(blocks * ep + source[rows], minlength=nb * ep).view(nb, ep)
    sizes = sends.sum(dim=1).tolist()
    # Sender: the same pairs as seen from its tokens: by block, destination, token, slot.
    ids = sent_topk_ids.long()
    num_tokens, top_k = ids.shape
    chosen = ids >= 0
    flat = torch.arange(num_tokens * top_k, device=device).view(num_tokens, top_k)[chosen]
    ids = ids[chosen]
    dest = torch.div(ids, num_local_experts, rounding_mode="floor")
    sent_block = block_of[ids % num_local_experts]
    key = (sent_block * ep + dest) * (num_tokens * top_k) + flat
    token_idx = torch.div(flat[torch.argsort(key)], top_k, rounding_mode="floor")
    recvs = torch.bincount(sent_block * ep + dest, minlength=nb * ep).view(nb, ep)
    return (
        CombineOverlapArgs(nb, list(token_idx.split(recvs.sum(dim=1).tolist())), recvs.tolist()),
        DownGemmOverlapArgs(nb, list(rows.split(sizes)), list(slots.split(sizes)), sends.tolist()),
    )


# ----------------------------------------------------------------------------- CUDA SM split
DEFAULT_COMMUNICATE_SMS = 3
BLACKWELL_COMMUNICATE_SMS = 32  # Blackwell's combine needs more SMs to keep up (SGLang's value)


@dataclass(frozen=True)
class SmSplit:
    """How a CUDA device's SMs are shared while a blocked combine overlaps the down GEMMs."""

    total: int
    communicate: int

    @property
    def compute(self) -> int:
        return self.total - self.communicate

    @classmethod
    def resolve(cls, total: int, capability_major: int, override: int | None) -> SmSplit:
        """``override``: ``--sbo-communication-sms``; default 3, 32 on Blackwell (sm_10x)."""
        if override is None:
            blackwell = capability_major == 10
            override = BLACKWELL_COMMUNICATE_SMS if blackwell else DEFAULT_COMMUNICATE_SMS
        if not 1 <= override < total:
            raise ValueError(
                f"--sbo-communication-sms {override}: must be in [1, {total}) on this "
                f"device ({total} SMs)"
            )
        return cls(total, override)

    @classmethod
    def for_device(cls, device: torch.device, override: int | None) -> SmSplit:
        props = torch.cuda.get_device_properties(device)
        return cls.resolve(props.multi_processor_count, props.major, override)


# ------------------------------------------------------------------ where block combines run
class HostCombineStream:
    """CPU: collectives progress in the communication library's threads; every wait and
    reduction happens at ``join`` (``combine_b``), in launch order."""

    def __init__(self) -> None:
        self._pending: list[tuple[object, Callable[[], None]]] = []

    def submit(self, launch: Callable[[], object], reduce: Callable[[], None]) -> None:
        """``launch()`` starts the block's exchange and returns something with ``wait()``;
        ``reduce()`` adds the received rows once it is done."""
        self._pending.append((launch(), reduce))

    def join(self) -> None:
        pending, self._pending = self._pending, []
        for work, reduce in pending:
            work.wait()
            reduce()

    def compute_sms(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class CudaCombineStream:
    """CUDA: block combines on an alternate stream (see the module docstring). The tensors a
    block uses are allocated on the compute stream and kept alive by the caller until after
    ``join``, so the caching allocator cannot hand their memory out early."""

    def __init__(self, device: torch.device, sm_split: SmSplit):
        self.device, self.sm_split = device, sm_split
        self.stream = torch.cuda.Stream(device, priority=-1)

    def submit(self, launch: Callable[[], object], reduce: Callable[[], None]) -> None:
        ready = torch.cuda.Event()
        ready.record()  # on the compute stream, after the block's down-projection
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            launch().wait()  # a stream dependency on nccl's stream: the host does not block
            reduce()

    def join(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    @contextlib.contextmanager
    def compute_sms(self) -> Iterator[None]:
        """GEMMs issued inside leave ``sm_split.communicate`` SMs to the combine."""
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(self.sm_split.communicate)
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(before)


def make_combine_stream(
    device: torch.device | str, communicate_sms: int | None = None
) -> HostCombineStream | CudaCombineStream:
    device = torch.device(device)
    if device.type == "cuda":
        return CudaCombineStream(device, SmSplit.for_device(device, communicate_sms))
    if communicate_sms is not None:
        raise ValueError("--sbo-communication-sms applies to CUDA devices only")
    return HostCombineStream()
