"""Start srt's process tree (schedulers, detokenizer) and the TokenizerManager that talks to it;
shared by the HTTP server and the offline Engine."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

from srt.managers.detokenizer_process import run_detokenizer_process
from srt.managers.scheduler_process import run_scheduler_process
from srt.managers.tokenizer_manager import TokenizerManager
from srt.model_loader.config import ModelConfig
from srt.server_args import ServerArgs
from srt.utils.ipc import PortArgs
from srt.utils.process import Child, Watchdog, kill_children, start_child, wait_ready

logger = logging.getLogger(__name__)


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
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)


def launch_subprocesses(server_args: ServerArgs, exit_on_child_death: bool) -> Runtime:
    """Spawn the children, wait until every scheduler is ready, then build the
    TokenizerManager. A child that dies later is reported by the watchdog: the server exits
    (``exit_on_child_death``); the Engine fails its pending and later requests instead."""
    if server_args.tp_size > 1:  # fail before any rank starts
        server_args.check_against_model(ModelConfig.from_server_args(server_args).hf_config)
    port_args = PortArgs()
    schedulers = [
        start_child(f"scheduler rank {rank}", run_scheduler_process, server_args, port_args, rank)
        for rank in range(server_args.tp_size)
    ]
    detokenizer = start_child(
        "detokenizer", run_detokenizer_process, server_args, port_args, ready=False
    )
    children = [*schedulers, detokenizer]
    try:
        infos = wait_ready(schedulers)
        if not detokenizer.process.is_alive():
            raise RuntimeError("detokenizer exited during start-up")
        tm = TokenizerManager(server_args, port_args, infos[0])
    except BaseException:
        kill_children(children)
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
        raise

    def on_death(name: str) -> None:
        tm.fatal_error = f"child process {name} died"
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)

    watchdog = Watchdog(children, on_death, exit_process=exit_on_child_death)
    watchdog.start()
    return Runtime(tm, children, watchdog, port_args, infos[0])
