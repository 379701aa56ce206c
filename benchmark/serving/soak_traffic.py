"""The soak benchmark's requests (``benchmark/serving/soak.py``): what each kind sends, and what
counts as a correct answer to it."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import httpx

WORDS = (
    "the of and to in is was for on are with as by at from that this be which or an were "
    "river mountain city garden window number letter market engine signal paper morning"
).split()
# Prompts share these prefixes, so the prefix cache is hit, split and evicted all the time.
PREFIXES = [" ".join(random.Random(i).choices(WORDS, k=40 + 30 * i)) for i in range(4)]
KINDS = {"native": 3, "native_stream": 2, "completion": 2, "chat": 2, "abort": 1, "bad": 1}
BAD_REQUESTS = [  # each must be answered with a 400
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"text": "hi", "no_such_field": 1}),
    ("/generate", b"{not json"),
    ("/generate", {"input_ids": [10**9]}),
    ("/generate", {"input_ids": [1] * 5000}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}),
    ("/v1/chat/completions", {"messages": "not a list"}),
]


@dataclass
class Request:
    kind: str
    route: str
    body: dict | bytes
    stream: bool = False
    abort_after: int = 0  # abort: chunks read before the client closes the stream
    greedy: bool = False


@dataclass
class Outcome:
    kind: str
    failure: str | None = None
    reference: tuple[dict, list[int]] | None = field(default=None, repr=False)


def _prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + " " + " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))


def _sampling(rng: random.Random) -> tuple[dict, bool]:
    greedy = rng.random() < 0.5
    params = {"temperature": 0.0} if greedy else {"temperature": 0.7, "top_p": 0.9}
    params["max_new_tokens"] = rng.randint(1, 64)
    params["ignore_eos"] = rng.random() < 0.5
    return params, greedy


def make_request(rng: random.Random) -> Request:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    if kind == "bad":
        route, body = rng.choice(BAD_REQUESTS)
        return Request(kind, route, body)
    params, greedy = _sampling(rng)
    if kind in ("native", "native_stream"):
        body = {"text": _prompt(rng), "sampling_params": params, "stream": kind != "native"}
        return Request(kind, "/generate", body, body["stream"], greedy=greedy)
    if kind == "abort":
        params["max_new_tokens"] = 500
        body = {"text": _prompt(rng), "sampling_params": params, "stream": True}
        return Request(kind, "/generate", body, True, abort_after=rng.randint(1, 5))
    openai = {
        "max_tokens": params["max_new_tokens"],
        "temperature": params["temperature"],
        "stream": rng.random() < 0.5,
    }
    if kind == "completion":
        return Request(
            kind, "/v1/completions", {"prompt": _prompt(rng), **openai}, openai["stream"]
        )
    messages = [{"role": "user", "content": _prompt(rng)}]
    return Request(kind, "/v1/chat/completions", {"messages": messages, **openai}, openai["stream"])


def run_request(http: httpx.Client, req: Request) -> Outcome:
    try:
        if req.kind == "bad":
            return _run_bad(http, req)
        if req.stream:
            return _run_stream(http, req)
        return _run_plain(http, req)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Outcome(req.kind, f"{type(e).__name__}: {e}")


def _run_bad(http: httpx.Client, req: Request) -> Outcome:
    kwargs = {"content": req.body} if isinstance(req.body, bytes) else {"json": req.body}
    response = http.post(req.route, **kwargs)
    ok = response.status_code == 400
    return Outcome(req.kind, None if ok else f"{req.body!r:.80}: {response.status_code}")


def _run_plain(http: httpx.Client, req: Request) -> Outcome:
    response = http.post(req.route, json=req.body)
    if response.status_code != 200:
        return Outcome(req.kind, f"HTTP {response.status_code}: {response.text[:200]}")
    out = response.json()
    if req.kind == "native":
        meta = out["meta_info"]
        failure = _native_failure(meta, req.body["sampling_params"]["max_new_tokens"])
        reference = (req.body, out["output_ids"]) if req.greedy and failure is None else None
        return Outcome(req.kind, failure, reference)
    reason = out["choices"][0]["finish_reason"]
    tokens = out["usage"]["completion_tokens"]
    bad = reason not in ("stop", "length") or not 1 <= tokens <= req.body["max_tokens"]
    return Outcome(req.kind, f"finish {reason}, {tokens} tokens" if bad else None)


def _native_failure(meta: dict, max_new_tokens: int) -> str | None:
    reason = (meta.get("finish_reason") or {}).get("type")
    tokens = meta["completion_tokens"]
    if reason not in ("length", "stop") or not 1 <= tokens <= max_new_tokens:
        return f"finish {meta.get('finish_reason')}, {tokens} tokens"
    return None


def _run_stream(http: httpx.Client, req: Request) -> Outcome:
    with http.stream("POST", req.route, json=req.body) as response:
        if response.status_code != 200:
            return Outcome(req.kind, f"HTTP {response.status_code}")
        chunks, done = [], False
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[len("data: ") :]))
            if req.abort_after and len(chunks) >= req.abort_after:
                return Outcome(req.kind)  # closing the stream aborts the request
    if not done or not chunks or any("error" in c for c in chunks):
        return Outcome(req.kind, f"stream ended without [DONE] or with an error: {chunks[-1:]}")
    if req.kind in ("native_stream", "abort"):  # an abort whose request finished first
        return Outcome(
            req.kind,
            _native_failure(chunks[-1]["meta_info"], req.body["sampling_params"]["max_new_tokens"]),
        )
    reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
    ok = any(r in ("stop", "length") for r in reasons)
    return Outcome(req.kind, None if ok else f"no finish reason in {len(chunks)} chunks")
