"""Next-token sampling from logits, and logprob helpers."""

from __future__ import annotations

import torch

from srt.sampling.sampling_batch_info import SamplingBatchInfo


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one request's `sampling_seed`; it must live on the logits' device."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler(torch.nn.Module):
    def __init__(self, random_seed: int = 0):
        super().__init__()
        self.random_seed = random_seed
        # One generator per device for rows without a seed, made on first use.
        self._generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits [B, V] float32 (left unchanged) -> next token ids [B] int64."""
        if info.has_penalties:
            logits = logits.clone()
            info.apply_penalties_(logits)
        greedy_ids = logits.argmax(dim=-1)
        if info.is_all_greedy:
            return greedy_ids
        probs = torch.softmax(logits / info.temperatures, dim=-1)  # [B, V]
        if info.need_top_p_top_k:
            probs = _top_k_top_p(probs, info.top_ks, info.top_ps)
        if info.need_min_p:
            probs = _min_p(probs, info.min_ps)
        sampled = self._multinomial(probs, info.generators)
        # Greedy rows in a mixed batch: exactly the argmax, whatever ties or rounding do.
        return torch.where(info.top_ks == 1, greedy_ids, sampled)

    def _multinomial(
        self, probs: torch.Tensor, generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """One draw per row (probs need not sum to 1). A row with its own generator draws alone
        with it, so its tokens do not depend on the rest of the batch."""
        out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        shared = [i for i, g in enumerate(generators) if g is None]
        if shared:
            index = torch.tensor(shared, dtype=torch.int64, device=probs.device)
            generator = self._shared_generator(probs.device)
            out[index] = torch.multinomial(probs[index], 1, generator=generator).squeeze(1)
        for i, generator in enumerate(generators):
            if generator is not None:
                out[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
        return out

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = make_generator(self.random_seed, device)
        return self._generators[device]


def _top_k_top_p(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, then outside the smallest set of the
    remaining (renormalised) tokens whose cumulative probability reaches top_p. Kept entries
    keep their exact values, so a row without top-k/top-p samples the same in any batch."""
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    sorted_probs = sorted_probs.masked_fill(ranks >= top_ks.unsqueeze(1), 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep a token if the tokens ranked above it do not reach top_p of the top-k mass yet; the
    # top token always stays. top_p == 1 keeps everything, whatever the rounding.
    mass_before = (cumulative - sorted_probs) / cumulative[:, -1:]
    drop = (mass_before >= top_ps.unsqueeze(1)) & (top_ps.unsqueeze(1) < 1.0)
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, sorted_ids, sorted_probs)


def _min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Zero the tokens less likely than min_p times the row's most likely token."""
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def get_token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """logits [N, V] (raw model logits), token_ids [N] -> logprob of each token [N] float32."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(-1, token_ids.long().unsqueeze(1)).squeeze(1)


def get_top_logprobs(logits: torch.Tensor, nums: list[int]) -> list[tuple[list[float], list[int]]]:
    """Per row i, the `nums[i]` largest logprobs (descending) and their token ids."""
    max_num = min(max(nums, default=0), logits.shape[-1])
    if max_num <= 0:
        return [([], []) for _ in nums]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(max_num, dim=-1)
    values_list, ids_list = values.tolist(), ids.tolist()
    return [(values_list[i][:n], ids_list[i][:n]) for i, n in enumerate(nums)]
