"""Start-up validation of the parallel layout: every invalid combination fails before any rank
starts, with a message naming the flags (SGLang's rules)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from srt.server_args import ServerArgs


def args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", **kwargs)


DPA = dict(enable_dp_attention=True)
TWO_NODES = dict(nnodes=2, dist_init_addr="h:1")
TORCH = dict(moe_a2a_backend="torch")
LL = dict(moe_a2a_backend="torch", deepep_mode="low_latency")
INVALID = [
    (dict(tp_size=4, dp_size=3, **DPA), "--tp-size 4 must be divisible by --dp-size 3"),
    (dict(tp_size=3, **TWO_NODES), "--tp-size 3 must be divisible by --nnodes 2"),
    (dict(tp_size=4, dp_size=2, **TWO_NODES), "multi-node data parallelism needs --enable-dp"),
    (dict(tp_size=4, dp_size=2), "--dp-size 2 needs --enable-dp-attention"),
    (dict(tp_size=2, nnodes=2), "--nnodes > 1 needs --dist-init-addr"),
    (dict(tp_size=2, node_rank=2, **TWO_NODES), "--node-rank 2 must be in"),
    (dict(tp_size=2, nnodes=2, dist_init_addr="nohostport"), "expected HOST:PORT"),
    (dict(tp_size=2, enable_dp_lm_head=True), "--enable-dp-lm-head needs --enable-dp-attention"),
    (dict(tp_size=4, ep_size=2, **TORCH), "--ep-size must be --tp-size"),
    (dict(tp_size=4, ep_size=3), "--ep-size 3 must divide --tp-size 4"),
    (dict(dp_size=0), "--dp-size: must be"),
    (dict(tp_size=2, max_dispatch_tokens_per_rank=0, **TORCH), "--max-dispatch-tokens-per-rank"),
    (dict(tp_size=2, chunked_prefill_size=2048, **LL), "--chunked-prefill-size 2048 puts up to"),
    (dict(tp_size=2, max_running_requests=512, **LL), "--max-running-requests 512 puts up to"),
    (dict(tp_size=2, chunked_prefill_size=-1, **LL), "needs chunked prefill"),
    (dict(tp_size=2, moe_a2a_backend="deepep"), "deepep: srt has no DeepEP dispatcher"),
]


@pytest.mark.parametrize("kwargs, message", INVALID)
def test_invalid_layouts_are_refused(kwargs, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        args(**kwargs)


def test_resolved_layouts(caplog):
    with caplog.at_level(logging.WARNING):
        a = args(tp_size=2, dp_size=1, enable_dp_attention=True)
    assert not a.enable_dp_attention and "turned off" in caplog.text
    assert args(tp_size=4, moe_a2a_backend="torch").ep_size == 4  # a2a: experts over all ranks
    assert args(tp_size=4).ep_size == 1  # none: expert TP
    ok = args(tp_size=4, dp_size=2, enable_dp_attention=True, moe_a2a_backend="torch")
    assert (ok.parallel_config.attn_tp_size, ok.parallel_config.moe_ep_size) == (2, 4)
    small = args(
        tp_size=2, moe_a2a_backend="torch", deepep_mode="low_latency",
        chunked_prefill_size=256, max_running_requests=256,
    )  # fmt: skip
    assert small.max_dispatch_tokens_per_rank == 128  # 256 tokens over 2 attention-TP ranks
    # low_latency alone: the batch limits default to what fits the capacity
    derived = args(tp_size=4, dp_size=2, **DPA, **LL, max_dispatch_tokens_per_rank=64)
    assert (derived.chunked_prefill_size, derived.max_running_requests) == (128, 128)


def test_more_ranks_than_experts_is_refused(qwen3_moe_path):
    from srt.model_loader.config import ModelConfig

    a = ServerArgs(model_path=qwen3_moe_path, tp_size=16, dp_size=16, enable_dp_attention=True)
    with pytest.raises(ValueError, match="more ranks than experts"):
        a.check_against_model(ModelConfig.from_server_args(a).hf_config)


def test_layout_refused_at_launch_leaves_no_ipc_dir(qwen3_moe_path, monkeypatch, tmp_path):
    """The model check runs after the IPC directory is made: a refusal must remove it."""
    import tempfile

    import srt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ValueError, match="more ranks than experts"):
        srt.Engine(model_path=qwen3_moe_path, tp_size=16, dp_size=16, enable_dp_attention=True)
    assert list(tmp_path.iterdir()) == []


def test_launch_server_exits_naming_the_flag(qwen3_moe_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch_server", "--model-path", qwen3_moe_path, "--tp", "4",
         "--dp", "3", "--enable-dp-attention"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--tp-size 4 must be divisible by --dp-size 3" in proc.stderr


def test_shared_experts_must_split_over_all_ranks_without_all_to_all(deepseek_v3_path):
    from types import SimpleNamespace

    from srt.model_loader.config import ModelConfig

    # backend none with EP-sharded routed experts: they need no split of their intermediate
    # size, the shared experts still do (over all 4 ranks)
    a = ServerArgs(
        model_path=deepseek_v3_path, tp_size=4, dp_size=4, enable_dp_attention=True, ep_size=4
    )
    cfg = ModelConfig.from_server_args(a).hf_config
    odd = SimpleNamespace(**{**cfg.to_dict(), "moe_intermediate_size": 34, "n_shared_experts": 1})
    with pytest.raises(ValueError, match="shared experts' intermediate size"):
        a.check_against_model(odd)
    a2a = ServerArgs(model_path=deepseek_v3_path, tp_size=2, moe_a2a_backend="torch")
    a2a.check_against_model(SimpleNamespace(**{**vars(odd), "moe_intermediate_size": 33}))
