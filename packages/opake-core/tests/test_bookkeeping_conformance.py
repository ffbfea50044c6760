"""Generated conformance test: EVERY registered book-keeping layer rule against the per-example
reference, with the adversarial inputs of the privacy suite.

The cases come from the registry (``registered_rules()``: the built-in rules, first-party
plugins' and any third party's installed in the environment), each rule's ``example()`` giving
the module to run it on, so a new rule is tested without touching this file. The harness is
public: a plugin author runs it on one rule with :func:`opake.core.testing.check_rule` (every
example), which runs :func:`opake.core.testing.search_rule` (one example, as here):
hypothesis *searches* batches of 0–3 examples whose inputs and output gradients are random,
repeated at every position, alternating, cancelling up to a tiny residual, zero /
padding-only or non-finite, at magnitudes 1e-30..1e30, and checks
(:func:`opake.core.testing.check_rule_example`):

- the plan puts the example's layer under the rule being tested (the case exercises it);
- each example's contribution, isolated with ``example_mask``, is at most ``C`` (no tolerance
  beyond the oracle's own fp64 rounding: the bound is proven);
- the batch's sum is the sum of the contributions;
- for moderate inputs, the sum equals the per-example loop of plain autograd, in fp64.
"""

from __future__ import annotations

import pytest

from opake.core import testing

CASES = testing.rule_example_cases()


def test_the_registry_yields_cases_for_every_builtin_rule():
    names = {name for name, _ in CASES}
    assert {"linear", "conv1d", "embedding", "layer_norm", "rms_norm", "per_layer"} <= names


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_rule_never_lets_an_example_exceed_the_bound(name, index):
    testing.search_rule(name, index, max_examples=8)


def test_the_harness_catches_a_rule_that_under_reports():
    """Negative control: with the certified bound replaced by the computed norm alone (the
    engine of earlier releases, without its margin), cancelling tokens escape clipping and the
    harness says so (the bound fails, or the engine's own check catches the example)."""
    from opake.core.errors import OperationError
    from opake.dpsgd.bookkeeping import _certify
    from opake.dpsgd.bookkeeping._fused import LeafBoundsFn

    real = LeafBoundsFn.__call__  # what the runner asks for every leaf's bounds

    def naive(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return _certify.LeafBounds(
            out.sq, out.sq.sqrt(), out.slack * 0.0, out.loose & False, out.rounding
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LeafBoundsFn, "__call__", naive)
        attack = ("repeated", "alternating", 0.0, 15.0, -12.0)
        with pytest.raises((AssertionError, OperationError)):
            testing.check_rule_example(
                "linear", 0, [("random", "random", 0.0, 0.0, 0.0), attack], 1.0, 0
            )
