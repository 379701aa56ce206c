"""Running one OpenAI request's prompts through ``TokenizerManager.generate_request``.

Each prompt is its own single request, so several prompts run concurrently in the scheduler.
Streams are started (``TokenizerManager.start_request``: checked and sent to the scheduler)
before the HTTP response starts, so that a ``ValueError`` for bad input is still answered with
a 400 and not inside a 200 stream; their first output is not awaited there, so it goes out as
soon as it is made, like every later one.
Whatever stops early (an error, a disconnect) cancels or closes the other prompts' generators,
which makes the TokenizerManager abort them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

from srt.entrypoints.openai.utils import OpenAIError
from srt.managers.io_struct import GenerateReqInput


async def gather_or_cancel(awaitables: list[Awaitable[Any]]) -> list[Any]:
    """asyncio.gather that cancels (and waits for) the rest when one fails."""
    if len(awaitables) == 1:
        return [await awaitables[0]]
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def collect_final(tm: Any, objs: list[GenerateReqInput], request: Any) -> list[dict]:
    """The final output of every prompt (non-streaming)."""
    outs = await gather_or_cancel([_final(tm, obj, request) for obj in objs])
    if any(out is None for out in outs):
        raise OpenAIError("the request was aborted before it finished")
    return outs


async def _final(tm: Any, obj: GenerateReqInput, request: Any) -> dict | None:
    final = None
    async for out in tm.generate_request(obj, request):
        final = out
    return final


async def open_streams(
    tm: Any, objs: list[GenerateReqInput], request: Any
) -> list[AsyncGenerator[dict, None]]:
    """Start every prompt (input errors are raised here, with every started one aborted)."""
    started: list[AsyncGenerator[dict, None]] = []
    try:
        for obj in objs:
            started.append(await tm.start_request(obj, request))
    except BaseException:
        await close_all(started)
        raise
    return started


async def close_all(gens: list[AsyncGenerator[dict, None]]) -> None:
    for gen in gens:
        with contextlib.suppress(Exception):
            await gen.aclose()


async def merge_streams(
    streams: list[AsyncGenerator[dict, None]],
) -> AsyncIterator[tuple[int, dict]]:
    """(prompt index, output) pairs from all streams, in arrival order."""
    if len(streams) == 1:
        async for out in _closing(streams[0]):
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, dict | Exception | None]] = asyncio.Queue()
    tasks = [
        asyncio.create_task(_pump(index, stream, queue)) for index, stream in enumerate(streams)
    ]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, stream: AsyncGenerator[dict, None], queue: asyncio.Queue) -> None:
    try:
        async for out in _closing(stream):
            queue.put_nowait((index, out))
        queue.put_nowait((index, None))
    except Exception as e:  # handed to the consumer, which raises it
        queue.put_nowait((index, e))


async def _closing(gen: AsyncGenerator[dict, None]) -> AsyncIterator[dict]:
    try:
        async for out in gen:
            yield out
    finally:
        await gen.aclose()
