"""apply_model_patches: dispatch, options, report, all-or-nothing, removal, loss-only, masks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.func import functional_call, grad, vmap

from opake.core import plugins
from opake.core.errors import ConfigurationError, InputTypeError, OperationError
from opake.core.plugins import KernelBackend, ModelFamily, hookimpl
from opake.patches import (
    FamilyResult,
    HFCompat,
    LossOnlyHead,
    PatchOptions,
    apply_model_patches,
    is_runtime_patched,
    model_patch_report,
    remove_model_patches,
)
from opake.patches.hf import additive_attention_mask

pytest.importorskip("transformers")

CALLS: list[dict] = []


def ref_lce(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    logit_scale=None,
    logit_divisor=None,
    softcap=None,
    label_smoothing=0.0,
    chunk_size=True,
):
    """The obvious linear cross-entropy (full logits), recording how it was called."""
    CALLS.append({"reduction": reduction, "chunk_size": chunk_size, "softcap": softcap})
    logits = F.linear(hidden, weight, bias).float()
    if logit_scale is not None:
        logits = logits * logit_scale
    if logit_divisor is not None:
        logits = logits / logit_divisor
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    nll = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    ).reshape(labels.shape)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    if reduction == "per_example":  # each example's mean over its own target tokens
        counts = (labels != ignore_index).reshape(labels.shape[0], -1).sum(-1).clamp_min(1)
        return nll.reshape(labels.shape[0], -1).sum(-1) / counts
    assert reduction == "mean", reduction
    return nll.sum() / (labels != ignore_index).sum().clamp_min(1)


def chunked_lce(*args, **kwargs):
    CALLS.append({"backend": "chunked"})
    return ref_lce(*args, **kwargs)


class _Plugin:
    def __init__(self, families=(), backends=()):
        self.families, self.backends = list(families), list(backends)

    @hookimpl
    def opake_model_families(self):
        return self.families

    @hookimpl
    def opake_kernel_backends(self):
        return self.backends


BACKENDS = [
    KernelBackend("torch", {"linear_cross_entropy": ref_lce}, ("cpu", "cuda")),
    KernelBackend("chunked", {"linear_cross_entropy": chunked_lce}, ("cpu", "cuda"), priority=10),
    KernelBackend(
        "triton",
        {"linear_cross_entropy": ref_lce},
        ("cuda",),
        priority=20,
        available=lambda: False,
    ),
]

SEEN_OPTIONS: list[PatchOptions] = []


def llama_apply(model, options):
    """A minimal family: records the options, tags one module, describes the head."""
    SEEN_OPTIONS.append(options)
    result = FamilyResult(hf=HFCompat("causal", LossOnlyHead()))
    result.patcher.set_attr(model.model.norm, "_toy_family_mark", True)
    result.applied.append("toy: marked the final norm")
    result.skipped["rms_norm"] = "toy family swaps no kernels"
    return result


def broken_apply(model, options):
    model.model.norm._half_done = True  # changed, then fails without undoing: the dispatcher must
    raise ConfigurationError("toy family: unrecognised structure")


def bad_return_apply(model, options):
    return {"not": "a FamilyPatch"}


@pytest.fixture
def toy_plugins(fresh_plugins):
    CALLS.clear()
    SEEN_OPTIONS.clear()
    plugins.register_plugin(
        _Plugin([ModelFamily("toyllama", ("llama",), apply=llama_apply)], BACKENDS), "toy"
    )


def _ids(batch=2, seq=6, seed=0):
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


# -- dispatch and options ------------------------------------------------------------------------


def test_unsupported_model_type_names_supported_ones(fresh_plugins, tiny_llama):
    plugins.register_plugin(
        _Plugin([ModelFamily("gpt", ("gpt2", "gpt_neox"), apply=llama_apply)]), "p"
    )
    with pytest.raises(ConfigurationError, match=r"'llama'.*gpt2, gpt_neox.*plugins\.md"):
        apply_model_patches(tiny_llama())
    assert not is_runtime_patched()  # nothing was applied


def test_unknown_keyword_and_bad_types(toy_plugins, tiny_llama):
    model = tiny_llama()
    with pytest.raises(ConfigurationError, match=r"chunked_linear_crossentropy.*valid ones"):
        apply_model_patches(model, chunked_linear_crossentropy=2)
    with pytest.raises(InputTypeError):
        apply_model_patches(model, performance="yes")
    with pytest.raises(InputTypeError):
        apply_model_patches(model, kernels=3)
    with pytest.raises(InputTypeError):
        apply_model_patches(model, chunked_linear_cross_entropy=2.5)
    with pytest.raises(ConfigurationError, match="positive"):
        apply_model_patches(model, chunked_linear_cross_entropy=-1)
    with pytest.raises(ConfigurationError, match=r"no config\.model_type"):
        apply_model_patches(torch.nn.Linear(2, 2))
    assert model_patch_report(model) is None


def test_report_and_runtime_patches(toy_plugins, tiny_llama):
    model = tiny_llama()
    report = apply_model_patches(model)
    assert is_runtime_patched("vmap_checkpointing")
    assert report.family == "toyllama"
    assert report.model_type == "llama"
    assert report.runtime.vmap_checkpointing
    assert report.kernels["linear_cross_entropy"].backend == "chunked"  # highest priority on cpu
    assert "automatic" in report.kernels["linear_cross_entropy"].reason
    assert "toy: marked the final norm" in report.applied
    assert any(a.startswith("loss_only") for a in report.applied)
    assert any(a.startswith("attention_mask") for a in report.applied)
    assert report.skipped["rms_norm"] == "toy family swaps no kernels"
    opts = SEEN_OPTIONS[-1]
    assert (opts.family, opts.model_type, opts.device_type) == ("toyllama", "llama", "cpu")
    assert opts.loss_kernel.backend == "chunked"
    with pytest.raises(AttributeError):
        report.family = "x"  # frozen
    assert model_patch_report(model) is report


@pytest.mark.parametrize(
    ("kwargs", "backend", "chunk_size"),
    [
        ({"chunked_linear_cross_entropy": 8}, "chunked", 8),
        ({"chunked_linear_cross_entropy": True}, "chunked", True),
        ({"chunked_linear_cross_entropy": False}, "torch", True),
        ({"chunked_linear_cross_entropy": 0}, "torch", True),
        ({"kernels": False}, "torch", True),
        ({"kernels": {"linear_cross_entropy": "torch"}}, "torch", True),
        ({"kernels": "chunked", "chunked_linear_cross_entropy": 16}, "chunked", 16),
        ({"fused_linear_cross_entropy": False}, "chunked", True),
    ],
)
def test_loss_kernel_selection(toy_plugins, tiny_llama, kwargs, backend, chunk_size):
    model = tiny_llama()
    report = apply_model_patches(model, **kwargs)
    assert report.kernels["linear_cross_entropy"].backend == backend
    CALLS.clear()
    model(_ids(1), labels=_ids(1), loss_only=True)
    assert CALLS[-1]["chunk_size"] == chunk_size


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fused_linear_cross_entropy": True}, OperationError, "triton"),
        (
            {"fused_linear_cross_entropy": True, "chunked_linear_cross_entropy": 8},
            ConfigurationError,
            "choose one",
        ),
        ({"performance": False, "chunked_linear_cross_entropy": 8}, ConfigurationError, "drop"),
        ({"kernels": "torch", "chunked_linear_cross_entropy": 8}, ConfigurationError, "contra"),
        ({"kernels": {"linear_cross_entropy": "nope"}}, ConfigurationError, "not installed"),
    ],
)
def test_contradictory_or_impossible_requests_raise(toy_plugins, tiny_llama, kwargs, error, match):
    model = tiny_llama()
    with pytest.raises(error, match=match):
        apply_model_patches(model, **kwargs)
    assert model_patch_report(model) is None
    assert "forward" not in vars(model)


def test_idempotent_and_option_changes_refused(toy_plugins, tiny_llama):
    model = tiny_llama()
    first = apply_model_patches(model, chunked_linear_cross_entropy=8)
    assert apply_model_patches(model, chunked_linear_cross_entropy=8) is first
    assert len(SEEN_OPTIONS) == 1  # the family was not applied twice
    with pytest.raises(ConfigurationError, match="remove_model_patches"):
        apply_model_patches(model, chunked_linear_cross_entropy=16)
    first.remove()
    assert not first.active
    second = apply_model_patches(model, chunked_linear_cross_entropy=16)
    assert second.active


def test_remove_restores_the_instance(toy_plugins, tiny_llama, hf_checkpointing):
    model = tiny_llama(use_cache=True)
    hf_checkpointing(model)
    before_dict = {k: v for k, v in vars(model).items() if not k.startswith("_")}
    layer_func = model.model.layers[0]._gradient_checkpointing_func
    hooks = dict(model.get_input_embeddings()._forward_hooks)
    report = apply_model_patches(model)
    assert model.config.use_cache is False
    assert model.model.layers[0]._gradient_checkpointing_func is not layer_func
    assert "forward" in vars(model)
    assert model.model.norm._toy_family_mark
    assert remove_model_patches(model) is True
    assert remove_model_patches(model) is False
    assert not report.active
    assert model.config.use_cache is True
    assert model.model.layers[0]._gradient_checkpointing_func is layer_func
    assert dict(model.get_input_embeddings()._forward_hooks) == hooks
    assert {k: v for k, v in vars(model).items() if not k.startswith("_")} == before_dict
    assert "forward" not in vars(model)
    assert "gradient_checkpointing_enable" not in vars(model)
    assert not hasattr(model.model.norm, "_toy_family_mark")
    assert is_runtime_patched()  # runtime patches are global and stay


def test_all_or_nothing_when_the_family_fails(fresh_plugins, tiny_llama):
    plugins.register_plugin(
        _Plugin(
            [
                ModelFamily("broken", ("llama",), apply=broken_apply),
                ModelFamily("badreturn", ("mistral",), apply=bad_return_apply),
            ],
            BACKENDS,
        ),
        "p",
    )
    model = tiny_llama(use_cache=True)
    with pytest.raises(ConfigurationError, match="unrecognised structure"):
        apply_model_patches(model)
    assert model.config.use_cache is True  # the dispatcher's own changes were undone
    assert model_patch_report(model) is None
    model.config.model_type = "mistral"
    with pytest.raises(InputTypeError, match="undo"):
        apply_model_patches(model)
    assert model.config.use_cache is True
    assert "forward" not in vars(model)


def test_performance_and_compat_off(toy_plugins, tiny_llama):
    model = tiny_llama(use_cache=True)
    report = apply_model_patches(model, performance=False, compat=False)
    assert report.skipped["loss_only"] == "performance=False"
    assert report.skipped["compat"] == "compat=False"
    assert "linear_cross_entropy" not in report.kernels
    assert model.config.use_cache is True
    assert "forward" not in vars(model)
    assert SEEN_OPTIONS[-1].kernel_for("rms_norm") == (False, None)


def test_vmap_checkpointing_false_leaves_checkpoint_untouched(toy_plugins, tiny_llama):
    stock = tuc.checkpoint
    report = apply_model_patches(tiny_llama(), vmap_checkpointing=False)
    assert tuc.checkpoint is stock
    assert not report.runtime.vmap_checkpointing
    assert report.skipped["gradient_checkpointing"] == "vmap_checkpointing=False"
    assert SEEN_OPTIONS[-1].vmap_checkpointing is False


def test_dropout_note(toy_plugins, tiny_llama):
    report = apply_model_patches(tiny_llama(attention_dropout=0.1))
    assert any("randomness='different'" in n for n in report.notes)
    assert "attention_dropout" in report.notes[0]


# -- loss-only forward ---------------------------------------------------------------------------


def _hf_mean_of_example_means(model, ids, labels):
    """Reference: the logits path, one example at a time (HF's own loss for a batch of one)."""
    return torch.stack(
        [model(ids[i : i + 1], labels=labels[i : i + 1]).loss for i in range(len(ids))]
    ).mean()


def test_loss_only_matches_the_logits_path(toy_plugins, tiny_llama):
    model = tiny_llama()
    ids = _ids(3, 7)
    labels = ids.clone()
    labels[0, :3] = -100  # examples with different numbers of target tokens
    labels[2, 5:] = -100
    plain = tiny_llama()
    ref_single = plain(ids[:1], labels=labels[:1]).loss
    ref_batch = _hf_mean_of_example_means(plain, ids, labels)
    apply_model_patches(model)
    out = model(ids, labels=labels)  # without loss_only: HF's forward, logits kept
    assert out.logits.shape == (3, 7, 64)
    torch.testing.assert_close(out.logits, plain(ids).logits)
    one = model(ids[:1], labels=labels[:1], loss_only=True)
    assert one.logits is None
    torch.testing.assert_close(one.loss, ref_single)
    batch = model(ids, labels=labels, loss_only=True)
    assert batch.logits is None
    torch.testing.assert_close(batch.loss, ref_batch)  # per-example means, then their mean
    as_tuple = model(ids, None, labels=labels, loss_only=True, return_dict=False)
    assert len(as_tuple) == 1
    torch.testing.assert_close(as_tuple[0], ref_batch)


def test_per_example_loss_returns_each_example_loss(toy_plugins, tiny_llama):
    model = tiny_llama()
    plain = tiny_llama()
    ids = _ids(3, 7)
    labels = ids.clone()
    labels[1, :4] = -100
    labels[2] = -100  # no target token: loss 0, as causal_lm_losses gives
    want = [plain(ids[i : i + 1], labels=labels[i : i + 1]).loss for i in range(2)]
    apply_model_patches(model)
    out = model(ids, labels=labels, loss_only=True, per_example_loss=True)
    assert out.logits is None
    assert out.loss.shape == (3,)
    torch.testing.assert_close(out.loss[:2], torch.stack(want))
    assert out.loss[2].item() == 0.0
    one = model(ids[:1], labels=labels[:1], loss_only=True, per_example_loss=True)
    assert one.loss.shape == (1,)
    torch.testing.assert_close(one.loss[0], want[0])
    with pytest.raises(ConfigurationError, match="per_example_loss=True needs loss_only=True"):
        model(ids, labels=labels, per_example_loss=True)


def test_loss_only_per_example_grads_under_vmap(toy_plugins, tiny_llama):
    model = tiny_llama()
    plain = tiny_llama()
    apply_model_patches(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = _ids(3, 6)

    def loss(m, p, x, loss_only):
        kwargs = {"labels": x[None], "loss_only": True} if loss_only else {"labels": x[None]}
        return functional_call(m, p, (x[None],), kwargs).loss

    with torch.no_grad():
        got = vmap(grad(functools.partial(loss, model, loss_only=True)), in_dims=(None, 0))(
            params, ids
        )
    ref = []
    for x in ids:  # per-example loop, plain autograd, unpatched model
        plain.zero_grad()
        plain(x[None], labels=x[None]).loss.backward()
        ref.append({k: p.grad.clone() for k, p in plain.named_parameters()})
    for k in params:
        torch.testing.assert_close(got[k], torch.stack([r[k] for r in ref]), atol=1e-6, rtol=1e-4)


def test_loss_only_refuses_batch_global_counts_and_needs_labels(toy_plugins, tiny_llama):
    model = tiny_llama()
    apply_model_patches(model)
    ids = _ids(2)
    with pytest.raises(ConfigurationError, match="needs labels"):
        model(ids, loss_only=True)
    with pytest.raises(ConfigurationError, match="num_items_in_batch"):
        model(ids, labels=ids, loss_only=True, num_items_in_batch=10)


@pytest.mark.parametrize(
    ("head", "transform"),
    [
        (LossOnlyHead(logit_scale=0.5), lambda z: z * 0.5),
        (LossOnlyHead(logit_divisor=4.0), lambda z: z / 4.0),
        (LossOnlyHead(softcap=2.0), lambda z: torch.tanh(z / 2.0) * 2.0),
    ],
)
def test_logit_transforms_reach_the_kernel(fresh_plugins, tiny_llama, head, transform):
    def apply(model, options):
        return FamilyResult(hf=HFCompat("causal", head))

    plugins.register_plugin(_Plugin([ModelFamily("t", ("llama",), apply=apply)], BACKENDS), "p")
    model = tiny_llama()
    ids = _ids(1, 8)
    logits = transform(model(ids).logits[0, :-1].float())
    expected = F.cross_entropy(logits, ids[0, 1:])
    apply_model_patches(model, kernels="torch")
    torch.testing.assert_close(model(ids, labels=ids, loss_only=True).loss, expected)


def test_loss_only_with_the_real_kernels(fresh_plugins, tiny_llama):
    """Integration with opake-kernels' registered backends (its torch and chunked ops)."""
    kernels_plugin = pytest.importorskip("opake.kernels._plugin")
    plugins.register_plugin(kernels_plugin, "opake-kernels")
    plugins.register_plugin(_Plugin([ModelFamily("t", ("llama",), apply=llama_apply)]), "p")
    model = tiny_llama()
    ids = _ids(2, 9)
    labels = ids.clone()
    labels[1, :4] = -100
    ref = _hf_mean_of_example_means(tiny_llama(), ids, labels)
    report = apply_model_patches(model, chunked_linear_cross_entropy=16)
    assert report.kernels["linear_cross_entropy"].backend == "chunked"
    torch.testing.assert_close(model(ids, labels=labels, loss_only=True).loss, ref)


# -- masks ---------------------------------------------------------------------------------------


def test_2d_mask_under_vmap_equals_4d_mask_and_the_loop(toy_plugins, tiny_llama):
    model = tiny_llama()
    plain = tiny_llama()
    ids = _ids(3, 6)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, 4:] = 0  # right padding
    labels = torch.where(mask.bool(), ids, -100)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(m, p, x, am, y):
        return functional_call(
            m, p, (x[None],), {"attention_mask": am[None], "labels": y[None]}
        ).loss

    mask4 = additive_attention_mask(mask, dtype=torch.float32, causal=True)
    with torch.no_grad():
        ref4 = vmap(grad(functools.partial(loss, plain)), in_dims=(None, 0, 0, 0))(
            params, ids, mask4, labels
        )
    apply_model_patches(model)
    with torch.no_grad():
        got = vmap(grad(functools.partial(loss, model)), in_dims=(None, 0, 0, 0))(
            params, ids, mask, labels
        )
    loop = []
    for i in range(3):
        plain.zero_grad()
        plain(
            ids[i : i + 1], attention_mask=mask[i : i + 1], labels=labels[i : i + 1]
        ).loss.backward()
        loop.append({k: p.grad.clone() for k, p in plain.named_parameters()})
    for k in params:
        torch.testing.assert_close(got[k], ref4[k], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[k], torch.stack([r[k] for r in loop]), atol=1e-6, rtol=1e-4)


def bert_apply(model, options):
    return FamilyResult(hf=HFCompat("bidirectional", head=None))


def test_bidirectional_2d_mask_under_vmap_where_stock_transformers_fails(fresh_plugins):
    from transformers import BertConfig, BertForSequenceClassification

    plugins.register_plugin(_Plugin([ModelFamily("toybert", ("bert",), apply=bert_apply)]), "p")
    cfg = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg)
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids, y = _ids(3, 6), torch.tensor([0, 2, 1])
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    mask[2, 2:] = 0

    def loss(p, x, am, yy):
        kwargs = {"attention_mask": am[None], "labels": yy[None]}
        return functional_call(model, p, (x[None],), kwargs).loss

    per_example = vmap(grad(loss), in_dims=(None, 0, 0, 0))
    with torch.no_grad(), pytest.raises(RuntimeError, match="data-dependent"):
        per_example(params, ids, mask, y)  # stock transformers
    report = apply_model_patches(model)
    assert report.skipped["loss_only"].endswith("describes no causal-LM head for this model")
    with torch.no_grad():
        got = per_example(params, ids, mask, y)
    for i in range(3):
        model.zero_grad()
        model(ids[i : i + 1], attention_mask=mask[i : i + 1], labels=y[i : i + 1]).loss.backward()
        for k, p in model.named_parameters():
            torch.testing.assert_close(got[k][i], p.grad, atol=1e-6, rtol=1e-4, msg=k)


