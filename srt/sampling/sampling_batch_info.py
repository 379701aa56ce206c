"""The sampling parameters of one batch as tensors, rebuilt by the scheduler every step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from srt.constrained.grammar import RequestGrammar, apply_bitmask_, batch_bitmask
from srt.sampling import penalties
from srt.sampling.sampling_params import SamplingParams
from srt.utils.host_to_device import host_lists_to_device


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [B, 1] float32; 1.0 on greedy rows
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64; vocab_size for "no top-k", 1 on greedy rows
    min_ps: torch.Tensor  # [B] float32
    is_all_greedy: bool
    need_min_p: bool  # some non-greedy row has min_p > 0
    need_top_p_top_k: bool  # some non-greedy row has top_p < 1 or top_k < vocab_size
    generators: list[torch.Generator | None]  # per row; None: the sampler's own generator
    vocab_size: int
    # Penalties: None when no row of the batch uses them.
    frequency_penalties: torch.Tensor | None = None  # [B, 1]
    presence_penalties: torch.Tensor | None = None  # [B, 1]
    output_counts: torch.Tensor | None = None  # [B, V] float32, occurrences in the output
    repetition_scales: torch.Tensor | None = None  # [B, V] penalty on seen tokens, else 1
    min_tokens_block: torch.Tensor | None = None  # [2, K] (row, token) pairs set to -inf
    logit_bias: torch.Tensor | None = None  # [B, V] float32 added to the logits
    vocab_mask: torch.Tensor | None = None  # [B, ceil(V / 32)] int32 bitmask of allowed tokens

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        input_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[set[int]],
        vocab_size: int,
        device: torch.device | str,
        grammars: Sequence[RequestGrammar | None] | None = None,
    ) -> SamplingBatchInfo:
        """One row per request; the lists are parallel and hold the request's prompt ids,
        the ids generated so far, its generator (from `sampling_seed`), its eos ids and its
        grammar (None: unconstrained)."""
        info = cls._sampling_fields(params, list(generators), vocab_size, device)
        info._init_frequency_presence(params, output_ids, device)
        info._init_repetition(params, output_ids, input_ids, device)
        info._init_min_tokens_block(params, output_ids, eos_token_ids, device)
        info._init_logit_bias(params, device)
        if grammars is not None:
            info.vocab_mask = batch_bitmask(list(grammars), vocab_size)
        return info

    @classmethod
    def _sampling_fields(
        cls,
        params: Sequence[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatchInfo:
        greedy = [p.is_greedy for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_ks = [1 if g else _top_k(p.top_k, vocab_size) for p, g in zip(params, greedy)]
        sampled = [(p, k) for p, k, g in zip(params, top_ks, greedy) if not g]
        floats = [temps, [p.top_p for p in params], [p.min_p for p in params]]
        temperatures, top_ps, min_ps = host_lists_to_device(floats, torch.float32, device)
        return cls(
            temperatures=temperatures.unsqueeze(1),
            top_ps=top_ps,
            top_ks=torch.tensor(top_ks, dtype=torch.int64).to(device, non_blocking=True),
            min_ps=min_ps,
            is_all_greedy=all(greedy),
            need_min_p=any(p.min_p > 0.0 for p, _ in sampled),
            need_top_p_top_k=any(p.top_p < 1.0 or k < vocab_size for p, k in sampled),
            generators=generators,
            vocab_size=vocab_size,
        )

    def _init_frequency_presence(
        self,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        used = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
        if not any(used):
            return
        freq = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        self.frequency_penalties = _column(freq, device)
        self.presence_penalties = _column(presence, device)
        tokens = [out if u else () for out, u in zip(output_ids, used)]
        self.output_counts = penalties.token_counts(tokens, self.vocab_size, device)

    def _init_repetition(
        self,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        input_ids: Sequence[Sequence[int]],
        device: torch.device | str,
    ) -> None:
        used = [p.repetition_penalty != 1.0 for p in params]
        if not any(used):
            return
        # HF/SGLang: the prompt counts as seen, not only the generated tokens.
        tokens = [[*inp, *out] if u else () for inp, out, u in zip(input_ids, output_ids, used)]
        values = [p.repetition_penalty for p in params]
        self.repetition_scales = penalties.repetition_scales(
            tokens, values, self.vocab_size, device
        )

    def _init_min_tokens_block(
        self,
        params: Sequence[SamplingParams],
        output_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[set[int]],
        device: torch.device | str,
    ) -> None:
        blocked: list[list[int]] = []
        for p, out, eos in zip(params, output_ids, eos_token_ids):
            if len(out) >= p.min_new_tokens:
                blocked.append([])
                continue
            ids = set(p.stop_token_ids or ())
            if not p.ignore_eos:
                ids |= set(eos)
            blocked.append(sorted(ids))
        if any(blocked):
            self.min_tokens_block = penalties.block_index(blocked, self.vocab_size, device)

    def _init_logit_bias(self, params: Sequence[SamplingParams], device: torch.device | str):
        if not any(p.logit_bias for p in params):
            return
        self.logit_bias = torch.zeros(len(params), self.vocab_size, device=device)
        for row, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                self.logit_bias[row, int(token)] = bias

    @property
    def has_penalties(self) -> bool:
        return (
            self.output_counts is not None
            or self.repetition_scales is not None
            or self.min_tokens_block is not None
            or self.logit_bias is not None
            or self.vocab_mask is not None
        )

    def apply_penalties_(self, logits: torch.Tensor) -> None:
        """Apply every penalty to `logits` [B, V] in place. Order as vLLM: repetition scaling,
        then frequency and presence subtraction, then the logit bias, then the
        min_new_tokens block, then the grammars' masks."""
        if self.repetition_scales is not None:
            penalties.apply_repetition_(logits, self.repetition_scales)
        if self.output_counts is not None:
            penalties.apply_frequency_presence_(
                logits, self.output_counts, self.frequency_penalties, self.presence_penalties
            )
        if self.logit_bias is not None:
            logits += self.logit_bias
        if self.min_tokens_block is not None:
            penalties.apply_block_(logits, self.min_tokens_block)
        if self.vocab_mask is not None:
            apply_bitmask_(logits, self.vocab_mask)


def _top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k < 0 else min(top_k, vocab_size)


def _column(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
