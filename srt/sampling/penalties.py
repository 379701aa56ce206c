"""Penalty tensors for a batch, built from explicit token lists, and their in-place application.

Everything here is built only for the rows that need it: a row with default penalties
contributes no tokens, so a batch of plain requests costs nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """[B, V] float32: how many times each token occurs in each row's list."""
    rows, cols = _row_col_index(token_lists, vocab_size, device)
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(cols.numel(), dtype=torch.float32, device=device)
    counts.index_put_((rows, cols), ones, accumulate=True)
    return counts


def repetition_scales(
    token_lists: Sequence[Sequence[int]],
    penalties: Sequence[float],
    vocab_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """[B, V] float32: the row's repetition penalty on tokens in its list, 1.0 elsewhere."""
    rows, cols = _row_col_index(token_lists, vocab_size, device)
    scales = torch.ones(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    values = torch.tensor(penalties, dtype=torch.float32, device=device)
    scales[rows, cols] = values[rows]
    return scales


def block_index(
    token_sets: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor | None:
    """[2, K] int64 (row, token) pairs to set to -inf, or None when there are none."""
    rows, cols = _row_col_index(token_sets, vocab_size, device)
    if cols.numel() == 0:
        return None
    return torch.stack([rows, cols])


def apply_frequency_presence_(
    logits: torch.Tensor,
    counts: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> None:
    """logits -= freq * count + presence * (count > 0); penalties are [B, 1]."""
    logits -= frequency_penalties * counts
    logits -= presence_penalties * (counts > 0).to(logits.dtype)


def apply_repetition_(logits: torch.Tensor, scales: torch.Tensor) -> None:
    """HF/SGLang scaling: positive logits are divided by the penalty, negative multiplied."""
    logits.copy_(torch.where(logits > 0, logits / scales, logits * scales))


def apply_block_(logits: torch.Tensor, index: torch.Tensor) -> None:
    logits[index[0], index[1]] = float("-inf")


def _row_col_index(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    cols = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.int64)
    # Ids outside the vocabulary (a bad prompt id, a padded LM head) cannot be penalised.
    valid = (cols >= 0) & (cols < vocab_size)
    return rows[valid].to(device), cols[valid].to(device)
