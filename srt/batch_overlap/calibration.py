"""``--overlap-mode auto``'s start-up calibration: synthetic steps of every power-of-two size, so
that the cost model has measured each mode before the first request (a serving burst may be a
single prefill and a dozen decode steps: no time to learn online).

Every rank runs the same ladder in the same order through ``ModelRunner.forward_step`` (under
DP attention each group brings its own synthetic batch of the same size, so the MLP sync and
the collectives line up); the policy, in calibrating mode, runs each step in the mode least
sampled in its bucket. Three passes over the ladder run each size in every mode three times (the
plain step only where the all-to-all is too small a share to hide), and the median stands: the
first run of a size is cold, and a burst of other work on the machine spoils at most one of
the three, which lie a pass apart. Rungs, the largest first: prefills of 16, 32, ... tokens up
to --chunked-prefill-size (prompts of 128 tokens at most), then decode batches of 1, 2, 4, ...
sequences up to --max-running-requests, each sequence 64 tokens long; both within half the KV
pool. The slots and request rows are returned, both pools reset and the runner's step counts
cleared, so serving starts from the same state as without calibration.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PASSES = 3  # over the whole ladder, each mode once per size and pass
DECODE_CONTEXT = 64  # tokens of context behind each synthetic decode token
PROMPT_TOKENS = 128  # the longest synthetic prompt


def ladder(first: int, limit: int) -> list[int]:
    """``first``, ``2 * first``, ... up to ``limit``, and ``limit`` itself when it lies
    between powers of two."""
    sizes, n = [], first
    while n <= limit:
        sizes.append(n)
        n *= 2
    if limit >= first and sizes[-1] != limit:
        sizes.append(limit)
    return sizes


def calibrate(runner: ModelRunner) -> None:
    policy = runner.step_overlap.policy
    sa, pool = runner.server_args, runner.max_total_num_tokens
    decode = ladder(1, min(runner.max_running_requests, pool // 2 - DECODE_CONTEXT))
    prefill_limit = sa.chunked_prefill_size if sa.enable_chunked_prefill else sa.max_prefill_tokens
    prefill = ladder(16, min(prefill_limit, sa.max_prefill_tokens, pool // 2))
    start = time.perf_counter()
    policy.calibrating = True
    try:
        for _ in range(PASSES):  # a burst of other work spoils one sample of a size, not all
            for mode, sizes in ((ForwardMode.EXTEND, prefill), (ForwardMode.DECODE, decode)):
                for n in reversed(sizes):  # the largest first: its buffers serve the rest
                    for _ in policy.modes:
                        _run(runner, mode, n)
    finally:
        policy.end_calibration()
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
        runner.step_counts.clear()  # they count served steps
    logger.info(
        "overlap auto: calibrated %d steps (decode up to %d, prefill up to %d tokens) in %.1f s",
        policy.num_calibration_steps,
        decode[-1] if decode else 0,
        prefill[-1] if prefill else 0,
        time.perf_counter() - start,
    )


def _run(runner: ModelRunner, mode: ForwardMode, num_tokens: int) -> None:
    """One synthetic step of ``num_tokens`` through ``forward_step``; pools returned after."""
    if mode == ForwardMode.DECODE:
        lens, new = [DECODE_CONTEXT] * num_tokens, [1] * num_tokens
    else:
        lens = [PROMPT_TOKENS] * (num_tokens // PROMPT_TOKENS)
        lens += [num_tokens % PROMPT_TOKENS] if num_tokens % PROMPT_TOKENS else []
        new = lens
    rows = runner.req_to_token_pool.alloc(len(lens))
    # Decode sequences share their context's slots; every new token gets its own.
    shared = runner.token_to_kv_pool_allocator.alloc(max(lens) - max(new))
    out = runner.token_to_kv_pool_allocator.alloc(num_tokens)
    try:
        runner.forward_step(_batch(runner, mode, rows, lens, new, shared, out))
    finally:
        runner.req_to_token_pool.free(rows)
        runner.token_to_kv_pool_allocator.free(torch.cat((shared, out)))


def _batch(runner, mode, rows, lens, new, shared, out) -> ForwardBatch:
    device = runner.device
    positions, start = [], 0
    for row, total, n in zip(rows, lens, new):
        runner.req_to_token_pool.write(row, 0, shared[: total - n])
        runner.req_to_token_pool.write(row, total - n, out[start : start + n])
        positions += range(total - n, total)
        start += n
    vocab = runner.model_config.vocab_size
    generator = torch.Generator().manual_seed(len(positions))  # the same ids on every rank

    def ints(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    extend = {}
    if mode == ForwardMode.EXTEND:
        extend = dict(extend_prefix_lens_cpu=[0] * len(rows), extend_seq_lens_cpu=list(new))
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=torch.randint(vocab, (len(positions),), generator=generator).to(device),
        positions=ints(positions),
        req_pool_indices=ints(rows),
        seq_lens=ints(lens),
        seq_lens_cpu=list(lens),
        out_cache_loc=out,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.token_to_kv_pool,
        **extend,
    )
