"""Book-keeping clipping on every first-party family: equal to the vmap engine and to a
per-example loop of plain autograd, full fine-tuning and LoRA, tied and untied heads, with
left- and right-padded examples.

Each case builds the tiny model of the family, a batch of 3 (one unpadded, one right-padded,
one left-padded) with a 4-D float additive mask (the mask form both engines accept) and
``-100`` labels on pads, and runs ``clipped_grad(BatchedLoss(...), engine="bookkeeping")``
against ``engine="vmap"`` and against the oracle: Hugging Face's own ``.loss`` (or, for
sequence classification, ``cross_entropy``) on one example at a time, clipped and summed in
float64 at the median per-example norm (so some examples are clipped, some not). (An
unpatched model uses a 4-D mask as given in every layer, sliding-window layers included: the
engines and the oracle all see that same function.)
"""

from __future__ import annotations

import math

import pytest
import torch

from opake.core import testing
from opake.dpsgd.bookkeeping import BatchedLoss, bookkeeping_plan, causal_lm_losses
from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.models import family_names, family_spec
from opake.models.testing import tiny_model

F = torch.nn.functional
BATCH, SEQ = 3, 8
LORA_TARGETS = {
    "gpt2": ("c_attn",),
    "phi3": ("qkv_proj",),
    "bert": ("query", "value"),
    "deepseek_v4": ("q_a_proj", "q_b_proj"),
}
TIED = {name for name in family_names() if family_spec(name).task == "causal_lm"}
MOE = {name for name in family_names() if family_spec(name).moe is not None}
#: parameters owned by a module that also has parameterised children: the engine has no rule
#: for them, "auto" picks vmap (GPT-OSS's attention sinks and Qwen3-Next's gated delta-net
#: decay have one: ``attention_sinks``, ``broadcast_params``, in the patched modules)
RULELESS = {
    "deepseek_v4": ("sinks", "position_bias"),
}
#: what book-keeping runs with frozen (each spec's ``bookkeeping_frozen``, with the reason):
#: Qwen3-Next's gated delta-net decay, conv1d and gated norm (its projections are trained),
#: DeepSeek-V4's hyper-connections (they return tuples), routers, sinks and position bias
BLOCKED = {
    name: tuple(family_spec(name).bookkeeping_frozen)
    for name in family_names()
    if family_spec(name).bookkeeping_frozen
}


#: no gradient from the language-model loss at all (DeepSeek-V4's top-k indexer): always frozen
NO_GRAD = {"deepseek_v4": (".indexer.",)}
BOOKKEEPING = family_names()
#: DeepSeek-V4's indexer scatters in place: the vmap engine runs that op per example (warns)
SLOW_VMAP = pytest.mark.filterwarnings(
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
)


def _freeze_blocked(family, model, *, blocked=True):
    parts = (*NO_GRAD.get(family, ()), *(BLOCKED.get(family, ()) if blocked else ()))
    for name, param in model.named_parameters():
        if any(part in name for part in parts):
            param.requires_grad_(False)


def _ready(family, model, *, freeze=True):
    """Mixture-of-experts families run under DP only patched (per-example routing); the others
    are tested on the stock model. Parameters without a book-keeping rule are frozen."""
    if family in MOE:
        from opake.patches import apply_model_patches

        apply_model_patches(model)
    _freeze_blocked(family, model, blocked=freeze)
    return model


def _inputs(model):
    config = model.config
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, int(config.vocab_size), (BATCH, SEQ), generator=gen)
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
    keep[1, SEQ - 3 :] = False  # right padding
    keep[2, :2] = False  # left padding
    ids = ids.masked_fill(~keep, int(config.pad_token_id or 0))
    neg = torch.finfo(torch.float32).min
    causal = model.get_output_embeddings() is not None
    allowed = keep[:, None, None, :].expand(BATCH, 1, SEQ, SEQ)
    if causal:
        allowed = allowed & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    # set, not add: a fully masked row (a left pad) stays finite (uniform attention, no NaN)
    mask = torch.zeros(BATCH, 1, SEQ, SEQ).masked_fill(~allowed, neg)
    if causal:
        labels = ids.masked_fill(~keep, -100)
    else:
        labels = torch.randint(0, int(config.num_labels), (BATCH,), generator=gen)
    return ids, labels, mask, causal


