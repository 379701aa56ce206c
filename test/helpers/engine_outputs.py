"""Run prompts through ``srt.Engine`` and compare outputs with a reference run: shared by the
multi-rank end-to-end tests (TP, DP attention, multi-node)."""

from __future__ import annotations

from typing import Any

import srt

PROMPTS = [
    [5, 77, 300, 12, 9, 401, 33, 2, 18, 250, 90, 71, 6],
    [101],
    [44, 45, 46, 200, 310],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27],
]
PARAMS = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
TOLERANCE = 1e-4


def run_engine(
    path: str, prompts: list[list[int]] = PROMPTS, with_state: bool = False, **kwargs: Any
) -> Any:
    """Greedy outputs with fp32 logprobs of every position; with ``with_state`` also the
    internal states of the DP groups after the run."""
    kwargs = {"dtype": "float32", "max_total_tokens": 1024, **kwargs}
    engine = srt.Engine(model_path=path, **kwargs)
    try:
        outputs = engine.generate(
            input_ids=prompts, sampling_params=PARAMS, return_logprob=True, logprob_start_len=0
        )
        if with_state:
            return outputs, engine.get_server_info()["internal_states"]
        return outputs
    finally:
        engine.shutdown()


def assert_same_outputs(
    ours: list[dict], reference: list[dict], tolerance: float = TOLERANCE
) -> None:
    assert len(ours) == len(reference)
    for i, (out, ref) in enumerate(zip(ours, reference)):
        assert out["output_ids"] == ref["output_ids"], f"prompt {i}"
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, want = out["meta_info"][key], ref["meta_info"][key]
            assert [t[1] for t in got] == [t[1] for t in want], f"prompt {i} {key}"
            for (lp, token, _), (ref_lp, _, _) in zip(got, want):
                if ref_lp is None:
                    assert lp is None
                    continue
                assert abs(lp - ref_lp) <= tolerance, f"prompt {i} {key} token {token}"
