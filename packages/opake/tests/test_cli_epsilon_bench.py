"""``opake epsilon`` (against the accountant), ``opake bench``, and one-line usage errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from opake import accounting
from opake.cli import main
from opake.cli._epsilon import PLD_OPTIONS


def _run(capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err.strip()


def test_epsilon_table_matches_the_accountant(capsys):
    code, out, _ = _run(
        capsys, ["epsilon", "-q", "0.01", "-s", "0.8", "1.2", "-t", "100", "1000", "-d", "1e-5"]
    )
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0].startswith("accountant: pld")
    assert lines[1].split() == ["q", "σ", "steps", "δ", "ε"]
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 4  # every combination
    for q, sigma, steps, delta, eps in rows:
        expected = accounting.epsilon(
            sample_rate=float(q),
            noise_multiplier=float(sigma),
            steps=int(steps),
            delta=float(delta),
            accountant_options=PLD_OPTIONS,
        )
        assert float(eps) == pytest.approx(expected, rel=1e-3)


def test_epsilon_json_and_target(capsys):
    argv = ["epsilon", "--batch-size", "64", "--dataset-size", "6400", "-e", "2", "-t", "500"]
    code, out, _ = _run(capsys, [*argv, "-d", "1e-5", "--accountant", "rdp", "--json"])
    assert code == 0
    data = json.loads(out)
    assert data["accountant"] == "rdp"
    (row,) = data["rows"]
    assert row["q"] == pytest.approx(0.01)
    assert row["ε"] <= 2.0
    # the σ found is the smallest that meets the target (within calibration tolerance)
    looser = accounting.epsilon(
        sample_rate=0.01, noise_multiplier=row["σ"] * 0.99, steps=500, delta=1e-5, accountant="rdp"
    )
    assert looser > 2.0


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["epsilon", "-q", "0.01", "-t", "10", "-d", "1e-5"], "nothing to compute"),
        (["epsilon", "-s", "1", "-t", "10", "-d", "1e-5"], "no sampling rate"),
        (["epsilon", "-q", "0.01", "-s", "1", "-e", "2", "-t", "10", "-d", "1e-5"], "not both"),
        (["epsilon", "-q", "2", "-s", "1", "-t", "10", "-d", "1e-5"], "sample_rate"),
        (["epsilon", "-q", "0.1", "-s", "-1", "-t", "10", "-d", "1e-5"], "must be a finite"),
        (
            [
                "epsilon",
                "--batch-size",
                "9",
                "--dataset-size",
                "5",
                "-s",
                "1",
                "-t",
                "1",
                "-d",
                "0.1",
            ],
            "exceeds",
        ),
        (["epsilon", "-q", "0.1", "-s", "1", "-d", "1e-5"], "required: --steps"),
        (["no-such-command"], "invalid choice"),
    ],
)
def test_epsilon_errors_are_one_line(capsys, argv, expected):
    code, _, err = _run(capsys, argv)
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert expected in err


@pytest.fixture
def bench_dir(tmp_path):
    directory = tmp_path / "tools" / "bench"
    directory.mkdir(parents=True)
    (directory / "alpha.py").write_text(
        textwrap.dedent(
            '''\
            """Alpha: prints its arguments as a table."""
            import sys
            print("| arg |")
            print("|---|")
            for a in sys.argv[1:]:
                print(f"| {a} |")
            print("progress goes to stderr", file=sys.stderr)
            '''
        )
    )
    (directory / "broken.py").write_text('"""Fails."""\nraise SystemExit(3)\n')
    (directory / "_shared.py").write_text("")
    return directory


def test_bench_lists_and_runs_scripts(bench_dir, capsys):
    code, out, _ = _run(capsys, ["bench", "--dir", str(bench_dir), "--list"])
    assert code == 0
    assert [line.split()[0] for line in out.strip().splitlines()] == ["alpha", "broken"]
    assert "Alpha: prints its arguments as a table." in out

    code, out, _ = _run(
        capsys, ["bench", "alpha", "--dir", str(bench_dir), "--script-args", "x 'y z'"]
    )
    assert code == 0
    assert "## alpha" in out
    assert "| x |" in out
    assert "| y z |" in out


def test_bench_reports_failures_and_unknown_names(bench_dir, capsys):
    code, out, err = _run(capsys, ["bench", "--dir", str(bench_dir)])
    assert code == 1
    assert "## alpha" in out
    assert "## broken" in out
    assert "failed: broken" in err
    code, _, err = _run(capsys, ["bench", "gamma", "--dir", str(bench_dir)])
    assert code == 2
    assert "unknown benchmark 'gamma'" in err


def test_bench_finds_the_checkout(tmp_path, bench_dir, monkeypatch, capsys):
    monkeypatch.chdir(bench_dir.parent.parent)
    code, out, _ = _run(capsys, ["bench", "--list"])
    assert code == 0
    assert "alpha" in out
