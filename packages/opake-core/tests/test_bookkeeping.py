"""Book-keeping engine: equal to the vmap engine and to the per-example loop, or loud."""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.core.errors import ConfigurationError, OperationError
from opake.dpsgd.bookkeeping import (
    BatchedLoss,
    bookkeeping_plan,
    causal_lm_losses,
    registered_rules,
)
from opake.dpsgd.clipping import (
    AdaptiveClipping,
    AutoSClipping,
    ClippedGrads,
    GroupClipping,
    clipped_grad,
)
from opake.functional import make_functional

F = torch.nn.functional


def _mlp_loss(model):
    fmodel, params = make_functional(model)

    def losses(p, x, y):
        return F.cross_entropy(fmodel(p, x), y, reduction="none")

    return BatchedLoss(losses, fmodel), params


def _run(loss_fn, args, clipping_norm, method, **options):
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=clipping_norm, return_aux=True, engine=method, **options
    )
    (grads, aux), new_state = grad_fn(*args, state=state)
    return grad_fn, grads, aux, new_state


def _median_norm(loss_fn, args, batch_argnums):
    grads, _ = testing.per_example_grads_loop(loss_fn, args, batch_argnums=batch_argnums)
    norms = sorted(
        math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in grads
    )
    return 0.5 * (norms[len(norms) // 2 - 1] + norms[len(norms) // 2]), grads


@pytest.mark.parametrize("microbatch_size", [None, 3])
def test_mlp_equals_vmap_and_loop(mlp, mlp_batch, microbatch_size):
    loss_fn, params = _mlp_loss(mlp)
    args = (params, *mlp_batch)
    one = loss_fn.per_example(batch_argnums=(1, 2), has_aux=False)
    clip, per_example = _median_norm(one, args, (1, 2))
    options = {"batch_argnums": (1, 2), "microbatch_size": microbatch_size, "normalize_by": 4.0}
    bk_fn, bk, bk_aux, _ = _run(loss_fn, args, clip, "bookkeeping", **options)
    vm_fn, vm, vm_aux, _ = _run(loss_fn, args, clip, "vmap", **options)
    assert (bk_fn.engine, vm_fn.engine) == ("bookkeeping", "vmap")
    expected = testing.reference_clipped_sum(per_example, clipping_norm=clip, normalize_by=4.0)
    testing.assert_grads_close(bk, expected, rtol=1e-5)
    testing.assert_grads_close(bk, vm, rtol=1e-5)
    assert isinstance(bk, ClippedGrads)
    assert bk.max_norm == vm.max_norm == clip / 4.0
    torch.testing.assert_close(bk_aux.grad_norms, vm_aux.grad_norms, rtol=1e-5, atol=0)
    torch.testing.assert_close(bk_aux.loss_values, vm_aux.loss_values)
    assert float(bk_aux.clipping_rate) == float(vm_aux.clipping_rate) == 0.5
    # no weight gradient was formed on the module (the backward targets a sink only)
    assert all(p.grad is None for p in mlp.parameters())


@pytest.mark.parametrize(
    "state",
    [
        GroupClipping({"0": 0.5, "2": 1.0}),
        AutoSClipping(clipping_norm=1.0, stability=0.01),
        AdaptiveClipping(1.0, count_noise_multiplier=1.0, expected_batch_size=10, seed=0),
    ],
    ids=["group", "auto_s", "adaptive"],
)
def test_clip_states_equal_vmap(mlp, mlp_batch, state):
    loss_fn, params = _mlp_loss(mlp)
    args = (params, *mlp_batch)
    _, bk, bk_aux, bk_state = _run(loss_fn, args, state, "bookkeeping", batch_argnums=(1, 2))
    _, vm, vm_aux, vm_state = _run(loss_fn, args, state, "vmap", batch_argnums=(1, 2))
    testing.assert_grads_close(bk, vm, rtol=1e-5)
    assert bk_state == vm_state
    if isinstance(state, GroupClipping):
        for group in state.clipping_norms:
            torch.testing.assert_close(
                bk_aux.group_grad_norms[group], vm_aux.group_grad_norms[group], rtol=1e-5, atol=0
            )


def test_nonfinite_and_padding_examples_contribute_zero(mlp, mlp_batch):
    loss_fn, params = _mlp_loss(mlp)
    x, y = mlp_batch
    x = x.clone()
    x[3, 0] = float("inf")
    mask = torch.ones(x.shape[0], dtype=torch.bool)
    mask[5] = False
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), return_aux=True, engine="bookkeeping"
    )
    (grads, aux), _ = grad_fn(params, x, y, state=state, example_mask=mask)
    one = loss_fn.per_example(batch_argnums=(1, 2), has_aux=False)
    keep = [i not in (3, 5) for i in range(x.shape[0])]
    expected = testing.reference_clipped_grad(
        one, (params, x, y), clipping_norm=1.0, batch_argnums=(1, 2), example_mask=keep
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5)
    assert int(aux.nonfinite_count) == 1
    assert int(grads.batch_size) == x.shape[0] - 1
    assert all(torch.isfinite(v).all() for v in grads.values())


