"""``python -m launch_server``: start the srt server."""

from __future__ import annotations

import argparse
import sys

from make_tiny_models import default_model_path

from srt.server_args import ServerArgs


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="python -m launch_server", description=__doc__)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.model_path is None:
        args.model_path = default_model_path()
    try:
        return ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> None:
    server_args = parse_args(argv)
    from srt.entrypoints.http_server import launch_server

    launch_server(server_args)


if __name__ == "__main__":
    main(sys.argv[1:])
