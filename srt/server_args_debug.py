"""The logging, metrics and debugging flags of ``ServerArgs``, a dataclass of their own that
``ServerArgs`` extends, and the one table of environment variables srt reads as their aliases.

An environment variable sets its flag's field when the flag was left at its default (an
explicit flag wins); ``ServerArgs.check_and_resolve`` applies the table once, right after
parsing, so no module reads these variables anywhere else."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from srt.server_args_choices import LOG_LEVEL_CHOICES
from srt.server_args_overlap import _arg


class EnvAlias(NamedTuple):
    """An environment variable and the ``ServerArgs`` field it sets: a flag is on when the
    variable is set to anything but ``0``; a path field takes the variable's value."""

    variable: str
    field: str


ENV_ALIASES = (
    EnvAlias("SRT_STREAM_TRACE", "stream_trace_dir"),
    EnvAlias("SRT_FORBID_HOST_SYNC", "forbid_host_sync"),
    EnvAlias("SRT_OPERATION_PROFILE", "enable_operation_profile"),
)


@dataclass
class DebugArgs:
    log_level: str = field(
        default="info",
        metadata=_arg("logging", "Logging level.", choices=LOG_LEVEL_CHOICES),
    )
    enable_metrics: bool = field(
        default=False,
        metadata=_arg(
            "logging",
            "Record Prometheus metrics (request latencies, token counters, the schedulers' "
            "gauges) and serve them at GET /metrics; without it, as in SGLang, none are "
            "recorded and /metrics answers 404.",
        ),
    )
    stream_trace_dir: str | None = field(
        default=None,
        metadata=_arg(
            "debugging",
            "Folder where every srt process logs each stream's per-token timestamps and each "
            "rank's forward steps (benchmark/serving/stream_timeline.py reads them; also: "
            "environment SRT_STREAM_TRACE=DIR).",
        ),
    )
    forbid_host_sync: bool = field(
        default=False,
        metadata=_arg(
            "debugging",
            "Fail any host synchronisation (a device value read on the host) inside a forward, "
            "on CPU too: what keeps a step device-resident and capturable in a CUDA graph "
            "(also: environment SRT_FORBID_HOST_SYNC=1).",
        ),
    )


def apply_env_aliases(args: object, environ: Mapping[str, str] = os.environ) -> None:
    """Set each aliased field still at its default from its environment variable."""
    defaults = {f.name: f.default for f in args.__dataclass_fields__.values()}
    for variable, name in ENV_ALIASES:
        value = environ.get(variable)
        if not value or getattr(args, name) != defaults[name]:
            continue
        setattr(args, name, value != "0" if isinstance(defaults[name], bool) else value)
