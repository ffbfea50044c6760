"""Mixture of experts under DP: the dense dispatch, the per-example auxiliary loss, and the
clipped sum's sensitivity when the router's load-balancing loss is on.

The oracle is always transformers' own, unpatched model run on one example at a time (its
``.loss`` with ``output_router_logits=True`` is the language-model loss plus
``router_aux_loss_coef ×`` the load-balancing loss of that example alone).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.models import family_names, family_spec
from opake.models._moe import dense_experts, per_example_load_balancing
from opake.models.testing import tiny_model
from opake.patches import apply_model_patches

MOE = [n for n in family_names() if family_spec(n).moe is not None]
AUX = [n for n in MOE if family_spec(n).moe.aux_loss and family_spec(n).moe.routing != "family"]
VOCAB, SEQ = 128, 6


def _experts_of(model):
    spec = family_spec(
        next(n for n in MOE if model.config.model_type in family_spec(n).model_types)
    )
    block = next(m for m in model.modules() if type(m).__name__ == spec.moe.block)
    return getattr(block, spec.moe.experts)


@pytest.mark.parametrize("family", MOE)
def test_dense_dispatch_is_the_family_experts_function(family):
    """Every expert on every token, weighted by a dense top-k matrix, equals the family's own
    sparse loop — top-k > 1, repeated experts across tokens, and an out-of-range (dropped)
    slot that selects nothing — in value and in the gradient of the expert weights."""
    experts = _experts_of(tiny_model(family))
    gen = torch.Generator().manual_seed(0)
    for p in experts.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    tokens, k, count = 7, 2, int(experts.num_experts)
    x = torch.randn(tokens, experts.gate_up_proj.shape[-1 if not experts.is_transposed else 1])
    index = torch.randint(0, count, (tokens, k), generator=gen)
    index[0] = torch.tensor([1, 1 % count])
    weights = torch.rand(tokens, k, generator=gen)
    stock = type(experts).forward(experts, x, index, weights)
    dense = dense_experts(experts, x, index, weights)
    scale = float(stock.detach().abs().max())
    torch.testing.assert_close(dense, stock, rtol=1e-5, atol=1e-5 * scale)
    params = dict(experts.named_parameters())
    g_stock = torch.autograd.grad(stock.square().sum(), list(params.values()))
    g_dense = torch.autograd.grad(dense.square().sum(), list(params.values()))
    for a, b in zip(g_dense, g_stock, strict=True):  # fp32, relative to the largest entry
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    if getattr(type(experts), "_is_expert_parallel", None) is None:
        dropped = index.clone()
        dropped[:, 1] = count  # a sentinel: that slot contributes nothing
        only_first = dense_experts(experts, x, index[:, :1], weights[:, :1])
        torch.testing.assert_close(
            dense_experts(experts, x, dropped, weights), only_first, rtol=1e-6, atol=1e-6
        )


def test_load_balancing_loss_is_transformers_on_one_example():
    """The per-example statistic is transformers' ``load_balancing_loss_func`` of that example
    alone (with its padding mask)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(3, 5, 4, generator=gen) for _ in range(2)]
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    ours = per_example_load_balancing(logits, mask.float(), experts=4, top_k=2)
    for i in range(3):
        theirs = load_balancing_loss_func(tuple(x[i] for x in logits), 4, 2, mask[i : i + 1])
        torch.testing.assert_close(ours[i], theirs, rtol=1e-6, atol=1e-7)


