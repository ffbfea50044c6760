"""The docstring examples of opake.transformers, run under the package's real import name
(see ``conftest.py`` of this distribution for why they are not collected by file path)."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "opake.transformers",
    "opake.transformers._args",
    "opake.transformers._collate",
    "opake.transformers._dp_mixin",
    "opake.transformers._hf_checks",
    "opake.transformers._losses",
    "opake.transformers._microbatch",
    "opake.transformers._refusals",
    "opake.transformers._trainer",
    "opake.transformers.losses",
    "opake.transformers.losses._completion",
    "opake.transformers.losses._dpo",
    "opake.transformers.trl",
    "opake.transformers.trl._config",
    "opake.transformers.trl._dpo",
    "opake.transformers.trl._refusals",
    "opake.transformers.trl._sft",
    "opake.transformers.trl._truncation",
]
WITH_EXAMPLES = {
    "opake.transformers",
    "opake.transformers._args",
    "opake.transformers._collate",
    "opake.transformers._hf_checks",
    "opake.transformers._microbatch",
    "opake.transformers._refusals",
    "opake.transformers.losses",
    "opake.transformers.losses._completion",
    "opake.transformers.losses._dpo",
    "opake.transformers.trl",
    "opake.transformers.trl._config",
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    if name.startswith("opake.transformers.trl."):
        pytest.importorskip("trl")
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
    assert (result.attempted > 0) == (name in WITH_EXAMPLES)