def _lm_case(model, *, pad: bool):
    """Batch with a 4-D float additive mask and labels = -100 on the pads of example 0."""
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def losses(t, f, ids, labels, mask):
        out = fmodel((t, f), input_ids=ids, attention_mask=mask, use_cache=False)
        return causal_lm_losses(out.logits, labels)

    gen = torch.Generator().manual_seed(3)
    batch, seq = 4, 8
    ids = torch.randint(0, 128, (batch, seq), generator=gen)
    labels = ids.clone()
    neg = torch.finfo(torch.float32).min
    mask = torch.triu(torch.full((seq, seq), neg), 1).expand(batch, 1, seq, seq).clone()
    if pad:
        labels[0, 5:] = -100
        mask[0, :, :, 5:] = neg
    return BatchedLoss(losses, fmodel), (trainable, frozen, ids, labels, mask)


def _hf_loss(fmodel):
    """The oracle's loss: Hugging Face's own ``.loss`` for one example (not causal_lm_losses)."""

    def loss(t, f, ids, labels, mask):
        out = fmodel((t, f), input_ids=ids[None], attention_mask=mask[None], labels=labels[None])
        return out.loss

    return loss


def _check_lm(model, *, microbatch_size=None, auto="bookkeeping"):
    loss_fn, args = _lm_case(model, pad=True)
    oracle = _hf_loss(make_functional(loss_fn.module, partition_trainable=True)[0])
    clip, per_example = _median_norm(oracle, args, (2, 3, 4))
    options = {"batch_argnums": (2, 3, 4), "microbatch_size": microbatch_size}
    auto_fn, auto_grads, _, _ = _run(loss_fn, args, clip, "auto", **options)
    assert auto_fn.engine == auto, auto_fn.engine_reason
    bk_fn, bk, bk_aux, _ = _run(loss_fn, args, clip, "bookkeeping", **options)
    _, vm, vm_aux, _ = _run(loss_fn, args, clip, "vmap", **options)
    assert bk_fn.engine == "bookkeeping", bk_fn.engine_reason
    testing.assert_grads_close(auto_grads, bk, rtol=1e-5)
    expected = testing.reference_clipped_sum(per_example, clipping_norm=clip)
    testing.assert_grads_close(bk, expected, rtol=1e-5)
    testing.assert_grads_close(bk, vm, rtol=1e-5)
    torch.testing.assert_close(bk_aux.grad_norms, vm_aux.grad_norms, rtol=1e-5, atol=0)
    return args[0]


def test_llama_full(tiny_llama):
    trainable = _check_lm(tiny_llama, microbatch_size=3)
    assert len(trainable) == len(list(tiny_llama.parameters()))
    rules = {layer.rule for layer in bookkeeping_plan(tiny_llama, trainable).layers}
    # LlamaRMSNorm: the rule its family spec declares (opake-models), else the per-layer fallback
    registered = {rule.name for rule in registered_rules()}
    norm = "family_norm" if "family_norm" in registered else "per_layer"
    assert rules == {"embedding", "linear", norm}


def test_llama_lora(tiny_llama):
    pytest.importorskip("peft")
    model = testing.with_lora(tiny_llama, r=4)
    trainable = _check_lm(model)  # adapters too: book-keeping measured faster on a BatchedLoss
    assert all("lora_" in name for name in trainable)


def test_gpt2_tied_full(tiny_gpt2):
    trainable = _check_lm(tiny_gpt2)
    plan = bookkeeping_plan(tiny_gpt2, trainable)
    users = [
        layer.module
        for layer in plan.layers
        if ("weight", "transformer.wte.weight") in layer.params
    ]
    assert users == ["transformer.wte", "lm_head"]  # both uses of the tied matrix count
    assert {layer.rule for layer in plan.layers} == {"embedding", "conv1d", "layer_norm", "linear"}


def test_gpt2_lora(tiny_gpt2):
    pytest.importorskip("peft")
    model = testing.with_lora(tiny_gpt2, r=4, target_modules=("c_attn",))
    trainable = _check_lm(model, microbatch_size=2)
    assert all("lora_" in name for name in trainable)