def _batch(seed: int, batch: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    if batch > 1:
        mask[1, SEQ - 2 :] = 0  # right padding
    if batch > 2:
        mask[2, :2] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    return ids, ids.masked_fill(mask == 0, -100), mask


#: parameters book-keeping runs with frozen (see test_bookkeeping_families.py)
FROZEN = {"gpt_oss": (".sinks",), "qwen3_next": (".linear_attn.",)}


def _aux_models(family, coef=0.5):
    kw = {"output_router_logits": True, "router_aux_loss_coef": coef}
    stock, patched = tiny_model(family, **kw), tiny_model(family, **kw)
    apply_model_patches(patched)
    for name, param in patched.named_parameters():
        if any(part in name for part in FROZEN.get(family, ())):
            param.requires_grad_(False)
    return stock, patched


def _losses(patched):
    fmodel, trainable, frozen = make_functional(patched, partition_trainable=True)

    def losses(t, f, ids, labels, mask):
        out = fmodel(
            (t, f),
            input_ids=ids,
            attention_mask=mask,
            labels=labels,
            loss_only=True,
            per_example_loss=True,
        )
        return out.loss

    return BatchedLoss(losses, fmodel), trainable, frozen


def _oracle(stock):
    """transformers' own loss of one example (language model + its own auxiliary loss)."""
    fmodel, _ = make_functional(stock)

    def oracle(t, f, ids, labels, mask):
        return fmodel(
            {**t, **f}, input_ids=ids[None], attention_mask=mask[None], labels=labels[None]
        ).loss

    return oracle


@pytest.mark.parametrize("family", AUX)
def test_per_example_aux_loss_equals_transformers_one_example_at_a_time(family):
    """With ``output_router_logits=True`` the loss-only path adds each example's own auxiliary
    loss: per-example losses and clipped sums (book-keeping and vmap) equal transformers'
    model on one example at a time, and the auxiliary term is really there."""
    stock, patched = _aux_models(family)
    loss_fn, trainable, frozen = _losses(patched)
    ids, labels, mask = _batch(0)
    args = (trainable, frozen, ids, labels, mask)
    oracle = _oracle(stock)
    with torch.no_grad():
        got = loss_fn.fn(*args)
        want = torch.stack(
            [oracle(trainable, frozen, ids[i], labels[i], mask[i]) for i in range(3)]
        )
        plain = tiny_model(family)(input_ids=ids[:1], attention_mask=mask[:1], labels=labels[:1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got[0], plain.loss)  # the auxiliary loss is included
    per_example, _ = testing.per_example_grads_loop(oracle, args, batch_argnums=(2, 3, 4))
    norms = sorted(
        math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in per_example
    )
    expected = testing.reference_clipped_sum(per_example, clipping_norm=norms[1])
    for method in ("bookkeeping", "vmap"):
        grad_fn, state = clipped_grad(
            loss_fn, clipping_norm=norms[1], batch_argnums=(2, 3, 4), engine=method
        )
        grads, _ = grad_fn(*args, state=state)
        assert grad_fn.engine == method
        testing.assert_grads_close(grads, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_logits_path_aux_loss_is_the_mean_of_per_example_ones(family):
    """The patched model's logits path (padded 2-D mask) reports ``aux_loss`` = the mean of the
    examples' own load-balancing losses — transformers' value for each example alone — and
    under the vmap engine its per-example gradients equal transformers one at a time."""
    from torch.func import grad, vmap

    stock, patched = _aux_models(family)
    ids, labels, mask = _batch(0)
    with torch.no_grad():
        out = patched(input_ids=ids, attention_mask=mask, labels=labels)
        alone = [stock(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]) for i in range(3)]
    assert out.logits is not None
    torch.testing.assert_close(out.aux_loss, torch.stack([a.aux_loss for a in alone]).mean())
    fmodel, params = make_functional(patched)
    oracle = _oracle(stock)

    def one(p, ids, labels, mask):
        return fmodel(p, input_ids=ids[None], attention_mask=mask[None], labels=labels[None]).loss

    with torch.no_grad():
        got = vmap(grad(one), in_dims=(None, 0, 0, 0))(params, ids, labels, mask)
    want, _ = testing.per_example_grads_loop(
        oracle, (params, {}, ids, labels, mask), batch_argnums=(2, 3, 4)
    )
    expected = {k: torch.stack([w[k] for w in want]) for k in want[0]}
    testing.assert_grads_close(got, expected, rtol=1e-5, atol=1e-7)


def test_batch_wide_router_logit_capture_is_refused_under_bookkeeping():
    """Asking transformers for the router logits of a *batched* forward (its capture feeds the
    batch-wide load-balancing loss) while book-keeping records is refused, not mixed."""
    from opake.core.errors import OperationError

    _, patched = _aux_models("mixtral")
    fmodel, trainable, frozen = make_functional(patched.model, partition_trainable=True)

    def losses(t, f, ids, labels, mask):  # the backbone, with transformers' capture on
        out = fmodel((t, f), input_ids=ids, attention_mask=mask, output_router_logits=True)
        return out.last_hidden_state.float().square().mean(dim=(1, 2))

    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel),
        clipping_norm=1.0,
        batch_argnums=(2, 3, 4),
        engine="bookkeeping",
    )
    ids, labels, mask = _batch(0)
    with pytest.raises(OperationError, match="mixes examples"):
        grad_fn(trainable, frozen, ids, labels, mask, state=state)


