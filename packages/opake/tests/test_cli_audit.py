"""``opake audit``: a tiny audited run end to end, its outputs, and one-line errors."""

from __future__ import annotations

import json

import pytest

from opake.cli import main


def _audit_args(tiny_args, out, *extra):
    args = tiny_args(out=out)
    args[0] = "audit"
    for option in ("--eval-every", "--max-val-blocks"):  # train's, refused by the audit
        at = args.index(option)
        del args[at : at + 2]
    steps = args.index("--steps")
    args[steps + 1] = "12"
    return [*args, "--canary-count", "100", *extra]


def test_gradient_audit_writes_json_and_plot(tiny_args, tmp_path, capsys):
    """A run like the guide's ``--steps 20``: 12 steps at q = 8/338, so each included canary is
    in 0.28 batches on average; the verdict says what the audit could show and what to
    change."""
    out = tmp_path / "audit"
    assert main(_audit_args(tiny_args, out)) == 0
    printed = capsys.readouterr().out
    assert "claimed ε =" in printed
    assert "measured lower bound" in printed
    lines = [line.strip() for line in printed.splitlines()]
    at_most = next(line for line in lines if line.startswith("at most: ε ≥ "))
    assert "when every included canary scores above every excluded one (" in at_most
    assert "guesses right on 100 canaries, 33 tries sharing 95% confidence)" in at_most
    expected = next(line for line in lines if line.startswith("expected: "))
    assert "a run that exactly meets the claim shows ε ≥ 0.0" in expected
    assert "12 steps" in expected
    advice = [line for line in lines if line.startswith("to make it informative: ")]
    assert any("q·T = 0.28" in line and "(--steps 212)" in line for line in advice)
    assert any(line.endswith("(--target-epsilon 1)") for line in advice)  # 8 is beyond reach
    data = json.loads((out / "audit.json").read_text())
    assert data["max_provable_epsilon"] < data["claimed_epsilon"]
    right = data["max_provable_guesses"]
    assert f"({right['correct']} of {right['guesses']} guesses right" in at_most
    assert at_most.startswith(f"at most: ε ≥ {data['max_provable_epsilon']:.3f}")
    assert data["expected_epsilon_if_correct"] < 0.05
    assert data["expected_simulations"] == 9
    assert data["mechanism"]["steps"] == 12
    assert data["mechanism"]["noise_multiplier"] == data["noise_multiplier"]
    assert {a["change"] for a in data["advice"]} == {"claim", "canaries", "steps"}
    assert data["verdict"].startswith("no violation found, and none could show")
    assert data["explanation"][0] == at_most
    # the settings the audit takes: none of the training-only options it refuses
    assert not {"resume", "checkpoint_every", "eval_every", "max_val_blocks"} & set(
        data["settings"]
    )
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


