"""The random dataset of bench_serving: random token ids from the tokenizer's regular vocabulary."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np


@dataclass
class DatasetRow:
    prompt: str
    input_ids: list[int]
    prompt_len: int
    output_len: int


def _regular_token_ids(tokenizer) -> np.ndarray:
    """Ids of the base vocabulary minus special tokens, so prompts never hold control tokens."""
    special = set(tokenizer.all_special_ids)
    special.update(i for i, tok in tokenizer.added_tokens_decoder.items() if tok.special)
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special])


def _sample_lens(rng: np.random.Generator, length: int, ratio: float, n: int) -> list[int]:
    low = max(int(length * ratio), 1)
    return rng.integers(low, max(length, low) + 1, size=n).tolist()


def sample_random_requests(
    tokenizer, args: argparse.Namespace, rng: np.random.Generator, *, count_text: bool
) -> list[DatasetRow]:
    """Random prompts; `count_text` measures each prompt by re-encoding its decoded text."""
    vocab = _regular_token_ids(tokenizer)
    n, ratio = args.num_prompts, args.random_range_ratio
    input_lens = _sample_lens(rng, args.random_input_len, ratio, n)
    output_lens = _sample_lens(rng, args.random_output_len, ratio, n)
    rows = []
    for input_len, output_len in zip(input_lens, output_lens):
        ids = rng.choice(vocab, size=input_len).tolist()
        prompt = tokenizer.decode(ids)
        if count_text:
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            prompt_len = len(ids)
        rows.append(DatasetRow(prompt, ids, prompt_len, output_len))
    return rows
