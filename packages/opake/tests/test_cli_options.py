"""Each ``opake train`` option is declared once, on its :class:`TrainSettings` field; the argument
table and the resume lock are derived from the fields (issue 34, point 5)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from opake.cli._options import add_arguments, internal, locked_fields, option, options_of
from opake.cli._plan import _check_resumed_settings
from opake.cli._settings import (
    RESUME_LOCKED,
    TrainSettings,
    add_train_arguments,
    settings_from_args,
)
from opake.cli._sources import model_help
from opake.core.errors import ConfigurationError

#: the table of the hand-written parser this derivation replaced (generated from it, once)
GOLDEN = Path(__file__).parent / "data" / "train_options.json"


def option_table(p: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """Everything ``--help`` and parsing depend on, action by action, in the parser's order."""
    groups = {id(a): g.title for g in p._action_groups for a in g._group_actions}
    exclusive = {
        id(a): i for i, m in enumerate(p._mutually_exclusive_groups) for a in m._group_actions
    }
    return [
        {
            "section": groups[id(a)],
            "flags": a.option_strings,
            "dest": a.dest,
            "action": type(a).__name__,
            "default": a.default,
            "type": getattr(a.type, "__name__", a.type),
            "choices": None if a.choices is None else list(a.choices),
            "metavar": a.metavar,
            "exclusive": exclusive.get(id(a)),
            "help": a.help,
        }
        for a in p._actions
        if a.dest != "help"
    ]


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="opake train")
    add_train_arguments(p)
    return p


def test_the_derived_table_is_the_hand_written_one():
    derived = option_table(_train_parser())
    # the model list comes from the registry (plugins add to it): one source, model_help
    assert derived[0]["help"] == model_help(TrainSettings.model)
    derived[0]["help"] = "model_help('llama-small')"
    for row in derived:  # the converter was renamed when it moved to _options
        if row["type"] == "int_or_auto":
            row["type"] = "_int_or_auto"
    assert derived == json.loads(GOLDEN.read_text(encoding="utf-8"))


def test_the_derived_help_lists_sections_and_options_in_the_hand_written_order():
    text = _train_parser().format_help()
    sections = ["model and data:", "privacy:", "optimisation:", "memory and speed:", "run:"]
    assert [text.index(s) for s in sections] == sorted(text.index(s) for s in sections)
    usage = text.split("\n\n")[0]
    flags = [row["flags"][0] for row in json.loads(GOLDEN.read_text(encoding="utf-8"))]
    assert re.findall(r"--[a-z-]+", usage) == flags


def test_the_resume_lock_is_derived_and_unchanged():
    assert locked_fields(TrainSettings) == RESUME_LOCKED
    assert RESUME_LOCKED == (
        "model", "data", "text_field", "objective", "dpo_beta", "privacy_unit",
        "max_records_per_unit", "block_size", "val_fraction", "lora_r", "lora_alpha",
        "dropout", "target_epsilon", "noise_multiplier", "delta", "accountant", "clip",
        "batch_size", "sampler", "steps", "epochs", "lr", "warmup", "optimizer", "weight_decay",
        "shard", "seed", "reproducible",
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Grown(TrainSettings):
    """The settings with one more locked option, declared in one place only."""

    new_knob: int = option(3, group="run", type=int, help="a new knob", locked=True)
    scratch: str = internal("x")


def test_a_new_locked_field_is_locked_without_touching_a_second_list():
    assert locked_fields(_Grown) == (*RESUME_LOCKED, "new_knob")
    saved = _Grown(new_knob=3).to_dict()
    _check_resumed_settings(saved, _Grown(new_knob=3))  # same: accepted
    with pytest.raises(ConfigurationError, match=r"--new-knob 3 \(saved\) vs 4 \(given\)"):
        _check_resumed_settings(saved, _Grown(new_knob=4))
    _check_resumed_settings(saved, _Grown(new_knob=3, scratch="y"))  # internal: not locked
    p = argparse.ArgumentParser()
    add_arguments(p, _Grown)
    assert p.parse_args(["--new-knob", "5"]).new_knob == 5
    assert "--scratch" not in p.format_help()


def test_every_field_has_exactly_one_option_or_is_internal():
    flags = [f for row in option_table(_train_parser()) for f in row["flags"]]
    assert len(flags) == len(set(flags))
    dests = [row["dest"] for row in option_table(_train_parser())]
    fields = [f.name for f in dataclasses.fields(TrainSettings)]
    with_option = [f.name for f, _ in options_of(TrainSettings)]
    assert set(dests) <= set(fields)  # each dest is a field
    assert sorted(dests) == sorted(with_option)  # one option per option field
    internal_fields = set(fields) - set(with_option)
    for f in dataclasses.fields(TrainSettings):  # the rest are declared internal
        assert (f.name in internal_fields) == (f.metadata["opake.cli"] is None)


def test_an_undeclared_field_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Bare:
        size: int = 1

    with pytest.raises(TypeError, match=r"Bare.size: declare it with option\(\) or internal\(\)"):
        locked_fields(Bare)


def test_every_default_is_the_settings_default_or_filled_in_when_none_is_given():
    defaults = TrainSettings()
    for row in option_table(_train_parser()):
        if row["exclusive"] is None:
            assert row["default"] == getattr(defaults, row["dest"]), row
        else:
            assert row["default"] is None, row


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], {"target_epsilon": 8.0, "noise_multiplier": None, "steps": 240, "epochs": None}),
        (["--noise-multiplier", "1.5", "--epochs", "2"], {"target_epsilon": None, "steps": None}),
        (["--target-epsilon", "3", "--steps", "7"], {"target_epsilon": 3.0, "steps": 7}),
    ],
)
def test_an_exclusive_pair_takes_its_fallback_only_when_neither_is_given(argv, expected):
    settings = settings_from_args(_train_parser().parse_args(argv))
    assert {k: getattr(settings, k) for k in expected} == expected
