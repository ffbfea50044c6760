"""``opake train`` randomness: secure by default, ``--reproducible`` only when asked.

Reproduces the attack on the old default (noise and Poisson sampling seeded from the public
``--seed 0``): a default run must not be replayable from its seed, and must store no key.
"""

from __future__ import annotations

import json

import pytest
import torch

from opake.cli import main


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _same_weights(a, b) -> bool:
    wa, wb = _weights(a / "model"), _weights(b / "model")
    return all(torch.equal(wa[name], wb[name]) for name in wa)


def test_default_run_is_secure_and_not_the_run_its_seed_would_replay(tiny_args, tmp_path, capsys):
    secure, seeded, again = tmp_path / "secure", tmp_path / "seeded", tmp_path / "again"
    assert main(tiny_args("--steps", "2", "--noise-multiplier", "1", out=secure)) == 0
    plan = capsys.readouterr().err
    assert "random    secure" in plan
    summary = json.loads((secure / "summary.json").read_text())
    assert summary["randomness"] == "secure"
    assert summary["settings"]["seed"] == 0

    argv = ("--steps", "2", "--noise-multiplier", "1", "--reproducible")
    assert main(tiny_args(*argv, out=seeded)) == 0
    assert "seeded (not private)" in capsys.readouterr().err
    assert json.loads((seeded / "summary.json").read_text())["randomness"] == (
        "seeded (not private)"
    )
    assert main(tiny_args(*argv, out=again)) == 0
    # the seeded run is replayed exactly from the public seed (that is the attack) ...
    assert _same_weights(seeded, again)
    # ... while the default run with the same --seed (same initialisation and split) is not
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
    assert main(tiny_args("--steps", "1", "--secure-noise", out=out)) == 0
    assert "--secure-noise is deprecated" in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["randomness"] == "secure"
    assert main(tiny_args("--secure-noise", "--reproducible", out=tmp_path / "x")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "contradict" in err[0]


@pytest.mark.slow
def test_resumed_secure_run_keeps_the_accountant_history(tiny_args, tmp_path, monkeypatch):
    from opake.cli import _trainer as trainer

    full, parts = tmp_path / "full", tmp_path / "parts"
    extra = ("--steps", "4", "--checkpoint-every", "10")
    assert main(tiny_args(*extra, out=full)) == 0
    real = trainer._lr_at

    def lr_at(step, **kwargs):
        if step == 2:
            raise KeyboardInterrupt
        return real(step, **kwargs)

    monkeypatch.setattr(trainer, "_lr_at", lr_at)
    assert main(tiny_args(*extra, out=parts)) == 130
    monkeypatch.undo()
    assert main(tiny_args(*extra, "--resume", out=parts)) == 0
    a = json.loads((full / "summary.json").read_text())
    b = json.loads((parts / "summary.json").read_text())
    assert b["resumed_from_step"] == 2
    assert b["randomness"] == "secure"
    assert b["steps"] == a["steps"] == 4
    assert b["epsilon"] == a["epsilon"]  # the same schedule accounted: 2 + 2 steps
    assert not _same_weights(full, parts)  # fresh randomness after the resume
