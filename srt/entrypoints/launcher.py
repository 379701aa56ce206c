"""Start srt's process tree (schedulers, DP controller, detokenizer) and the TokenizerManager
that talks to it; shared by the HTTP server and the offline Engine.

Multi-node (``--nnodes N``): every node starts the scheduler ranks it hosts
(``[node_rank·T/N, (node_rank+1)·T/N)``); node 0 also runs the DP controller, detokenizer,
tokenizer manager and HTTP server. The other nodes run only their schedulers and follow node 0:
when node 0 stops, their collectives fail, their schedulers exit and so do they."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

from srt.managers.data_parallel_controller import run_data_parallel_controller_process
from srt.managers.detokenizer_process import run_detokenizer_process
from srt.managers.scheduler_process import run_scheduler_process
from srt.managers.tokenizer_manager import TokenizerManager
from srt.model_executor.cpu_threads import limit_openmp_spin
from srt.model_loader.config import ModelConfig
from srt.server_args import ServerArgs
from srt.utils import stream_trace
from srt.utils.ipc import PortArgs
from srt.utils.process import (
    Child,
    Watchdog,
    kill_children,
    start_child,
    wait_ready,
    yield_to_ranks_on_wakeup,
)

logger = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 3.0


@dataclass
class Runtime:
    tokenizer_manager: TokenizerManager
    children: list[Child]
    watchdog: Watchdog
    port_args: PortArgs
    scheduler_info: dict

    def shutdown(self) -> None:
        self.watchdog.stopping = True
        kill_children(self.children)
        self.tokenizer_manager.close()
        stream_trace.close()
        _remove_ipc_dir(self.port_args)


def _remove_ipc_dir(port_args: PortArgs) -> None:
    if port_args.ipc_dir is not None:
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def _start_schedulers(server_args: ServerArgs, port_args: PortArgs) -> list[Child]:
    if server_args.tp_size > 1:  # fail before any rank starts
        server_args.check_against_model(ModelConfig.from_server_args(server_args).hf_config)
    if server_args.device == "cpu":
        limit_openmp_spin()  # before the ranks start: libgomp reads it once, when loaded
    per_node = server_args.num_ranks_per_node
    first = server_args.node_rank * per_node
    return [
        start_child(f"scheduler rank {rank}", run_scheduler_process, server_args, port_args, rank)
        for rank in range(first, first + per_node)
    ]


def run_follower_node(server_args: ServerArgs) -> None:
    """Node ``node_rank > 0``: run this node's scheduler ranks until one of them exits (node 0
    stopped, or a failure); then stop the others and exit non-zero."""
    port_args = PortArgs.init_new(server_args)
    schedulers = _start_schedulers(server_args, port_args)
    try:
        wait_ready(schedulers)
    except BaseException:
        kill_children(schedulers)
        raise
    logger.info(
        "node %d of %d: ranks %s ready; following node 0",
        server_args.node_rank,
        server_args.nnodes,
        [c.name.rsplit(" ", 1)[1] for c in schedulers],
    )
    watchdog = Watchdog(schedulers, exit_process=True)
    watchdog.start()
    watchdog.thread.join()


def launch_subprocesses(server_args: ServerArgs, exit_on_child_death: bool) -> Runtime:
    """Node 0: spawn the children, wait until every local scheduler is ready (rank 0 is ready
    only once all ranks of every node joined the world), then build the TokenizerManager. A
    child that dies later is reported by the watchdog: the server exits
    (``exit_on_child_death``); the Engine fails its pending and later requests instead."""
    if server_args.node_rank != 0:
        raise ValueError("launch_subprocesses runs on node 0; other nodes use run_follower_node")
    port_args = PortArgs.init_new(server_args)
    try:
        schedulers = _start_schedulers(server_args, port_args)
    except BaseException:
        _remove_ipc_dir(port_args)
        raise
    children = list(schedulers)
    if server_args.enable_dp_attention:
        children.append(
            start_child(
                "data parallel controller",
                run_data_parallel_controller_process,
                server_args,
                port_args,
                ready=False,
            )
        )
    children.append(
        start_child("detokenizer", run_detokenizer_process, server_args, port_args, ready=False)
    )
    try:
        infos = wait_ready(schedulers)
        for child in children[len(schedulers) :]:
            if not child.process.is_alive():
                raise RuntimeError(f"{child.name} exited during start-up")
            if infos[0].get("front_end_core"):
                yield_to_ranks_on_wakeup(child.process.pid)
        stream_trace.start(server_args.stream_trace_dir)  # this process: the front end
        tm = TokenizerManager(server_args, port_args, infos[0])
    except BaseException:
        kill_children(children)
        _remove_ipc_dir(port_args)
        raise

    def on_death(name: str) -> None:
        tm.fail(f"the server failed: child process {name} died")
        _remove_ipc_dir(port_args)
        tm.wait_drained(DRAIN_TIMEOUT_S)  # the requests in flight get their error first

    watchdog = Watchdog(children, on_death, exit_process=exit_on_child_death)
    watchdog.start()
    return Runtime(tm, children, watchdog, port_args, infos[0])
