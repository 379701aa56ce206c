"""Tool calls in Qwen's format (SGLang's ``qwen`` / ``qwen25`` tool-call parser): the model
writes each call as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Whole outputs and streams are split into text and calls (a block that is not a call of one of
the request's tools stays text). ``tool_choice`` "required" or a named function constrains the
output to one such call: an EBNF grammar of the block, the JSON inside following the tools'
parameter schemas, which structured output then enforces.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from srt.constrained.grammar import xgrammar_module

BOT, EOT = "<tool_call>\n", "\n</tool_call>"
_BLOCK = re.compile(re.escape(BOT) + r"(.*?)" + re.escape(EOT), re.DOTALL)


@dataclass
class ToolCallOut:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _parse_block(block: str, names: set[str]) -> ToolCallOut | None:
    try:
        call = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return ToolCallOut(call["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCallOut]]:
    """(the text before the first call, or None if empty; the calls) of a whole output; the
    whole text and no calls when it holds no valid call."""
    calls = [c for c in (_parse_block(b, names) for b in _BLOCK.findall(text)) if c is not None]
    if not calls:
        return text, []
    content = text[: text.find(BOT)].strip()
    return content or None, calls


class ToolCallStream:
    """Splits a stream of text deltas into text to send now and calls completed so far; text
    that may be the start of a call is held back until it is known."""

    def __init__(self, names: set[str]):
        self.names, self.buffer, self.in_call = names, "", False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCallOut]]:
        self.buffer += delta
        text, calls = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find(BOT)
                if start == -1:
                    keep = _partial_suffix(self.buffer, BOT)
                    cut = len(self.buffer) - keep
                    text, self.buffer = text + self.buffer[:cut], self.buffer[cut:]
                    break
                text += self.buffer[:start]
                self.buffer, self.in_call = self.buffer[start + len(BOT) :], True
            else:
                end = self.buffer.find(EOT)
                if end == -1:
                    break
                block, self.buffer = self.buffer[:end], self.buffer[end + len(EOT) :]
                self.in_call = False
                call = _parse_block(block, self.names)
                if call is None:
                    text += BOT + block + EOT
                else:
                    calls.append(call)
        self.num_calls += len(calls)
        return text, calls

    def finish(self) -> str:
        """What is still held back (an unfinished call stays text)."""
        rest = (BOT if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return rest


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of ``text`` that begins ``token``."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


def tool_call_ebnf(tools: list[dict[str, Any]]) -> str:
    """EBNF of exactly one call block of one of ``tools`` (OpenAI function dicts: name and
    parameters), the JSON compact."""
    xgr = xgrammar_module()
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["name"]},
                "arguments": tool.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for tool in tools
    ]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    begin = xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"')
    end = xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"')
    return str(xgr.Grammar.concat(begin, call, end))


def active_tools(tools: list[Any] | None, tool_choice: Any) -> list[dict[str, Any]]:
    """The request's tools as OpenAI function dicts, unless tool_choice is "none"."""
    if not tools or tool_choice == "none":
        return []
    return [tool.function.model_dump(exclude_none=True) for tool in tools]


def forced_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools one of which must be called ("required", or the named one), else None."""
    if tool_choice == "required":
        return tools
    name = getattr(getattr(tool_choice, "function", None), "name", None)
    return [tool for tool in tools if tool["name"] == name] if name else None
