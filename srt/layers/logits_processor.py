"""LM head application: logits for the last token of each sequence (and, for input logprobs,
for the requested prompt positions).

The LM head is vocabulary-sharded over ``vocab_group``: each rank computes the logits of its
vocabulary rows and they are all-gathered, so every rank holds the same logits and samples the
same tokens. The group is the attention-TP group (one rank, plain TP, or DP attention with
``--enable-dp-lm-head``), or, under DP attention without it (SGLang's default), the whole world:
each rank then holds 1/T of the vocabulary instead of 1/attn_tp, and the rows the LM head keeps
("pruned" rows) of every DP group are gathered first (``cross_dp``) so that every rank computes
its vocabulary slice for all of them; each group keeps its own rows of the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from srt.distributed.communication_op import all_gather
from srt.distributed.group_coordinator import GroupCoordinator
from srt.layers.linear import linear
from srt.model_executor.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from srt.layers.dp_attention import DpRowsGather


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] float32, logits at each sequence's last token
    # Extend with return_logprob only: for each sequence i, the rows of positions
    # extend_logprob_start_lens_cpu[i] .. extend_seq_lens_cpu[i] - 1 of its new tokens,
    # concatenated over sequences. Row j of a sequence predicts the token after position j.
    input_token_logits: torch.Tensor | None = None  # [sum(extend_len - start), V] float32


def logprob_rows(batch: ForwardBatch) -> list[int]:
    """Extend with input logprobs: the hidden rows whose logits input logprobs need."""
    rows: list[int] = []
    offset = 0
    for start, length in zip(batch.extend_logprob_start_lens_cpu, batch.extend_seq_lens_cpu):
        rows.extend(range(offset + start, offset + length))
        offset += length
    return rows


def kept_rows(batch: ForwardBatch) -> list[int] | None:
    """The hidden rows the LM head is applied to, in output order: each sequence's last token,
    then the input-logprob rows. None: every row (decode, idle)."""
    if not batch.forward_mode.is_extend():
        return None
    last, end = [], 0
    for length in batch.extend_seq_lens_cpu:
        end += length
        last.append(end - 1)
    return last + logprob_rows(batch) if batch.return_logprob else last


def num_logit_rows(batch: ForwardBatch) -> int:
    """How many rows the LM head computes for ``batch`` (the DP sync's num_tokens_for_logprob)."""
    rows = kept_rows(batch)
    return batch.num_tokens if rows is None else len(rows)


class LogitsProcessor(torch.nn.Module):
    def __init__(
        self,
        vocab_size: int,
        vocab_group: GroupCoordinator | None = None,
        cross_dp: DpRowsGather | None = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_group = vocab_group
        self.cross_dp = cross_dp

    def forward(
        self, hidden_states: torch.Tensor, lm_head: torch.nn.Module, batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        rows = kept_rows(batch)
        if rows is not None:
            index = torch.tensor(rows, dtype=torch.int64, device=hidden_states.device)
            hidden_states = hidden_states.index_select(0, index)
        logits = self._logits(hidden_states, lm_head, batch)
        if not batch.forward_mode.is_extend():
            return LogitsProcessorOutput(logits)
        num_seqs = batch.batch_size
        input_logits = logits[num_seqs:] if logits.shape[0] > num_seqs else None
        return LogitsProcessorOutput(logits[:num_seqs], input_logits)

    def _logits(
        self, hidden: torch.Tensor, lm_head: torch.nn.Module, batch: ForwardBatch
    ) -> torch.Tensor:
        counts = batch.global_num_tokens_for_logprob_cpu
        if self.cross_dp is not None:
            hidden = self.cross_dp.gather(hidden, counts)
        logits = linear(hidden, lm_head.weight, packed=getattr(lm_head, "packed_weight", None))
        if self.cross_dp is not None:  # the vocabulary group is the world
            logits = self.cross_dp.own_rows_all_vocab(logits, counts, self.vocab_group)
        elif self.vocab_group is not None:
            logits = all_gather(self.vocab_group, logits, dim=-1)
        return logits[:, : self.vocab_size].float()
