"""``opake audit``: a tiny audited run end to end, its outputs, and one-line errors."""

from __future__ import annotations

import json

import pytest

from opake.cli import main


def _audit_args(tiny_args, out, *extra):
    args = tiny_args(out=out)
    args[0] = "audit"
    steps = args.index("--steps")
    args[steps + 1] = "12"
    return [*args, "--canary-count", "100", *extra]


def test_gradient_audit_writes_json_and_plot(tiny_args, tmp_path, capsys):
    out = tmp_path / "audit"
    assert main(_audit_args(tiny_args, out)) == 0
    printed = capsys.readouterr().out
    assert "claimed ε =" in printed
    assert "measured lower bound" in printed
    data = json.loads((out / "audit.json").read_text())
    for key in ("claimed_epsilon", "delta", "epsilon_lower_bound", "confidence", "correct"):
        assert key in data
    assert data["canaries"] == 100
    assert data["canary_kind"] == "gradient"
    assert 0.0 <= data["epsilon_lower_bound"] <= data["claimed_epsilon"]
    assert data["claimed_epsilon"] == pytest.approx(data["planned_epsilon"], rel=1e-3)
    assert set(data["scores"]) == {"all_steps", "likelihood_ratio", "replayed_steps"}
    # a full model: the data and the canaries, plain and crafted, went through book-keeping
    assert data["engine"] == "bookkeeping"
    assert data["engine_steps"] == {"data": {"bookkeeping": 12}, "canaries": {"bookkeeping": 12}}
    assert data["group"] in {"all", "dirac", "cancellation", "underflow", "absorption"}
    assert (out / "audit.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "checkpoint.pt").exists()  # an audit trains, scores and stops


def test_input_audit_scores_loss_reduction(tiny_args, tmp_path):
    out = tmp_path / "audit"
    assert (
        main(_audit_args(tiny_args, out, "--canaries", "input", "--no-plots", "--lora-r", "2")) == 0
    )
    data = json.loads((out / "audit.json").read_text())
    assert data["canary_kind"] == "input"
    assert data["group"] == "all"
    assert set(data["engine_steps"]) == {"data"}  # the input canaries are data
    assert data["engine"] in {"bookkeeping", "vmap"}
    assert set(data["scores"]) == {"loss_reduction"}
    assert data["epsilon_lower_bound"] <= data["claimed_epsilon"]
    assert not (out / "audit.png").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--canary-count", "1"], "--canary-count 1"),
        (["--confidence", "1.0"], "--confidence 1.0"),
        (["--resume"], "--resume"),
        (["--canaries", "input", "--canary-direction", "random"], "--canary-direction"),
        (["--target-epsilon", "-1"], "--target-epsilon"),
    ],
)
def test_bad_input_is_a_one_line_error(tiny_args, tmp_path, capsys, extra, message):
    assert main(_audit_args(tiny_args, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opake audit: error:")
    assert message in err
    assert "\n" not in err


def test_unknown_canary_kind_is_an_argparse_error(tiny_args, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(_audit_args(tiny_args, tmp_path / "x", "--canaries", "laser"))
    assert exc.value.code == 2
    assert "--canaries" in capsys.readouterr().err


def test_audit_steps_through_dptraining_with_fixed_shape_sampling(tiny_args, tmp_path, monkeypatch):
    """The audited DP step is DPTraining's (one logical step per planned step, the canaries'
    clipped sum in its pending step before the noise), fixed-shape sampling over data and
    canary slots gets a finite claim at the default ε = 8, and with the vmap engine the
    canaries go through the vmap engine too."""
    from opake.dpsgd.training import DPTraining

    seen = []
    original = DPTraining.finish_step

    def finish_step(self):
        seen.append(self.optimizer.pending_batches)
        return original(self)

    monkeypatch.setattr(DPTraining, "finish_step", finish_step)
    out = tmp_path / "audit"
    args = _audit_args(
        tiny_args, out, "--sampler", "fixed", "--no-plots", "--reproducible", "--engine", "vmap"
    )
    args[args.index("--steps") + 1] = "5"
    args[args.index("--canary-count") + 1] = "20"
    assert main(args) == 0
    data = json.loads((out / "audit.json").read_text())
    assert seen == [2] * 5  # the data's clipped sum and the canaries', every step
    assert data["engine"] == "vmap"
    assert data["engine_steps"] == {"data": {"vmap": 5}, "canaries": {"vmap": 5}}
    assert 0.0 <= data["epsilon_lower_bound"] <= data["claimed_epsilon"] < 8.01
    assert data["claimed_epsilon"] == pytest.approx(data["planned_epsilon"], rel=1e-2)
    assert data["randomness"] == "seeded (not private)"


def test_audit_catches_an_engine_that_trusts_its_gram_norm(tiny_args, tmp_path, monkeypatch):
    """Book-keeping clipping each example by its computed Gram norm (no error terms, never
    measured exactly — the engine before its certified bounds): the crafted canaries escape
    clipping whole and ``opake audit`` reports a violation of the claimed ε."""
    import torch

    import opake.dpsgd.bookkeeping._engine as bookkeeping_engine
    from opake.dpsgd.bookkeeping._certify import LeafBounds

    original = bookkeeping_engine.leaf_bounds

    def leaf_bounds(*args, **kwargs):
        leaf = original(*args, **kwargs)
        zero = torch.zeros_like(leaf.sq)
        return LeafBounds(leaf.sq, leaf.sq.sqrt(), zero, zero > 0, leaf.rounding)

    monkeypatch.setattr(bookkeeping_engine, "leaf_bounds", leaf_bounds)
    out = tmp_path / "audit"
    args = _audit_args(tiny_args, out, "--no-plots", "--reproducible", "--target-epsilon", "1")
    args[args.index("--batch-size") + 1] = "100"  # q ≈ 0.3: every canary drawn a few times
    args[args.index("--canary-count") + 1] = "400"
    assert main(args) == 0
    data = json.loads((out / "audit.json").read_text())
    assert data["engine"] == "bookkeeping"
    assert data["group"] in {"cancellation", "underflow", "absorption"}
    assert not data["consistent"]
    assert data["epsilon_lower_bound"] > 2.0 * data["claimed_epsilon"]
