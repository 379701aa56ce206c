"""ForwardMode and ForwardBatch: the tensors one model forward needs.

The batch is passed explicitly through the model (no global "current batch"), because TBO keeps
two micro-batches alive at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from srt.layers.attention.base_attn_backend import AttentionBackend
    from srt.layers.dp_attention import DpPaddingMode
    from srt.mem_cache.memory_pool import KVCache, ReqToTokenPool
    from srt.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly with a cached prefix or as a chunk
    DECODE = auto()  # one new token per sequence
    MIXED = auto()  # extend and decode sequences in one batch
    IDLE = auto()  # no sequences: a rank without work joins the collectives
    TARGET_VERIFY = auto()  # speculative decoding: verify draft tokens

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


SPLIT_MODES = ("tbo", "dbo")  # the overlaps that run a step as two micro-batches


@dataclass(frozen=True)
class StepSplit:
    """How one step overlaps its communication, and where its batch splits: the one value the
    planner proposes (``srt.batch_overlap.step_split.plan_split``), the DP sync agrees on,
    ``StepOverlap`` settles, and the runner, the graph runner, the model and the executors read.

    ``mode``: "off", "sbo" (one batch), or "tbo" / "dbo" (two micro-batches). A split mode
    also says where: ``seq_index``, the first sequence of micro-batch B (with a cut, the
    sequence that is cut), ``token_index``, its first token, and under DP attention
    ``group_tokens``, every group's micro-batch A tokens. A micro-batch carries its parent's
    mode with no split point (``child``)."""

    mode: str = "off"
    seq_index: int = 0
    token_index: int = 0
    group_tokens: tuple[int, ...] | None = None

    @property
    def is_split(self) -> bool:
        return self.mode in SPLIT_MODES

    def child(self) -> StepSplit:
        return StepSplit(self.mode)


NO_SPLIT = StepSplit()


@dataclass
class ForwardBatch:
    """Device tensors of one forward pass.

    Token-level fields have one row per token of the batch (extend: the new tokens of every
    sequence, concatenated; decode: one per sequence). Sequence-level fields have one row per
    sequence. ``*_cpu`` fields are Python lists mirroring device tensors, for bookkeeping that
    must not synchronise the device.

    The ``global_*`` fields are set by the DP-attention MLP sync (``srt.model_executor.dp_sync``).
    They stay None without DP attention: every rank then runs the same batch, so the local
    values are the global ones (``global_is_extend``, ``global_num_tokens``).
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [B] int64, total length (prefix + new) after this step
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor  # [T] int64, KV slots the new tokens are written to
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVCache
    attn_backend: AttentionBackend | None = None
    # Extend only: per sequence, tokens already cached and tokens computed now.
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens_cpu: list[int] | None = None
    # Logprobs: for extend, the first position (relative to the new tokens) whose logits are
    # needed for input logprobs; len == B. None means only the last token's logits.
    return_logprob: bool = False
    extend_logprob_start_lens_cpu: list[int] | None = None
    sampling_info: SamplingBatchInfo | None = None
    # Attention-backend private metadata, set by init_forward_metadata.
    attn_metadata: Any = None
    # DP attention: per attention-DP group, its tokens and its LM-head rows; the agreed mode.
    global_num_tokens_cpu: list[int] | None = None
    global_num_tokens_for_logprob_cpu: list[int] | None = None
    global_forward_mode: ForwardMode | None = None
    is_extend_in_batch: bool = False
    dp_padding_mode: DpPaddingMode | None = None
    global_dp_buffer_len: int | None = None
    # The step's overlap and split (the same mode on every rank, idle ones too). A split
    # step's parent holds its two micro-batches once built (TBO interleaves their operations,
    # DBO runs each in a thread); a micro-batch holds its index (0 = A, 1 = B) and its token
    # range in the parent.
    split: StepSplit = NO_SPLIT
    tbo_children: list[ForwardBatch] | None = None
    tbo_subbatch_index: int | None = None
    tbo_parent_token_range: tuple[int, int] | None = None
    # MLA: an extend batch attending in two parts (``mla_attention_parts``), each with its
    # attention metadata; None when the batch attends as one.
    attn_parts: tuple[AttnPart, ...] | None = None

    @classmethod
    def idle(
        cls, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: KVCache, device: torch.device
    ) -> ForwardBatch:
        """No sequences and no tokens: a rank without work runs it so collectives line up."""
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return cls(
            forward_mode=ForwardMode.IDLE,
            batch_size=0,
            input_ids=empty,
            positions=empty,
            req_pool_indices=empty,
            seq_lens=empty,
            seq_lens_cpu=[],
            out_cache_loc=empty,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def global_is_extend(self) -> bool:
        """Whether any DP group extends: collectives whose kind depends on the mode (the MoE
        all-to-all) must follow it on every rank, idle ones included."""
        mode = self.forward_mode if self.global_forward_mode is None else self.global_forward_mode
        return mode.is_extend()

    def global_num_tokens(self) -> list[int]:
        """Tokens per attention-DP group (this batch's alone without DP attention)."""
        if self.global_num_tokens_cpu is None:
            return [self.num_tokens]
        return self.global_num_tokens_cpu

    @property
    def device(self) -> torch.device:
        return self.input_ids.device


class AttnPart(NamedTuple):
    """Token rows ``[start, end)`` of a batch that attend one way: ``batch``, the part as a
    batch of its own (with its own attention metadata), and for MLA whether it attends
    ``absorbed`` (MQA over the cached latent) or expands per-head keys and values."""

    batch: ForwardBatch
    start: int
    end: int
    absorbed: bool


def mla_attention_parts(
    batch: ForwardBatch, absorbed_extend: bool, split: bool = True
) -> tuple[AttnPart, ...]:
    """MLA's attention form, decided here only. Decode attends absorbed, and so does extend on
    a backend that reads the latent in place (``absorbed_extend``). Otherwise extend expands
    per-head keys, except (``split``) its trailing run of one-token sequences after a prefix:
    in a MIXED batch the running requests decoding in it, else prompts that the radix cache
    holds but for one token. Such a row attends exactly as a decode step does, so that run
    becomes a DECODE part attending absorbed, rather than expanding its whole history, and the
    sequences before it (if any) an EXTEND part."""
    expands = batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED)
    whole = AttnPart(batch, 0, batch.num_tokens, absorbed_extend or not expands)
    if whole.absorbed or not split:
        return (whole,)
    prefix, new = batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu
    first = batch.batch_size
    while first > 0 and new[first - 1] == 1 and prefix[first - 1] > 0:
        first -= 1
    if first == batch.batch_size:
        return (whole,)
    token = sum(new[:first])
    decode = slice_forward_batch(
        batch, ForwardMode.DECODE, (token, batch.num_tokens), (first, batch.batch_size),
        attn_backend=batch.attn_backend,
    )  # fmt: skip
    parts = (AttnPart(decode, token, batch.num_tokens, True),)
    if not first:
        return parts
    extend = slice_forward_batch(
        batch, ForwardMode.EXTEND, (0, token), (0, first),
        attn_backend=batch.attn_backend,
        extend_prefix_lens_cpu=prefix[:first], extend_seq_lens_cpu=new[:first],
    )  # fmt: skip
    return (AttnPart(extend, 0, token, False), *parts)


def slice_forward_batch(
    batch: ForwardBatch, mode: ForwardMode, tokens: tuple[int, int], seqs: tuple[int, int], **fields
) -> ForwardBatch:
    """The sequences ``seqs`` of ``batch`` (its token rows ``tokens``) as a batch of their own:
    views of the parent's tensors (so a CUDA graph captured on the parent's buffers serves it
    too); ``fields`` set the rest or override these."""
    (t0, t1), (s0, s1) = tokens, seqs
    part = dict(
        forward_mode=mode,
        batch_size=s1 - s0,
        input_ids=batch.input_ids[t0:t1],
        positions=batch.positions[t0:t1],
        req_pool_indices=batch.req_pool_indices[s0:s1],
        seq_lens=batch.seq_lens[s0:s1],
        seq_lens_cpu=list(batch.seq_lens_cpu[s0:s1]),
        out_cache_loc=batch.out_cache_loc[t0:t1],
        req_to_token_pool=batch.req_to_token_pool,
        token_to_kv_pool=batch.token_to_kv_pool,
    )
    return ForwardBatch(**(part | fields))
