"""Qwen-format tool calls: whole outputs and streams split into text and calls (only the
request's tools count), and the grammar that forces one call."""

from __future__ import annotations

import json
import re

import pytest

from srt.entrypoints.openai.tool_calls import (
    ToolCallStream,
    parse_tool_calls,
    tool_call_ebnf,
)

NAMES = {"get_weather", "now"}
OUTPUT = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)


def test_parse_whole_output():
    content, calls = parse_tool_calls(OUTPUT, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("no calls here", NAMES) == ("no calls here", [])
    broken = '<tool_call>\n{"name": "now", \n</tool_call>'
    assert parse_tool_calls(broken, NAMES) == (broken, [])
    assert parse_tool_calls(OUTPUT.split("\n", 1)[1], NAMES)[0] is None


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_stream_in_pieces(step):
    stream, text, calls = ToolCallStream(NAMES), "", []
    for i in range(0, len(OUTPUT), step):
        plain, done = stream.feed(OUTPUT[i : i + step])
        text, calls = text + plain, calls + done
    text += stream.finish()
    assert [c.name for c in calls] == ["get_weather", "now"] and stream.num_calls == 2
    # The unknown tool's block stays text; nothing of a valid call leaks into it.
    assert "get_weather" not in text and "unknown" in text and text.startswith("Let me check.")


def test_stream_holds_back_only_what_may_start_a_call():
    stream = ToolCallStream(NAMES)
    assert stream.feed("a <tool") == ("a ", [])
    assert stream.feed("box>") == ("<toolbox>", [])
    stream.feed("<tool_call>\n{")
    assert stream.finish() == "<tool_call>\n{"  # an unfinished call ends as text


def test_forced_call_grammar():
    xgrammar = pytest.importorskip("xgrammar")
    tools = [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
        {"name": "now"},
    ]
    grammar = xgrammar.Grammar.from_ebnf(tool_call_ebnf(tools))
    assert re.search(r"tool_call", str(grammar))
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo([chr(i) for i in range(32, 127)]))
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar))
    call = {"name": "get_weather", "arguments": {"city": "Rome"}}
    good = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
    assert all(matcher.accept_string(ch) for ch in good)
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(grammar))
    assert not all(matcher.accept_string(ch) for ch in '<tool_call>\n{"name": "other"')


def test_stream_deltas_with_one_call_only():
    from srt.entrypoints.openai.serving_chat import _tool_stream_deltas

    stream = ToolCallStream(NAMES)
    deltas = _tool_stream_deltas(stream, OUTPUT, True, only_one=True)
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather")]
    stream = ToolCallStream(NAMES)
    deltas = _tool_stream_deltas(stream, OUTPUT, True, only_one=False)
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.index, c.function.name) for c in calls] == [(0, "get_weather"), (1, "now")]
