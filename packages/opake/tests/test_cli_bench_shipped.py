"""``opake bench`` outside a checkout: the scripts a wheel ships, and the error without any."""

from __future__ import annotations

import logging

import pytest

from opake.cli import _bench
from opake.cli.__main__ import main
from opake.core.errors import ConfigurationError


@pytest.fixture
def nowhere(tmp_path, monkeypatch):
    """A working directory and an install location with no tools/bench above them."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(_bench, "_INSTALLED_AT", tmp_path / "site-packages" / "opake" / "cli")
    monkeypatch.setattr(_bench, "SHIPPED_DIR", tmp_path / "site-packages" / "missing")
    return tmp_path


def test_bench_uses_the_shipped_scripts_outside_a_checkout(nowhere, monkeypatch, capsys, caplog):
    shipped = nowhere / "site-packages" / "opake" / "cli" / "_bench_scripts"
    shipped.mkdir(parents=True)
    (shipped / "step.py").write_text('"""Step: a shipped benchmark."""\nprint("| shipped |")\n')
    monkeypatch.setattr(_bench, "SHIPPED_DIR", shipped)
    with caplog.at_level(logging.INFO, logger="opake.cli"):
        assert main(["bench", "--list"]) == 0
    assert capsys.readouterr().out.split() == ["step", "Step:", "a", "shipped", "benchmark."]
    assert f"benchmark scripts from {shipped}" in caplog.text
    assert main(["bench", "step"]) == 0
    assert "| shipped |" in capsys.readouterr().out


def test_a_checkout_above_the_working_directory_wins_over_the_shipped_scripts(nowhere, monkeypatch):
    shipped = nowhere / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(_bench, "SHIPPED_DIR", shipped)
    checkout = nowhere / "work" / "tools" / "bench"
    checkout.mkdir(parents=True)
    monkeypatch.chdir(checkout)
    assert _bench.find_bench_dir() == checkout


def test_bench_without_any_scripts_says_how_to_fix_it(nowhere, capsys):
    with pytest.raises(ConfigurationError, match="pass --dir PATH/TO/tools/bench"):
        _bench.find_bench_dir()
    assert main(["bench", "--list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("opake bench: error: no benchmark scripts found")
    assert len(err.splitlines()) == 1
