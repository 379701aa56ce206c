"""Two-batch overlap (TBO): split a batch into two micro-batches and run the MoE layers'
operations of both interleaved, so one computes while the other's all-to-all is in flight.

Where to split (SGLang's rules, names and keywords, as in its ``two_batch_overlap.py``):

- Decode and target-verify split the sequences in half (each sequence has the same number of
  tokens: 1, or the draft length).
- Extend uses the balanced split (the sequence boundary minimising |left − right| tokens) unless
  its left share falls outside ``[threshold, 1 − threshold]``; then the two-chunk split cuts the
  sequence that straddles the middle token, so both children get half the tokens: child A keeps
  the first part of that sequence, child B continues it with a longer prefix.
- ``token_distribution_threshold`` is ``--tbo-token-distribution-threshold`` (0 turns the
  two-chunk split off). It is an explicit argument: no global server-args dictionary.

Whether to split: the thresholds every split mode shares (``srt.batch_overlap.step_split``);
a batch whose split would leave a child empty runs unsplit; under DP attention the decision is
unanimous (``agree_two_batch_overlap``, run by the MLP sync): every non-idle group must be able
to split, all in the same mode.

How (``split_forward_batch``, ``run_layers_overlapped``, ``execute_overlapped_operations``):
the children are ForwardBatches over token ranges ``[0, split_token)`` and
``[split_token, N)`` of the parent; embedding, the dense layers before the first MoE layer, the
final norm and the LM head run on the parent. The model runs the overlapped layers through
``run_layers_overlapped``, which the ModelRunner hands it (models import no executor).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from srt.layers.dp_attention import DpPaddingMode, dp_buffer_len
from srt.layers.overlap.operations import (
    LayerState,
    OperationItem,
    OperationObserver,
    run_stage,
    to_stages,
)
from srt.model_executor.forward_batch_info import (
    ForwardBatch,
    ForwardMode,
    StepSplit,
    slice_forward_batch,
)
from srt.models.operations_strategy import OperationsStrategy

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48


def compute_split_seq_index(
    forward_mode: ForwardMode,
    num_tokens: int,
    extend_lens: Sequence[int] | None,
    token_num_per_seq: int | None,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int:
    """The first sequence of child B (with the two-chunk split, the sequence that is cut)."""
    if forward_mode == ForwardMode.EXTEND:
        if extend_lens is None:
            raise ValueError("an extend split needs extend_lens")
        if is_two_chunk_split_enabled(extend_lens, token_distribution_threshold):
            return _split_array_by_cum_less_than_half(extend_lens)
        return _split_array_by_balanced_sum(extend_lens)
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        if not token_num_per_seq:
            raise ValueError(f"a {forward_mode.name} split needs token_num_per_seq")
        return (num_tokens // token_num_per_seq) // 2
    if forward_mode.is_idle():
        if num_tokens:
            raise ValueError(f"an IDLE batch has no tokens, got {num_tokens}")
        return 0
    raise ValueError(f"two-batch overlap cannot split a {forward_mode.name} batch")


def compute_split_token_index(
    split_seq_index: int,
    forward_mode: ForwardMode,
    extend_seq_lens: Sequence[int] | None,
    token_num_per_seq: int | None,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int:
    """The first token of child B."""
    if forward_mode == ForwardMode.EXTEND:
        if extend_seq_lens is None:
            raise ValueError("an extend split needs extend_seq_lens")
        if is_two_chunk_split_enabled(extend_seq_lens, token_distribution_threshold):
            return sum(extend_seq_lens) // 2
        return sum(extend_seq_lens[:split_seq_index])
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        return split_seq_index * token_num_per_seq
    if forward_mode.is_idle():
        if split_seq_index:
            raise ValueError(f"an IDLE batch splits at 0, got {split_seq_index}")
        return 0
    raise ValueError(f"two-batch overlap cannot split a {forward_mode.name} batch")


def is_two_chunk_split_enabled(extend_lens: Sequence[int], threshold: float) -> bool:
    """Whether the balanced split is too lopsided, so one sequence must be cut in two. Not when
    child A would hold more sequences than tokens (every sequence needs at least one)."""
    if not 0 <= threshold <= 0.5:
        raise ValueError(f"--tbo-token-distribution-threshold {threshold} must be in [0, 0.5]")
    if threshold == 0 or not extend_lens:
        return False
    total = sum(extend_lens)
    left = sum(extend_lens[: _split_array_by_balanced_sum(extend_lens)])
    if threshold * total <= left <= (1 - threshold) * total:
        return False
    return _split_array_by_cum_less_than_half(extend_lens) + 1 <= total // 2


def _split_array_by_balanced_sum(lens: Sequence[int]) -> int:
    """Index i in 1..len-1 minimising |sum(lens[:i]) − sum(lens[i:])|; ties go to the later
    index and the scan stops at the first increase. 0 when there is at most one sequence."""
    total, left, best, best_diff = sum(lens), 0, 0, None
    for i in range(1, len(lens)):
        left += lens[i - 1]
        diff = abs(2 * left - total)
        if best_diff is not None and diff > best_diff:
            break
        best, best_diff = i, diff
    return best


def _split_array_by_cum_less_than_half(lens: Sequence[int]) -> int:
    """The first index whose inclusive prefix sum exceeds half the tokens."""
    half, left = sum(lens) // 2, 0
    for i, n in enumerate(lens):
        left += n
        if left > half:
            return i
    return 0


# ---------------------------------------------------------------------------------- whether
def propose_tbo_split(batch: ForwardBatch, token_distribution_threshold: float) -> StepSplit | None:
    """This rank's TBO split of a batch that passed its threshold (``SplitConfig.passes``), or
    None when a micro-batch would be empty."""
    mode, num_tokens = batch.forward_mode, batch.num_tokens
    lens, per_seq = (batch.extend_seq_lens_cpu, None) if mode.is_extend() else (None, 1)
    dist = token_distribution_threshold
    seq = compute_split_seq_index(mode, num_tokens, lens, per_seq, dist)
    token = compute_split_token_index(seq, mode, lens, per_seq, dist)
    if not 0 < token < num_tokens:  # a child would be empty: not worth two micro-batches
        return None
    return StepSplit("tbo", seq, token)


def agree_two_batch_overlap(rows: list[tuple[ForwardMode, bool]]) -> bool:
    """The DP agreement of two-batch overlap over ``(forward_mode, can_split)`` per group: TBO
    only if every non-idle group can split and all non-idle groups are in the same mode; an
    idle group follows (it splits its empty batch in two); all idle → no TBO."""
    busy = [(mode, can) for mode, can in rows if not mode.is_idle()]
    return bool(busy) and all(can for _, can in busy) and len({m for m, _ in busy}) == 1


# ---------------------------------------------------------------------------------- children
def split_forward_batch(batch: ForwardBatch, attn_tp_size: int) -> list[ForwardBatch]:
    """The two micro-batches of a batch whose step runs split (an idle batch: two
    empty ones). Token fields are views of the parent's; under the two-chunk split the cut
    sequence appears in both: child A with its first tokens, child B continuing it with its
    prefix length increased by those. Under DP attention each child gets every group's token
    count for its half, and its own padding mode and buffer length."""
    if batch.forward_mode.is_idle():
        bounds = [(0, 0, 0, 0), (0, 0, 0, 0)]
        cut = 0
    else:
        split, bs = batch.split, batch.batch_size
        seq, token = split.seq_index, split.token_index
        cut = 0
        if batch.forward_mode.is_extend():
            cut = token - sum(batch.extend_seq_lens_cpu[:seq])  # child A's part of seq
        bounds = [(0, token, 0, seq + (cut > 0)), (token, batch.num_tokens, seq, bs)]
    children = [_child(batch, i, *bounds[i], cut) for i in range(2)]
    if batch.global_num_tokens_cpu is not None:
        firsts = batch.split.group_tokens
        counts = [firsts, [n - a for n, a in zip(batch.global_num_tokens_cpu, firsts)]]
        for child, child_counts in zip(children, counts):
            _set_dp_fields(child, batch, child_counts, attn_tp_size)
    return children


def _child(
    parent: ForwardBatch, index: int, t0: int, t1: int, s0: int, s1: int, cut: int
) -> ForwardBatch:
    seq_lens = list(parent.seq_lens_cpu[s0:s1])
    fields = dict(
        global_forward_mode=parent.global_forward_mode or parent.forward_mode,
        is_extend_in_batch=parent.is_extend_in_batch,
        tbo_subbatch_index=index,
        tbo_parent_token_range=(t0, t1),
        split=parent.split.child(),
    )
    if parent.forward_mode.is_extend() and t1 > t0:
        prefix = list(parent.extend_prefix_lens_cpu[s0:s1])
        extend = list(parent.extend_seq_lens_cpu[s0:s1])
        if cut and index == 0:  # the cut sequence ends after its first `cut` new tokens
            extend[-1] = cut
            seq_lens[-1] = prefix[-1] + cut
        elif cut:  # ... and child B computes the rest on top of them
            prefix[0] += cut
            extend[0] -= cut
        fields |= dict(extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=extend)
    if cut:  # the cut sequence's length differs from the parent's
        tensor = torch.tensor(seq_lens, dtype=torch.int64, device=parent.device)
        fields |= dict(seq_lens=tensor, seq_lens_cpu=seq_lens)
    mode = parent.forward_mode if t1 > t0 else ForwardMode.IDLE
    return slice_forward_batch(parent, mode, (t0, t1), (s0, s1), **fields)


def _set_dp_fields(
    child: ForwardBatch, parent: ForwardBatch, counts: list[int], attn_tp_size: int
) -> None:
    padding = DpPaddingMode.choose(parent.is_extend_in_batch, counts)
    child.global_num_tokens_cpu = list(counts)
    child.dp_padding_mode = padding
    child.global_dp_buffer_len = dp_buffer_len(padding, counts, attn_tp_size)


# ---------------------------------------------------------------------------------- running
def run_layers_overlapped(
    strategy: OperationsStrategy,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    batch: ForwardBatch,
    observer: OperationObserver | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The overlapped layers' ``strategy`` (for the step's global mode) on the two children of
    ``batch``, interleaved; the children's outputs concatenated back in the parent's token
    order."""
    states = []
    for child in batch.tbo_children:
        t0, t1 = child.tbo_parent_token_range
        state = LayerState(child, child.positions)
        state.put(
            hidden_states=hidden[t0:t1], residual=None if residual is None else residual[t0:t1]
        )
        states.append(state)
    execute_overlapped_operations(*states, strategy.operations, strategy.tbo_delta_stages, observer)
    outputs = [state.take_outputs("hidden_states", "residual") for state in states]
    return tuple(torch.cat(parts) for parts in zip(*outputs))


