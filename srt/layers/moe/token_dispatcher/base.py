"""Token dispatcher interface: move tokens to the ranks owning their experts and back."""

from __future__ import annotations

import abc
from typing import NamedTuple

import torch


class DispatchOutput(NamedTuple):
    hidden_states: torch.Tensor  # [T_recv, H] tokens this rank's experts must process
    topk_weights: torch.Tensor  # [T_recv, topk]
    topk_ids: torch.Tensor  # [T_recv, topk], global ids (other ranks' experts are skipped)


class TokenDispatcher(abc.ABC):
    """Every dispatcher splits each direction in a launch half (``_a``: start the exchange,
    return at once) and a wait half (``_b``: block until it is done), so the overlap
    executors can run other work in between. One instance serves one micro-batch.

    ``dispatch_a``'s keyword arguments describe the step, identically on every EP rank, for
    dispatchers that choose their collectives per step (``auto``); the others ignore them:
    ``is_extend``, whether any DP group extends; ``global_max_tokens``, the most tokens any EP
    rank dispatches in this step."""

    @abc.abstractmethod
    def dispatch_a(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        is_extend: bool | None = None,
        global_max_tokens: int | None = None,
    ) -> None: ...

    @abc.abstractmethod
    def dispatch_b(self) -> DispatchOutput: ...

    @abc.abstractmethod
    def combine_a(self, expert_output: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def combine_b(self) -> torch.Tensor: ...
