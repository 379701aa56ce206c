"""DataParallelController: routes requests to the attention-DP groups (``--dp-size D`` with
``--enable-dp-attention``). One process on node 0, between the tokenizer manager and the
schedulers.

- A generate request goes to one group, picked by ``--load-balance-method``: ``round_robin``;
  ``shortest_queue`` (fewest running + waiting requests) or ``minimum_tokens`` (fewest tokens in
  use or waiting), from the load each group's entry rank reports when it changes, plus what was
  sent since that report (so a burst does not all land on one group between reports).
  SGLang's names for them (auto, total_requests, total_tokens) become these at start-up
  (``srt.server_args_choices.VALUE_ALIASES``).
- The other groups get a ``WakeUp``: an all-idle world polls slowly, and the group that got the
  request needs every rank in its next MLP-sync step.
- Aborts and control requests go to every group (an abort is a no-op where the rid is unknown;
  each group answers a control request, and the tokenizer manager gathers the D replies).
"""

from __future__ import annotations

import itertools
import logging

import zmq

from srt.managers.io_struct import DpLoadReport, TokenizedGenerateReqInput, WakeUp
from srt.server_args import ServerArgs
from srt.server_args_choices import LOAD_BALANCE_CHOICES
from srt.utils.ipc import PortArgs, Receiver, Sender
from srt.utils.logging import configure_logging
from srt.utils.process import set_parent_death_signal

logger = logging.getLogger(__name__)


class LoadBalancer:
    """Pure routing decision, testable without sockets."""

    def __init__(self, method: str, dp_size: int):
        if method not in LOAD_BALANCE_CHOICES:
            raise ValueError(f"--load-balance-method {method!r} is not supported")
        self.method, self.dp_size = method, dp_size
        self._cycle = itertools.cycle(range(dp_size))
        self.reported = [DpLoadReport(d, 0, 0) for d in range(dp_size)]
        self.sent_reqs = [0] * dp_size  # dispatched since the group's last report
        self.sent_tokens = [0] * dp_size

    def on_report(self, report: DpLoadReport) -> None:
        self.reported[report.dp_rank] = report
        self.sent_reqs[report.dp_rank] = self.sent_tokens[report.dp_rank] = 0

    def load(self, d: int) -> tuple[int, int]:
        reqs = self.reported[d].num_reqs + self.sent_reqs[d]
        tokens = self.reported[d].num_tokens + self.sent_tokens[d]
        return (reqs, tokens) if self.method == "shortest_queue" else (tokens, reqs)

    def pick(self, req: TokenizedGenerateReqInput) -> int:
        if self.method == "round_robin":
            d = next(self._cycle)
        else:  # ties go to the lowest group
            d = min(range(self.dp_size), key=lambda g: (*self.load(g), g))
        self.sent_reqs[d] += 1
        self.sent_tokens[d] += len(req.input_ids)
        return d


class DataParallelController:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        self.dp_size = server_args.dp_size
        self.balancer = LoadBalancer(server_args.load_balance_method, self.dp_size)
        context = zmq.Context()
        self.recv_from_tokenizer = Receiver(context, port_args.controller_input, bind=True)
        self.recv_load = Receiver(context, port_args.controller_load, bind=True)
        self.send_to_groups = [
            Sender(context, endpoint, bind=True) for endpoint in port_args.scheduler_inputs
        ]
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer.socket, zmq.POLLIN)
        self.poller.register(self.recv_load.socket, zmq.POLLIN)

    def handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            target = self.balancer.pick(msg)
            for d, sender in enumerate(self.send_to_groups):
                sender.send(msg if d == target else WakeUp())
        else:  # AbortReq and control requests
            for sender in self.send_to_groups:
                sender.send(msg)

    def run_forever(self) -> None:
        while True:
            self.poller.poll()
            for report in self.recv_load.recv_all():
                self.balancer.on_report(report)
            for msg in self.recv_from_tokenizer.recv_all():
                self.handle(msg)


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    set_parent_death_signal()
    configure_logging(server_args.log_level, prefix="dp controller")
    DataParallelController(server_args, port_args).run_forever()
