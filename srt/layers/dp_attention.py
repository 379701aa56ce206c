"""DP attention padding (SGLang's rules): how the MLP-sync step sizes the buffer that gathers
every attention-DP rank's tokens around the MoE.

- MAX_LEN: every rank pads to the longest rank; the gather is an all-gather and the return a
  reduce-scatter of equal chunks.
- SUM_LEN: one buffer of the summed length, each rank writing its slice; the exchange is an
  all-reduce.
SUM_LEN when any rank has an extend (lengths are skewed and padding to the max would be costly);
otherwise MAX_LEN when it wastes at most half the buffer (2·sum ≥ max·ranks), else SUM_LEN.
"""

from __future__ import annotations

from enum import Enum, auto


class DpPaddingMode(Enum):
    MAX_LEN = auto()
    SUM_LEN = auto()

    def is_max_len(self) -> bool:
        return self is DpPaddingMode.MAX_LEN

    def is_sum_len(self) -> bool:
        return self is DpPaddingMode.SUM_LEN

    @classmethod
    def choose(cls, is_extend_in_batch: bool, global_num_tokens: list[int]) -> DpPaddingMode:
        if is_extend_in_batch:
            return cls.SUM_LEN
        max_len, sum_len = max(global_num_tokens, default=0), sum(global_num_tokens)
        return cls.MAX_LEN if 2 * sum_len >= max_len * len(global_num_tokens) else cls.SUM_LEN


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dp_buffer_len(mode: DpPaddingMode, global_num_tokens: list[int], attn_tp_size: int) -> int:
    """Tokens in the gathered buffer. Each rank's count is first rounded up to a multiple of
    ``attn_tp_size`` so the buffer splits evenly across the attention-TP ranks."""
    padded = [round_up(n, attn_tp_size) for n in global_num_tokens]
    if mode.is_max_len():
        return max(padded, default=0) * len(padded)
    return sum(padded)
