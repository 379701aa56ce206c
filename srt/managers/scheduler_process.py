"""The scheduler process: receives requests over ZMQ, runs Scheduler iterations, sends token ids
to the detokenizer and control replies to the tokenizer manager.

Tensor parallelism (``--tp-size N``): one scheduler process per rank, each with its ModelRunner.
The entry rank (first of its attention-TP group) alone talks ZMQ; every iteration it broadcasts
the messages it received (an empty list too) over the group's gloo group, so every rank handles
the same messages, runs the same schedule and steps in lock-step. Sampling is identical on every
rank (the logits are all-gathered and the generators seeded alike); only the entry rank sends
outputs and replies.

DP attention (``--dp-size D``): D attention-TP groups, each with its own entry rank, requests
(from the DP controller), KV cache and schedule. Every rank steps on every iteration, since the
MLP-sync all-gather spans all ranks; an entry rank waits for messages only after a sync that
found every group idle (the controller's WakeUp gets the other groups out of that wait)."""

from __future__ import annotations

import logging
import os
import re
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import zmq

from srt.distributed.communication_op import broadcast_object
from srt.distributed.group_coordinator import GroupCoordinator
from srt.distributed.heartbeat import PeerHeartbeat
from srt.distributed.parallel_state import ParallelState, init_parallel_state
from srt.layers.overlap.single_batch_overlap import SmSplit
from srt.managers.io_struct import (
    AbortReq,
    DpLoadReport,
    ExpertDistributionReq,
    ExpertDistributionReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    WakeUp,
)
from srt.managers.scheduler import Scheduler
from srt.managers.scheduler_watchdog import PEER_WAIT_S, RankFailure, StepWatchdog
from srt.server_args import ServerArgs
from srt.utils import stream_trace
from srt.utils.ipc import PortArgs, Receiver, Sender
from srt.utils.logging import configure_logging
from srt.utils.network import set_socket_ifname_for
from srt.utils.process import freeze_startup_heap, set_parent_death_signal

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 1000
RENDEZVOUS_TIMEOUT_S = 1800.0  # torch's default: nodes may start minutes apart


class SchedulerLoop:
    def __init__(self, scheduler: Scheduler, port_args: PortArgs):
        self.scheduler = scheduler
        parallel = scheduler.model_runner.parallel
        self.group: GroupCoordinator = parallel.attn_tp
        self.dp_rank = parallel.attn_dp_rank
        self.is_entry = self.group.is_first_rank
        self.dp_attention = scheduler.enable_dp_attention
        self.last_load: tuple[int, int] | None = None
        self.watchdog: StepWatchdog | None = None
        self.num_iterations = 0
        if self.is_entry:
            context = zmq.Context()
            endpoint = port_args.scheduler_inputs[self.dp_rank]
            self.recv_from_tokenizer = Receiver(context, endpoint, bind=False)
            self.send_to_detokenizer = Sender(context, port_args.detokenizer_input)
            self.send_to_tokenizer = Sender(context, port_args.tokenizer_input)
            if self.dp_attention:
                self.send_load = Sender(context, port_args.controller_load)

    def reply(self, message: object) -> None:
        if self.is_entry:
            self.send_to_tokenizer.send(message)

    def may_block(self) -> bool:
        """Wait for messages only when nothing is running here and, under DP attention, the
        last MLP sync found every group idle (a busy group needs this one every step)."""
        sched = self.scheduler
        sync = sched.model_runner.last_dp_sync  # DP attention: no work anywhere last step?
        return sched.is_idle() and (not self.dp_attention or sync is None or sync.all_idle)

    def recv_messages(self) -> tuple[float, list[object]]:
        """This iteration's clock and messages, the entry rank's on every rank of the group
        (see ``Scheduler.begin_iteration``)."""
        received = None
        if self.is_entry:
            if self.may_block():
                first = self.recv_from_tokenizer.recv(IDLE_POLL_MS)
                messages = [first] if first is not None else []
                messages += self.recv_from_tokenizer.recv_all()
            else:
                messages = self.recv_from_tokenizer.recv_all()
            messages = [m for m in messages if not isinstance(m, WakeUp)]
            received = (time.monotonic(), messages)
        return broadcast_object(self.group, received)

    def handle(self, msg: object) -> None:
        sched = self.scheduler
        if isinstance(msg, TokenizedGenerateReqInput):
            if self.is_entry:
                stream_trace.record("received", [msg.rid], [0])
            sched.add_request(msg)
        elif isinstance(msg, AbortReq):
            sched.abort_request(msg)
        elif isinstance(msg, FlushCacheReq):
            self.reply(FlushCacheReqOutput(sched.flush_cache()))
        elif isinstance(msg, GetInternalStateReq):
            self.reply(GetInternalStateReqOutput(sched.get_internal_state()))
        elif isinstance(msg, ExpertDistributionReq):
            self.reply(expert_distribution(sched.model_runner.expert_recorder, msg.action))
        else:
            raise TypeError(f"scheduler received an unknown message {type(msg).__name__}")

    def report_load(self) -> None:
        load = self.scheduler.load()
        if self.is_entry and self.dp_attention and load != self.last_load:
            self.send_load.send(DpLoadReport(self.dp_rank, *load))
            self.last_load = load

    def run_forever(self) -> None:
        sched = self.scheduler
        while True:
            self.num_iterations += 1
            sched.current_step = f"the message broadcast of iteration {self.num_iterations}"
            if self.watchdog is not None:
                self.watchdog.begin()
            now, messages = self.recv_messages()
            sched.begin_iteration(now)
            for msg in messages:
                self.handle(msg)
            if not self.dp_attention and sched.is_idle():
                continue
            steps = sched.num_forward_steps
            outputs = sched.step()  # under DP attention on every iteration: it syncs
            if self.is_entry:
                for out in outputs:
                    stream_trace.record("scheduler", out.rids, out.completion_tokens)
                    self.send_to_detokenizer.send(out)
            self.report_load()
            if sched.num_forward_steps != steps and sched.is_idle():
                # As SGLang: a leak is a bug that must stop the server, not go unnoticed.
                sched.check_memory(check_duplicates=False)


