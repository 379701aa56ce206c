"""TokenizerManager: the asyncio side of the server. Tokenizes and validates requests, sends
them to the scheduler, and streams detokenized results back to each caller."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from srt.constrained.grammar import check_grammar, grammar_spec
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    ExpertDistributionReq,
    ExpertDistributionReqOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerFailure,
    TokenizedGenerateReqInput,
)
from srt.managers.metrics import TokenizerMetrics
from srt.managers.request_log import RequestLog
from srt.managers.request_state import ReqState
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs
from srt.utils import stream_trace
from srt.utils.ipc import AsyncReceiver, PortArgs, Sender

logger = logging.getLogger(__name__)
DISCONNECT_CHECK_S = 1.0
WARMUP_TEXT = "The capital city of France is"
WARMUP_NEW_TOKENS = 8
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
# What generate_request yields first for start_request: the request is in the scheduler's hands.
_SUBMITTED: dict = {"submitted": True}


class ServerOverloadedError(Exception):
    """The server holds as many requests as it may (``--max-queued-requests``): HTTP 503."""


class ServerFailedError(RuntimeError):
    """A process of the server failed (a rank died, a step hung): the server is going down."""


class TokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict):
        from transformers import AutoConfig, AutoTokenizer

        self.server_args = server_args
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name or server_args.model_path
        self.tool_call_parser = server_args.tool_call_parser
        self.tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer_path)
        self.hf_config = AutoConfig.from_pretrained(server_args.model_path)
        self.context_len = scheduler_info["context_len"]
        self.vocab_size = scheduler_info["vocab_size"]
        self.max_req_input_len = scheduler_info["max_req_input_len"]
        self.zmq_context, self.zmq_async_context = zmq.Context(), zmq.asyncio.Context()
        # The schedulers (or, with DP attention, the DP controller) connect to this socket.
        dp_attention = server_args.enable_dp_attention
        self.num_reply_groups = server_args.dp_size if dp_attention else 1
        self.send_to_scheduler = Sender(
            self.zmq_context,
            port_args.controller_input if dp_attention else port_args.scheduler_inputs[0],
            bind=not dp_attention,
        )
        self.recv_from_detokenizer = AsyncReceiver(
            self.zmq_async_context, port_args.tokenizer_input, bind=True
        )
        self.rid_to_state: dict[str, ReqState] = {}
        self.control_futures: dict[type, asyncio.Future] = {}
        self.control_replies: list[object] = []
        self.control_lock: asyncio.Lock | None = None
        self.handle_loop_task: asyncio.Task | None = None
        # --enable-metrics: recorded for /metrics, else not at all
        metrics = server_args.enable_metrics
        self.metrics = TokenizerMetrics(self.served_model_name) if metrics else None
        level = server_args.log_requests_level
        self.request_log = RequestLog(level) if server_args.log_requests else None
        self.fatal_error: str | None = None  # set when a child process died or a rank failed
        self.loop: asyncio.AbstractEventLoop | None = None
        running = server_args.max_running_requests * server_args.num_running_groups
        self.max_in_flight = running + server_args.max_queued_requests

    # ------------------------------------------------------------------ requests
    def tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        """Validate one (single) request; raises ValueError naming what is wrong."""
        input_ids = obj.input_ids if obj.input_ids is not None else self.tokenizer.encode(obj.text)
        if not input_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if obj.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be >= 0, got {obj.top_logprobs_num}")
        if not -1 <= obj.logprob_start_len < len(input_ids):
            raise ValueError(
                f"logprob_start_len must be -1 or in [0, {len(input_ids)}), got "
                f"{obj.logprob_start_len}"
            )
        if len(input_ids) > self.max_req_input_len:
            raise ValueError(
                f"the prompt has {len(input_ids)} tokens, more than the maximum "
                f"input length of {self.max_req_input_len} tokens"
            )
        params = SamplingParams.from_dict(obj.sampling_params)
        params.verify(self.vocab_size)
        spec = grammar_spec(params)
        if spec is not None:
            if self.server_args.grammar_backend == "none":
                raise ValueError(f"{spec.kind}: structured output is off (--grammar-backend none)")
            check_grammar(spec)
        if len(input_ids) + params.max_new_tokens > self.context_len:
            raise ValueError(
                f"the request needs {len(input_ids) + params.max_new_tokens} tokens (prompt "
                f"{len(input_ids)} + max_new_tokens {params.max_new_tokens}), more than the "
                f"maximum context length of {self.context_len}"
            )
        params.normalize(self.tokenizer)
        return TokenizedGenerateReqInput(
            rid=obj.rid,
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=obj.return_logprob,
            logprob_start_len=obj.logprob_start_len,
            top_logprobs_num=obj.top_logprobs_num,
            stream=obj.stream,
        )

    async def start_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncGenerator[dict | list[dict], None]:
        """``generate_request``, returned once the request is checked and sent to the scheduler
        (bad input raises here), before its first output: a stream's response can start, and
        its first chunk goes out as soon as it is made, like every later one. Closing the
        generator, or dropping it, aborts the request."""
        gen = self.generate_request(obj, request, _announce_submitted=True)
        first = await gen.__anext__()
        assert first is _SUBMITTED
        return gen

    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None, *, _announce_submitted: bool = False
    ) -> AsyncGenerator[dict | list[dict], None]:
        """Yields result dicts (SGLang's shape): every update when streaming, else the final one
        (a list of them for a batch). Raises ValueError for bad input before anything runs."""
        self._ensure_handle_loop()
        obj.normalize_batch_and_arguments()
        items = [obj[i] for i in range(obj.batch_size)]
        self.admit(sum(_num_samples(item) for item in items))
        if any(_num_samples(item) > 1 for item in items):
            # n samples per prompt: a list of outputs, the prompt's n samples together.
            items, obj.is_single = await self.expand_parallel_samples(items, request), False
        tokenized = [self.tokenize(item) for item in items]
        if any(item.rid in self.rid_to_state for item in items):
            raise ValueError("rid: a request with this id is already running")
        states = [self._submit(item, tok) for item, tok in zip(items, tokenized)]
        if _announce_submitted:
            try:
                yield _SUBMITTED
            except GeneratorExit:  # closed before its outputs were awaited
                for state in states:
                    self.abort_request(state.obj.rid)
                    self._forget(state)
                raise
        if obj.is_single:
            async for out in self._wait_one(states[0], request):
                yield out
        elif obj.stream:
            async for out in self._merge_streams(states, request):
                yield out
        else:
            yield await self._gather_final(states, request)

    async def expand_parallel_samples(
        self, items: list[GenerateReqInput], request: Any = None
    ) -> list[GenerateReqInput]:
        """Single requests → one request per sample: a request with ``n`` > 1 becomes n copies
        (rids ``{rid}-{i}``; with a ``sampling_seed``, copy i samples with seed + i). Each such
        prompt is first prefilled once without output, so that its copies find it in the
        prefix cache and compute only their last prompt token. Raises ValueError for bad input
        before anything runs."""
        items = [_single(item) for item in items]
        for item in items:
            self.tokenize(item)
        prompts = [item for item in items if _num_samples(item) > 1]
        warmups = [
            dataclasses.replace(
                item,
                rid=f"{item.rid}-prefix",
                sampling_params={**item.sampling_params, "max_new_tokens": 0, "n": 1},
                return_logprob=False,
                logprob_start_len=-1,
                top_logprobs_num=0,
                stream=False,
                log_metrics=False,
            )
            for item in prompts
        ]
        states = [self._submit(w, self.tokenize(w)) for w in warmups]
        await asyncio.gather(*(self._final(state, request) for state in states))
        expanded = []
        for item in items:
            n = _num_samples(item)
            if n == 1:
                expanded.append(item)
                continue
            seed = item.sampling_params.get("sampling_seed")
            for i in range(n):
                params = {**item.sampling_params, "n": 1}
                if seed is not None:
                    params["sampling_seed"] = seed + i
                expanded.append(
                    dataclasses.replace(item, rid=f"{item.rid}-{i}", sampling_params=params)
                )
        return expanded

    def admit(self, num_requests: int) -> None:
        """Raise ServerOverloadedError unless ``num_requests`` more fit under the bound on
        requests in flight (running batches + ``--max-queued-requests``); ServerFailedError
        once the server is failing."""
        if self.fatal_error is not None:
            raise ServerFailedError(self.fatal_error)
        if num_requests > self.max_in_flight:
            raise ValueError(
                f"{num_requests} requests in one call, more than this server holds at once "
                f"({self.max_in_flight}: running batches + --max-queued-requests)"
            )
        if len(self.rid_to_state) + num_requests > self.max_in_flight:
            if self.metrics is not None:
                self.metrics.rejected.inc(num_requests)
            raise ServerOverloadedError(self.overloaded_message())

    def overloaded_message(self) -> str | None:
        """Why the server takes no new request now (its queue is full), or None."""
        if len(self.rid_to_state) < self.max_in_flight:
            return None
        return (
            f"The server is overloaded: {len(self.rid_to_state)} requests in flight, the "
            f"limit (--max-queued-requests {self.server_args.max_queued_requests} beyond the "
            f"running batches); retry after {RETRY_AFTER_S} s."
        )

    def fail(self, message: str) -> None:
        """The server is going down (thread-safe): every waiting request ends with
        ServerFailedError, and new ones are refused. The first message is kept."""
        if self.fatal_error is None:
            self.fatal_error = message
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._wake_all)

    def wait_drained(self, timeout: float) -> None:
        """From another thread, after ``fail``: wait until every request in flight has had
        its error (at most ``timeout`` s), then a moment for the responses to go out."""
        deadline = time.monotonic() + timeout
        while self.rid_to_state and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)

    def _wake_all(self) -> None:
        for state in self.rid_to_state.values():
            state.event.set()

    def _submit(self, obj: GenerateReqInput, tokenized: TokenizedGenerateReqInput) -> ReqState:
        state = ReqState(obj, len(tokenized.input_ids), self.tokenizer)
        self.rid_to_state[obj.rid] = state
        stream_trace.record("submitted", [obj.rid], [0])
        self.send_to_scheduler.send(tokenized)
        if self.request_log is not None:
            self.request_log.received(state)
        return state

    def _forget(self, state: ReqState) -> None:
        """Drop a request's state once its caller is done with it (finished or not)."""
        dropped = self.rid_to_state.pop(state.obj.rid, None) is not None
        if dropped and not state.finished and self.request_log is not None:
            self.request_log.finished(state)

    async def _wait_one(self, state: ReqState, request: Any) -> AsyncIterator[dict]:
        try:
            while True:
                try:
                    # awaited in this task (wait_for would wrap it in a task of its own: two
                    # more turns of the event loop before this stream writes its token)
                    async with asyncio.timeout(DISCONNECT_CHECK_S):
                        await state.event.wait()
                except TimeoutError:
                    if self.fatal_error is not None:
                        raise ServerFailedError(self.fatal_error) from None
                    if request is not None and await request.is_disconnected():
                        self.abort_request(state.obj.rid)
                        return
                    continue
                state.event.clear()
                if state.obj.stream and stream_trace.enabled():
                    stream_trace.record("http", [state.obj.rid], [len(state.output_ids)])
                if state.finished:
                    yield state.result()
                    return
                if self.fatal_error is not None:
                    raise ServerFailedError(self.fatal_error)
                if state.obj.stream:
                    yield state.result()
        except (asyncio.CancelledError, GeneratorExit):
            self.abort_request(state.obj.rid)
            raise
        finally:
            self._forget(state)

    async def _final(self, state: ReqState, request: Any) -> dict:
        result = None
        async for out in self._wait_one(state, request):
            result = out
        return result

    async def _gather_final(self, states: list[ReqState], request: Any) -> list[dict]:
        """All results of a non-streamed batch, awaited together so a disconnect aborts every
        request at once."""
        tasks = [asyncio.create_task(self._final(s, request)) for s in states]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _merge_streams(self, states: list[ReqState], request: Any) -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, state: ReqState) -> None:
            async for out in self._wait_one(state, request):
                await queue.put({**out, "index": index})
            await queue.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
        try:
            remaining = len(tasks)
            while remaining:
                out = await queue.get()
                if out is None:
                    remaining -= 1
                else:
                    yield out
        finally:
            for task in tasks:
                task.cancel()

    def abort_request(self, rid: str) -> None:
        state = self.rid_to_state.get(rid)
        if state is None:
            return
        self.send_to_scheduler.send(AbortReq(rid))
        counted = self.metrics is not None and state.obj.log_metrics
        if counted and not (state.finished or state.abort_sent):
            self.metrics.aborted.inc()  # once per request, as SGLang: on the abort's sending
        state.abort_sent = True

    def close(self) -> None:
        """Close the sockets and their contexts (an open context blocks garbage collection)."""
        self.send_to_scheduler.socket.close(linger=0)
        self.recv_from_detokenizer.socket.close(linger=0)
        self.zmq_context.term()
        self.zmq_async_context.term()

    # ------------------------------------------------------------------ control
    async def _control(self, request: object, reply_type: type) -> list[Any]:
        """Send a control request; one reply per attention-DP group, in arrival order."""
        self._ensure_handle_loop()
        async with self.control_lock:
            future = asyncio.get_running_loop().create_future()
            self.control_futures[reply_type] = future
            self.control_replies = []
            self.send_to_scheduler.send(request)
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(future), DISCONNECT_CHECK_S)
                except asyncio.TimeoutError:
                    if self.fatal_error is not None:
                        raise ServerFailedError(self.fatal_error) from None

    async def flush_cache(self) -> bool:
        replies = await self._control(FlushCacheReq(), FlushCacheReqOutput)
        return all(r.success for r in replies)

    async def expert_distribution(self, action: str) -> list[list[int]] | None:
        """Start, stop or dump (→ ``logical_count`` [layers, experts], summed over the DP
        groups) the expert-distribution recorder; ValueError when the model has none."""
        reply = ExpertDistributionReqOutput
        replies = await self._control(ExpertDistributionReq(action), reply)
        if replies[0].error:
            raise ValueError(replies[0].error)
        if action != "dump":
            return None
        counts = [r.logical_count for r in replies]
        return [[sum(col) for col in zip(*rows)] for rows in zip(*counts)]

    async def get_internal_state(self) -> list[dict]:
        """One state per attention-DP group, ordered by dp_rank."""
        replies = await self._control(GetInternalStateReq(), GetInternalStateReqOutput)
        return sorted((r.state for r in replies), key=lambda s: s.get("dp_rank", 0))

    async def warm_up(self) -> float:
        """One short greedy generation per attention-DP group (a batch, so the DP controller
        spreads it), then a cache flush: the next request pays no first-use cost (kernel
        loading, allocator growth) and finds an empty prefix cache; /metrics is untouched.
        Returns the seconds it took."""
        start = time.perf_counter()
        obj = GenerateReqInput(
            text=[WARMUP_TEXT] * self.num_reply_groups,
            sampling_params={"temperature": 0, "max_new_tokens": WARMUP_NEW_TOKENS},
            log_metrics=False,
        )
        async for _ in self.generate_request(obj):
            pass
        if not await self.flush_cache():
            raise RuntimeError("the prefix cache could not be flushed after the warm-up")
        return time.perf_counter() - start

    # ------------------------------------------------------------------ results
    def _ensure_handle_loop(self) -> None:
        if self.fatal_error is not None:
            raise ServerFailedError(self.fatal_error)
        if self.handle_loop_task is None:
            self.loop = asyncio.get_running_loop()
            self.control_lock = asyncio.Lock()
            self.handle_loop_task = asyncio.get_running_loop().create_task(self._handle_loop())

    async def _handle_loop(self) -> None:
        while True:
            msg = await self.recv_from_detokenizer.recv()
            if isinstance(msg, BatchStrOutput):
                self._handle_batch_output(msg)
                # let the streams woken here write before the next message is read: a recv
                # that finds a message queued returns without yielding to the event loop, so
                # a burst of steps would otherwise reach a stream as one coalesced chunk
                await asyncio.sleep(0)
            elif isinstance(msg, SchedulerFailure):
                logger.error("%s", msg.message)
                self.fail(msg.message)
            elif type(msg) in self.control_futures:
                self.control_replies.append(msg)
                if len(self.control_replies) == self.num_reply_groups:
                    future = self.control_futures.pop(type(msg))
                    if not future.done():
                        future.set_result(self.control_replies)
            else:
                logger.error("tokenizer manager received unexpected %s", type(msg).__name__)

    def _handle_batch_output(self, out: BatchStrOutput) -> None:
        stream_trace.record("tokenizer", out.rids, out.completion_tokens)
        now = time.perf_counter()
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None:
                continue  # aborted and forgotten
            if self.metrics is not None and state.obj.log_metrics:
                self.metrics.observe(state, out, i, now)
            state.update(out, i)
            if state.finished and self.request_log is not None:
                self.request_log.finished(state)
            state.event.set()


def _single(item: GenerateReqInput) -> GenerateReqInput:
    """A normalized copy of a single request (idempotent)."""
    item = dataclasses.replace(item)
    item.normalize_batch_and_arguments()
    if not item.is_single:
        raise ValueError("expected a single prompt")
    return item[0]


def _num_samples(item: GenerateReqInput) -> int:
    n = (item.sampling_params or {}).get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
