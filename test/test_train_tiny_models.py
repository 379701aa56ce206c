"""launch/train_tiny_models.py: the per-layer balancing loss, and a few training steps of each
bundled architecture (the committed checkpoints themselves: test/models/test_trained_models.py)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from train_tiny_models import MODEL_NAMES, balancing_loss, train_and_save

EXPERTS, TOP_K, TOKENS = 8, 2, 64


def _routed_to(experts: list[int], tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits that send every token to ``experts`` (one pair per token), and the picks."""
    logits = torch.zeros(tokens, EXPERTS)
    picks = torch.tensor([experts[2 * (t % (len(experts) // 2)) :][:2] for t in range(tokens)])
    logits.scatter_(1, picks, 4.0)
    return logits, picks


def test_balanced_routing_costs_one() -> None:
    logits, picks = _routed_to(list(range(EXPERTS)))
    loss = balancing_loss([logits], [picks], torch.ones(TOKENS))
    assert loss.item() == pytest.approx(1.0, abs=1e-6)


def test_each_layer_is_balanced_on_its_own() -> None:
    """Two layers that each use two experts (different ones) cost twice what a loss pooled over
    the layers charges them: pooling hides a layer that ignores most of its experts."""
    first, second = _routed_to([0, 1]), _routed_to([2, 3])
    mask = torch.ones(TOKENS)
    per_layer = balancing_loss([first[0], second[0]], [first[1], second[1]], mask)
    pooled = balancing_loss(
        [torch.cat([first[0], second[0]])], [torch.cat([first[1], second[1]])], mask.repeat(2)
    )
    assert per_layer.item() > 1.9 * pooled.item()
    assert per_layer.item() > 3.5  # 8 experts, two of them with every pick


def test_padding_does_not_count() -> None:
    logits, picks = _routed_to(list(range(EXPERTS)))
    pad_logits, pad_picks = _routed_to([0, 1], tokens=16)
    mask = torch.cat([torch.ones(TOKENS), torch.zeros(16)])
    loss = balancing_loss([torch.cat([logits, pad_logits])], [torch.cat([picks, pad_picks])], mask)
    assert loss.item() == pytest.approx(1.0, abs=1e-6)


def test_balancing_loss_has_a_gradient_toward_balance() -> None:
    """A step against the gradient lowers the router probability of the overloaded experts."""
    logits, picks = _routed_to([0, 1])
    logits.requires_grad_(True)
    balancing_loss([logits], [picks], torch.ones(TOKENS)).backward()
    assert (logits.grad[:, :2] > 0).all() and (logits.grad[:, 2:] < 0).all()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_few_steps_write_a_checkpoint_and_its_log(name: str, tmp_path) -> None:
    args = argparse.Namespace(
        out_dir=str(tmp_path), steps=3, batch_size=4, lr=3e-3, seed=0, threads=1, plot=None
    )
    _, log = train_and_save(name, args)
    saved = json.loads((tmp_path / name / "training_log.json").read_text())
    assert saved["steps"] == [0, 1, 2] and len(saved["loss"]) == 3
    assert set(saved["held_out_accuracy"]) == {"plain", "chat"}
    config = json.loads((tmp_path / name / "config.json").read_text())
    moe_layers = config["num_hidden_layers"] - config.get("first_k_dense_replace", 0)
    assert len(saved["expert_share"]) == moe_layers
    for shares in saved["expert_share"]:
        assert len(shares) == 8 and sum(shares) == pytest.approx(1.0, abs=1e-3)
    assert log == saved
