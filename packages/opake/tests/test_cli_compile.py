"""``opake train --compile``: the DP step compiled (``DPTraining(compile=True)``), its plan
line, its chunk rows, and the refusals of what does not trace."""

from __future__ import annotations

import csv

import pytest

from opake.cli import main
from opake.cli._compiling import compile_line, compiled_choice
from opake.cli._memory import MicrobatchChoice
from opake.cli._settings import TrainSettings
from opake.core.errors import ConfigurationError
from opake.dpsgd.certify import ieee_compile_options


@pytest.mark.parametrize(
    ("options", "advice"),
    [
        ({"data": "u.jsonl", "privacy_unit": "user"}, "without --compile"),
        ({"checkpointing": True}, "drop one of them"),
        ({"kernels": "torch"}, "use --kernels none"),
        ({"data": "p.jsonl", "objective": "dpo"}, "train DPO without --compile"),
    ],
)
def test_what_does_not_trace_is_refused_before_the_plan(options, advice):
    with pytest.raises(ConfigurationError, match="--compile with") as caught:
        TrainSettings(compile=True, **options).check()
    assert advice in str(caught.value)


def test_the_chunk_is_the_microbatch_or_the_largest_likely_poisson_batch():
    given = MicrobatchChoice(4, "--microbatch 4 (given)")
    assert compiled_choice(given, largest=22) is given
    whole = compiled_choice(MicrobatchChoice(None, "whole batch at once"), largest=22)
    assert whole.microbatch == 22
    assert "one chunk of 22 rows" in whole.reason
    assert "book-keeping engine's batched forward and backward (the whole step on the vmap" in (
        compile_line("auto", 22, None)
    )
    assert "of the DP step on the vmap engine" in compile_line("vmap", None, 40)
    assert "chunks of 40 rows" in compile_line("vmap", None, 40)  # fixed sampler: B_max


def test_a_compiled_run_equals_the_eager_one(tiny_args, tmp_path, capsys, monkeypatch):
    import torch

    # Dynamo traces the whole DP step as one graph (fullgraph), as in a run; the graph then
    # runs eagerly instead of through Inductor's code generation, which takes over a minute
    # for this model on a 2-core CPU (and is exercised by opake-core's compile tests)
    calls: list[dict[str, object]] = []
    real = torch.compile

    def compile_eagerly(fn, **options):
        calls.append({"fn": getattr(fn, "__name__", "?"), **options})
        return real(fn, backend="eager", **options)

    monkeypatch.setattr(torch, "compile", compile_eagerly)
    fixed = ("--reproducible", "--steps", "3", "--microbatch", "3", "--no-plots")
    eager = ("--kernels", "none")  # what the compiled run runs (book-keeping), uncompiled
    assert main(tiny_args(*fixed, *eager, out=tmp_path / "eager")) == 0
    capsys.readouterr()
    assert main(tiny_args(*fixed, "--compile", out=tmp_path / "compiled")) == 0
    err = capsys.readouterr().err
    assert "compile   torch.compile of the book-keeping engine's batched forward" in err
    assert "chunks of 3 rows" in err
    assert "the first steps compile" in err
    assert "--compile: the model runs unpatched" in err  # the patched forward does not trace
    # one shape, two graphs: the batched forward and backward, and the bound arithmetic (its
    # IEEE flags pinned, whatever Inductor's global configuration)
    names = [call.pop("fn") for call in calls]
    assert sorted(name == "leaf_arith" for name in names) == [False, True]
    ieee = {"options": ieee_compile_options()}
    assert calls == [
        {"fullgraph": True, "dynamic": False, **(ieee if name == "leaf_arith" else {})}
        for name in names
    ]

    def losses(run: str) -> list[float]:
        with (tmp_path / run / "metrics.csv").open() as handle:
            return [float(row["train_loss"]) for row in csv.DictReader(handle)]

    assert losses("compiled") == pytest.approx(losses("eager"), rel=1e-5)
