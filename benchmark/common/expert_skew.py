"""Routers whose expert popularity follows a power law, for the expert-parallel load balancing
benchmarks (``make_random_model.py --expert-skew S``), and the measurement of how tokens are
routed in a checkpoint.

With skew ``S``, the expert of popularity rank ``r`` in a MoE layer is meant to receive a share
of the routed tokens proportional to ``1 / r**S``; which expert holds which rank is a seeded
permutation drawn per layer. A token takes an expert at most once, so no expert can take more
than ``1 / top_k`` of the routed tokens: a hot expert the law would give more is held at that
and its excess goes to the others in proportion (``power_law_shares``).

How the routers get there. Random routers route about evenly: an expert's mean logit over the
tokens is its router row times the mean hidden state, and random embeddings leave that mean
near zero. So the skew is fitted, layer after layer, to the hidden states HF transformers'
forward gives on random token ids (layer ``l`` sees the routing already fitted before it): one
offset per expert, added to the scores the choice ranks, moved until the shares the router
gives on those tokens match the target.

- DeepSeek-V3 routers choose by sigmoid score plus ``e_score_correction_bias``: the offsets go
  into that bias, which the choice alone reads (the combine weights stay the router's scores).
  Their choice is group-limited (a token's experts come from ``topk_group`` of the ``n_group``
  groups), which cannot follow the law once the experts that nearly every token takes sit in
  more groups than a token may use; so there the popularity ranks fill one group after
  another (the groups, and the places within a group, in seeded random order).
- Qwen3-MoE routers have no bias, so the offset must come from the weight times a component
  every token shares. Random embeddings give none worth the name (what a few hundred tokens'
  mean shows is mostly their sampling noise, and routing fitted on it does not carry over to
  other tokens), so with ``S > 0`` every embedding row also gets one shared random vector as
  large as a row itself, which the residual stream carries to every layer, as real models'
  hidden states carry a large common component. Router row ``i`` then gets ``b_i u``, with
  ``u`` along the layer's mean hidden state and scaled so that its product with that mean is 1.
  The shared vector also shifts the attention scores and the logits of the checkpoint; it is a
  benchmark's random model either way.

``measure_expert_shares`` runs a written checkpoint through HF transformers on token ids the
fit never saw and counts, per MoE layer, the tokens each expert receives.
"""

from __future__ import annotations

import math
import tempfile
import zlib
from pathlib import Path

import torch
from make_tiny_models import VOCAB_SIZE, _write_json, save_weights

FIT_STEPS = 200  # offset updates per layer; the shares settle well within them
FIT_RATE = 0.5  # per update: this times the scores' spread times log(target / measured share)
FIT_DECAY = 50  # the rate falls as 1 / (1 + update / FIT_DECAY), so the offsets settle
FIT_SEED, MEASURE_SEED = 1, 2  # the token ids of the fit and of the measurement differ
BATCH, SEQ_LEN = 4, 128  # 512 tokens per forward: a few seconds on the small presets
HOT_FRACTION = 0.1  # the "hottest 10 %" of the report


def power_law_shares(num_experts: int, top_k: int, skew: float) -> torch.Tensor:
    """Target share of the routed tokens for each popularity rank (rank 1 first), summing to 1:
    proportional to ``1 / rank**skew``, none above ``1 / top_k``."""
    weight = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -skew
    capped = torch.zeros(num_experts, dtype=torch.bool)
    while True:  # the capped ranks are a prefix: each round caps at least one more or ends
        free_share = 1 - capped.sum().item() / top_k
        shares = torch.where(capped, 1 / top_k, weight * free_share / weight[~capped].sum())
        over = (shares > 1 / top_k + 1e-12) & ~capped
        if not over.any():
            return shares
        capped |= over


def hottest_share(shares: torch.Tensor) -> float:
    """The share of one layer's routed tokens that its hottest ``HOT_FRACTION`` of experts (at
    least one) receive."""
    num_hot = math.ceil(HOT_FRACTION * shares.numel())
    return shares.sort(descending=True).values[:num_hot].sum().item()


def _random_ids(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=gen)


def _load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # as it is stored
    return model.eval()


def _routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer index, router) of each MoE layer, in order."""
    return [
        (i, layer.mlp.gate)
        for i, layer in enumerate(model.model.layers)
        if isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module)
    ]


def _counts_to_shares(chosen: torch.Tensor, router: torch.nn.Module) -> torch.Tensor:
    counts = torch.bincount(chosen.flatten(), minlength=router.weight.shape[0])
    return counts.double() / chosen.numel()


def _shares(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Share of the routed tokens each expert takes under ``router``'s own choice rule."""
    return _counts_to_shares(router(hidden)[2], router)


class _Captured(Exception):
    """Ends a forward once the router being fitted has seen its input."""


