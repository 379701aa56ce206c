"""The DBO thread executor on CUDA (skipped without a GPU): each micro-batch's thread runs on
its own stream, forked from the caller's and joined back; a receive hook left for the other
thread makes the owner's stream wait (not the other's); the host-sync guard holds in the
threads; results equal the plain run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srt.batch_overlap.ubatching import UBatchWrapper
from srt.layers.overlap.ubatch_context import (
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
)
from srt.utils.sync_guard import forbid_host_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class ToyExchangeModel:
    """Per layer: a matmul, then an "exchange" on a side stream (a scaled copy) handed over as
    the dispatchers do, then the sum."""

    def __init__(self, layers: int = 4, hidden: int = 512):
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.weights = [
            torch.randn(hidden, hidden, device="cuda", generator=gen) / hidden**0.5
            for _ in range(layers)
        ]
        self.streams: dict[int, torch.cuda.Stream] = {}

    def __call__(self, input_ids, positions, batch):
        self.streams[batch.index] = torch.cuda.current_stream()
        x = batch.x
        for w in self.weights:
            x = torch.tanh(x @ w)
            dbo_maybe_run_recv_hook()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y = x * 0.5
            dbo_register_recv_hook(lambda side=side: torch.cuda.current_stream().wait_stream(side))
            dbo_yield()
            torch.cuda.current_stream().wait_stream(side)
            x = x + y
        return x


def make_batch(index: int, rows: int) -> SimpleNamespace:
    gen = torch.Generator(device="cuda").manual_seed(index + 1)
    x = torch.randn(rows, 512, device="cuda", generator=gen)
    ids = torch.zeros(rows, dtype=torch.int64, device="cuda")
    return SimpleNamespace(input_ids=ids, positions=ids, x=x, index=index)


def test_streams_hooks_and_results():
    model = ToyExchangeModel()
    batches = [make_batch(0, 64), make_batch(1, 48)]
    plain = [model(b.input_ids, b.positions, b) for b in batches]
    main = torch.cuda.current_stream()
    wrapper = UBatchWrapper(model)
    with torch.inference_mode(), forbid_host_sync("cuda"):
        outs = wrapper.run(batches)
    torch.cuda.synchronize()
    for got, want in zip(outs, plain):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    streams = [model.streams[0], model.streams[1]]
    assert main not in streams and streams[0] != streams[1]
    assert wrapper.num_yields == 2 * len(model.weights)
    wrapper.close()
