"""docs/flags.md is what ``srt.server_args_doc`` generates from ``ServerArgs`` today, and it
shows what the generator promises: every flag and alias, the groups of --help, the defaults
per device."""

from __future__ import annotations

import argparse

import pytest

from srt.server_args import ServerArgs
from srt.server_args_doc import COMMAND, DOC_PATH, render


def test_committed_flags_doc_is_up_to_date():
    if DOC_PATH.read_text() != render():
        pytest.fail(f"docs/flags.md is out of date: run {COMMAND}")


def test_flags_doc_lists_every_flag_in_the_help_groups():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    text = render()
    flags = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert all(f"`{name}`" in text for a in flags for name in a.option_strings)
    titles = [g.title for g in parser._action_groups if set(g._group_actions) & set(flags)]
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == titles
    assert "`--chunked-prefill-size` (default: CPU `2048`, GPU `8192`)" in text
    assert "`--tp-size`, `--tp`, `--tensor-parallel-size` (default `1`)" in text
