"""The request flow shared by /v1/completions and /v1/chat/completions: parse and check the
request, turn it into GenerateReqInputs, run them, and answer with one JSON object or an SSE
stream of chunks ending in ``data: [DONE]``."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from srt.entrypoints.openai.protocol import SamplingRequest
from srt.entrypoints.openai.streams import collect_final, merge_streams, open_streams
from srt.entrypoints.openai.utils import (
    OpenAIError,
    check_model,
    json_response,
    parse_request,
    sse_done,
    sse_line,
)
from srt.managers.io_struct import GenerateReqInput
from srt.managers.tokenizer_manager import ServerFailedError, ServerOverloadedError

logger = logging.getLogger(__name__)


@dataclass
class RequestContext:
    """What every response object and chunk of one request shares."""

    request_id: str
    model: str
    created: int

    def rid(self, index: int, num_prompts: int) -> str:
        return self.request_id if num_prompts == 1 else f"{self.request_id}-{index}"


class OpenAIServingBase:
    """One OpenAI endpoint over a TokenizerManager. Subclasses say how a request becomes
    GenerateReqInputs and how outputs become a response or stream chunks."""

    request_cls: type[SamplingRequest]
    id_prefix: str

    def __init__(self, tm: Any):
        self.tm = tm

    async def handle(self, request: Request) -> Response:
        try:
            req = await parse_request(request, self.request_cls)
            check_model(self.tm, req.model)
            req.check_supported()
            ctx = RequestContext(
                request_id=f"{self.id_prefix}{uuid.uuid4().hex}",
                model=req.model or self.tm.served_model_name,
                created=int(time.time()),
            )
            objs = self.build_inputs(req, ctx)
            self.tm.admit(len(objs) * req.n)  # all of the request's prompts, or none
            if req.n > 1:  # n choices per prompt, the prompt prefilled once for all of them
                objs = await self.tm.expand_parallel_samples(objs, request)
            if req.stream:
                streams = await open_streams(self.tm, objs, request)
                chunks = self.stream_chunks(req, ctx, len(objs), merge_streams(streams))
                return StreamingResponse(sse_body(chunks), media_type="text/event-stream")
            outs = await collect_final(self.tm, objs, request)
            return json_response(self.build_response(req, ctx, outs))
        except OpenAIError as e:
            return e.response()
        except ValueError as e:  # bad input found by the TokenizerManager or a check here
            return OpenAIError(str(e)).response()
        except ServerOverloadedError as e:
            return OpenAIError(str(e), 503, "ServiceUnavailableError").response()
        except ServerFailedError as e:
            return OpenAIError(str(e), 500, "InternalServerError").response()

    def build_inputs(self, req: Any, ctx: RequestContext) -> list[GenerateReqInput]:
        raise NotImplementedError

    def build_response(self, req: Any, ctx: RequestContext, outs: list[dict]) -> BaseModel:
        """The whole response from the final output of every prompt."""
        raise NotImplementedError

    def stream_chunks(
        self,
        req: Any,
        ctx: RequestContext,
        num_choices: int,
        outs: AsyncIterator[tuple[int, dict]],
    ) -> AsyncGenerator[BaseModel, None]:
        """Chunks from (choice index, cumulative output) pairs; raises OpenAIError on abort."""
        raise NotImplementedError


async def sse_body(chunks: AsyncGenerator[BaseModel, None]) -> AsyncIterator[bytes]:
    """SSE lines of the chunks, then [DONE]; a failure mid-stream becomes an error event."""
    try:
        async for chunk in chunks:
            yield sse_line(chunk)
    except OpenAIError as e:
        yield e.sse()
    except Exception as e:  # the status line is sent already: report in the stream
        logger.exception("OpenAI stream failed")
        yield OpenAIError(str(e), 500, "InternalServerError").sse()
    finally:
        await chunks.aclose()
    yield await sse_done()
