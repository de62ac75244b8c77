"""`sparrow` command line: generate text, serve the engine (HTTP or gRPC), the gateway over
workers, checkpoint tools. `args.py` holds the flags, `commands.py` what each command does."""

from __future__ import annotations

import sys

from sparrow.cli import commands
from sparrow.cli.args import build_parser
from sparrow.config import ConfigError
from sparrow.logs import setup

COMMANDS = {
    "generate": commands.cmd_generate,
    "serve": commands.cmd_serve,
    "worker": commands.cmd_worker,
    "gateway": commands.cmd_gateway,
    "checkpoint_random": commands.cmd_checkpoint_random,
    "checkpoint_quantize": commands.cmd_checkpoint_quantize,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup(args.log_level)
    from sparrow.loader.weights import CheckpointError

    try:
        return COMMANDS[args.func](args)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"sparrow: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the server has stopped (and said so)
        return 130
