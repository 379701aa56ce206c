"""The scheduler process: receives requests over ZMQ, runs Scheduler iterations, sends token ids
to the detokenizer and control replies to the tokenizer manager.

Tensor parallelism (``--tp-size N``): one scheduler process per rank, each with its ModelRunner.
The entry rank (first of its attention-TP group) alone talks ZMQ; every iteration it broadcasts
the messages it received (an empty list too) over the group's gloo group, so every rank handles
the same messages, runs the same schedule and steps in lock-step. Sampling is identical on every
rank (the logits are all-gathered and the generators seeded alike); only the entry rank sends
outputs and replies."""

from __future__ import annotations

import logging
import os
import traceback
from multiprocessing.connection import Connection

import torch
import zmq

from srt.distributed.communication_op import broadcast_object
from srt.distributed.group_coordinator import GroupCoordinator
from srt.distributed.parallel_state import ParallelState, init_parallel_state
from srt.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
)
from srt.managers.scheduler import Scheduler
from srt.server_args import ServerArgs
from srt.utils.ipc import PortArgs, Receiver, Sender
from srt.utils.logging import configure_logging
from srt.utils.process import set_parent_death_signal

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 1000


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, port_args: PortArgs):
        self.scheduler = scheduler
        self.group: GroupCoordinator = scheduler.model_runner.parallel.attn_tp
        self.is_entry = self.group.is_first_rank
        if self.is_entry:
            context = zmq.Context()
            self.recv_from_tokenizer = Receiver(context, port_args.scheduler_input, bind=True)
            self.send_to_detokenizer = Sender(context, port_args.detokenizer_input)
            self.send_to_tokenizer = Sender(context, port_args.tokenizer_input)

    def reply(self, message: object) -> None:
        if self.is_entry:
            self.send_to_tokenizer.send(message)

    def recv_messages(self) -> list[object]:
        """This iteration's messages, the same on every rank of the group."""
        messages = None
        if self.is_entry:
            if self.scheduler.is_idle():
                first = self.recv_from_tokenizer.recv(IDLE_POLL_MS)
                messages = [first] if first is not None else []
                messages += self.recv_from_tokenizer.recv_all()
            else:
                messages = self.recv_from_tokenizer.recv_all()
        return broadcast_object(self.group, messages)

    def handle(self, msg: object) -> None:
        sched = self.scheduler
        if isinstance(msg, TokenizedGenerateReqInput):
            sched.add_request(msg)
        elif isinstance(msg, AbortReq):
            sched.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            self.reply(FlushCacheReqOutput(sched.flush_cache()))
        elif isinstance(msg, GetInternalStateReq):
            self.reply(GetInternalStateReqOutput(sched.get_internal_state()))
        else:
            raise TypeError(f"scheduler received an unknown message {type(msg).__name__}")

    def run_forever(self) -> None:
        while True:
            for msg in self.recv_messages():
                self.handle(msg)
            if not self.scheduler.is_idle():
                outputs = self.scheduler.step()
                if self.is_entry:
                    for out in outputs:
                        self.send_to_detokenizer.send(out)
                if self.scheduler.is_idle():
                    # As SGLang: a leak is a bug that must stop the server, not go unnoticed.
                    self.scheduler.check_memory(check_duplicates=False)


def init_rank_parallel_state(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int
) -> ParallelState | None:
    """This rank's groups (None on one rank: no torch.distributed). On CPU the ranks share the
    cores, so each gets its share of torch threads."""
    if server_args.tp_size == 1:
        return None
    on_cuda = server_args.device == "cuda"
    if not on_cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // server_args.tp_size))
    return init_parallel_state(
        server_args.tp_size,
        tp_rank,
        backend="nccl" if on_cuda else "gloo",
        init_method=port_args.dist_init_method,
        device=None if on_cuda else "cpu",
    )


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, ready_writer: Connection
) -> None:
    set_parent_death_signal()
    tag = f"scheduler TP{tp_rank}" if server_args.tp_size > 1 else "scheduler"
    configure_logging(server_args.log_level, prefix=tag)
    try:
        parallel = init_rank_parallel_state(server_args, port_args, tp_rank)
        scheduler = Scheduler(server_args, parallel=parallel)
        loop = SchedulerLoop(scheduler, port_args)
    except Exception:
        ready_writer.send({"status": "error", "error": traceback.format_exc()})
        raise
    ready_writer.send(
        {
            "status": "ready",
            "max_total_num_tokens": scheduler.max_total_num_tokens,
            "max_req_input_len": scheduler.max_req_input_len,
            "context_len": scheduler.model_config.context_len,
            "vocab_size": scheduler.model_config.vocab_size,
        }
    )
    loop.run_forever()
