"""The detokenizer process: BatchTokenIDOutput (ids) in, BatchStrOutput (text) out."""

from __future__ import annotations

import zmq

from srt.managers.detokenizer import DetokenizerManager
from srt.managers.io_struct import BatchTokenIDOutput
from srt.server_args import ServerArgs
from srt.utils import stream_trace
from srt.utils.ipc import PortArgs, Receiver, Sender
from srt.utils.logging import configure_logging
from srt.utils.process import freeze_startup_heap, set_parent_death_signal


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs) -> None:
    set_parent_death_signal()
    configure_logging(server_args.log_level, prefix="detokenizer")
    stream_trace.start(server_args.stream_trace_dir)
    from transformers import AutoTokenizer

    manager = DetokenizerManager(AutoTokenizer.from_pretrained(server_args.tokenizer_path))
    context = zmq.Context()
    recv = Receiver(context, port_args.detokenizer_input, bind=True)
    send = Sender(context, port_args.tokenizer_input)
    freeze_startup_heap()
    while True:
        msg = recv.recv()
        if not isinstance(msg, BatchTokenIDOutput):
            raise TypeError(f"detokenizer received an unknown message {type(msg).__name__}")
        out = manager.handle_batch_token_id_out(msg)
        stream_trace.record("detokenizer", out.rids, out.completion_tokens)
        send.send(out)
