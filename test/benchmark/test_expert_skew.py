"""``make_random_model.py --expert-skew S`` (``benchmark.common.expert_skew``): the default
checkpoint stays byte for byte what it was, skew concentrates the routing as the power law says
and grows with S, a negative S is refused, and srt serves a skewed checkpoint as HF transformers
runs it."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch
from helpers.model_driver import ModelDriver

from benchmark.common.expert_skew import hottest_share, measure_expert_shares, power_law_shares
from benchmark.offline import make_random_model
from benchmark.offline.make_random_model import make_mid_size_model
from srt.model_loader.weight_utils import iterate_safetensors

# sha256 over the sorted names and bytes of the small preset's tensors, as written before the
# flag existed: the benchmark figures of docs/benchmarks.md were measured on these weights.
SMALL_DIGEST = "130a2338bdbf4f9e3e73634c0bfa05b61ff3db67c6a3a3ea1c1ddf2bee15de52"


def _tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    return dict(iterate_safetensors(str(model_dir)))


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        h.update(key.encode())
        h.update(tensors[key].numpy().tobytes())
    return h.hexdigest()


def _hot(model_dir: str) -> list[float]:
    return [hottest_share(s) for s in measure_expert_shares(model_dir)]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict[float, str]:
    root = tmp_path_factory.mktemp("skew")
    return {
        s: make_mid_size_model(str(root / f"small-{s}"), "small", expert_skew=s)
        for s in (0, 0.5, 1.5)
    }


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> dict[float, str]:
    root = tmp_path_factory.mktemp("skew-dsv3")
    return {
        s: make_mid_size_model(str(root / f"dsv3-{s}"), "deepseek-v3", expert_skew=s)
        for s in (0, 1)
    }


def test_power_law_shares():
    shares = power_law_shares(16, 2, 1.0)
    assert shares.sum().item() == pytest.approx(1.0)
    assert (shares[:-1] > shares[1:]).all()
    assert shares[0] / shares[3] == pytest.approx(4.0)  # 1/r: rank 1 gets 4 times rank 4
    assert torch.allclose(power_law_shares(8, 2, 0.0), torch.full((8,), 1 / 8, dtype=torch.float64))
    capped = power_law_shares(12, 3, 3.0)  # rank 1 would take 83 %, more than 1/top_k
    assert capped[0].item() == pytest.approx(1 / 3) and capped.sum().item() == pytest.approx(1.0)
    assert (capped <= 1 / 3 + 1e-12).all()
    assert capped[2] / capped[3] == pytest.approx((4 / 3) ** 3)  # below the cap, the law holds


def test_default_checkpoint_unchanged(small, tmp_path):
    tensors = _tensors(small[0])
    assert _digest(tensors) == SMALL_DIGEST
    default = make_mid_size_model(str(tmp_path / "default"), "small")
    assert _digest(_tensors(default)) == SMALL_DIGEST


def test_skew_concentrates_routing_and_grows_with_s(small):
    hot = {s: _hot(path) for s, path in small.items()}
    means = [sum(hot[s]) / len(hot[s]) for s in (0, 0.5, 1.5)]
    assert means[0] < means[1] < means[2], means
    for s in (0.5, 1.5):  # every layer near the law, measured on tokens the fit never saw
        law = hottest_share(power_law_shares(12, 3, s))
        assert all(abs(h - law) < 0.05 for h in hot[s]), (s, hot[s], law)


def test_skew_changes_only_routers_and_embeddings(small):
    """A normal checkpoint: same names, shapes and dtypes; besides the routers only the
    embeddings change (the shared vector every token carries), and each layer's hottest expert
    is its own draw."""
    plain, skewed = _tensors(small[0]), _tensors(small[1.5])
    assert plain.keys() == skewed.keys()
    changed = {k for k in plain if not torch.equal(plain[k], skewed[k])}
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(3)}
    assert changed == routers | {"model.embed_tokens.weight"}
    assert all(
        skewed[k].shape == plain[k].shape and skewed[k].dtype == plain[k].dtype for k in plain
    )
    hottest = [int(s.argmax()) for s in measure_expert_shares(small[1.5])]
    assert len(set(hottest)) > 1, hottest


def test_deepseek_skew_moves_only_the_correction_bias(deepseek):
    a, b = _tensors(deepseek[0]), _tensors(deepseek[1])
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed == {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)}
    law = hottest_share(power_law_shares(16, 4, 1.0))
    hot, hot_plain = _hot(deepseek[1]), _hot(deepseek[0])
    assert max(hot_plain) < min(hot)
    assert all(abs(h - law) < 0.05 for h in hot), (hot, law)


def test_command_line_prints_the_measured_share(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cli"
    argv = ["make_random_model.py", "--preset", "small", "--out-dir", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--expert-skew", "1"])
    make_random_model.main()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("expert skew"))
    assert "the hottest 2 of 12 experts take" in line
    measured = float(line.split(" take ")[1].split(" %")[0]) / 100
    assert measured == pytest.approx(sum(_hot(str(out))) / 3, abs=1e-3)


@pytest.mark.parametrize("bad", ["-0.5", "nan", "inf"])
def test_bad_skew_refused(bad, tmp_path, monkeypatch, capsys):
    out = tmp_path / "bad"
    monkeypatch.setattr(
        sys, "argv", ["make_random_model.py", "--out-dir", str(out), "--expert-skew", bad]
    )
    with pytest.raises(SystemExit):
        make_random_model.main()
    assert "--expert-skew must be a finite number >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expert_skew must be a finite number >= 0"):
        make_mid_size_model(str(out), "small", expert_skew=float(bad))
    assert not out.exists()


@pytest.mark.parametrize("checkpoint", ["small", "deepseek"])
def test_srt_serves_a_skewed_checkpoint_as_hf_does(checkpoint, request):
    """srt's own routing (its top-k, DeepSeek-V3's grouped choice with the correction bias) on
    the skewed weights: prefill logits equal HF transformers'."""
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(checkpoint)[1.5 if checkpoint == "small" else 1]
    prompts = [[5, 77, 300, 12, 9, 401, 33, 2], [44, 45, 46, 200, 310, 7, 8, 9]]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor(prompts)).logits[:, -1]
    got = ModelDriver(path).prefill(prompts).float().cpu()
    diff = (torch.log_softmax(got, -1) - torch.log_softmax(want, -1)).abs().max().item()
    assert diff <= 1e-4, diff
