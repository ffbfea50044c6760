"""Book-keeping rule for fused mixture-of-experts weights: per-example norms and clipped sums
without per-example gradients, against slow obvious references.

- :class:`ExpertGrads` (the operator holding a fused weight's per-example gradients as routed
  slots) against each example's gradient built slot by slot in float64, with hypothesis
  searching routings: every slot on one expert, experts no slot uses, examples without slots
  (padding only), tiny and huge values, gradients that cancel;
- :func:`recorded_experts` on transformers' own experts modules (Mixtral, Qwen3-MoE, GPT-OSS
  with biases and the clamped SwiGLU) against plain autograd through the family's sparse
  experts forward, one example at a time (top-k > 1, dropped slots);
- the whole DP step on tiny models: the clipped sum equals the per-example loop's, and
  removing one example moves it by at most C.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss, ghost_is_cheaper
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.models import family_spec
from opake.models.bookkeeping import ExpertGrads, recorded_experts
from opake.models.testing import tiny_model
from opake.patches import apply_model_patches

QUICK = settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _reference(slots, experts, batch, rows, cols):
    """Each example's gradient ``[B, E, R, C]`` in float64, one slot at a time."""
    a, b, expert, example = slots
    out = torch.zeros(batch, experts, rows, cols, dtype=torch.float64)
    for s in range(a.shape[0]):
        out[example[s], expert[s]] += torch.outer(a[s].double(), b[s].double())
    return out


def _grads(slots, experts, batch):
    """The operator for ``slots`` (sorted by expert, then example, as the forward sorts)."""
    a, b, expert, example = slots
    order = sorted(range(len(expert)), key=lambda s: (int(expert[s]), int(example[s])))
    order = torch.tensor(order, dtype=torch.long)
    counts = tuple(int((expert == e).sum()) for e in range(experts))
    return ExpertGrads(a[order], b[order], example[order], counts, batch)