class Scale(torch.nn.Module):
    """A leaf layer without a rule: elementwise scale and shift."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.shift = torch.nn.Parameter(torch.linspace(-0.1, 0.1, width))

    def forward(self, x):
        return torch.tanh(x * self.scale + self.shift)


def test_layer_without_rule_falls_back_per_layer(mlp_batch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), Scale(16), torch.nn.Linear(16, 4))
    loss_fn, params = _mlp_loss(model)
    plan = bookkeeping_plan(model, params)
    assert [layer.rule for layer in plan.layers] == ["linear", "per_layer", "linear"]
    args = (params, *mlp_batch)
    _, bk, _, _ = _run(loss_fn, args, 1.0, "bookkeeping", batch_argnums=(1, 2))
    _, vm, _, _ = _run(loss_fn, args, 1.0, "vmap", batch_argnums=(1, 2))
    testing.assert_grads_close(bk, vm, rtol=1e-5)


class Gate(torch.nn.Module):
    """Owns a parameter directly *and* has a parameterised child: no rule, no fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(8, 4)
        self.gate = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.inner(x) * self.gate


def test_unsupported_layer_is_named(mlp_batch):
    model = Gate()
    loss_fn, params = _mlp_loss(model)
    args = (params, *mlp_batch)
    with pytest.raises(ConfigurationError, match=r"<root>.*Gate owns trainable parameter"):
        _run(loss_fn, args, 1.0, "bookkeeping", batch_argnums=(1, 2))
    grad_fn, auto, _, _ = _run(loss_fn, args, 1.0, "auto", batch_argnums=(1, 2))
    assert grad_fn.engine == "vmap"
    assert "Gate" in grad_fn.engine_reason
    _, vm, _, _ = _run(loss_fn, args, 1.0, "vmap", batch_argnums=(1, 2))
    testing.assert_grads_close(auto, vm, rtol=0)


def test_loss_mixing_examples_is_caught(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)

    def mixed(p, x, y):  # per-example entries, but normalised by a batch statistic
        out = fmodel(p, x)
        return F.cross_entropy(out, y, reduction="none") / out.detach().abs().mean() * out.mean()

    loss_fn = BatchedLoss(mixed, fmodel)
    args = (params, *mlp_batch)
    with pytest.raises(OperationError, match="disagree"):
        _run(loss_fn, args, 1.0, "bookkeeping", batch_argnums=(1, 2))
    grad_fn, _, _, _ = _run(loss_fn, args, 1.0, "auto", batch_argnums=(1, 2))
    assert grad_fn.engine == "vmap"
    assert "disagree" in grad_fn.engine_reason


def test_batch_moved_off_dim0_is_caught():
    model = torch.nn.Linear(4, 3)
    fmodel, params = make_functional(model)

    def seq_first(p, x):  # x [B, T, 4] run as [T, B, 4]
        return fmodel(p, x.transpose(0, 1)).square().sum(dim=(0, 2))

    grad_fn, state = clipped_grad(
        BatchedLoss(seq_first, fmodel), clipping_norm=1.0, engine="bookkeeping"
    )
    with pytest.raises(OperationError, match="batch \\(2\\) on dimension 0"):
        grad_fn(params, torch.randn(2, 5, 4), state=state)


def test_configuration_errors(mlp, mlp_batch):
    loss_fn, params = _mlp_loss(mlp)
    with pytest.raises(ConfigurationError, match="engine='fast'"):
        clipped_grad(loss_fn, clipping_norm=1.0, engine="fast")
    with pytest.raises(ConfigurationError, match="needs a BatchedLoss"):
        clipped_grad(lambda p, x: x.sum(), clipping_norm=1.0, engine="bookkeeping")
    fmodel = make_functional(mlp)[0]
    cases = [
        # a batch mean (a scalar) instead of per-example losses
        (
            BatchedLoss(lambda p, x, y: F.cross_entropy(fmodel(p, x), y), fmodel),
            ConfigurationError,
            r"expected per-example losses of shape \[10\]",
        ),
        # the module's own weights instead of the differentiated dict
        (
            BatchedLoss(lambda p, x, y: F.cross_entropy(mlp(x), y, reduction="none"), mlp),
            OperationError,
            "not the differentiated tensor '0.weight'",
        ),
    ]
    for bad, error, message in cases:
        grad_fn, state = clipped_grad(
            bad, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
        )
        with pytest.raises(error, match=message):
            grad_fn(params, *mlp_batch, state=state)
    with pytest.raises(TypeError, match=r"expected the torch\.nn\.Module"):
        BatchedLoss(lambda p: p, object())


def test_outer_transform_needs_vmap(mlp, mlp_batch):
    loss_fn, params = _mlp_loss(mlp)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), engine="bookkeeping"
    )

    def total(p):
        grads, _ = grad_fn(p, *mlp_batch, state=state)
        return sum(g.sum() for g in grads.values())

    with pytest.raises(ConfigurationError, match=r"outer torch\.func transform"):
        torch.func.grad(total)(params)


