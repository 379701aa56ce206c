"""What the GPU check's two programs (``gpu_parity.py``, ``gpu_report.py``) share: headed
sections of which one that fails does not stop the others (``Report``), a runner built from
server flags (``new_runner``) and given back (``release``), and the check that a variant's mode
really ran (``check_ran_as_asked``)."""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from collections.abc import Iterator

import torch

from benchmark.common.static_batch import make_runner
from srt.server_args import ServerArgs

# Two-batch overlap on one rank, forced on every step: what the checks' "tbo" variants run.
TBO_FLAGS = {
    "moe_a2a_backend": "torch",
    "enable_two_batch_overlap": True,
    # forced: every batch splits, however small
    "tbo_decode_token_threshold": 0,
    "tbo_prefill_token_threshold": 0,
}


class CheckFailed(AssertionError):
    """A figure was measured and is wrong (as opposed to a section that crashed)."""


class Report:
    """Headed sections; one that raises is reported FAIL and the run goes on."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    @contextlib.contextmanager
    def section(self, title: str) -> Iterator[None]:
        print(f"\n=== {title} ===", flush=True)
        start = time.perf_counter()
        try:
            yield
        except Exception as e:  # report it, run the next section
            if not isinstance(e, CheckFailed):
                traceback.print_exc(limit=-4)  # the frames that say where
            print(f"FAIL {title}: {type(e).__name__}: {e}", flush=True)
            self.failed.append(title)
        else:
            print(f"--- {title}: {time.perf_counter() - start:.1f} s", flush=True)

    def exit_status(self) -> int:
        print("\nfailed: " + (", ".join(self.failed) if self.failed else "none"), flush=True)
        return 1 if self.failed else 0


def release() -> None:
    """Give the memory of objects the caller just dropped back to the device (runners hold
    reference cycles), so that the next runner's KV budget, sized from free memory, sees it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def new_runner(model_path: str, device: str, dtype: str, max_bs: int, max_tokens: int, **flags):
    """``make_runner``'s runner and batch context, with ``flags`` as server flags
    (``cuda_graph_bs`` dropped off CUDA, where ServerArgs refuses it)."""
    if device != "cuda":
        flags.pop("cuda_graph_bs", None)
    server_args = ServerArgs(
        model_path=model_path,
        device=device,
        dtype=dtype,
        max_running_requests=max_bs,
        max_total_tokens=max_tokens,
        **flags,
    )
    return make_runner(server_args, max_bs, max_tokens)


def check_ran_as_asked(runner, variant: str) -> None:
    """The variant's mode really ran: split steps, SBO steps, decode from the graphs."""
    counts = runner.step_counts
    if variant.startswith("tbo") and not any(overlap == "tbo" for overlap, _ in counts):
        raise CheckFailed(f"no step ran split: {dict(counts)}")
    if variant == "sbo" and not any(overlap == "sbo" for overlap, _ in counts):
        raise CheckFailed(f"no step ran single-batch overlap: {dict(counts)}")
    if runner.device.type != "cuda" or "graphs" not in variant:
        return
    if runner.graph_runner is None:
        raise CheckFailed("no CUDA graphs were captured")
    if not runner.graph_runner.num_replays:
        raise CheckFailed("no decode step replayed a CUDA graph")