def _case(model, *, loss_only=False):
    """(BatchedLoss, the one-example oracle loss, args); ``loss_only``: the patched model's
    logits-free forward returning per-example losses."""
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    ids, labels, mask, causal = _inputs(model)
    extra = {"use_cache": False} if causal else {}

    def losses(t, f, ids, labels, mask):
        if loss_only:
            out = fmodel(
                (t, f),
                input_ids=ids,
                attention_mask=mask,
                labels=labels,
                loss_only=True,
                per_example_loss=True,
                **extra,
            )
            assert out.logits is None
            return out.loss
        logits = fmodel((t, f), input_ids=ids, attention_mask=mask, **extra).logits
        if causal:
            return causal_lm_losses(logits, labels)
        return F.cross_entropy(logits.float(), labels, reduction="none")

    def oracle(t, f, ids, labels, mask):  # the model's own loss on one example
        out = fmodel(
            (t, f), input_ids=ids[None], attention_mask=mask[None], labels=labels[None], **extra
        )
        return out.loss

    return BatchedLoss(losses, fmodel), oracle, (trainable, frozen, ids, labels, mask)


def _check(model, *, loss_only=False):
    loss_fn, oracle, args = _case(model, loss_only=loss_only)
    per_example, _ = testing.per_example_grads_loop(oracle, args, batch_argnums=(2, 3, 4))
    norms = sorted(
        math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in per_example
    )
    clip = norms[1]  # the median: one example clipped, one at the boundary, one not
    expected = testing.reference_clipped_sum(per_example, clipping_norm=clip)
    results = {}
    for method in ("bookkeeping", "vmap"):
        grad_fn, state = clipped_grad(
            loss_fn, clipping_norm=clip, batch_argnums=(2, 3, 4), return_aux=True, engine=method
        )
        (grads, aux), _ = grad_fn(*args, state=state)
        assert grad_fn.engine == method
        results[method] = grads, aux
    (bk, bk_aux), (vm, vm_aux) = results["bookkeeping"], results["vmap"]
    testing.assert_grads_close(bk, expected, rtol=1e-5, atol=1e-7)
    testing.assert_grads_close(bk, vm, rtol=1e-5, atol=1e-7)
    want = torch.tensor(
        [math.sqrt(sum(float(g.double().square().sum()) for g in d.values())) for d in per_example],
        dtype=torch.float64,
    )
    torch.testing.assert_close(bk_aux.grad_norms.double(), want, rtol=1e-5, atol=0)
    torch.testing.assert_close(bk_aux.grad_norms, vm_aux.grad_norms, rtol=1e-5, atol=0)
    return args[0]


@SLOW_VMAP
@pytest.mark.parametrize("family", BOOKKEEPING)
def test_full_finetuning(family):
    model = _ready(family, tiny_model(family))
    trainable = _check(model)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert len(trainable) == len(list(model.parameters())) - len(frozen)
    assert bool(frozen) == (family in BLOCKED)
    plan = bookkeeping_plan(model, trainable)
    assert plan.supported, plan.explain()
    embedding = model.get_input_embeddings().weight
    (name,) = [n for n, p in model.named_parameters() if p is embedding]
    users = [layer.module for layer in plan.layers if any(n == name for _, n in layer.params)]
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is embedding
    )
    assert tied == getattr(family_spec(family).head, "tied", False)
    assert len(users) == (2 if tied else 1), plan.explain()  # a tied head is a second use


@pytest.mark.filterwarnings(  # DeepSeek-V4's indexer: an in-place scatter, per example
    "ignore:There is a performance drop because we have not yet implemented the batching rule"
)
@pytest.mark.parametrize("family", sorted(RULELESS))
def test_parameters_without_a_rule_make_auto_pick_vmap(family):
    """Trained, DeepSeek-V4's sinks and position bias have no book-keeping rule: the plan
    names them, ``"bookkeeping"`` raises, ``"auto"`` runs the vmap engine exactly."""
    from opake.core.errors import ConfigurationError

    model = _ready(family, tiny_model(family), freeze=False)
    loss_fn, oracle, args = _case(model)
    plan = bookkeeping_plan(model, args[0])
    assert not plan.supported
    assert all(attr in plan.explain() for attr in RULELESS[family])
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(2, 3, 4), engine="bookkeeping"
    )
    with pytest.raises(ConfigurationError, match="no book-keeping rule"):
        grad_fn(*args, state=state)
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(2, 3, 4))
    grads, _ = grad_fn(*args, state=state)
    assert grad_fn.engine == "vmap"
    expected = testing.reference_clipped_grad(
        oracle, args, clipping_norm=1.0, batch_argnums=(2, 3, 4)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5, atol=1e-7)