def test_additive_mask_is_float_and_vmappable():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    out = vmap(lambda m: additive_attention_mask(m[None], dtype=torch.bfloat16, causal=True))(mask)
    assert out.dtype == torch.bfloat16
    assert out.shape == (2, 1, 1, 3, 3)
    visible = out[:, 0, 0] == 0
    assert visible[0].tolist() == [[True, False, False], [True, True, False], [True, True, False]]
    assert visible[1].tolist() == [[False, False, False], [False, True, False], [False, True, True]]
    assert (
        out[~torch.stack([visible[0], visible[1]])[:, None, None]]
        == torch.finfo(torch.bfloat16).min
    ).all()
    bi = additive_attention_mask(mask, dtype=torch.float32, causal=False)
    assert (bi[1, 0] == 0).tolist() == [[False, True, True]] * 3
    with pytest.raises(ConfigurationError):
        additive_attention_mask(torch.ones(1, 1, 2, 2), dtype=torch.float32, causal=True)


# -- gradient checkpointing and PEFT -------------------------------------------------------------


@pytest.mark.slow
def test_checkpointing_enabled_before_patching_is_rerouted(
    toy_plugins, tiny_llama, hf_checkpointing
):
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    ids = _ids(3, 6)
    model = tiny_llama()
    hf_checkpointing(model)  # stock: hooks and partial(stock checkpoint, use_reentrant=...)
    apply_model_patches(model)
    assert model.model.layers[0]._gradient_checkpointing_func.keywords["use_reentrant"] is False
    results = []
    for m, loss_only in ((model, True), (tiny_llama(), False)):
        fmodel, params = make_functional(m)
        grad_fn, state = clipped_grad(
            lambda p, x, fm=fmodel, lo=loss_only: (
                fm(p, x[None], labels=x[None], loss_only=lo).loss
                if lo
                else fm(p, x[None], labels=x[None]).loss
            ),
            clipping_norm=0.05,
            batch_argnums=1,
            check_unused=False,
        )
        results.append(grad_fn(params, ids, state=state)[0])
    for k in results[1]:
        torch.testing.assert_close(results[0][k], results[1][k], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize(
    "method", ["gradient_checkpointing_enable", "activation_checkpointing_enable"]
)
def test_checkpointing_enabled_after_patching_is_forced_non_reentrant(
    toy_plugins, tiny_llama, method
):
    model = tiny_llama()
    apply_model_patches(model)
    if not hasattr(model, method):
        pytest.skip(f"this transformers has no {method}")
    kwarg = method.replace("_enable", "_kwargs")
    getattr(model, method)(**{kwarg: {"use_reentrant": True}})
    func = model.model.layers[0]._gradient_checkpointing_func
    assert func.keywords["use_reentrant"] is False
    params = {k: v.detach() for k, v in model.named_parameters()}
    ids = _ids(2, 5)
    with torch.no_grad():
        g = vmap(
            grad(lambda p, x: functional_call(model, p, (x[None],), {"labels": x[None]}).loss),
            in_dims=(None, 0),
        )(params, ids)
    assert torch.isfinite(g["lm_head.weight"]).all()
    remove_model_patches(model)
    assert method not in vars(model)
    assert "activation_checkpointing_enable" not in vars(model)


def test_peft_wrapped_model(toy_plugins, tiny_llama):
    peft = pytest.importorskip("peft")
    base = tiny_llama()
    wrapped = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    ids = _ids(2, 6)
    ref = _hf_mean_of_example_means(wrapped, ids, ids)
    report = apply_model_patches(wrapped)
    assert report.model_type == "llama"
    assert "forward" in vars(base)  # the base HF model carries the instance patches
    out = wrapped(input_ids=ids, labels=ids, loss_only=True)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref)
    assert model_patch_report(base) is report
    assert remove_model_patches(wrapped)
    assert "forward" not in vars(base)
