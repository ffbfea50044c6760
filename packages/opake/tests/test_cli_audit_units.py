"""``opake audit --privacy-unit FIELD``: canaries as whole units, ε per unit, and refusals."""

from __future__ import annotations

import json

import pytest

from opake import accounting
from opake.cli import main
from opake.cli._plan import PLD_OPTIONS

CANARIES, RECORDS, STEPS = 20, 3, 6


@pytest.fixture
def author_records(small_corpus, tmp_path):
    """The small corpus's paragraphs as records of 8 authors (one is held out to validate)."""
    paragraphs = [p for p in small_corpus.read_text().split("\n\n") if p.strip()]
    path = tmp_path / "records.jsonl"
    lines = [json.dumps({"author": f"a{i % 8}", "text": p}) for i, p in enumerate(paragraphs)]
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def _unit_audit_args(tiny_args, out, data, *extra):
    args = tiny_args("--data", str(data), out=out)
    args[0] = "audit"
    for option in ("--eval-every", "--max-val-blocks"):  # train's, refused by the audit
        at = args.index(option)
        del args[at : at + 2]
    args[args.index("--steps") + 1] = str(STEPS)
    args[args.index("--batch-size") + 1] = "2"  # authors per step
    return [*args, "--privacy-unit", "author", "--canaries", "input", "--no-plots", *extra]


@pytest.mark.parametrize("cap", [4, 2])
def test_canary_units_are_sampled_whole_and_epsilon_is_per_unit(
    tiny_args, tmp_path, author_records, monkeypatch, capsys, cap
):
    """Each canary is one unit of M blocks: a step that draws it takes all M (or, with a cap
    below M, a random ``cap`` of them, as for any unit) and the claim is the accountant's ε at
    the unit rate over the data's and the included canaries' units."""
    from opake.dpsgd.training import DPTraining

    trainings, steps = [], []
    init, accumulate = DPTraining.__init__, DPTraining.accumulate

    def record_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        trainings.append(self)

    def record_accumulate(self, *batch, **kwargs):
        steps.append([int(i) for i in kwargs["records"]])
        return accumulate(self, *batch, **kwargs)

    monkeypatch.setattr(DPTraining, "__init__", record_init)
    monkeypatch.setattr(DPTraining, "accumulate", record_accumulate)
    out = tmp_path / "audit"
    args = _unit_audit_args(
        tiny_args,
        out,
        author_records,
        *("--canary-count", str(CANARIES), "--canary-records", str(RECORDS)),
        *("--max-records-per-unit", str(cap)),
    )
    assert main(args) == 0
    captured = capsys.readouterr()
    data = json.loads((out / "audit.json").read_text())
    units, n, k = data["units"], data["dataset_size"], data["canaries_included"]
    per_step = min(RECORDS, cap)
    # audit.json: the unit, and canary units of M blocks (the statistics count canary units)
    assert (data["privacy_unit"], data["epsilon_per"]) == ("author", "author")
    assert (data["canary_records"], data["canary_records_per_step"]) == (RECORDS, per_step)
    assert data["canaries"] == CANARIES
    assert data["canary_units_included"] == k == sum(data["included"])
    assert len(data["scores"]["loss_reduction"]) == CANARIES
    assert data["settings"]["privacy_unit"] == "author"
    assert "canary_kind" not in {a["change"] for a in data["advice"]}  # gradient: not as units
    # the sampler: the data's units and each included canary as one unit, at the plan's rate
    (training,) = trainings
    assert training.sampler.unit_count == units + k
    assert training.sampler.record_count == n + k * RECORDS
    assert training.sample_rate == pytest.approx(2 / units)
    drawn = 0
    for records in steps:
        assert max(records, default=0) < n + k * RECORDS
        for j in range(k):  # canary unit j: rows n + j·M … n + j·M + M − 1
            present = sum(n + j * RECORDS <= r < n + (j + 1) * RECORDS for r in records)
            assert present in (0, per_step)
            drawn += present > 0
    assert drawn > 0  # q ≈ 0.29 over 6 steps: canary units were drawn
    # the claim: ε per author at the unit rate q, δ = 1/U² (the canaries add units, not cost)
    assert data["claimed_epsilon"] == pytest.approx(
        accounting.epsilon(
            sample_rate=2 / units,
            noise_multiplier=data["noise_multiplier"],
            steps=STEPS,
            delta=1 / units**2,
            accountant_options=PLD_OPTIONS,
        ),
        rel=1e-9,
    )
    assert f"unit: ε per author; the {CANARIES} canaries are units of {RECORDS} blocks" in (
        captured.out
    )
    assert f"each one author of {RECORDS} random-token blocks" in captured.err
    assert ("canary units are capped too" in captured.err) == (cap < RECORDS)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--privacy-unit", "author"], "--privacy-unit author with gradient canaries"),
        (["--canary-records", "3"], "--canary-records 3 without --privacy-unit"),
        (["--canaries", "input", "--canary-records", "2"], "without --privacy-unit"),
        (
            ["--privacy-unit", "author", "--canaries", "input", "--canary-records", "0"],
            "--canary-records 0: expected an int >= 1",
        ),
        (["--max-records-per-unit", "2"], "without --privacy-unit"),
    ],
)
def test_unit_options_the_audit_cannot_honour_fail_in_one_line(
    tiny_args, tmp_path, author_records, capsys, extra, message
):
    args = _unit_audit_args(tiny_args, tmp_path / "x", author_records)
    at = args.index("--privacy-unit")
    del args[at : at + 4]  # the test's own unit options
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opake audit: error:")
    assert message in err
    assert "\n" not in err
    assert not (tmp_path / "x").exists()


def test_gradient_canaries_with_units_say_what_to_use(tiny_args, tmp_path, author_records, capsys):
    args = _unit_audit_args(tiny_args, tmp_path / "x", author_records, "--canaries", "gradient")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not a unit of several records" in err
    assert "pass --canaries input" in err
