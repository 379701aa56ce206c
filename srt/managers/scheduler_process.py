"""The scheduler process: receives requests over ZMQ, runs Scheduler iterations, sends token ids
to the detokenizer and control replies to the tokenizer manager."""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection

import zmq

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
        context = zmq.Context()
        self.recv_from_tokenizer = Receiver(context, port_args.scheduler_input, bind=True)
        self.send_to_detokenizer = Sender(context, port_args.detokenizer_input)
        self.send_to_tokenizer = Sender(context, port_args.tokenizer_input)

    def handle(self, msg: object) -> None:
        sched = self.scheduler
        if isinstance(msg, TokenizedGenerateReqInput):
            sched.add_request(msg)
        elif isinstance(msg, AbortReq):
            sched.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            self.send_to_tokenizer.send(FlushCacheReqOutput(sched.flush_cache()))
        elif isinstance(msg, GetInternalStateReq):
            self.send_to_tokenizer.send(GetInternalStateReqOutput(sched.get_internal_state()))
        else:
            raise TypeError(f"scheduler received an unknown message {type(msg).__name__}")

    def run_forever(self) -> None:
        while True:
            if self.scheduler.is_idle():
                first = self.recv_from_tokenizer.recv(IDLE_POLL_MS)
                messages = (
                    [first] if first is not None else []
                ) + self.recv_from_tokenizer.recv_all()
            else:
                messages = self.recv_from_tokenizer.recv_all()
            for msg in messages:
                self.handle(msg)
            if not self.scheduler.is_idle():
                for out in self.scheduler.step():
                    self.send_to_detokenizer.send(out)
                if self.scheduler.is_idle():
                    # As SGLang: a leak is a bug that must stop the server, not go unnoticed.
                    self.scheduler.check_memory(check_duplicates=False)


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, ready_writer: Connection
) -> None:
    set_parent_death_signal()
    configure_logging(server_args.log_level, prefix="scheduler")
    try:
        scheduler = Scheduler(server_args)
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