def test_qwen3_next_linear_attention_trained_makes_auto_fall_back_to_vmap():
    """Trained, Qwen3-Next's delta-net conv1d (read outside its module) and gated norm (tokens
    flattened across examples) have rules in the plan but fail when recorded: ``"bookkeeping"``
    raises an OperationError, ``"auto"`` falls back to the vmap engine, exactly."""
    from opake.core.errors import OperationError

    model = _ready("qwen3_next", tiny_model("qwen3_next"), freeze=False)
    loss_fn, oracle, args = _case(model)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(2, 3, 4), engine="bookkeeping"
    )
    with pytest.raises(OperationError):
        grad_fn(*args, state=state)
    grad_fn, state = clipped_grad(loss_fn, clipping_norm=1.0, batch_argnums=(2, 3, 4))
    grads, _ = grad_fn(*args, state=state)
    assert grad_fn.engine == "vmap"
    expected = testing.reference_clipped_grad(
        oracle, args, clipping_norm=1.0, batch_argnums=(2, 3, 4)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5, atol=1e-7)


#: the other tying on the first families and on one tied and one MoE family of the newer ones
#: (the loss-only head test covers every family's default tying; the suite's time is budgeted)
OTHER_TYING = sorted(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2", "cohere"}
    | {"granite", "olmo2", "gemma3", "mixtral", "qwen3_moe"}
)


@pytest.mark.parametrize("family", OTHER_TYING)
def test_full_finetuning_other_tying(family):
    """The head tying the family does *not* use by default (untied Gemma, tied Llama …)."""
    default = bool(tiny_model(family).config.tie_word_embeddings)
    model = _ready(family, tiny_model(family, tie_word_embeddings=not default))
    embedding = model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is embedding) == (not default)
    _check(model)


@SLOW_VMAP
@pytest.mark.parametrize("family", BOOKKEEPING)
def test_lora(family):
    pytest.importorskip("peft")
    targets = LORA_TARGETS.get(family, ("q_proj", "v_proj"))
    model = _ready(family, testing.with_lora(tiny_model(family), r=2, target_modules=targets))
    trainable = _check(model)
    assert trainable
    assert all("lora_" in name for name in trainable)


def _zero_dropout(model):
    for name in dir(model.config):
        if "dropout" in name or name.endswith("_pdrop"):
            value = getattr(model.config, name, None)
            if isinstance(value, float):
                setattr(model.config, name, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "mixtral", "gpt_oss"])
def test_patched_model_with_activation_checkpointing(family):
    """``apply_model_patches`` + ``gradient_checkpointing_enable()``: book-keeping's one
    backward recomputes every decoder layer once (hooks record only the first forward; a
    mixture of experts' tapped router and sparse experts, GPT-OSS's tapped attention sinks
    replay the recorded computation), and
    the clipped sum still equals the per-example loop on a patched, un-checkpointed copy."""
    import warnings

    from opake.patches import apply_model_patches

    model = tiny_model(family)
    _zero_dropout(model)
    apply_model_patches(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renaming notice
        model.gradient_checkpointing_enable()
    model.train()
    # a module *inside* a layer: transformers checkpoints the layer's forward, not its hooks
    inner = model.transformer.h[0].attn if family == "gpt2" else model.model.layers[0].self_attn
    calls = []
    inner.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    loss_fn, _, args = _case(model)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(2, 3, 4), engine="bookkeeping"
    )
    grad_fn(*args, state=state)  # the first call also runs the one-example check
    calls.clear()
    grads, _ = grad_fn(*args, state=state)
    assert len(calls) == 2, calls  # the recorded forward, then the recomputation in backward
    _assert_patched_loop(family, grads, clipping_norm=1.0)


def _assert_patched_loop(family, grads, *, clipping_norm):
    """``grads`` equal the per-example loop on a patched copy without checkpointing (a patched
    sliding-window family restricts a 4-D mask to the window, which the unpatched model does
    not)."""
    from opake.patches import apply_model_patches

    reference = tiny_model(family)
    apply_model_patches(reference)
    _, oracle, ref_args = _case(reference)
    expected = testing.reference_clipped_grad(
        oracle, ref_args, clipping_norm=clipping_norm, batch_argnums=(2, 3, 4)
    )
    testing.assert_grads_close(grads, expected, rtol=1e-5, atol=1e-7)


