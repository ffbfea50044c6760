"""Entry point of the ``opake`` console command."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import NoReturn

from opake.cli import _audit, _bench, _epsilon, _info, _train, _tune
from opake.cli._version import __version__

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
    parser.add_argument("--version", action="version", version=f"opake {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _info.register(sub)
    _train.register(sub)
    _epsilon.register(sub)
    _bench.register(sub)
    _tune.register(sub)
    _audit.register(sub)
    return parser


#: options whose value may itself start with "-" (``--script-args "--help"``)
_DASHED_VALUE_OPTIONS = ("--script-args",)


def _join_dashed_values(argv: Sequence[str]) -> list[str]:
    """``["--script-args", "--quick"]`` → ``["--script-args=--quick"]``: argparse would read the
    value as an option of its own.

    >>> _join_dashed_values(["bench", "x", "--script-args", "--help", "--timeout", "5"])
    ['bench', 'x', '--script-args=--help', '--timeout', '5']
    """
    out: list[str] = []
    items = iter(argv)
    for item in items:
        if item in _DASHED_VALUE_OPTIONS:
            value = next(items, None)
            out.append(item if value is None else f"{item}={value}")
        else:
            out.append(item)
    return out


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> NoReturn:
    """Refuse arguments the subcommand does not know, in the subcommand's name (``opake train:
    error: ... (see opake train --help)``), suggesting the nearest option of that command."""
    sub = next(
        action.choices[command]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    message = f"unrecognized arguments: {' '.join(extra)}"
    options = [o for action in sub._actions for o in action.option_strings if o.startswith("--")]
    first = extra[0].split("=", 1)[0]
    if first.startswith("--"):
        close = difflib.get_close_matches(first, options, n=1, cutoff=0.5)
        near = [o for o in options if first[2:] and first[2:] in o]
        guess = close or near[:1]
        if guess:
            message += f"; did you mean {guess[0]}?"
    sub.error(message)  # exits
    raise AssertionError("unreachable")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``opake`` command; returns the process exit code."""
    parser = build_parser()
    args, extra = parser.parse_known_args(
        _join_dashed_values(sys.argv[1:] if argv is None else argv)
    )
    if extra:
        _unrecognized(parser, args.command, extra)
    from opake.core.errors import OpakeError

    try:
        return int(args.run(args) or 0)
    except OpakeError as err:
        print(f"opake {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