def test_accumulation_and_optimizer(mlp, mlp_batch):
    from opake.dpsgd.optimizer import DPOptimizer

    loss_fn, params = _mlp_loss(mlp)
    x, y = mlp_batch
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(1, 2))
    a, state = grad_fn(params, x[:6], y[:6], state=state)
    b, state = grad_fn(params, x[6:], y[6:], state=state)
    whole, _ = grad_fn(params, x, y, state=state)
    testing.assert_grads_close(a + b, whole, rtol=1e-5)
    assert grad_fn.engine == "bookkeeping"
    opt = DPOptimizer(
        torch.optim.SGD(mlp.parameters(), lr=0.1),
        params,
        noise_multiplier=1e-9,  # the update is the clipped mean up to negligible noise
        expected_batch_size=10,
        seed=0,
    )
    before = mlp[0].weight.detach().clone()
    opt.accumulate(whole)
    report = opt.step()
    assert report.noise_std == pytest.approx(1e-9 * whole.max_norm)
    expected = before - 0.1 * whole["0.weight"] / 10
    torch.testing.assert_close(mlp[0].weight.detach(), expected, atol=1e-6, rtol=0)


def test_bf16_compute_fp32_sums(mlp, mlp_batch):
    loss_fn, params = _mlp_loss(mlp)
    args = (params, *mlp_batch)
    options = {"batch_argnums": (1, 2), "compute_dtype": torch.bfloat16}
    bk_fn, bk, bk_aux, _ = _run(loss_fn, args, 0.5, "bookkeeping", **options)
    _, vm, _, _ = _run(loss_fn, args, 0.5, "vmap", **options)
    assert bk_fn.engine == "bookkeeping"
    assert all(v.dtype == torch.float32 for v in bk.values())
    assert bk_aux.grad_norms.dtype == torch.float32
    testing.assert_grads_close(bk, vm, rtol=2e-2)  # bf16 rounding differs batched vs per example


class DoubledLinear(torch.nn.Linear):
    """An nn.Linear subclass whose forward computes something else: the linear rule is wrong."""

    def forward(self, x):
        return 2.0 * super().forward(x) + 0.1 * x[..., :1]


def test_subclass_overriding_forward_gets_the_per_layer_rule(mlp_batch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(DoubledLinear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    loss_fn, params = _mlp_loss(model)
    plan = bookkeeping_plan(model, params)
    assert [layer.rule for layer in plan.layers] == ["per_layer", "linear"]
    args = (params, *mlp_batch)
    _, bk, _, _ = _run(loss_fn, args, 0.5, "bookkeeping", batch_argnums=(1, 2))
    one = loss_fn.per_example(batch_argnums=(1, 2), has_aux=False)
    expected = testing.reference_clipped_grad(one, args, clipping_norm=0.5, batch_argnums=(1, 2))
    testing.assert_grads_close(bk, expected, rtol=1e-5)


def test_a_negligible_loose_leaf_keeps_its_bound_and_skips_the_exact_route():
    """LoRA's first step: ``lora_A`` gets an all-zero gradient (its ``lora_B`` partner starts
    at zero), whose certified bound is only the underflow allowance (~1e-17), loose against a
    computed 0. Beside ordinary leaves it cannot change the clip factor, so the exact route is
    not taken for it; the clipped sum still equals the per-example loop's."""
    from opake.dpsgd.bookkeeping import _runner

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(300, 8, bias=False), torch.nn.Linear(8, 3), torch.nn.Linear(3, 2)
    )
    torch.nn.init.zeros_(model[1].weight)
    x, y = torch.randn(4, 300), torch.tensor([0, 1, 1, 0])
    loss_fn, params = _mlp_loss(model)
    chunks = []
    real = _runner.BookkeepingRunner.run

    def spy(self, *args, **kwargs):
        chunks.append(real(self, *args, **kwargs))
        return chunks[-1]

    args, options = (params, x, y), {"batch_argnums": (1, 2)}
    _runner.BookkeepingRunner.run = spy
    try:
        _, grads, _, _ = _run(loss_fn, args, 0.1, "bookkeeping", **options)
    finally:
        _runner.BookkeepingRunner.run = real
    (chunk,) = chunks
    first = list(params).index("0.weight")
    assert bool((chunk.leaf_sq[:, first] == 0).all())
    assert bool((chunk.clip_sq[:, first] > 0).all())  # the allowance, loose against 0
    assert chunk.exact is None
    one = loss_fn.per_example(batch_argnums=(1, 2), has_aux=False)
    _, per_example = _median_norm(one, args, (1, 2))
    expected = testing.reference_clipped_sum(per_example, clipping_norm=0.1)
    testing.assert_grads_close(grads, expected, rtol=1e-4)
