"""A deterministic stand-in for the TokenizerManager, with the interface the OpenAI layer uses:
``generate_request``, ``start_request``, ``expand_parallel_samples``, ``tokenizer``,
``served_model_name``, ``model_path``, ``context_len``.

Every request answers with the words of CANNED, one token each, cut by ``max_new_tokens``
(finish "length") or by a stop string (finish "stop", the stop string trimmed), else ending with
EOS (finish "stop"). A text prompt containing "abort" is aborted after two tokens; one
containing "slow" takes SLOW_STEP_S per token. Bad input
raises ValueError before anything is yielded, like the real one.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from srt.entrypoints.openai import add_openai_routes
from srt.managers.io_struct import GenerateReqInput
from srt.sampling.sampling_params import SamplingParams

CANNED = ["Hello", " world", "!", " How", " are", " you", "?"]
FIRST_ID = 1000  # output token i has id FIRST_ID + i
EOS_ID = 2
VOCAB_SIZE = 2000
MODEL = "tiny-moe"
MODEL_PATH = "/models/tiny-moe"
SLOW_STEP_S = 0.5


class FakeTokenizer:
    """One token per character for prompts (plus a BOS of id 1 when asked); ids from
    FIRST_ID decode to the CANNED words."""

    def apply_chat_template(
        self,
        conversation: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str:
        assert tokenize is False
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in conversation)
        return text + ("<|assistant|>" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(CANNED[i - FIRST_ID] if i >= FIRST_ID else chr(i) for i in ids)


class FakeTokenizerManager:
    def __init__(self, tokenizer: Any = None, context_len: int = 64, token_text: bool = False):
        self.token_text = token_text  # fill the text of logprob entries (else None)
        self.tokenizer = tokenizer or FakeTokenizer()
        self.served_model_name = MODEL
        self.model_path = MODEL_PATH
        self.context_len = context_len
        self.tool_call_parser = "qwen25"
        self.requests: list[GenerateReqInput] = []
        self.aborted: list[str] = []

    def admit(self, num_requests: int) -> None:
        """Room for every request (the real bound is tested against a real server)."""

    async def start_request(self, obj: GenerateReqInput, request: Any = None):
        """The stream, once its input is checked (as the real one: closing it aborts)."""
        gen = self.generate_request(obj, request, _announce_submitted=True)
        await gen.__anext__()
        return gen

    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None, *, _announce_submitted: bool = False
    ):
        self.requests.append(obj)
        prompt_len = self._check(obj)
        steps = self._plan(obj)
        step_s = SLOW_STEP_S if "slow" in (obj.text or "") else 0
        try:
            if _announce_submitted:
                yield None
            for num_tokens, text, finish in steps:
                if obj.stream or finish is not None:
                    yield self._output(obj, prompt_len, num_tokens, text, finish)
                await asyncio.sleep(step_s)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(obj.rid)
            raise

    async def expand_parallel_samples(self, items: list[GenerateReqInput], request: Any = None):
        """n copies of each request (rids ``{rid}-{i}``), as the real one does."""
        for item in items:
            self._check(item)
        out = []
        for item in items:
            n = (item.sampling_params or {}).get("n") or 1
            for i in range(n):
                params = {**item.sampling_params, "n": 1}
                rid = item.rid if n == 1 else f"{item.rid}-{i}"
                out.append(dataclasses.replace(item, rid=rid, sampling_params=params))
        return out

    def _check(self, obj: GenerateReqInput) -> int:
        copy.deepcopy(obj).normalize_batch_and_arguments()  # a valid single request
        assert isinstance(obj.text, str) or isinstance(obj.input_ids[0], int)
        SamplingParams.from_dict(obj.sampling_params).verify(VOCAB_SIZE)
        ids = obj.input_ids if obj.input_ids is not None else self.tokenizer.encode(obj.text)
        bad = [t for t in ids if not 0 <= t < VOCAB_SIZE]
        if bad:
            raise ValueError(f"input_ids: token ids out of range [0, {VOCAB_SIZE}): {bad}")
        if len(ids) > self.context_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than the maximum")
        return len(ids)

    def _plan(self, obj: GenerateReqInput) -> list[tuple[int, str, dict | None]]:
        """(tokens so far, cumulative text, finish reason) after each step."""
        params = obj.sampling_params or {}
        stops = params.get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        max_new = params.get("max_new_tokens", 128)
        steps = []
        for k in range(1, len(CANNED) + 1):
            text, finish = "".join(CANNED[:k]), None
            prompt = obj.text or "".join(chr(i) for i in obj.input_ids or [] if i > 1)
            if k == 2 and "held" in prompt:  # the detokenizer holds token 2's text back
                text = CANNED[0]
            matched = [s for s in stops if s in text]
            if matched:
                text, finish = (
                    text[: text.index(matched[0])],
                    {"type": "stop", "matched": matched[0]},
                )
            elif k == 2 and "abort" in (obj.text or ""):
                finish = {"type": "abort", "message": "Aborted by request."}
            elif k == max_new:
                finish = {"type": "length", "length": k}
            elif k == len(CANNED):
                finish = {"type": "stop", "matched": EOS_ID}
            steps.append((k, text, finish))
            if finish is not None:
                return steps
        return steps

    def _output(
        self, obj: GenerateReqInput, prompt_len: int, k: int, text: str, finish: dict | None
    ) -> dict:
        meta = {
            "id": obj.rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": k,
            "cached_tokens": 0,
        }
        if finish is not None:
            meta["e2e_latency"] = 0.01
        if obj.return_logprob:
            meta["output_token_logprobs"] = [
                (-0.5 * (i + 1), FIRST_ID + i, f"<{i}>" if self.token_text else None)
                for i in range(k)
            ]
            meta["output_top_logprobs"] = [self._top_row(obj, i) for i in range(k)]
        ids = [FIRST_ID + i for i in range(k)]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    @staticmethod
    def _top_row(obj: GenerateReqInput, i: int) -> list | None:
        num = obj.top_logprobs_num or 0
        if num == 0:
            return None
        return [(-0.5 * (i + 1) - j, FIRST_ID + (i + j) % len(CANNED), None) for j in range(num)]


def make_client(tm: FakeTokenizerManager) -> TestClient:
    app = FastAPI()
    add_openai_routes(app, tm)
    return TestClient(app)


def sse_events(client: TestClient, url: str, body: dict) -> list[Any]:
    """The decoded `data:` events of a streamed response; the final [DONE] stays a string."""
    with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    events = [line[len("data: ") :] for line in lines]
    return [e if e == "[DONE]" else json.loads(e) for e in events]