# --------------------------------------------------------------------- sensitivity (adversarial)

CLIP = 1e-3  # far below every example's gradient norm: each contribution is clipped to C


def _clipped_sum(loss_fn, trainable, frozen, ids, labels, mask, method):
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=CLIP, batch_argnums=(2, 3, 4), engine=method
    )
    grads, _ = grad_fn(trainable, frozen, ids, labels, mask, state=state)
    return grads


def _distance(a, b):
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


_SETUP: dict[str, tuple] = {}


def _setup():
    if not _SETUP:
        _SETUP["mixtral"] = _losses(_aux_models("mixtral", coef=10.0)[1])
    return _SETUP["mixtral"]


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    rows=st.lists(
        st.lists(st.integers(3, VOCAB - 1), min_size=SEQ, max_size=SEQ), min_size=3, max_size=3
    ),
    removed=st.integers(0, 2),
    pads=st.lists(st.integers(0, SEQ - 2), min_size=3, max_size=3),
    method=st.sampled_from(["bookkeeping", "vmap"]),
)
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(rows, removed, pads, method):
    """The auxiliary loss on (coefficient 10, so it dominates the router's gradients): removing
    any one example from a batch — token ids, padding and position searched by hypothesis —
    moves the clipped sum by at most C, on both engines."""
    loss_fn, trainable, frozen = _setup()
    ids = torch.tensor(rows)
    mask = torch.ones_like(ids)
    for i, pad in enumerate(pads):
        if pad:
            mask[i, -pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    keep = [i for i in range(3) if i != removed]
    full = _clipped_sum(loss_fn, trainable, frozen, ids, labels, mask, method)
    less = _clipped_sum(loss_fn, trainable, frozen, ids[keep], labels[keep], mask[keep], method)
    assert _distance(full, less) <= CLIP * (1 + 1e-4)


def test_a_batch_wide_aux_loss_breaks_the_bound_the_search_above_checks():
    """The search above can fail: with transformers' batch-wide load-balancing loss added to
    each example's loss (what "per example" fixes), removing one example changes the other
    examples' clipped gradients too, and the clipped sum moves by more than C."""
    stock = tiny_model("mixtral", output_router_logits=True, router_aux_loss_coef=10.0)
    fmodel, params = make_functional(stock)

    def coupled_grads(ids, labels, mask):
        grads = []
        for i in range(ids.shape[0]):

            def loss(p, i=i):
                pooled = fmodel(p, input_ids=ids, attention_mask=mask).aux_loss
                own = fmodel(
                    p,
                    input_ids=ids[i : i + 1],
                    attention_mask=mask[i : i + 1],
                    labels=labels[i : i + 1],
                    output_router_logits=False,
                ).loss
                return own + 10.0 * pooled

            grads.append(torch.func.grad(loss)(params))
        return testing.reference_clipped_sum(grads, clipping_norm=CLIP)

    worst = 0.0
    for seed in range(4):
        ids, labels, mask = _batch(seed)
        full = coupled_grads(ids, labels, mask)
        less = coupled_grads(ids[:2], labels[:2], mask[:2])
        worst = max(worst, _distance(full, less))
    assert worst > CLIP * 1.05, worst