def test_input_audit_scores_loss_reduction(tiny_args, tmp_path, monkeypatch):
    """On the default corpus (no --data): audit.json names it, as --data takes it; with input
    canaries --offload-optimizer is honoured."""
    from opake.dpsgd.training import DPTraining

    offload, init = [], DPTraining.__init__

    def record_init(self, *args, **kwargs):
        offload.append(kwargs.get("offload_state"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(DPTraining, "__init__", record_init)
    out = tmp_path / "audit"
    args = _audit_args(
        tiny_args,
        out,
        *("--canaries", "input", "--no-plots", "--lora-r", "2", "--offload-optimizer"),
    )
    at = args.index("--data")
    del args[at : at + 2]
    args[args.index("--steps") + 1] = "3"
    assert main(args) == 0
    data = json.loads((out / "audit.json").read_text())
    assert offload == [True]
    assert data["settings"]["data"] == "pydoc"
    assert data["data"]["corpus"] == "pydoc"
    assert data["data"]["characters"] > 100_000
    assert data["data"]["training_blocks"] == data["dataset_size"]
    assert "canary_kind" in {a["change"] for a in data["advice"]}  # black-box: weaker
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
        (["--canaries", "input", "--canary-direction", "random"], "--canary-direction"),
        (["--offload-optimizer"], "--offload-optimizer with gradient canaries"),
        (["--target-epsilon", "-1"], "--target-epsilon"),
    ],
)
def test_bad_input_is_a_one_line_error(tiny_args, tmp_path, capsys, extra, message):
    assert main(_audit_args(tiny_args, tmp_path / "x", *extra)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("opake audit: error:")
    assert message in err
    assert "\n" not in err


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--resume"], "an audit is one uninterrupted run and saves no checkpoint"),
        (["--checkpoint-every", "5"], "an audit saves no checkpoint"),
        (["--eval-every", "2"], "an audit does not evaluate on the validation split"),
        (["--max-val-blocks", "16"], "an audit does not evaluate on the validation split"),
    ],
)
def test_training_only_options_are_refused(tiny_args, tmp_path, capsys, extra, why):
    with pytest.raises(SystemExit) as exc:
        main(_audit_args(tiny_args, tmp_path / "x", *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"opake audit: error: argument {extra[0]}: {why}")
    assert "\n" not in err
    assert not (tmp_path / "x").exists()


def test_help_lists_exactly_the_options_the_audit_honours(capsys):
    """train's options less the ones the audit refuses, plus the audit's own."""
    from opake.cli.__main__ import build_parser

    def options(command):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        parser = build_parser()
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        flags = {f for a in sub._actions if a.help != "==SUPPRESS==" for f in a.option_strings}
        assert all(f in text for f in flags)
        return flags, text

    train, _ = options("train")
    audit, text = options("audit")
    refused = {"--resume", "--checkpoint-every", "--eval-every", "--max-val-blocks"}
    refused |= {"--compile", "--objective", "--dpo-beta"}
    own = {"--canaries", "--canary-count", "--canary-direction", "--canary-records"}
    own |= {"--confidence"}
    assert audit == (train - refused) | own
    for flag in refused:
        assert flag not in text
    # never into opake train's default run directory
    assert build_parser().parse_args(["audit"]).out == "opake-audit"


def test_a_used_out_is_refused(tiny_args, tmp_path, capsys):
    """An audit never replaces an earlier one, nor writes into a training run."""
    out = tmp_path / "audit"
    out.mkdir()
    (out / "audit.json").write_text("{}")
    assert main(_audit_args(tiny_args, out)) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"opake audit: error: --out {out} already holds an audit (audit.json); an audit never "
        f"replaces another: choose another --out, or delete {out / 'audit.json'} to replace it"
    )
    assert (out / "audit.json").read_text() == "{}"
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"")
    assert main(_audit_args(tiny_args, run)) == 2
    err = capsys.readouterr().err.strip()
    assert "holds an opake train run (checkpoint.pt)" in err
    assert "choose another --out" in err
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt"]


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

    from opake.dpsgd.bookkeeping._certify import LeafBounds
    from opake.dpsgd.bookkeeping._fused import LeafBoundsFn

    original = LeafBoundsFn.__call__  # what the runner asks for every leaf's bounds

    def leaf_bounds(self, *args, **kwargs):
        leaf = original(self, *args, **kwargs)
        zero = torch.zeros_like(leaf.sq)
        return LeafBounds(leaf.sq, leaf.sq.sqrt(), zero, zero > 0, leaf.rounding)

    monkeypatch.setattr(LeafBoundsFn, "__call__", leaf_bounds)
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


def test_the_audit_says_how_it_chose_its_microbatch(tiny_args, tmp_path, monkeypatch, capsys):
    # the audit's run takes the same memory-aware default as `opake train`, and says so
    from opake.profiling import get_memory_stats

    def scarce(device):  # a few MB beyond what the process holds: half of it is the limit
        held = get_memory_stats("cpu").allocated_gb
        assert held is not None
        return 2 * (held + 0.02)

    monkeypatch.setattr("opake.cli._memory.available_memory_gb", scarce)
    out = tmp_path / "audit"
    args = _audit_args(tiny_args, out)
    args[args.index("--steps") + 1] = "2"
    assert main(args) == 0
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("memory ")]
    # what it chose (the whole batch, or a microbatch) and why: the estimate against the limit
    assert line.split("memory", 1)[1].strip().startswith(("whole batch at once", "--microbatch"))
    assert "estimated to peak at" in line
    assert "GB available" in line
