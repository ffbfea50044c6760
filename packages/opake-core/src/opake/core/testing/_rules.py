"""The book-keeping rule conformance harness (public: plugin authors run it on their rules).

:func:`check_rule_example` runs one registered rule's example module through
``clipped_grad(engine="bookkeeping")`` on a batch built from adversarial patterns and checks the
clipping guarantee against an exact oracle; :func:`search_rule` lets hypothesis *search* such
batches (guided towards the largest contribution) for every example the rule declares.
Opake's own generated test (``test_bookkeeping_conformance.py``) runs :func:`search_rule` on
every rule of ``registered_rules()`` — yours too, once it is installed.

The loss is ``loss_i = Σ_t ⟨y_{i,t}, layer(x_i)_t⟩``: the output gradients are the ``y`` drawn
here, so the attacker controls both factors of every norm identity. Patterns: random, one token
repeated at every position, alternating signs, pairs cancelling up to a tiny residual, zero or
padding-only, non-finite; magnitudes 10⁻³⁰ … 10³⁰.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from opake.core.testing._isolate import contribution, exact_norm

if TYPE_CHECKING:
    import torch

    from opake.core.plugins import BookkeepingRule
    from opake.dpsgd.bookkeeping import RuleExample

__all__ = [
    "PATTERNS",
    "TOLERANCE",
    "adversarial_batch",
    "adversarial_tensor",
    "check_rule_example",
    "rule_example_cases",
    "search_rule",
]

#: the kinds of adversarial tokens the harness builds (inputs and output gradients alike)
PATTERNS = ("random", "repeated", "alternating", "cancelling", "zero", "nonfinite")
#: relative slack on ``‖contribution‖ ≤ C``: the oracle's own fp64 rounding of a norm (the
#: bound is proven, so nothing else is tolerated)
TOLERANCE = 1e-12

#: one example: (input pattern, output-gradient pattern, log10 magnitude of the inputs, of the
#: output gradients, log10 of the residual left after cancellation)
ExampleSpec = tuple[str, str, float, float, float]


def rule_example_cases(rules: Sequence[BookkeepingRule] | None = None) -> list[tuple[str, int]]:
    """``(rule name, index of its example)`` for every rule (default: ``registered_rules()``).

    >>> ("linear", 0) in rule_example_cases()
    True
    """
    from opake.dpsgd.bookkeeping import registered_rules

    out: list[tuple[str, int]] = []
    for rule in registered_rules() if rules is None else rules:
        built = rule.load_example()()
        count = len(built) if isinstance(built, Sequence) else 1
        out.extend((rule.name, k) for k in range(count))
    return out


def _example(name: str, index: int) -> RuleExample:
    from opake.core.errors import ConfigurationError
    from opake.dpsgd.bookkeeping import RuleExample, registered_rules

    found = [r for r in registered_rules() if r.name == name]
    if not found:
        raise ConfigurationError(
            f"no registered book-keeping rule named {name!r}; registered: "
            f"{[r.name for r in registered_rules()]}"
        )
    built = found[0].load_example()()
    got = built[index] if isinstance(built, Sequence) else built
    if not isinstance(got, RuleExample):
        raise ConfigurationError(f"rule {name!r}: example() must return RuleExample(s)")
    return got


def adversarial_tensor(
    gen: torch.Generator, shape: tuple[int, ...], pattern: str, exponent: float, residual: float
) -> torch.Tensor:
    """An fp32 ``[T, ...]`` tensor of tokens following ``pattern`` (one of :data:`PATTERNS`) at
    magnitude ``10**exponent``; ``residual`` (log10) is what cancelling or repeated tokens keep
    of their difference.

    >>> import torch
    >>> x = adversarial_tensor(torch.Generator().manual_seed(0), (4, 3), "alternating", 2.0, -9)
    >>> bool(((x[0] + x[1]).abs() < 1e-3).all())
    True
    """
    import torch

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
    out: torch.Tensor = (base * 10.0**exponent).float()
    if pattern == "nonfinite":
        out.view(-1)[0] = math.nan if exponent > 0 else math.inf
    return out


def adversarial_batch(
    examples: Sequence[ExampleSpec],
    gen: torch.Generator,
    *,
    tokens: bool,
    width: int,
    steps: int,
    out_shape: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and output gradients of a batch of ``examples`` (:data:`ExampleSpec` each):
    token ids in ``[1, width)`` (``tokens``; repeated for the repeating patterns, 0 — padding —
    for ``"zero"``) or ``[steps, width]`` vectors, and ``out_shape`` output gradients.

    >>> import torch
    >>> x, y = adversarial_batch(
    ...     [("random", "zero", 0.0, 0.0, 0.0)], torch.Generator().manual_seed(0),
    ...     tokens=False, width=3, steps=2, out_shape=(2, 4),
    ... )
    >>> tuple(x.shape), tuple(y.shape), float(y.abs().sum())
    ((1, 2, 3), (1, 2, 4), 0.0)
    """
    import torch

    xs, ys = [], []
    for inputs, grads, ex, ey, res in examples:
        if tokens:
            ids = torch.randint(1, width, (steps,), generator=gen)
            if inputs in ("repeated", "alternating", "cancelling"):
                ids[:] = ids[0]
            elif inputs == "zero":
                ids[:] = 0  # padding only
            xs.append(ids)
        else:
            xs.append(adversarial_tensor(gen, (steps, width), inputs, ex, res))
        ys.append(adversarial_tensor(gen, out_shape, grads, ey, res))
    if not xs:
        shape = (0, steps) if tokens else (0, steps, width)
        dtype = torch.int64 if tokens else torch.float32
        return torch.zeros(shape, dtype=dtype), torch.zeros(0, *out_shape)
    return torch.stack(xs), torch.stack(ys)


