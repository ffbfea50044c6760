"""Entry point of the ``opake`` console command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from opake.cli import _bench, _epsilon, _info, _train, _tune

__all__ = ["OneLineErrorParser", "build_parser", "main"]


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = OneLineErrorParser(
        prog="opake",
        description="Opake: differentially private training (DP-SGD) for PyTorch.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _info.register(sub)
    _train.register(sub)
    _epsilon.register(sub)
    _bench.register(sub)
    _tune.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opake`` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    from opake.core.errors import OpakeError

    try:
        return int(args.run(args) or 0)
    except OpakeError as err:
        print(f"opake {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
