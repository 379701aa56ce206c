"""LM head application: logits for the last token of each sequence (and, for input logprobs,
for the requested prompt positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.distributed.communication_op import all_gather
from srt.distributed.group_coordinator import GroupCoordinator
from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    next_token_logits: torch.Tensor  # [B, V] float32, logits at each sequence's last token
    # Extend with return_logprob only: for each sequence i, the rows of positions
    # extend_logprob_start_lens_cpu[i] .. extend_seq_lens_cpu[i] - 1 of its new tokens,
    # concatenated over sequences. Row j of a sequence predicts the token after position j.
    input_token_logits: torch.Tensor | None = None  # [sum(extend_len - start), V] float32


class LogitsProcessor(torch.nn.Module):
    """With a vocabulary-parallel LM head (``tp_group`` of several ranks) each rank computes the
    logits of its vocabulary rows; they are all-gathered (identical on every rank, so every rank
    samples the same tokens) and the padding rows past ``vocab_size`` are dropped."""

    def __init__(self, vocab_size: int, tp_group: GroupCoordinator | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_group = tp_group

    def forward(
        self, hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, batch: ForwardBatch
    ) -> LogitsProcessorOutput:
        if batch.forward_mode.is_extend():
            lens = batch.extend_seq_lens_cpu
            last_index = torch.tensor(lens, device=hidden_states.device).cumsum(0) - 1
            last_hidden = hidden_states[last_index]
        else:
            last_hidden = hidden_states
        next_logits = self._logits(last_hidden, lm_head_weight)
        input_logits = None
        if batch.return_logprob and batch.forward_mode.is_extend():
            rows = self._logprob_rows(batch)
            if rows:
                index = torch.tensor(rows, dtype=torch.int64, device=hidden_states.device)
                input_logits = self._logits(hidden_states[index], lm_head_weight)
        return LogitsProcessorOutput(next_logits, input_logits)

    def _logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits = torch.matmul(hidden, weight.t())
        if self.tp_group is not None:
            logits = all_gather(self.tp_group, logits, dim=-1)
        return logits[:, : self.vocab_size].float()

    @staticmethod
    def _logprob_rows(batch: ForwardBatch) -> list[int]:
        rows: list[int] = []
        offset = 0
        for start, length in zip(batch.extend_logprob_start_lens_cpu, batch.extend_seq_lens_cpu):
            rows.extend(range(offset + start, offset + length))
            offset += length
        return rows
