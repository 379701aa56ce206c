"""ForwardBatches without a model or pools, for the code that splits them."""

from __future__ import annotations

import torch

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


def extend_batch(
    prefix: list[int], new: list[int], mode: ForwardMode = ForwardMode.EXTEND
) -> ForwardBatch:
    """Sequence i: ``prefix[i]`` cached tokens and ``new[i]`` computed now; input ids count
    from 100, KV slots from 1000, request rows from 10."""
    n = sum(new)
    seq_lens = [p + k for p, k in zip(prefix, new)]
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(new),
        input_ids=torch.arange(100, 100 + n),
        positions=torch.tensor([p + i for p, k in zip(prefix, new) for i in range(k)]),
        req_pool_indices=torch.arange(len(new)) + 10,
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens,
        out_cache_loc=torch.arange(1000, 1000 + n),
        req_to_token_pool=None,
        token_to_kv_pool=None,
        extend_prefix_lens_cpu=list(prefix),
        extend_seq_lens_cpu=list(new),
    )