def expert_distribution(recorder, action: str) -> ExpertDistributionReqOutput:
    """Start, stop or dump the expert-distribution recorder (every rank of the group at this
    message: a dump sums the group's counts)."""
    if recorder is None:
        return ExpertDistributionReqOutput(None, "the model has no MoE layer to record")
    if action == "dump":
        return ExpertDistributionReqOutput(recorder.dump())
    if action == "start":
        recorder.start()
    else:
        recorder.stop()
    return ExpertDistributionReqOutput(None)


def init_rank_parallel_state(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int
) -> ParallelState | None:
    """This rank's groups (None on one rank: no torch.distributed). On CPU the ranks of a node
    share the cores this process may run on (its affinity, e.g. under taskset), so each gets
    its share of torch threads."""
    if server_args.tp_size == 1:
        return None
    on_cuda = server_args.device == "cuda"
    if not on_cuda:
        threads = len(os.sched_getaffinity(0)) // server_args.num_ranks_per_node
        torch.set_num_threads(max(1, threads))
    if server_args.nnodes > 1:
        set_socket_ifname_for(port_args.dist_init_host)
    return init_parallel_state(
        server_args.tp_size,
        tp_rank,
        dp_size=server_args.dp_size,
        enable_dp_attention=server_args.enable_dp_attention,
        moe_a2a_backend=server_args.moe_a2a_backend,
        ep_size=server_args.ep_size,
        backend="nccl" if on_cuda else "gloo",
        init_method=port_args.dist_init_method,
        device=None if on_cuda else "cpu",
        sbo_combine_ctas=_sbo_combine_ctas(server_args, tp_rank) if on_cuda else None,
        timeout=timedelta(seconds=server_args.watchdog_timeout),
        rendezvous_timeout=timedelta(
            seconds=max(RENDEZVOUS_TIMEOUT_S, server_args.watchdog_timeout)
        ),
    )


def _sbo_combine_ctas(server_args: ServerArgs, tp_rank: int) -> int | None:
    """Single-batch overlap on CUDA: the SMs (nccl CTAs) its combine group may use."""
    if "sbo" not in server_args.overlap_modes:
        return None
    device = torch.device("cuda", tp_rank % torch.cuda.device_count())
    return SmSplit.for_device(device, server_args.sbo_communication_sms).communicate


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, ready_writer: Connection
) -> None:
    set_parent_death_signal()
    tag = f"scheduler TP{tp_rank}" if server_args.tp_size > 1 else "scheduler"
    if server_args.enable_dp_attention:
        attn_tp = server_args.tp_size // server_args.dp_size
        tag = f"scheduler DP{tp_rank // attn_tp} TP{tp_rank}"
    configure_logging(server_args.log_level, prefix=tag)
    stream_trace.start(server_args.stream_trace_dir)
    try:
        parallel = init_rank_parallel_state(server_args, port_args, tp_rank)
        scheduler = Scheduler(server_args, parallel=parallel)
        loop = SchedulerLoop(scheduler, port_args)
    except Exception:
        ready_writer.send({"status": "error", "error": traceback.format_exc()})
        raise
    freeze_startup_heap()
    ready_writer.send(
        {
            "status": "ready",
            "max_total_num_tokens": scheduler.max_total_num_tokens,
            "max_req_input_len": scheduler.max_req_input_len,
            "context_len": scheduler.model_config.context_len,
            "vocab_size": scheduler.model_config.vocab_size,
            "front_end_core": front_end_has_a_core(scheduler),
        }
    )
    failure = RankFailure(
        tp_rank,
        PeerHeartbeat.from_default_group(server_args.num_ranks_per_node).start()
        if parallel is not None
        else None,
        port_args.tokenizer_input if loop.is_entry else None,
    )
    loop.watchdog = StepWatchdog(
        server_args.watchdog_timeout, failure, lambda: scheduler.current_step
    ).start()
    try:
        loop.run_forever()
    except Exception as e:
        peer_gone = _is_peer_gone(e)
        if not peer_gone:  # a bug, not a fault of the cluster: keep its traceback
            logger.error("%s", traceback.format_exc())
        what = f"{scheduler.current_step} failed: {_first_line(e)}"
        failure.exit(what, wait_for_peers=PEER_WAIT_S if peer_gone else 0.0)


def front_end_has_a_core(scheduler: Scheduler) -> bool:
    """This rank's decode steps leave a core to the front end (``CpuThreads``): then the
    front-end processes may wait for it rather than preempt the rank (see
    ``yield_to_ranks_on_wakeup``)."""
    threads = scheduler.model_runner.cpu_threads
    return threads is not None and threads.leaves_front_end_a_core(scheduler.max_running_requests)


def _first_line(error: BaseException) -> str:
    """The error's first sentence, without gloo's source location (``[.../pair.cc:537] ``)
    and advice."""
    text = (str(error) or type(error).__name__).splitlines()[0]
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return re.split(r"\.\s+(?=[A-Z])", text)[0][:300]


def _is_peer_gone(error: BaseException) -> bool:
    """A collective broke because a peer (or the link to it) did."""
    text = str(error).lower()
    signs = ("connection closed", "connection reset", "broken pipe", "timed out")
    return any(s in text for s in signs)
