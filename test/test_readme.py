"""The README's console examples run as written: each ``$ curl`` command is sent by curl itself
to a server started as ``make serve`` starts it (the bundled model, no flags), and what it
prints matches the line the README shows under it, ``...`` standing for what the README leaves
out."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from make_tiny_models import bundled_model_path

from benchmark.common.server import ServerProcess

README = Path(__file__).resolve().parents[1] / "README.md"
README_URL = "127.0.0.1:30000"


def console_examples(text: str) -> list[tuple[str, str]]:
    """(command, expected output) for each ``$ `` command in the README's console blocks; a
    command's continuation lines end in a backslash, its output is the next line."""
    examples = []
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ "):
                i += 1
                continue
            command = lines[i][2:]
            while command.endswith("\\"):
                i += 1
                command = command[:-1] + lines[i]
            examples.append((command, lines[i + 1]))
            i += 2
    return examples


def pattern(expected: str) -> re.Pattern:
    """The README's output line as a pattern: literal but for ``...``, which matches anything."""
    return re.compile(".*".join(re.escape(part) for part in expected.split("...")), re.S)


def test_the_readme_has_its_examples():
    examples = console_examples(README.read_text())
    assert [shlex.split(c)[2] for c, _ in examples] == [
        f"{README_URL}/generate",
        f"{README_URL}/v1/chat/completions",
    ]
    assert pattern('{"a":{...}}').fullmatch('{"a":{"b":1}}')
    assert not pattern('{"a":{...}}').fullmatch('{"a":[1]}')


@pytest.mark.slow  # starts the bundled model's server
@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_readme_curl_examples_answer_as_shown():
    examples = console_examples(README.read_text())
    with ServerProcess.running(bundled_model_path()) as server:
        host_port = server.url.removeprefix("http://")
        for command, expected in examples:
            argv = [arg.replace(README_URL, host_port) for arg in shlex.split(command)]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True)
            assert pattern(expected).fullmatch(out.stdout.strip()), (command, out.stdout)
