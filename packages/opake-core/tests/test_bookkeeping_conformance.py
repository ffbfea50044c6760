"""Generated conformance test: EVERY registered book-keeping layer rule against the per-example
reference, with the adversarial inputs of the privacy suite.

The cases come from the registry (``registered_rules()``: the built-in rules, first-party
plugins' and any third party's installed in the environment), each rule's ``example()`` giving
the module to run it on, so a new rule is tested without touching this file. For each,
hypothesis *searches* (guided by ``target`` towards the largest contribution) over batches of
0-3 examples whose inputs and output gradients are random, repeated at every position,
alternating, cancelling up to a tiny residual, zero / padding-only or non-finite, at magnitudes
1e-30..1e30. With ``loss_i = Σ_t ⟨y_{i,t}, layer(x_i)_t⟩`` the output gradients are the ``y``
drawn here, so the attacker controls both factors of every norm identity. Checked:

- the plan puts the example's layer under the rule being tested (the case exercises it);
- each example's contribution, isolated with ``example_mask``, is at most ``C·(1+1e-6)``;
- the batch's sum is the sum of the contributions;
- for moderate inputs, the sum equals the per-example loop of plain autograd, in fp64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss, RuleExample, bookkeeping_plan, registered_rules
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional

TOL = 1e-6
PATTERNS = ("random", "repeated", "alternating", "cancelling", "zero", "nonfinite")
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _cases() -> list[tuple[str, int]]:
    """(rule name, index of its example) for every registered rule."""
    out = []
    for rule in registered_rules():
        built = rule.load_example()()
        count = len(built) if isinstance(built, Sequence) else 1
        out.extend((rule.name, k) for k in range(count))
    return out


CASES = _cases()


def _example(name: str, index: int) -> RuleExample:
    (rule,) = [r for r in registered_rules() if r.name == name]
    built = rule.load_example()()
    got = built[index] if isinstance(built, Sequence) else built
    assert isinstance(got, RuleExample), f"{name}: example() must return RuleExample(s)"
    return got


def _pattern(gen, shape, pattern: str, exponent: float, residual: float) -> torch.Tensor:
    steps = shape[0]
    base = torch.randn(*shape, generator=gen, dtype=torch.float64)
    noise = torch.randn(*shape, generator=gen, dtype=torch.float64) * 10.0**residual
    if pattern == "repeated":
        base = base[:1].expand(shape).clone() + noise
    elif pattern == "alternating":
        sign = torch.tensor([(-1.0) ** t for t in range(steps)], dtype=torch.float64)
        base = base[:1] * sign.reshape(-1, *([1] * (len(shape) - 1))) + noise
    elif pattern == "cancelling":
        base[1::2] = -base[0 : steps - steps % 2 : 2]
        base = base + noise
    elif pattern == "zero":
        base = torch.zeros(shape, dtype=torch.float64)
    out = (base * 10.0**exponent).float()
    if pattern == "nonfinite":
        out.view(-1)[0] = math.nan if exponent > 0 else math.inf
    return out


def _inputs(case: RuleExample, examples, gen):
    xs, ys = [], []
    probe = torch.zeros(1, case.steps, dtype=torch.int64) if case.tokens else None
    if probe is None:
        probe = torch.zeros(1, case.steps, case.width)
    with torch.no_grad():
        out_shape = tuple(case.module(probe).shape[1:])
    for inputs, grads, ex, ey, res in examples:
        if case.tokens:
            ids = torch.randint(1, case.width, (case.steps,), generator=gen)
            if inputs in ("repeated", "alternating", "cancelling"):
                ids[:] = ids[0]
            elif inputs == "zero":
                ids[:] = 0  # padding only
            xs.append(ids)
        else:
            xs.append(_pattern(gen, (case.steps, case.width), inputs, ex, res))
        ys.append(_pattern(gen, out_shape, grads, ey, res))
    if not xs:
        shape = (0, case.steps) if case.tokens else (0, case.steps, case.width)
        dtype = torch.int64 if case.tokens else torch.float32
        return torch.zeros(shape, dtype=dtype), torch.zeros(0, *out_shape)
    return torch.stack(xs), torch.stack(ys)


def _norm(grads) -> float:
    return math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))


def _moderate(examples) -> bool:
    """No cancellation and fp32-safe magnitudes (where fp32 autograd itself is accurate)."""
    return all(
        {p, q} <= {"random", "zero"} and abs(ex) <= 6 and abs(ey) <= 6
        for p, q, ex, ey, _ in examples
    )


def _check(name: str, index: int, examples, clip: float, seed: int) -> None:
    torch.manual_seed(seed)
    case = _example(name, index)
    model = torch.nn.Sequential(case.module)
    fmodel, params = make_functional(model)
    plan = bookkeeping_plan(model, list(params))
    assert plan.supported, plan.explain()
    assert name in {layer.rule for layer in plan.layers}, plan.explain()

    def losses(p, x, y):
        out = fmodel(p, x)
        return (out * y.to(out.dtype)).reshape(out.shape[0], -1).sum(dim=1)

    loss = BatchedLoss(losses, fmodel)
    x, y = _inputs(case, examples, torch.Generator().manual_seed(seed))
    grad_fn, state = clipped_grad(
        loss, clipping_norm=clip, batch_argnums=(1, 2), method="bookkeeping", check_unused=False
    )
    batch = x.shape[0]
    total, _ = grad_fn(params, x, y, state=state)
    assert all(bool(torch.isfinite(g).all()) for g in total.values())
    contributions, worst = [], 0.0
    for i in range(batch):
        mask = torch.zeros(batch, dtype=torch.bool)
        mask[i] = True
        one, _ = grad_fn(params, x, y, state=state, example_mask=mask)
        norm = _norm(one)
        worst = max(worst, norm / clip)
        assert norm <= clip * (1 + TOL), (i, examples[i], norm, clip)
        contributions.append(one)
    target(worst, label=f"{name}[{index}]: contribution / bound")
    for key, value in total.items():
        want = sum((c[key].double() for c in contributions), torch.zeros(value.shape).double())
        err = float((value.double() - want).abs().max()) if value.numel() else 0.0
        assert err <= 1e-4 * max(1, batch) * clip, key
    if batch and _moderate(examples):
        one_loss = loss.per_example(batch_argnums=(1, 2), has_aux=False)
        params64 = {k: v.double() for k, v in params.items()}
        x64 = x if x.dtype == torch.int64 else x.double()
        model.double()
        want = testing.reference_clipped_grad(
            one_loss, (params64, x64, y.double()), clipping_norm=clip, batch_argnums=(1, 2)
        )
        testing.assert_grads_close(total, want, rtol=2e-3, atol=2e-3 * clip * batch)


EXAMPLE = st.tuples(
    st.sampled_from(PATTERNS),  # inputs
    st.sampled_from(PATTERNS),  # output gradients
    st.floats(-30.0, 30.0),  # log10 magnitude of the inputs
    st.floats(-30.0, 30.0),  # log10 magnitude of the output gradients
    st.floats(-12.0, 0.0),  # log10 of the residual left after cancellation
)


def test_the_registry_yields_cases_for_every_builtin_rule():
    names = {name for name, _ in CASES}
    assert {"linear", "conv1d", "embedding", "layer_norm", "rms_norm", "per_layer"} <= names


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
@SETTINGS
@given(
    examples=st.lists(EXAMPLE, min_size=0, max_size=3),
    clip=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
@example(examples=[("random", "random", 0.0, 0.0, 0.0)], clip=0.1, seed=0)  # batch 1, clipped
@example(examples=[("repeated", "alternating", 0.0, 5.0, -12.0)], clip=1.0, seed=0)
@example(
    examples=[("zero", "random", 0.0, 0.0, 0.0), ("cancelling", "repeated", 30.0, -30.0, -12.0)],
    clip=1.0,
    seed=1,
)
def test_rule_never_lets_an_example_exceed_the_bound(name, index, examples, clip, seed):
    _check(name, index, examples, clip, seed)
