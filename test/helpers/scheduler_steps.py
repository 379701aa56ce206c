"""Driving a Scheduler by hand in tests: requests in, steps, the batches it formed."""

from __future__ import annotations

from srt.managers.io_struct import TokenizedGenerateReqInput
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams


def tokenized(rid: str, ids: list[int], max_new_tokens: int = 8) -> TokenizedGenerateReqInput:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    params.normalize(None)
    return TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params)


def step(scheduler: Scheduler, finished: dict[str, dict]) -> None:
    for out in scheduler.step():
        for rid, reason in zip(out.rids, out.finished_reasons):
            if reason is not None:
                finished[rid] = reason


def record_batches(scheduler: Scheduler) -> tuple[dict, list]:
    """From now on, each batch's requests by rid and its (mode, extend lengths)."""
    reqs, shapes = {}, []
    get_next_batch = scheduler.get_next_batch

    def spy():
        batch = get_next_batch()
        if batch is not None:
            reqs.update((r.rid, r) for r in batch.reqs)
            shapes.append((batch.forward_mode.name, batch.extend_lens))
        return batch

    scheduler.get_next_batch = spy
    return reqs, shapes


def run_until_idle(scheduler: Scheduler, finished: dict | None = None) -> dict[str, dict]:
    finished = {} if finished is None else finished
    for _ in range(1000):
        step(scheduler, finished)
        if scheduler.is_idle():
            return finished
    raise AssertionError("scheduler did not become idle")
