"""docs/flags.md, generated from ``ServerArgs``: every flag of ``python -m launch_server`` in the
groups of its ``--help``, each with its other spellings, its choices, its help and its default,
for CPU and for GPU where srt resolves the two differently. ``python -m srt.server_args_doc``
rewrites the file; test/test_flags_doc.py fails while the committed one differs."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
from pathlib import Path
from typing import Any

from srt.server_args import ServerArgs

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "flags.md"
COMMAND = "python -m srt.server_args_doc"

HEADER = f"""\
# Server flags

Every flag of `python -m launch_server`, in the groups of its `--help`; `srt.Engine` takes the
same names as keyword arguments (`--tp-size 2`: `tp_size=2`). Generated from `ServerArgs` by
`{COMMAND}` (edit the help in `srt/server_args*.py`, then rerun it).

A default is the one srt resolves at start-up with every other flag at its default, shown for
CPU and for GPU where the two differ. Values chosen by looking at the machine stay `auto`
here (`--device`, `--attention-backend`); the help says how they resolve.
"""


def resolved_defaults(device: str) -> dict[str, Any]:
    """Every field's default as ``ServerArgs.resolve_for_device`` resolves it for ``device``,
    without a model or the machine (no GPU, no kernel build, no environment aliases); the
    device itself stays ``auto``, the machine's choice."""
    args = object.__new__(ServerArgs)  # the declared defaults, without __post_init__'s checks
    for f in dataclasses.fields(ServerArgs):
        setattr(args, f.name, f.default)
    args.device = device
    args.resolve_for_device()
    return {**vars(args), "device": "auto"}


def _value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _default(action: argparse.Action, cpu: Any, gpu: Any) -> str | None:
    """The default's text; none for an unset value or a switch that stays off (the help says
    what either means)."""
    if cpu != gpu:
        return f"default: CPU `{_value(cpu)}`, GPU `{_value(gpu)}`"
    if cpu is None or (isinstance(action, argparse._StoreTrueAction) and cpu is False):
        return None
    return f"default `{_value(cpu)}`"


def _flag(action: argparse.Action, cpu: dict[str, Any], gpu: dict[str, Any]) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    facts = []
    if action.choices is not None:
        facts.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    default = _default(action, cpu[action.dest], gpu[action.dest])
    if default is not None:
        facts.append(default)
    line = f"- {names}" + (f" ({'; '.join(facts)})" if facts else "") + f": {action.help}"
    return textwrap.fill(
        line, width=100, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False
    )


def render() -> str:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    cpu, gpu = resolved_defaults("cpu"), resolved_defaults("cuda")
    parts = [HEADER.rstrip("\n")]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if actions:
            parts.append(f"## {group.title}\n\n" + "\n".join(_flag(a, cpu, gpu) for a in actions))
    return "\n\n".join(parts) + "\n"


def main() -> None:
    DOC_PATH.write_text(render())
    print(f"wrote {DOC_PATH}")


if __name__ == "__main__":
    main()
