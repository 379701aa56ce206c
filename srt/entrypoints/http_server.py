"""The HTTP server: SGLang's native routes and the OpenAI API over one TokenizerManager."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from collections.abc import AsyncIterator

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from srt import __version__
from srt.entrypoints.launcher import launch_subprocesses, run_follower_node
from srt.entrypoints.openai.utils import sse_done
from srt.managers.io_struct import UNSUPPORTED_FIELDS, GenerateReqInput, is_unset
from srt.managers.tokenizer_manager import (
    RETRY_AFTER_S,
    ServerFailedError,
    ServerOverloadedError,
    TokenizerManager,
)
from srt.server_args import ServerArgs
from srt.utils.logging import configure_logging
from srt.utils.process import freeze_startup_heap, yield_to_ranks_on_wakeup

logger = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's bound on /health_generate


def json_response(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    response = json_response({"error": {"message": message, "code": status}}, status)
    if status == 503:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def server_error_response(error: Exception) -> Response:
    """503 (with Retry-After) for a full queue, 500 for a failing server."""
    return error_response(str(error), 503 if isinstance(error, ServerOverloadedError) else 500)


def sse_line(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def parse_generate_request(request: Request) -> GenerateReqInput:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise ValueError(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    names = {f.name for f in dataclasses.fields(GenerateReqInput)} - {"is_single", "batch_size"}
    unknown = sorted(set(body) - names - set(UNSUPPORTED_FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    refused = sorted(
        k for k in body if k in UNSUPPORTED_FIELDS and not is_unset(body[k], UNSUPPORTED_FIELDS[k])
    )
    if refused:
        raise ValueError(f"not supported by this server: {', '.join(refused)}")
    return GenerateReqInput(**{k: v for k, v in body.items() if k in names})


async def stream_generate(tm: TokenizerManager, obj: GenerateReqInput, request: Request):
    """Starts the request (so bad input still gets a 400), then streams SSE lines. The response
    starts before the first output, so that output goes out as soon as it is made."""
    gen = await tm.start_request(obj, request)

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for out in gen:
                yield sse_line(out)
        except ServerFailedError as e:  # the status line is sent already: report in the stream
            yield sse_line({"error": {"message": str(e), "code": 500}})
        yield await sse_done()

    return StreamingResponse(lines(), media_type="text/event-stream")


def add_native_routes(
    app: FastAPI, tm: TokenizerManager, server_args: ServerArgs, scheduler_info: dict
) -> None:
    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process serves HTTP and no part of the server has failed."""
        if tm.fatal_error is not None:
            return error_response(tm.fatal_error, 500)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: live, and room for another request (the port opens only once the model
        is loaded and warm)."""
        if tm.fatal_error is not None:
            return error_response(tm.fatal_error, 500)
        if (message := tm.overloaded_message()) is not None:
            return error_response(message, 503)
        return json_response({"status": "ready"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """A one-token generation through every stage, within HEALTH_GENERATE_TIMEOUT_S."""
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1})

        async def run() -> None:
            async for _ in tm.generate_request(obj):
                pass

        try:
            await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
        except (ServerOverloadedError, ServerFailedError) as e:
            return server_error_response(e)
        except asyncio.TimeoutError:
            return error_response(f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", 503)
        return Response(status_code=200)

    def model_info() -> dict:
        config = tm.hf_config
        return {
            "model_path": server_args.model_path,
            "served_model_name": tm.served_model_name,
            "tokenizer_path": server_args.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    async def server_info() -> dict:
        states = await tm.get_internal_state()
        return {
            **dataclasses.asdict(server_args),
            **scheduler_info,
            "internal_states": states,
            "version": __version__,
        }

    @app.get("/model_info")
    @app.get("/get_model_info")  # SGLang's older name
    async def get_model_info() -> Response:
        return json_response(model_info())

    @app.get("/server_info")
    @app.get("/get_server_info")  # SGLang's older name
    async def get_server_info() -> Response:
        return json_response(await server_info())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        if await tm.flush_cache():
            return Response("Cache flushed.\n", status_code=200)
        return error_response("Cache not flushed: requests are running.", 400)

    async def expert_distribution(action: str, done: str) -> Response:
        try:
            counts = await tm.expert_distribution(action)
        except ValueError as e:
            return error_response(str(e))
        if counts is None:
            return Response(done, status_code=200)
        return json_response({"logical_count": counts})

    # SGLang's expert-distribution routes; the dump is what --init-expert-location reads.
    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_expert_distribution_record() -> Response:
        return await expert_distribution("start", "Expert distribution recording started.\n")

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_expert_distribution_record() -> Response:
        return await expert_distribution("stop", "Expert distribution recording stopped.\n")

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_expert_distribution_record() -> Response:
        return await expert_distribution("dump", "")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            rid = orjson.loads(await request.body())["rid"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return error_response('expected a JSON body {"rid": "..."}')
        tm.abort_request(str(rid))
        return Response(status_code=200)

    if server_args.enable_metrics:  # as SGLang: no route without the flag

        @app.get("/metrics")
        async def metrics() -> Response:
            body = tm.metrics.render(await tm.get_internal_state())
            return Response(body, media_type="text/plain; version=0.0.4")

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            obj = await parse_generate_request(request)
            if obj.stream:
                return await stream_generate(tm, obj, request)
            result = None
            async for out in tm.generate_request(obj, request):
                result = out
            return json_response(result)
        except (ValueError, TypeError) as e:
            return error_response(str(e))
        except (ServerOverloadedError, ServerFailedError) as e:
            return server_error_response(e)


def create_app(tm: TokenizerManager, server_args: ServerArgs, scheduler_info: dict) -> FastAPI:
    from srt.entrypoints.openai.serving import add_openai_routes

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # uvicorn opens the port only after this: clients waiting for /health see a warm server.
        if not server_args.skip_server_warmup:
            logger.info("warm-up done in %.2f s", await tm.warm_up())
        yield

    app = FastAPI(title="srt", lifespan=lifespan)
    if server_args.api_key:
        expected = f"Bearer {server_args.api_key}"

        @app.middleware("http")
        async def check_api_key(request: Request, call_next):
            public = request.url.path in ("/health", "/ready")
            if not public and request.headers.get("authorization") != expected:
                return error_response("Unauthorized: missing or wrong API key.", 401)
            return await call_next(request)

    add_native_routes(app, tm, server_args, scheduler_info)
    add_openai_routes(app, tm)
    return app


def launch_server(server_args: ServerArgs) -> None:
    if server_args.node_rank > 0:  # only this node's scheduler ranks; node 0 serves HTTP
        configure_logging(server_args.log_level, prefix=f"node {server_args.node_rank}")
        run_follower_node(server_args)
        return
    configure_logging(server_args.log_level, prefix="http")
    runtime = launch_subprocesses(server_args, exit_on_child_death=True)
    if runtime.scheduler_info.get("front_end_core"):  # the ranks started: none inherits it
        yield_to_ranks_on_wakeup()
    app = create_app(runtime.tokenizer_manager, server_args, runtime.scheduler_info)
    logger.info(
        "serving %s on http://%s:%d", server_args.model_path, server_args.host, server_args.port
    )
    # uvicorn re-raises SIGTERM after its graceful shutdown; turn it into an exit so the
    # process tree and the IPC directory are cleaned up below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    freeze_startup_heap()
    try:
        uvicorn.run(
            app,
            host=server_args.host,
            port=server_args.port,
            loop="uvloop",
            log_level=server_args.log_level,
            timeout_keep_alive=5,
        )
    finally:
        runtime.shutdown()
