"""The CPU kernels' own team of threads (csrc/cpu_pool.c): a result does not depend on the
team's size, on a second thread calling while the team is busy (that call runs on OpenMP's
threads), or on the process being a fork of one whose team had started."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from srt.layers import cpu_kernels

if not cpu_kernels.available():
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)


def _call(x, panels, n, experts):
    """A GEMM and an experts call (bf16: widened and narrowed inside the region, with
    barriers between) on the calling thread."""
    w13, w2, ids, topk_w = experts
    return (
        cpu_kernels.panel_linear(x, panels, n),
        cpu_kernels.fused_experts(x, topk_w, ids, 0, w13, w2),
    )


def _inputs(rows=5):
    torch.manual_seed(0)
    p = cpu_kernels.panel_width()
    hidden, inter, n = 2 * p, p, 3 * p + 7
    x = torch.randn(rows, hidden).to(torch.bfloat16)
    panels = cpu_kernels.pack_panels(torch.randn(n, hidden).to(torch.bfloat16))
    w13 = cpu_kernels.pack_panels(torch.randn(4, 2 * inter, hidden).to(torch.bfloat16))
    w2 = cpu_kernels.pack_panels(torch.randn(4, hidden, inter).to(torch.bfloat16))
    ids, topk_w = torch.randint(0, 4, (rows, 2)), torch.rand(rows, 2)
    return x, panels, n, (w13, w2, ids, topk_w)


def _equal(a, b) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_any_team_size_gives_the_same_bits():
    args, threads = _inputs(70), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _call(*args)
        for size in (2, 3, 5):
            torch.set_num_threads(size)
            assert _equal(_call(*args), alone), size
    finally:
        torch.set_num_threads(threads)


def test_two_calling_threads_at_once():
    args = _inputs(9)
    expected, results, errors = _call(*args), [], []

    def run():
        try:
            for _ in range(200):
                results.append(_call(*args))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 400
    assert all(_equal(r, expected) for r in results)


def _child(args, queue):
    queue.put([t.tolist() for t in _call(*args)])


def test_a_forked_child_starts_its_own_team():
    args = _inputs(9)
    expected = _call(*args)  # the parent's team is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(args, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert all(torch.equal(torch.tensor(g, dtype=e.dtype), e) for g, e in zip(got, expected))