def with_children(batch: ForwardBatch, attn_tp_size: int) -> ForwardBatch:
    """``batch`` with its ``tbo_children`` built when the step runs split."""
    if batch.split.is_split and batch.tbo_children is None:
        batch.tbo_children = split_forward_batch(batch, attn_tp_size)
    return batch


def execute_overlapped_operations(
    inputs_a: LayerState,
    inputs_b: LayerState,
    operations: Sequence[OperationItem],
    delta_stages: int,
    observer: OperationObserver | None = None,
) -> tuple[LayerState, LayerState]:
    """Two micro-batches through the same stages: A runs ``delta_stages`` stages alone, then A
    and B alternate stage by stage (A's stage ``i + delta`` then B's stage ``i``), then B runs
    its last ``delta_stages`` stages. Every rank runs the same sequence, so the collectives
    the stages launch line up across ranks. Each state carries its own micro-batch (and with
    it its DP buffer length and dispatcher index), so nothing global is switched between
    stages. Returns the two states."""
    stages = to_stages(operations)
    if not 0 <= delta_stages <= len(stages):
        raise ValueError(f"delta_stages {delta_stages} outside [0, {len(stages)}]")
    for i in range(len(stages) + delta_stages):
        if i < len(stages):
            run_stage(stages[i], inputs_a, observer, "A")
        if i >= delta_stages:
            run_stage(stages[i - delta_stages], inputs_b, observer, "B")
    return inputs_a, inputs_b
