"""Token dispatcher interface: move tokens to the ranks owning their experts and back."""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import torch

from srt.layers.overlap.ubatch_context import (
    dbo_register_recv_hook,
    dbo_yield,
)


class DispatchOutput(NamedTuple):
    hidden_states: torch.Tensor  # [T_recv, H] tokens this rank's experts must process
    topk_weights: torch.Tensor  # [T_recv, topk]
    topk_ids: torch.Tensor  # [T_recv, topk], global ids (other ranks' experts are skipped)


_T = TypeVar("_T")


class CommMeter:
    """Host seconds a model spends in its dispatchers' calls, and the bytes of the rows they
    bring in (dispatch) and send back (combine), while ``enabled`` (``--overlap-mode auto``
    measures each step's all-to-all with it). On CPU the calls block on the wire, so their time
    is the all-to-all's exposed time; on CUDA they only enqueue (read the bytes there)."""

    def __init__(self) -> None:
        self.enabled = False
        self.seconds = 0.0
        self.bytes = 0

    def timed(self, call: Callable[..., _T], *args) -> _T:
        if not self.enabled:
            return call(*args)
        start = time.perf_counter()
        out = call(*args)
        self.seconds += time.perf_counter() - start
        return out

    def take(self) -> tuple[float, int]:
        """The seconds and bytes since the last ``take``."""
        out, self.seconds, self.bytes = (self.seconds, self.bytes), 0.0, 0
        return out


class TokenDispatcher(abc.ABC):
    """Every dispatcher splits each direction in a launch half (``_a``: start the exchange,
    return at once) and a wait half (``_b``: block until it is done), so the overlap
    executors can run other work in between. One instance serves one micro-batch.

    ``dispatch_a``'s keyword arguments describe the step, identically on every EP rank, for
    dispatchers that choose their collectives per step (``auto``); the others ignore them:
    ``is_extend``, whether any DP group extends; ``global_max_tokens``, the most tokens any EP
    rank dispatches in this step; ``blocked_combine``, whether this dispatch's combine goes
    back block by block (single-batch overlap; None: whenever the dispatcher has a blocked
    combine, True where it has none is an error).

    Dual-batch overlap (``srt.layers.overlap.ubatch_context``, vLLM's schedule): each ``_a`` first
    runs the receive hook the other micro-batch left (``dbo_maybe_run_recv_hook``), then
    sends; each ``_b`` first hands over (``_hand_over``): it leaves the wait for its exchange
    to the other micro-batch and yields, then receives. The calls do nothing outside DBO."""

    @abc.abstractmethod
    def dispatch_a(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        is_extend: bool | None = None,
        global_max_tokens: int | None = None,
        blocked_combine: bool | None = None,
    ) -> None: ...

    @abc.abstractmethod
    def dispatch_b(self) -> DispatchOutput: ...

    @abc.abstractmethod
    def combine_a(self, expert_output: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def combine_b(self) -> torch.Tensor: ...

    @staticmethod
    def _hand_over(pending) -> None:
        """Dual-batch overlap, between a send and its receive: the other micro-batch gets the
        wait for ``pending`` (None: nothing to wait for) as its receive hook and the turn."""
        dbo_register_recv_hook(None if pending is None else pending.wait)
        dbo_yield()
