"""Under ``--moe-fb-overlap`` each F&B pair of DualPipeV takes its own messages
(``fold_pair_messages``): the receives right before it and the sends right after it move into
the pair by half, the receive that brings the half's input and the send that carries its
output; every other message stays in place, in order."""

from __future__ import annotations

import pytest

from pipeline.executor import PairWithMessages, fold_pair_messages
from pipeline.schedules import Comm, make_schedule


@pytest.mark.parametrize("pp, n", [(2, 4), (2, 8), (4, 12)])
def test_pairs_take_their_own_messages(pp, n):
    schedule = make_schedule("dualpipev", pp, n, dw_detach=True)
    for rank in range(pp):
        actions = schedule.ranks[rank]
        folded = fold_pair_messages(actions)
        pairs = [a for a in folded if isinstance(a, PairWithMessages)]
        assert pairs and len(pairs) == sum(type(a).__name__ == "Pair" for a in actions)
        taken = []
        for item in pairs:
            for half, recv in item.recvs.items():
                assert recv.kind == "recv" and recv.mb == half.mb
                assert (recv.what, recv.stage) == (
                    ("act", half.stage - 1) if half.kind == "F" else ("grad", half.stage + 1)
                )
            for half, send in item.sends.items():
                assert send.kind == "send" and (send.stage, send.mb) == (half.stage, half.mb)
                assert send.what == ("act" if half.kind == "F" else "grad")
            taken += [*item.recvs.values(), *item.sends.values()]
        # past the warm-up a pair has messages (at PP > 1 its neighbour is on another rank)
        assert taken
        left = [a for a in folded if isinstance(a, Comm)]
        assert sorted(map(str, left + taken)) == sorted(
            str(a) for a in actions if isinstance(a, Comm)
        )
        assert left == [a for a in actions if isinstance(a, Comm) and a not in taken]
