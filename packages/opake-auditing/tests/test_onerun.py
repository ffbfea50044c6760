"""Guessing from scores, the result object, its plot, and the generic audit() API."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from opake.auditing import (
    AuditResult,
    GradientCanaries,
    InputCanaries,
    audit,
    draw_inclusion,
    epsilon_lower_bound,
    one_run_audit,
)
from opake.core.errors import ConfigurationError, InputTypeError


def test_guesses_take_the_top_and_bottom_scores():
    included = np.array([True, False] * 50)
    scores = included.astype(float)
    scores[0] = -1.0  # one included canary scores lowest: the one wrong "out" guess
    result = one_run_audit(scores, included, claimed_epsilon=1.0, delta=0.0, guesses=(10, 10))
    assert (result.guesses, result.guesses_in, result.guesses_out) == (20, 10, 10)
    assert result.correct == 19
    expected = epsilon_lower_bound(canaries=100, guesses=20, correct=19, delta=0.0)
    assert result.epsilon_lower_bound == pytest.approx(expected)


def test_the_grid_pays_for_its_tries():
    included = draw_inclusion(1000, seed=0)
    scores = included + np.random.default_rng(0).normal(0, 0.3, 1000)
    grid = one_run_audit(scores, included, claimed_epsilon=1.0, delta=1e-5)
    single = one_run_audit(
        scores, included, claimed_epsilon=1.0, delta=1e-5, guesses=(grid.guesses_in,) * 2
    )
    assert grid.tries == 7
    assert single.tries == 1
    assert grid.correct == single.correct
    assert grid.epsilon_lower_bound < single.epsilon_lower_bound  # β / 7 per try


def test_scores_without_signal_prove_nothing():
    bounds = []
    for seed in range(5):
        included = draw_inclusion(500, seed=seed)
        scores = np.random.default_rng(seed + 100).normal(size=500)
        bounds.append(
            one_run_audit(scores, included, claimed_epsilon=1.0, delta=1e-5).epsilon_lower_bound
        )
    assert max(bounds) < 0.5


def test_several_attacks_share_beta():
    included = draw_inclusion(200, seed=0)
    good = included.astype(float)
    noise = np.random.default_rng(0).normal(size=200)
    result = one_run_audit({"noise": noise, "good": good}, included, claimed_epsilon=1, delta=0)
    assert result.attack == "good"
    assert result.tries == 2 * 7
    assert set(result.scores) == {"noise", "good"}


def test_a_leak_confined_to_one_group_is_guessed_within_it():
    """A quarter of the canaries leak completely, the rest show nothing: over all canaries the
    "out" guesses are coin flips; within the leaking group every guess is right."""
    m = 1000
    included = draw_inclusion(m, seed=0)
    labels = ["plain", "crafted-a", "crafted-b", "crafted-c"] * (m // 4)
    rng = np.random.default_rng(0)
    scores = rng.normal(size=m)
    leaking = np.array([label == "crafted-b" for label in labels])
    scores[leaking & included] += 100.0
    alone = one_run_audit(scores, included, claimed_epsilon=2.0, delta=1e-5)
    grouped = one_run_audit(scores, included, claimed_epsilon=2.0, delta=1e-5, groups=labels)
    assert alone.group == "all"
    assert alone.consistent  # diluted by the canaries that show nothing
    assert grouped.tries == 7 + 4  # the grid over all, one k per group
    assert grouped.group == "crafted-b"
    assert grouped.correct == grouped.guesses == 2 * round(0.4 * 250)
    assert not grouped.consistent
    assert "on the crafted-b canaries" in grouped.summary()
    assert grouped.to_dict()["group"] == "crafted-b"


def test_groups_are_checked():
    included = [True, False, True, False]
    with pytest.raises(ConfigurationError, match="4 canaries"):
        one_run_audit(np.zeros(4), included, claimed_epsilon=1.0, delta=0.0, groups=["a"] * 3)
    with pytest.raises(ConfigurationError, match="'all'"):
        one_run_audit(
            np.zeros(4), included, claimed_epsilon=1.0, delta=0.0, groups=["all", "b"] * 2
        )
    with pytest.raises(InputTypeError, match="groups"):
        one_run_audit(np.zeros(4), included, claimed_epsilon=1.0, delta=0.0, groups="abcd")
    one_label = one_run_audit(
        np.zeros(4), included, claimed_epsilon=1.0, delta=0.0, groups=["a"] * 4
    )
    assert one_label.tries == 2  # one group: nothing to add to the grid over all


def test_draw_inclusion_is_fair_and_secret_by_default():
    a, b = draw_inclusion(4000), draw_inclusion(4000)
    assert 0.45 < a.mean() < 0.55
    assert not np.array_equal(a, b)
    assert np.array_equal(draw_inclusion(50, seed=3), draw_inclusion(50, seed=3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scores": np.zeros(3)}, ConfigurationError, "shape"),
        ({"scores": np.array([0.0, np.nan, 0.0, 0.0])}, ConfigurationError, "non-finite"),
        ({"guesses": (3, 3)}, ConfigurationError, "k_in"),
        ({"guesses": "many"}, InputTypeError, "guesses"),
        ({"claimed_epsilon": -1.0}, ConfigurationError, "claimed_epsilon"),
        ({"confidence": 1.5}, ConfigurationError, "confidence"),
    ],
)
def test_bad_input_raises(kwargs, error, match):
    args = {"scores": np.zeros(4), "claimed_epsilon": 1.0, "guesses": None, "confidence": 0.95}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        one_run_audit(
            args["scores"],
            [True, False, True, False],
            claimed_epsilon=args["claimed_epsilon"],
            delta=1e-5,
            guesses=args["guesses"],
            confidence=args["confidence"],
        )


def test_result_dict_json_and_plot(tmp_path):
    included = draw_inclusion(100, seed=1)
    result = one_run_audit(included * 3.0, included, claimed_epsilon=8.0, delta=1e-5)
    assert isinstance(result, AuditResult)
    data = json.loads(result.write_json(tmp_path / "a" / "audit.json").read_text())
    for key in (
        "claimed_epsilon",
        "delta",
        "epsilon_lower_bound",
        "confidence",
        "canaries",
        "guesses",
        "correct",
    ):
        assert data[key] == getattr(result, key)
    assert len(data["scores"]["score"]) == 100
    png = result.plot(tmp_path / "audit.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "claimed ε = 8.000" in result.summary()
    with pytest.raises(ConfigurationError, match="attack"):
        result.plot(tmp_path / "x.png", attack="nope")


def test_audit_of_a_users_input_canary_training():
    canaries = InputCanaries(torch.arange(300.0))

    def train(examples):
        return set(examples.tolist())

    def score(trained, examples):
        return [float(x in trained) for x in examples.tolist()]

    result = audit(train, canaries, claimed_epsilon=lambda _: 2.0, delta=1e-5, score=score)
    assert result.claimed_epsilon == 2.0
    assert result.kind == "input"
    # exact scores: wrong guesses only when k exceeds the included (or excluded) count
    assert result.accuracy > 0.9
    assert not result.consistent


def test_audit_of_a_users_gradient_canary_training():
    from opake.dpsgd.optimizer import DPOptimizer

    canaries = GradientCanaries(200, kind="random", seed=0)

    def train(setup):
        run = setup(dataset_size=10, clipping_norm=1.0, engine="bookkeeping")
        opt = DPOptimizer(
            torch.optim.SGD([run.parameter], lr=0.1),
            run.params,
            noise_multiplier=1e-3,  # nearly no noise: must be caught
            expected_batch_size=float(run.total_size),
            seed=0,
        )
        for _ in range(3):  # full batches: every slot drawn
            _, ids = run.split(range(run.total_size))
            opt.accumulate(run.clipped_sum(ids))
            opt.step()
            run.observe(expected_batch_size=opt.expected_batch_size)

    result = audit(train, canaries, claimed_epsilon=1.0, delta=1e-5, seed=1)
    assert result.kind == "gradient"
    assert result.engine == "bookkeeping"
    assert result.tries == 7 + 4  # the grid over all canaries, and each of the four kinds
    assert result.accuracy > 0.95  # random directions overlap a little: not always 100 %
    assert not result.consistent


def test_audit_rejects_misuse():
    canaries = InputCanaries(torch.zeros(4, 2))
    with pytest.raises(ConfigurationError, match="unknown keyword"):
        audit(lambda x: x, canaries, claimed_epsilon=1.0, delta=0.0, scores=None)
    with pytest.raises(ConfigurationError, match="score="):
        audit(lambda x: x, canaries, claimed_epsilon=1.0, delta=0.0)
    with pytest.raises(ConfigurationError, match="never called setup"):
        audit(lambda setup: None, GradientCanaries(4), claimed_epsilon=1.0, delta=0.0)
    with pytest.raises(InputTypeError):
        audit(lambda x: x, [1, 2], claimed_epsilon=1.0, delta=0.0)  # type: ignore[arg-type]
