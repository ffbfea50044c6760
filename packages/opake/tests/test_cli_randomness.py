"""``opake train`` randomness: secure by default, ``--reproducible`` only when asked.

Reproduces the attack on the old default (noise and Poisson sampling seeded from the public
``--seed 0``): a default run must not be replayable from its seed, and must store no key.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from opake import accounting
from opake.cli import main


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a / "model"), _weights(b / "model")
    return all(torch.equal(wa[name], wb[name]) for name in wa)


def test_default_run_is_secure_and_not_the_run_its_seed_would_replay(tiny_args, tmp_path, capsys):
    secure, seeded = tmp_path / "secure", tmp_path / "seeded"
    assert main(tiny_args("--no-plots", "--steps", "2", "--noise-multiplier", "1", out=secure)) == 0
    plan = capsys.readouterr().err
    assert "random    secure" in plan
    summary = json.loads((secure / "summary.json").read_text())
    assert summary["randomness"] == "secure"
    assert summary["settings"]["seed"] == 0

    argv = ("--steps", "2", "--noise-multiplier", "1", "--reproducible")
    assert main(tiny_args("--no-plots", *argv, out=seeded)) == 0
    assert "seeded (not private)" in capsys.readouterr().err
    assert json.loads((seeded / "summary.json").read_text())["randomness"] == (
        "seeded (not private)"
    )
    # a seeded run is replayed exactly from its seed (that is the attack: test_cli_interrupt and
    # test_cli_train compare seeded runs bit for bit); the default run with the same --seed
    # (same initialisation and split) is not that run
    assert not _same_weights(secure, seeded)

    # nothing in the checkpoint replays the default run's noise or batches
    ckpt = torch.load(secure / "checkpoint.pt", weights_only=True)
    noise = ckpt["components"]["optimizer"]["state"]["noise"]
    sampler = ckpt["components"]["sampler"]["state"]
    assert noise["secure"] is True
    assert noise["seed"] is None
    assert sampler["secure"] is True
    assert sampler["seed"] is None


def test_secure_noise_flag_is_a_deprecated_no_op_and_contradicts_reproducible(
    tiny_args, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(tiny_args("--no-plots", "--steps", "1", "--secure-noise", out=out)) == 0
    assert "--secure-noise is deprecated" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["randomness"] == "secure"
    assert (
        main(tiny_args("--no-plots", "--secure-noise", "--reproducible", out=tmp_path / "x")) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "contradict" in err[0]


@pytest.mark.slow
def test_resumed_secure_run_keeps_the_accountant_history(tiny_args, tmp_path, monkeypatch):
    from opake.cli import _trainer as trainer

    parts = tmp_path / "parts"
    extra = ("--steps", "4", "--checkpoint-every", "10")
    real = trainer._lr_at

    def lr_at(step, **kwargs):
        if step == 2:
            raise KeyboardInterrupt
        return real(step, **kwargs)

    monkeypatch.setattr(trainer, "_lr_at", lr_at)
    assert main(tiny_args("--no-plots", *extra, out=parts)) == 130
    monkeypatch.undo()
    assert main(tiny_args("--no-plots", *extra, "--resume", out=parts)) == 0
    b = json.loads((parts / "summary.json").read_text())
    assert b["resumed_from_step"] == 2
    assert b["randomness"] == "secure"
    assert b["steps"] == 4
    # the whole schedule is accounted: the 2 steps before the interruption and the 2 after
    expected = accounting.epsilon(
        sample_rate=b["sample_rate"],
        noise_multiplier=b["noise_multiplier"],
        steps=4,
        delta=b["delta"],
        accountant_options=trainer.PLD_OPTIONS,
    )
    assert b["epsilon"] == pytest.approx(expected, rel=1e-9)
    with (parts / "metrics.csv").open() as handle:
        assert [int(r["step"]) for r in csv.DictReader(handle)] == [1, 2, 3, 4]
