"""The dispatcher of a single EP rank (``--moe-a2a-backend none``): tokens stay where they are."""

from __future__ import annotations

import torch

from srt.layers.moe.token_dispatcher.base import DispatchOutput, TokenDispatcher


class StandardDispatcher(TokenDispatcher):
    def __init__(self) -> None:
        self._pending: DispatchOutput | torch.Tensor | None = None

    def _put(self, value) -> None:
        if self._pending is not None:
            raise RuntimeError("dispatcher used again before its previous exchange was waited")
        self._pending = value

    def _take(self):
        value, self._pending = self._pending, None
        if value is None:
            raise RuntimeError("dispatcher wait without a launch")
        return value

    def dispatch_a(
        self,
        hidden_states,
        topk_weights,
        topk_ids,
        *,
        is_extend=None,
        global_max_tokens=None,
        blocked_combine=None,
    ) -> None:
        if blocked_combine:
            raise RuntimeError("blocked_combine=True needs an all-to-all (--moe-a2a-backend)")
        self._put(DispatchOutput(hidden_states, topk_weights, topk_ids))

    def dispatch_b(self) -> DispatchOutput:
        return self._take()

    def combine_a(self, expert_output: torch.Tensor) -> None:
        self._put(expert_output)

    def combine_b(self) -> torch.Tensor:
        return self._take()