def _router_input(model, router: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    captured = []

    def hook(_module, args):
        captured.append(args[0].detach().reshape(-1, args[0].shape[-1]))
        raise _Captured

    handle = router.register_forward_pre_hook(hook)
    try:
        model(ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured[0]


def _fit_offsets(router, hidden, target: torch.Tensor, scale: float, apply) -> None:
    """Moves the per-expert offsets ``apply`` sets (added to scores whose spread over experts
    is about ``scale``) until ``router``'s shares on ``hidden`` match ``target``; leaves the
    best offsets seen applied."""
    floor = 0.25 / (hidden.shape[0] * router.top_k)  # a quarter token: as good as none
    offsets = torch.zeros_like(target)
    best, best_error = offsets, math.inf
    for step in range(FIT_STEPS):
        apply(offsets)
        shares = _shares(router, hidden)
        error = (shares - target).abs().sum().item()
        if error < best_error:
            best, best_error = offsets, error
        rate = FIT_RATE * scale / (1 + step / FIT_DECAY)
        offsets = offsets + rate * ((target + floor).log() - (shares + floor).log())
        offsets = offsets - offsets.mean()
    apply(best)


def _skew_router(router, hidden: torch.Tensor, target: torch.Tensor, uses_bias: bool) -> str:
    """Fits one router to ``target`` on its inputs ``hidden``; returns the name (after
    ``mlp.gate.``) of the parameter that changed."""
    logits = hidden @ router.weight.T
    if uses_bias:  # the choice adds the bias to the sigmoid scores
        bias = router.e_score_correction_bias.clone()

        def apply(offsets: torch.Tensor) -> None:
            router.e_score_correction_bias.copy_(bias + offsets)

        _fit_offsets(router, hidden, target, logits.sigmoid().std().item(), apply)
        return "e_score_correction_bias"
    weight, mean = router.weight.clone(), hidden.double().mean(0)
    direction = mean / mean.dot(mean)  # its product with the mean hidden state is 1

    def apply(offsets: torch.Tensor) -> None:
        router.weight.copy_(weight + offsets[:, None] * direction)

    _fit_offsets(router, hidden, target, logits.std().item(), apply)
    return "weight"


def _rank_order(cfg: dict, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """The experts in order of popularity rank: a seeded permutation, which with group-limited
    routing fills one group after another (see the module docstring)."""
    groups, used = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    if groups <= 1 or used >= groups:
        return torch.randperm(num_experts, generator=gen)
    size = num_experts // groups
    within = torch.stack([torch.randperm(size, generator=gen) for _ in range(groups)])
    return (torch.randperm(groups, generator=gen)[:, None] * size + within).flatten()


def skew_routers(
    tensors: dict[str, torch.Tensor], cfg: dict, skew: float, name: str, scratch: Path
) -> None:
    """Fits the routers of the checkpoint ``tensors`` (with its ``cfg``) in place to skew
    ``skew`` > 0 as the module docstring says; ``name`` seeds the popularity ranks. HF
    transformers loads the checkpoint from a directory made and removed under ``scratch``."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/expert-skew".encode()))
    embed = tensors["model.embed_tokens.weight"]
    uses_bias = cfg.get("topk_method") == "noaux_tc"
    if not uses_bias:
        shared = torch.randn(embed.shape[1], generator=gen, dtype=torch.float32)
        tensors["model.embed_tokens.weight"] = embed + shared.to(embed.dtype)
    ids = _random_ids(FIT_SEED)
    with tempfile.TemporaryDirectory(dir=scratch) as model_dir, torch.no_grad():
        save_weights(tensors, Path(model_dir), num_shards=1)
        _write_json(Path(model_dir) / "config.json", cfg)
        model = _load_hf(model_dir)
        for layer, router in _routers(model):
            num_experts = router.weight.shape[0]
            target = torch.empty(num_experts, dtype=torch.float64)
            target[_rank_order(cfg, num_experts, gen)] = power_law_shares(
                num_experts, router.top_k, skew
            )
            hidden = _router_input(model, router, ids)
            changed = _skew_router(router, hidden, target, uses_bias)
            key = f"model.layers.{layer}.mlp.gate.{changed}"
            tensors[key] = getattr(router, changed).detach().to(tensors[key].dtype).clone()


def measure_expert_shares(model_dir: str) -> list[torch.Tensor]:
    """Per MoE layer, the share of the routed tokens each expert receives when HF transformers
    runs the checkpoint in ``model_dir`` on ``BATCH × SEQ_LEN`` random token ids (not those of
    the fit)."""
    model = _load_hf(model_dir)
    routers = _routers(model)
    chosen: dict[int, torch.Tensor] = {}

    def record(layer):
        def hook(_module, _args, output):
            chosen[layer] = output[2]  # the experts each token was routed to

        return hook

    handles = [router.register_forward_hook(record(layer)) for layer, router in routers]
    try:
        with torch.no_grad():
            model(_random_ids(MEASURE_SEED))
    finally:
        for handle in handles:
            handle.remove()
    return [_counts_to_shares(chosen[layer], router) for layer, router in routers]


def describe(skew: float, top_k: int, shares: list[torch.Tensor]) -> str:
    """One line: how much of the routed tokens the hottest 10 % of experts take, measured, by
    the law and if even."""
    num_experts = shares[0].numel()
    num_hot = math.ceil(HOT_FRACTION * num_experts)
    per_layer = [hottest_share(s) for s in shares]
    mean = sum(per_layer) / len(per_layer)
    law = hottest_share(power_law_shares(num_experts, top_k, skew))
    layers = ", ".join(f"{100 * s:.1f}" for s in per_layer)
    return (
        f"expert skew {skew:g}: the hottest {num_hot} of {num_experts} experts take "
        f"{100 * mean:.1f} % of the routed tokens (per MoE layer {layers} %; the law "
        f"{100 * law:.1f} %, even routing {100 * num_hot / num_experts:.1f} %), measured "
        f"through HF transformers on {BATCH * SEQ_LEN} random tokens"
    )