@st.composite
def routed_slots(draw):
    batch, experts = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    n = draw(st.integers(0, 24))
    mode = draw(st.sampled_from(["random", "one_expert", "one_example", "cancel"]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    expert = torch.randint(0, experts, (n,), generator=gen)
    example = torch.randint(0, batch, (n,), generator=gen)
    if mode == "one_expert":
        expert.fill_(experts - 1)  # every other expert unused
    if mode == "one_example":
        example.fill_(0)  # the other examples have no slot (padding only)
    scale = draw(st.sampled_from([1e-12, 1e-3, 1.0, 1e3, 1e8]))
    a = torch.randn(n, rows, generator=gen) * scale
    b = torch.randn(n, cols, generator=gen)
    if mode == "cancel" and n >= 2:  # same input, opposite output gradients: G cancels
        expert[1], example[1] = expert[0], example[0]
        a[1], b[1] = a[0], -b[0]
    return (a, b, expert, example), experts, batch, rows, cols


@QUICK
@given(routed_slots())
def test_expert_grads_match_each_examples_gradient(case):
    slots, experts, batch, rows, cols = case
    grads = _grads(slots, experts, batch)
    want = _reference(slots, experts, batch, rows, cols)
    assert grads.shape == (experts, rows, cols)
    assert grads.batch == batch
    # the norm: Gram or materialised route; bounded by the cancellation-free sum of |a||b|
    sq = grads.sq_norms()[0]
    want_sq = want.square().sum(dim=(1, 2, 3))
    bound = grads.abs_norms()
    tol = 1e-5 * bound.square() + 1e-300
    assert bool(((sq.double() - want_sq).abs() <= tol).all()), (sq, want_sq)
    assert bool((want_sq.sqrt() <= bound * (1 + 1e-6) + 1e-300).all())
    # the exact route: fp64, every expert block of one example
    for i in range(batch):
        for start in sorted({0, experts - 1}):
            got = grads.example_rows(i, start, experts)
            torch.testing.assert_close(
                got, want[i, start:].reshape(experts - start, -1), rtol=1e-12, atol=1e-300
            )
    # the clipped sum; an example not kept adds nothing even when its slots are NaN
    weights = torch.rand(batch, generator=torch.Generator().manual_seed(3))
    keep = torch.arange(batch) % 2 == 0
    total, bias = grads.weighted_sum(weights, keep)
    expected = torch.einsum("b,berc->erc", weights.double() * keep, want)
    assert bias is None
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(total.double(), expected, rtol=1e-5, atol=1e-5 * scale + 1e-30)
    if slots[0].shape[0]:
        poisoned = (slots[0].clone(), slots[1], slots[2], slots[3])
        poisoned[0][slots[3] % 2 == 1] = float("nan")
        again, _ = _grads(poisoned, experts, batch).weighted_sum(weights, keep)
        torch.testing.assert_close(again, total)


def test_gram_route_over_buckets_of_uneven_groups():
    """Wide factors and (expert, example) groups of very different sizes, padded bucket by
    bucket: the small groups' buckets take the Gram route, the large group's is materialised;
    the norms and the bound equal the slot-by-slot reference."""
    gen = torch.Generator().manual_seed(5)
    batch, experts, n = 5, 3, 100
    expert = torch.randint(0, experts, (n,), generator=gen)
    example = torch.randint(0, batch, (n,), generator=gen)
    expert[:40], example[:40] = 1, 2  # one large group
    slots = (torch.randn(n, 64, generator=gen), torch.randn(n, 64, generator=gen), expert, example)
    grads = _grads(slots, experts, batch)
    sizes = [size for _, _, size, _ in grads._buckets()[1]]
    assert len(sizes) > 1
    assert ghost_is_cheaper(min(sizes), 64, 64)
    assert not ghost_is_cheaper(max(sizes), 64, 64)
    want = _reference(slots, experts, batch, 64, 64)
    torch.testing.assert_close(
        grads.sq_norms()[0], want.square().sum(dim=(1, 2, 3)), rtol=1e-5, atol=0.0
    )
    a, b = slots[0].double().norm(dim=1), slots[1].double().norm(dim=1)
    bound = torch.zeros(batch, dtype=torch.float64).index_add_(0, example, a * b)
    torch.testing.assert_close(grads.abs_norms(), bound, rtol=1e-6, atol=0.0)


def test_clipped_sum_as_one_grouped_matmul_equals_the_reference(monkeypatch):
    """16-byte rows: the clipped sum is one grouped matmul over the slots (an expert without
    slots adds exactly zero), equal to the slot-by-slot reference and to the per-expert loop."""
    import opake.models.bookkeeping._grads as grads_module

    gen = torch.Generator().manual_seed(7)
    batch, experts, n = 4, 5, 60
    expert = torch.randint(0, experts - 1, (n,), generator=gen)  # the last expert unused
    example = torch.randint(0, batch, (n,), generator=gen)
    slots = (torch.randn(n, 8, generator=gen), torch.randn(n, 12, generator=gen), expert, example)
    grads = _grads(slots, experts, batch)
    weights = torch.rand(batch, generator=gen)
    calls = []
    real = grads_module.grouped_mm_takes
    monkeypatch.setattr(
        grads_module, "grouped_mm_takes", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    )
    total, _ = grads.weighted_sum(weights)
    assert calls == [True]
    want = torch.einsum("b,berc->erc", weights.double(), _reference(slots, experts, batch, 8, 12))
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-6)
    assert not bool(total[-1].any())
    monkeypatch.setattr(grads_module, "grouped_mm_takes", lambda *a, **k: False)
    torch.testing.assert_close(grads.weighted_sum(weights)[0], total, rtol=1e-6, atol=1e-6)


def test_expert_grads_refuse_a_cross_term():
    from opake.core.errors import OperationError

    grads = ExpertGrads(torch.ones(1, 2), torch.ones(1, 2), torch.tensor([0]), (1,), batch=1)
    with pytest.raises(OperationError, match="another layer"):
        grads.inner_outer(torch.ones(1, 1, 2), torch.ones(1, 1, 2))


# ----------------------------------------------------------------------------- one layer


class _Use:
    """Stands in for the engine's ImplicitUse: hands out the parameters, keeps the build."""

    def __init__(self, module):
        self.params = dict(module.named_parameters())
        self.build = None

    def tap(self, output, build):
        self.build = build
        return output


def _experts(family):
    """transformers' own experts module of ``family`` (4 experts, hidden 8), random weights."""
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    sizes = {"hidden_size": 8, "intermediate_size": 6, "moe_intermediate_size": 6}
    config, cls = {
        "mixtral": (MixtralConfig(num_local_experts=4, **sizes), MixtralExperts),
        "qwen3_moe": (Qwen3MoeConfig(num_experts=4, **sizes), Qwen3MoeExperts),
        "gpt_oss": (GptOssConfig(num_local_experts=4, **sizes), GptOssExperts),
    }[family]
    config._experts_implementation = "eager"
    experts = cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return experts


@pytest.fixture(scope="module")
def expert_modules():
    return {family: _experts(family) for family in ("mixtral", "qwen3_moe", "gpt_oss")}


@settings(max_examples=8, deadline=None, derandomize=True)
@given(
    family=st.sampled_from(["mixtral", "qwen3_moe", "gpt_oss"]),
    batch=st.integers(1, 3),
    steps=st.integers(1, 4),
    routing=st.sampled_from(["random", "one_expert", "dropped"]),
    seed=st.integers(0, 1000),
)
def test_recorded_experts_equal_per_example_autograd(
    expert_modules, family, batch, steps, routing, seed
):
    experts = expert_modules[family]
    count, k = int(experts.num_experts), 2
    size = experts.down_proj.shape[-1 if experts.is_transposed else 1]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, steps, size, generator=gen)
    index = torch.stack(
        [torch.randperm(count, generator=gen)[:k] for _ in range(batch * steps)]
    ).reshape(batch, steps, k)
    if routing == "one_expert":
        index[..., 0] = count - 1
        index[..., 1] = count - 2
    if routing == "dropped":  # an out-of-range slot selects nothing (a capacity drop)
        index[0, 0, 1] = count
    weights = torch.rand(batch, steps, k, generator=gen)
    out_grad = torch.randn(batch, steps, size, generator=gen)
    use = _Use(experts)
    out = recorded_experts(experts, use, x, index, weights)
    # the oracle: the family's own sparse forward, a dropped slot as weight 0 on expert 0
    # (transformers' fused kernels may read past the experts for an out-of-range index)
    dropped = index >= count
    ref_index, ref_weights = index.masked_fill(dropped, 0), weights.masked_fill(dropped, 0.0)

    def stock(x, i):
        return type(experts).forward(experts, x, ref_index[i], ref_weights[i])

    torch.testing.assert_close(
        out, torch.stack([stock(x[i], i) for i in range(batch)]), rtol=1e-5, atol=1e-5
    )
    pieces = use.build(out_grad)
    names = dict(experts.named_parameters())
    assert set(pieces) == set(names)
    clip = torch.rand(batch, generator=gen)
    total = {name: torch.zeros_like(p) for name, p in names.items()}
    for i in range(batch):
        y = stock(x[i], i)
        grads = torch.autograd.grad((y * out_grad[i]).sum(), list(names.values()))
        for name, g in zip(names, grads, strict=True):
            piece = pieces[name]
            total[name] += clip[i] * g
            if isinstance(piece, ExpertGrads):
                got = float(piece.sq_norms()[0][i])
            else:
                got = float(piece[i].double().square().sum())
            want = float(g.double().square().sum())
            assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-10), (name, i, got, want)
    for name, piece in pieces.items():
        if isinstance(piece, ExpertGrads):
            got = piece.weighted_sum(clip)[0]
        else:
            got = torch.einsum("b,b...->...", clip, piece)
        scale = float(total[name].abs().max()) + 1e-12
        torch.testing.assert_close(got, total[name], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_recorded_experts_grouped_matmul_equals_the_loop(family, monkeypatch):
    """Sizes the CPU grouped matmul takes (16-byte rows): the recorded forward runs each
    projection as one grouped matmul, and its output, the input gradient (for an expanded
    output gradient too) and the built pieces equal the per-expert loop's, an expert without
    slots and a dropped slot included."""
    from transformers import GptOssConfig, MixtralConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    import opake.models.bookkeeping._record as record

    sizes = {"hidden_size": 8, "intermediate_size": 16, "num_local_experts": 4}
    config, cls = {
        "mixtral": (MixtralConfig(**sizes), MixtralExperts),
        "gpt_oss": (GptOssConfig(**sizes), GptOssExperts),
    }[family]
    experts = cls(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x = torch.randn(3, 5, 8, generator=gen)
    index = torch.randint(0, 3, (3, 5, 2), generator=gen)  # expert 3: no slot
    index[0, 0, 1] = 4  # dropped
    weights = torch.rand(3, 5, 2, generator=gen)
    grouped = []
    real = record._grouped_ok
    monkeypatch.setattr(record, "_grouped_ok", lambda *a: grouped.append(real(*a)) or real(*a))

    def run(out_grad):
        xi = x.clone().requires_grad_(True)
        use = _Use(experts)
        out = recorded_experts(experts, use, xi, index, weights)
        (dx,) = torch.autograd.grad(out, xi, out_grad)
        return out, dx, use.build(torch.randn(out.shape, generator=torch.Generator()))

    ones = torch.ones(3)
    for out_grad in (torch.ones(8).expand(3, 5, 8), torch.randn(3, 5, 8, generator=gen)):
        grouped.clear()
        got = run(out_grad)
        assert grouped
        assert all(grouped)
        monkeypatch.setattr(record, "_grouped_ok", lambda *a: False)
        want = run(out_grad)
        monkeypatch.setattr(record, "_grouped_ok", lambda *a: grouped.append(real(*a)) or real(*a))
        torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        for name, piece in got[2].items():
            mine, other = piece, want[2][name]
            if isinstance(piece, ExpertGrads):
                mine, other = piece.weighted_sum(ones)[0], other.weighted_sum(ones)[0]
            torch.testing.assert_close(mine, other, rtol=1e-5, atol=1e-6)


def test_grouped_matmul_only_where_the_cpu_kernel_takes_the_operands():
    from opake.models.bookkeeping._record import _grouped_ok

    w = torch.randn(4, 8, 16)
    assert _grouped_ok(torch.randn(10, 8), w)
    assert _grouped_ok(torch.randn(10, 8), torch.randn(4, 16, 8).transpose(-2, -1))
    assert not _grouped_ok(torch.randn(10, 8, dtype=torch.float64), w.double())  # no fp64
    assert not _grouped_ok(torch.randn(10, 6), torch.randn(4, 6, 16))  # 24-byte rows
    assert not _grouped_ok(torch.randn(10, 8), torch.randn(4, 8, 6))  # 24-byte output rows
    assert not _grouped_ok(torch.randn(8, 10).T, w)  # column-major slots
    assert not _grouped_ok(torch.randn(81)[1:].view(10, 8), w)  # data 4 bytes off alignment


def test_grouped_matmul_backward_takes_an_expanded_gradient():
    """``out.sum()``'s gradient has zero strides, which torch's own grouped backward refuses."""
    from opake.models.bookkeeping._record import _per_expert

    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 16, 8)
    _per_expert(x, w, (4, 0, 6), transposed=False).sum().backward()
    want = torch.cat([torch.ones(4, 16) @ w[0], torch.ones(6, 16) @ w[2]])
    torch.testing.assert_close(x.grad, want)


# ----------------------------------------------------------------------------- the DP step


def _step_case(family, *, tie_router):
    torch.manual_seed(0)
    model = tiny_model(family)
    if tie_router:  # all router logits equal: every token on the same top-k experts
        spec = family_spec(family)
        with torch.no_grad():
            for m in model.modules():
                if type(m).__name__ == spec.moe.block:
                    for p in getattr(m, spec.moe.router).parameters():
                        p.zero_()
    apply_model_patches(model)
    for name, p in model.named_parameters():
        if ".sinks" in name:  # no rule for attention sinks: the vmap engine's business
            p.requires_grad_(False)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    gen = torch.Generator().manual_seed(1)
    batch, steps = 3, 6
    ids = torch.randint(3, int(model.config.vocab_size), (batch, steps), generator=gen)
    mask = torch.ones(batch, steps, dtype=torch.long)
    mask[2] = 0  # a padding-only example: no loss, routed pads, zero gradient
    mask[1, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    neg = torch.finfo(torch.float32).min
    allowed = (mask[:, None, None, :].bool() | torch.eye(steps, dtype=torch.bool)) & torch.ones(
        steps, steps, dtype=torch.bool
    ).tril()
    mask4 = torch.zeros(batch, 1, steps, steps).masked_fill(~allowed, neg)

    def losses(t, f, ids, labels, mask4):
        out = fmodel(
            (t, f),
            input_ids=ids,
            attention_mask=mask4,
            labels=labels,
            loss_only=True,
            per_example_loss=True,
            use_cache=False,
        )
        return out.loss

    def oracle(t, f, ids, labels, mask4):
        out = fmodel(
            (t, f),
            input_ids=ids[None],
            attention_mask=mask4[None],
            labels=labels[None],
            use_cache=False,
        )
        return torch.nan_to_num(out.loss)  # the padding-only example: mean of nothing

    return BatchedLoss(losses, fmodel), oracle, (trainable, frozen, ids, labels, mask4)


@pytest.mark.parametrize(
    ("family", "tie_router"),
    [("mixtral", True), ("qwen3_moe", False), ("gpt_oss", True)],
)
def test_dp_step_clips_each_example_to_c(family, tie_router):
    loss_fn, oracle, args = _step_case(family, tie_router=tie_router)
    per_example, _ = testing.per_example_grads_loop(oracle, args, batch_argnums=(2, 3, 4))
    norms = [
        math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in per_example
    ]
    clip = 0.5 * max(norms)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(2, 3, 4), engine="bookkeeping"
    )
    full, _ = grad_fn(*args, state=state)
    assert grad_fn.engine == "bookkeeping"
    expected = testing.reference_clipped_sum(per_example, clipping_norm=clip)
    testing.assert_grads_close(full, expected, rtol=1e-5, atol=1e-7)
    # one example removed: the clipped sum moves by at most C
    grad_fn2, state2 = clipped_grad(
        loss_fn, clipping_norm=clip, batch_argnums=(2, 3, 4), engine="bookkeeping"
    )
    # example 2 is padding only: removing example 0 instead tests a real contribution
    fewer = (*args[:2], *(a[1:] for a in args[2:]))
    without, _ = grad_fn2(*fewer, state=state2)
    moved = math.sqrt(sum(float((full[k] - without[k]).double().square().sum()) for k in full))
    assert moved <= clip * (1 + 1e-5)
    assert moved >= 0.99 * min(clip, norms[0])


@pytest.mark.parametrize(
    "family",
    ["mixtral", "qwen3_moe", "mellum", "gpt_oss", "hunyuan_v1_moe", "qwen3_next", "deepseek_v4"],
)
def test_the_plan_puts_every_experts_layer_under_the_fused_experts_rule(family):
    """No per-layer ``vmap`` fallback for fused experts: every experts module is planned under
    ``fused_experts`` (DeepSeek-V4 too, though other layers keep it on the vmap engine)."""
    from opake.dpsgd.bookkeeping import bookkeeping_plan

    model = tiny_model(family)
    apply_model_patches(model)
    spec = family_spec(family)
    names = [name for name, _ in model.named_parameters()]
    plan = bookkeeping_plan(model, names)
    experts = {
        f"{name}.{spec.moe.experts}"
        for name, m in model.named_modules()
        if type(m).__name__ == spec.moe.block
    }
    rules = {layer.module: layer.rule for layer in plan.layers}
    assert experts
    assert {rules.get(name) for name in experts} == {"fused_experts"}, plan.explain()