def _inputs(
    case: RuleExample, examples: Sequence[ExampleSpec], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    probe = torch.zeros(1, case.steps, dtype=torch.int64) if case.tokens else None
    if probe is None:
        probe = torch.zeros(1, case.steps, case.width)
    with torch.no_grad():
        out_shape = tuple(case.module(probe).shape[1:])
    return adversarial_batch(
        examples, gen, tokens=case.tokens, width=case.width, steps=case.steps, out_shape=out_shape
    )


def _moderate(examples: Sequence[ExampleSpec]) -> bool:
    """No cancellation and fp32-safe magnitudes (where fp32 autograd itself is accurate)."""
    return all(
        {p, q} <= {"random", "zero"} and abs(ex) <= 6 and abs(ey) <= 6
        for p, q, ex, ey, _ in examples
    )


def check_rule_example(
    name: str, index: int, examples: Sequence[ExampleSpec], clip: float, seed: int
) -> float:
    """Run rule ``name``'s example ``index`` on a batch of ``examples``; return the largest
    contribution ÷ ``clip``.

    Raises ``AssertionError`` unless: the plan puts the example's layer under that rule; every
    example's contribution, isolated with ``example_mask``, is at most
    ``clip·(1 + TOLERANCE)``; the batch's sum is the sum of the contributions; and, for moderate
    inputs, the sum equals the per-example loop of plain autograd in fp64.

    >>> check_rule_example("linear", 0, [("random", "random", 0.0, 0.0, 0.0)], 0.1, 0) <= 1.0
    True
    """
    import torch

    from opake.core import testing
    from opake.dpsgd.bookkeeping import BatchedLoss, bookkeeping_plan
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    torch.manual_seed(seed)
    case = _example(name, index)
    model = torch.nn.Sequential(case.module)
    fmodel, params = make_functional(model)
    plan = bookkeeping_plan(model, list(params), trusted=(name,))  # as clipped_grad below
    assert plan.supported, plan.explain()
    assert name in {layer.rule for layer in plan.layers}, plan.explain()

    def losses(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = fmodel(p, x)
        total: torch.Tensor = (out * y.to(out.dtype)).reshape(out.shape[0], -1).sum(dim=1)
        return total

    loss = BatchedLoss(losses, fmodel)
    x, y = _inputs(case, examples, torch.Generator().manual_seed(seed))
    grad_fn, state = clipped_grad(
        loss,
        clipping_norm=clip,
        batch_argnums=(1, 2),
        engine="bookkeeping",
        check_unused=False,
        trusted_rules=(name,),
    )
    batch = x.shape[0]
    total, _ = grad_fn(params, x, y, state=state)
    assert all(bool(torch.isfinite(g).all()) for g in total.values())
    contributions, worst = [], 0.0
    for i in range(batch):
        one = contribution(grad_fn, (params, x, y), state=state, index=i, batch=batch)
        norm = exact_norm(one)
        worst = max(worst, norm / clip)
        assert norm <= clip * (1 + TOLERANCE), (i, examples[i], norm, clip)
        contributions.append(one)
    for key, value in total.items():
        want = sum((c[key].double() for c in contributions), torch.zeros(value.shape).double())
        err = float((value.double() - want).abs().max()) if value.numel() else 0.0
        assert err <= 1e-4 * max(1, batch) * clip, key
    if batch and _moderate(examples):
        one_loss = loss.per_example(batch_argnums=(1, 2), has_aux=False)
        params64 = {k: v.double() for k, v in params.items()}
        x64 = x if x.dtype == torch.int64 else x.double()
        model.double()
        reference = testing.reference_clipped_grad(
            one_loss, (params64, x64, y.double()), clipping_norm=clip, batch_argnums=(1, 2)
        )
        testing.assert_grads_close(total, reference, rtol=2e-3, atol=2e-3 * clip * batch)
    return worst


def search_rule(name: str, index: int = 0, *, max_examples: int = 8) -> None:
    """Let hypothesis search adversarial batches (0–3 examples of :data:`PATTERNS` at
    magnitudes ``10⁻³⁰ … 10³⁰``, bounds ``10⁻³ … 10³``) for rule ``name``'s example ``index``,
    plus four fixed batches (a clipped batch of one, repeated tokens with alternating output
    gradients, a padding-only example next to a cancelling one, a non-finite example next to a
    finite one); raises on the first violation
    of :func:`check_rule_example`. Needs ``hypothesis``.

    >>> search_rule("rms_norm", max_examples=2)
    """
    try:
        from hypothesis import HealthCheck, example, given, settings, target
        from hypothesis import strategies as st
    except ImportError as err:  # pragma: no cover - a test dependency
        from opake.core.errors import ConfigurationError

        raise ConfigurationError(
            "opake.core.testing.search_rule needs hypothesis (pip install hypothesis)"
        ) from err

    spec = st.tuples(
        st.sampled_from(PATTERNS),
        st.sampled_from(PATTERNS),
        st.floats(-30.0, 30.0),
        st.floats(-30.0, 30.0),
        st.floats(-12.0, 0.0),
    )

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(
        examples=st.lists(spec, min_size=0, max_size=3),
        clip=st.floats(1e-3, 1e3),
        seed=st.integers(0, 2**16),
    )
    @example(examples=[("random", "random", 0.0, 0.0, 0.0)], clip=0.1, seed=0)
    @example(examples=[("repeated", "alternating", 0.0, 5.0, -12.0)], clip=1.0, seed=0)
    @example(
        examples=[
            ("zero", "random", 0.0, 0.0, 0.0),
            ("cancelling", "repeated", 30.0, -30.0, -12.0),
        ],
        clip=1.0,
        seed=1,
    )
    @example(
        examples=[("random", "random", 0.0, 0.0, 0.0), ("random", "nonfinite", 0.0, 0.0, 0.0)],
        clip=1.0,
        seed=0,
    )
    def run(examples: list[ExampleSpec], clip: float, seed: int) -> None:
        worst = check_rule_example(name, index, examples, clip, seed)
        target(worst, label=f"{name}[{index}]: contribution / bound")

    run()
