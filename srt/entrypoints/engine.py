"""The offline Engine: srt's process tree (scheduler, detokenizer) driven from Python, without
HTTP. ``generate`` runs the TokenizerManager's coroutine on the Engine's own event loop."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from srt.entrypoints.launcher import launch_subprocesses
from srt.managers.io_struct import GenerateReqInput
from srt.server_args import ServerArgs

UNBOUNDED_QUEUE = 2**62


class Engine:
    """``srt.Engine(**server_args)``: the same field names as the server's flags."""

    def __init__(self, **kwargs: Any):
        # Offline generation hands over whole batches: no bound on waiting requests unless
        # one is asked for (the server's default bound answers HTTP clients with 503s).
        kwargs.setdefault("max_queued_requests", UNBOUNDED_QUEUE)
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        if self.server_args.node_rank != 0:
            raise ValueError(
                "srt.Engine runs on node 0 (--node-rank 0); start the other nodes with "
                "python -m launch_server --node-rank R"
            )
        self.runtime = launch_subprocesses(self.server_args, exit_on_child_death=False)
        self.tokenizer_manager = self.runtime.tokenizer_manager
        self.loop = asyncio.new_event_loop()

    @property
    def tokenizer(self):
        return self.tokenizer_manager.tokenizer

    def generate(
        self,
        prompt: str | list[str] | list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
    ) -> dict | list[dict]:
        """One prompt (text or token ids) → one dict; a list of prompts → a list of dicts, in
        SGLang's shapes. Bad input raises ValueError naming the field before anything runs."""
        if prompt is not None and not isinstance(prompt, str) and _is_ids(prompt):
            prompt, input_ids = None, prompt
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        return self.loop.run_until_complete(self._final(obj))

    async def _final(self, obj: GenerateReqInput) -> dict | list[dict]:
        result = None
        async for out in self.tokenizer_manager.generate_request(obj):
            result = out
        return result

    def abort_request(self, rid: str) -> None:
        self.tokenizer_manager.abort_request(rid)

    def flush_cache(self) -> bool:
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def get_server_info(self) -> dict:
        states = self.loop.run_until_complete(self.tokenizer_manager.get_internal_state())
        return {
            **dataclasses.asdict(self.server_args),
            **self.runtime.scheduler_info,
            "internal_states": states,
        }

    def shutdown(self) -> None:
        if self.runtime is not None:
            task = self.tokenizer_manager.handle_loop_task
            if task is not None:
                task.cancel()
                self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            self.runtime.shutdown()
            self.runtime = None
            self.loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _is_ids(prompt: Any) -> bool:
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, int) or (
        isinstance(first, list) and (not first or isinstance(first[0], int))
    )
