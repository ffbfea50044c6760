"""Command-line metadata of a settings dataclass, declared once on each field.

Each field of :class:`~opake.cli._settings.TrainSettings` is declared with :func:`option` (an
``opake train`` option) or :func:`internal` (no option); the argument table
(:func:`add_arguments`) and the resume lock (:func:`locked_fields`) are derived from the
fields, in field order.

>>> import dataclasses
>>> @dataclasses.dataclass(frozen=True)
... class Demo:
...     size: int = option(4, group="g", type=int, help="a size", locked=True)
...     quiet: bool = option(False, group="g", help="say less")
>>> locked_fields(Demo)
('size',)
>>> p = argparse.ArgumentParser()
>>> add_arguments(p, Demo)
>>> p.parse_args(["--size", "3", "--quiet"])
Namespace(size=3, quiet=True)
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "Option",
    "add_arguments",
    "flag",
    "int_or_auto",
    "internal",
    "locked_fields",
    "option",
    "options_of",
    "values_from_args",
]

#: key of a field's metadata holding its :class:`Option` (or ``None`` for an internal field)
KEY = "opake.cli"


@dataclass(frozen=True)
class Option:
    """How one settings field appears on the command line.

    A ``bool`` field is a switch: ``--name`` (``store_true``) when its default is ``False``,
    ``--no-name`` (``store_false``) when it is ``True``. Any other field takes a value,
    converted by *type* (``None``: the text itself).

    Attributes:
        group: title of the ``--help`` section; sections appear in the order of their first
            field, options in field order.
        help: the ``--help`` text (``None``: none).
        type: converter of the value.
        choices: the values allowed (argparse refuses others).
        metavar: placeholder of the value in ``--help``.
        exclusive: a name shared by consecutive fields of one section that are mutually
            exclusive on the command line; their parser default is ``None`` (the settings
            builder fills in *fallback* when none of them is given).
        fallback: with *exclusive*, the value of this field when no field of its set is
            given on the command line (``None``: stays unset).
        locked: a resumed run must keep this setting (it decides data, model, privacy or
            schedule).
    """

    group: str
    help: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    exclusive: str | None = None
    fallback: Any = None
    locked: bool = False


#: a field's value type (what ``dataclasses.field(default=...)`` returns)
_T = TypeVar("_T")


def option(
    default: _T,
    *,
    group: str,
    help: str | None = None,  # argparse's name
    type: Callable[[str], Any] | None = None,  # argparse's name
    choices: Sequence[str] | None = None,
    metavar: str | None = None,
    exclusive: str | None = None,
    fallback: Any = None,
    locked: bool = False,
) -> _T:
    """A dataclass field with *default* and its command-line :class:`Option`."""
    meta = Option(group, help, type, choices, metavar, exclusive, fallback, locked)
    return dataclasses.field(default=default, metadata={KEY: meta})


def internal(default: _T) -> _T:
    """A dataclass field with *default* and no command-line option."""
    return dataclasses.field(default=default, metadata={KEY: None})


def int_or_auto(text: str) -> int | str:
    """An integer, or the word ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


def options_of(cls: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """The fields of dataclass *cls* that have an option, in field order.

    Raises:
        TypeError: a field declared with neither :func:`option` nor :func:`internal`.
    """
    found = []
    for f in dataclasses.fields(cls):
        if KEY not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with option() or internal()")
        if f.metadata[KEY] is not None:
            found.append((f, f.metadata[KEY]))
    return found


def locked_fields(cls: type) -> tuple[str, ...]:
    """Names of the fields of *cls* a resumed run must keep, in field order."""
    return tuple(f.name for f, o in options_of(cls) if o.locked)


def values_from_args(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The field values of dataclass *cls* in the parsed *args* (fields missing there keep
    their default), with the *fallback* of each exclusive set of which no field was given."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    sets: dict[str, list[tuple[dataclasses.Field[Any], Option]]] = {}
    for f, o in options_of(cls):
        if o.exclusive is not None:
            sets.setdefault(o.exclusive, []).append((f, o))
    for members in sets.values():
        if all(values.get(f.name) is None for f, _ in members):
            values.update({f.name: o.fallback for f, o in members if o.fallback is not None})
    return values


def flag(name: str) -> str:
    """The command-line spelling of field *name* (without dashes)."""
    return name.replace("_", "-")


def add_arguments(p: argparse.ArgumentParser, cls: type) -> None:
    """Add an option to *p* for every option field of dataclass *cls*, section by section."""
    sections: dict[str, list[tuple[dataclasses.Field[Any], Option]]] = {}
    for f, o in options_of(cls):
        sections.setdefault(o.group, []).append((f, o))
    for title, members in sections.items():
        group = p.add_argument_group(title)
        exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
        for f, o in members:
            target: argparse._ActionsContainer = group
            if o.exclusive is not None:
                if o.exclusive not in exclusive:
                    exclusive[o.exclusive] = group.add_mutually_exclusive_group()
                target = exclusive[o.exclusive]
            _add(target, f, o)


def _add(target: argparse._ActionsContainer, f: dataclasses.Field[Any], o: Option) -> None:
    extra: dict[str, Any] = {} if o.help is None else {"help": o.help}
    if isinstance(f.default, bool):
        if f.default:
            target.add_argument(f"--no-{flag(f.name)}", dest=f.name, action="store_false", **extra)
        else:
            target.add_argument(f"--{flag(f.name)}", action="store_true", **extra)
        return
    if o.type is not None:
        extra["type"] = o.type
    if o.choices is not None:
        extra["choices"] = o.choices
    if o.metavar is not None:
        extra["metavar"] = o.metavar
    default = None if o.exclusive is not None else f.default
    target.add_argument(f"--{flag(f.name)}", default=default, **extra)