@SLOW_VMAP
@pytest.mark.parametrize(
    ("family", "other_tying", "kernels"),
    [(name, False, "auto") for name in sorted(TIED)]
    + [("llama", True, "auto"), ("gpt2", False, "torch")],
)
def test_loss_only_head(family, other_tying, kernels, monkeypatch):
    """``apply_model_patches`` + ``loss_only=True``: no logits anywhere, ``lm_head`` is never
    called, and its per-example gradients (tied to the embedding or not; Gemma 2's softcap,
    Cohere's scale, Granite's divisor) come from the chunked kernel's recorded loss, whose
    backward computes them in the hidden-gradient pass, tile by tile (a vocabulary tile of 16;
    with the ``torch`` reference loss, chunked's op still): the clipped sum still equals the
    per-example loop on the model's own loss and the vmap engine on the same loss-only
    forward."""
    from opake.kernels.chunked import LinearCEExampleGrads
    from opake.patches import apply_model_patches

    kwargs = {}
    if other_tying:
        kwargs["tie_word_embeddings"] = not bool(tiny_model(family).config.tie_word_embeddings)
    model = tiny_model(family, **kwargs)
    if kernels == "torch":  # the reference loss; its backend has no example-grads op: chunked's
        report = apply_model_patches(model, kernels="torch")
    else:
        report = apply_model_patches(model, chunked_linear_cross_entropy=16)
    _freeze_blocked(family, model)
    assert "loss_only" in " ".join(report.applied), report
    head_calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    fused = []
    original = LinearCEExampleGrads.hidden_grad

    def spy(self):
        fused.append(self.route)
        return original(self)

    monkeypatch.setattr(LinearCEExampleGrads, "hidden_grad", spy)
    _check(model, loss_only=True)
    # the head's norms came from the recorded loss's backward (the hidden-gradient pass)
    assert fused, "the loss-only head was not book-kept through the recorded kernel"
    # the oracle (the model's own loss, one example at a time) calls lm_head; the batched
    # book-keeping and vmap forwards never do
    assert len(head_calls) == BATCH, head_calls


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_loss_only_head_with_checkpointing_and_microbatches(family):
    """The loss-only head composes with activation checkpointing (the backbone's layers are
    recomputed in the one backward, the head is not) and with microbatches (one recorded loss
    per microbatch): still the per-example loop's clipped sum."""
    import warnings

    from opake.patches import apply_model_patches

    model = tiny_model(family)
    _zero_dropout(model)
    apply_model_patches(model, chunked_linear_cross_entropy=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renaming notice
        model.gradient_checkpointing_enable()
    model.train()
    loss_fn, _, args = _case(model, loss_only=True)
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=0.5, batch_argnums=(2, 3, 4), engine="bookkeeping", microbatch_size=2
    )
    grads, _ = grad_fn(*args, state=state)
    _assert_patched_loop(family, grads, clipping_norm=0.5)


def test_loss_only_head_in_bf16_gives_fp32_sums():
    """``compute_dtype=torch.bfloat16``: the recorded loss runs on bf16 hidden states and weight,
    the norms and the clipped sum stay fp32, and book-keeping agrees with the vmap engine to
    bf16 rounding (which differs batched vs per example). The left-padded example's fully
    masked rows overflow the float mask to -inf in bf16: its norm is NaN in both engines and it
    is dropped from both sums (the per-layer check of the other examples must not trip on it)."""
    from opake.patches import apply_model_patches

    model = tiny_model("llama")
    apply_model_patches(model, chunked_linear_cross_entropy=16)
    loss_fn, _, args = _case(model, loss_only=True)
    results = {}
    for method in ("bookkeeping", "vmap"):
        grad_fn, state = clipped_grad(
            loss_fn,
            clipping_norm=1.0,
            batch_argnums=(2, 3, 4),
            engine=method,
            compute_dtype=torch.bfloat16,
            return_aux=True,
        )
        (grads, aux), _ = grad_fn(*args, state=state)
        assert grad_fn.engine == method
        assert all(g.dtype == torch.float32 for g in grads.values())
        assert aux.grad_norms.dtype == torch.float32
        results[method] = grads, aux
    testing.assert_grads_close(results["bookkeeping"][0], results["vmap"][0], rtol=3e-2, atol=1e-3)
    torch.testing.assert_close(
        results["bookkeeping"][1].grad_norms,
        results["vmap"][1].grad_norms,
        rtol=3e-2,
        atol=0,
        equal_nan=True,
    )
