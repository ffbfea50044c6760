"""``opake train`` draws Poisson batches only (plain or fixed-shape): no other batch order is
accepted, on the command line or from saved settings, since its ε would not hold."""

from __future__ import annotations

import pytest

from opake.cli import main
from opake.cli._settings import TrainSettings
from opake.core.errors import ConfigurationError


def test_a_sampler_other_than_poisson_or_fixed_is_refused_on_the_command_line(
    tiny_args, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        main(tiny_args("--sampler", "shuffle", out=tmp_path / "run"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--sampler" in err
    assert "'shuffle'" in err
    assert "poisson" in err
    assert "fixed" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("sampler", ["shuffle", "sequential"])
def test_saved_settings_with_another_sampler_are_refused_with_the_reason(sampler):
    settings = TrainSettings.from_dict({**TrainSettings().to_dict(), "sampler": sampler})
    with pytest.raises(ConfigurationError, match=f"--sampler '{sampler}'") as err:
        settings.check()
    message = str(err.value)
    assert "expected one of poisson, fixed" in message
    assert "ε is computed for Poisson sampling only" in message
    assert "\n" not in message
