"""Structured output: a request's ``regex``, ``json_schema`` or ``ebnf`` compiled by xgrammar
(SGLang's default grammar backend; it runs on CPU) into a matcher that follows the tokens the
request generates. Each step the batch's matchers fill one token bitmask, which the sampler
applies to the logits (tokens the grammar forbids get -inf), greedy and sampled alike. A
request whose grammar is complete finishes with the stop token the grammar allowed last.

xgrammar is imported on first use; without it, constrained requests are refused with a 400
that says so (the rest of the server is unaffected).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("json_schema", "regex", "ebnf")
ANY_JSON = "$$ANY$$"  # SGLang's json_schema value for "any JSON value"
MISSING = (
    "structured output (regex, json_schema, ebnf, response_format) needs the xgrammar package "
    "(pip install xgrammar), which is not installed"
)


def xgrammar_module() -> Any:
    """The xgrammar module; ValueError (a 400) when it is not installed."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(MISSING) from None
    return xgrammar


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str


def grammar_spec(params: Any) -> GrammarSpec | None:
    """The constraint of a request's SamplingParams (at most one kind), or None."""
    given = [(kind, getattr(params, kind)) for kind in KINDS if getattr(params, kind)]
    if len(given) > 1:
        names = ", ".join(kind for kind, _ in given)
        raise ValueError(f"only one of json_schema, regex and ebnf may be given, got {names}")
    return GrammarSpec(*given[0]) if given else None


def check_grammar(spec: GrammarSpec) -> None:
    """Parse the grammar without a tokenizer; raises ValueError naming the field if invalid."""
    xgr = xgrammar_module()
    try:
        if spec.kind == "regex":
            xgr.Grammar.from_regex(spec.source)
        elif spec.kind == "ebnf":
            xgr.Grammar.from_ebnf(spec.source)
        elif spec.source != ANY_JSON:
            json.loads(spec.source)
            xgr.Grammar.from_json_schema(spec.source)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"{spec.kind} is not valid: {_message(e)}") from None


def _message(error: Exception) -> str:
    """xgrammar's first line without its "[time] file.cc:line: " prefix."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(error).__name__


class GrammarBackend:
    """Compiles grammars for one tokenizer (compiled grammars are cached by xgrammar)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: set[int],
        any_whitespace: bool = True,
        max_whitespace_cnt: int | None = None,
    ):
        xgr = xgrammar_module()
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.vocab_size = vocab_size
        self.any_whitespace, self.max_whitespace_cnt = any_whitespace, max_whitespace_cnt

    def matcher(self, spec: GrammarSpec) -> RequestGrammar:
        xgr = xgrammar_module()
        if spec.kind == "regex":
            compiled = self.compiler.compile_regex(spec.source)
        elif spec.kind == "ebnf":
            compiled = self.compiler.compile_grammar(spec.source)
        elif spec.source == ANY_JSON:
            compiled = self.compiler.compile_builtin_json_grammar()
        else:
            compiled = self.compiler.compile_json_schema(
                spec.source,
                any_whitespace=self.any_whitespace,
                max_whitespace_cnt=self.max_whitespace_cnt,
            )
        return RequestGrammar(xgr.GrammarMatcher(compiled))


class RequestGrammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def batch_bitmask(grammars: list[RequestGrammar | None], vocab_size: int) -> torch.Tensor | None:
    """The batch's token bitmask [B, ceil(V / 32)] int32 on CPU (rows without a grammar allow
    every token), or None when no request of the batch has a grammar."""
    if not any(g is not None for g in grammars):
        return None
    bitmask = xgrammar_module().allocate_token_bitmask(len(grammars), vocab_size)
    for row, grammar in enumerate(grammars):
        if grammar is not None:
            grammar.fill_bitmask(bitmask, row)
    return bitmask


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of forbidden tokens to -inf, in place ([B, V] float, any device)."""
    xgrammar_module().apply_token_bitmask_inplace(logits, bitmask.to(logits.device))
