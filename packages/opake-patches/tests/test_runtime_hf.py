"""HF gradient checkpointing under clipped_grad / vmap(grad): same per-example clipped grads."""

from __future__ import annotations

import sys

import pytest
import torch

from opake.dpsgd.clipping import clipped_grad
from opake.functional import make_functional
from opake.patches import apply_runtime_patches, remove_runtime_patches

pytest.importorskip("transformers")


def _clipped(model, ids, *, microbatch_size=None):
    fmodel, params = make_functional(model)

    def loss_fn(p, x):
        return fmodel(p, x[None], labels=x[None], use_cache=False).loss

    grad_fn, state = clipped_grad(
        loss_fn,
        clipping_norm=0.05,
        batch_argnums=1,
        microbatch_size=microbatch_size,
        return_aux=True,
        check_unused=False,
    )
    (grads, aux), _ = grad_fn(params, ids, state=state)
    return grads, aux


def _per_example_loop(model, ids):
    """The slow obvious reference: one plain-autograd backward per example, no checkpointing."""
    out = []
    for x in ids:
        model.zero_grad()
        model(x[None], labels=x[None], use_cache=False).loss.backward()
        out.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    model.zero_grad()
    return out


@pytest.mark.slow
def test_gradient_checkpointing_enable_under_clipped_grad(patched, tiny_llama, hf_checkpointing):
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    plain = tiny_llama()
    ref, ref_aux = _clipped(plain, ids)
    loop = _per_example_loop(plain, ids)

    model = tiny_llama()  # same seed: same weights
    hf_checkpointing(model)
    assert model.model.layers[0].gradient_checkpointing
    got, aux = _clipped(model, ids, microbatch_size=2)
    assert ref.keys() == got.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=k)
    torch.testing.assert_close(aux.grad_norms, ref_aux.grad_norms, rtol=1e-4, atol=1e-6)
    # against the per-example loop: norms of the unclipped per-example gradients
    loop_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in ex.values())) for ex in loop])
    torch.testing.assert_close(aux.grad_norms, loop_norms, rtol=1e-4, atol=1e-6)


def test_a_later_import_of_transformers_is_patched(monkeypatch, tmp_path):
    """The import hook patches ``PreTrainedModel`` when its module is first imported.

    Exercised on a stand-in module so the real ``transformers.modeling_utils`` (already imported
    by other tests) is not re-imported.
    """
    from opake.patches.runtime import _hf

    (tmp_path / "fake_modeling_utils.py").write_text(
        "class PreTrainedModel:\n"
        "    def enable_input_require_grads(self):\n"
        "        self._require_grads_hooks = []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_hf, "_TARGET", "fake_modeling_utils")
    monkeypatch.delitem(sys.modules, "fake_modeling_utils", raising=False)
    apply_runtime_patches()
    assert any(isinstance(f, _hf._PatchOnImport) for f in sys.meta_path)
    import fake_modeling_utils

    method = fake_modeling_utils.PreTrainedModel.enable_input_require_grads
    assert method._opake_patch == "vmap_checkpointing"
    fake_modeling_utils.PreTrainedModel().enable_input_require_grads()  # still runs the stock body
    remove_runtime_patches()
    assert not any(isinstance(f, _hf._PatchOnImport) for f in sys.meta_path)
    restored = fake_modeling_utils.PreTrainedModel.enable_input_require_grads
    assert not hasattr(restored, "_opake_patch")


def test_input_require_grads_hook_still_works_outside_transforms(patched, tiny_llama):
    model = tiny_llama()
    for p in model.parameters():
        p.requires_grad_(False)
    model.enable_input_require_grads()
    emb = model.get_input_embeddings()(torch.tensor([[1, 2]]))
    assert emb.requires_grad  # the hook ran: stock behaviour outside transforms


@pytest.mark.slow
def test_lora_with_gradient_checkpointing_under_clipped_grad(patched, tiny_llama, hf_checkpointing):
    """LoRA adapters (clipped_grad may take its vmap-forward + plain-autograd path here)."""
    peft = pytest.importorskip("peft")
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    results = []
    for checkpointing in (False, True):
        model = peft.get_peft_model(
            tiny_llama(),
            peft.LoraConfig(
                r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
            ),
        )
        if checkpointing:
            hf_checkpointing(model)
        fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

        def loss_fn(p, f, x, fm=fmodel):
            return fm((p, f), x[None], labels=x[None]).loss

        grad_fn, state = clipped_grad(
            loss_fn, clipping_norm=0.01, batch_argnums=2, check_unused=False
        )
        results.append(grad_fn(trainable, frozen, ids, state=state)[0])
    assert results[0].keys() == results[1].keys()
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-4, atol=1e-7, msg=k)


def _padded_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16, pad_token_id=0
    )
    return GPT2LMHeadModel(config).train()  # dropout 0.1 everywhere


def _per_example_grads(model, ids):
    fmodel, params = make_functional(model)

    def loss_fn(p, x):
        return fmodel(p, x[None], labels=x[None], use_cache=False).loss

    return torch.func.vmap(torch.func.grad(loss_fn), in_dims=(None, 0), randomness="different")(
        params, ids
    )


def test_the_padding_check_of_transformers_runs_under_vmap(patched, monkeypatch):
    """``warn_if_padding_and_no_attention_mask`` asks ``pad_token_id in input_ids``, which
    ``vmap`` refuses (".item()"); patched, it is skipped inside transforms and kept outside."""
    import transformers.modeling_utils as mu

    warned = []

    def record(message, *args, **kwargs):
        if "attention_mask" in message:
            warned.append(message)

    monkeypatch.setattr(mu.logger, "warning_once", record)
    model = _padded_gpt2()
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])  # right padding with the pad id
    grads = _per_example_grads(model, ids)
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert warned == []
    model(input_ids=ids)  # outside transforms: the stock check, and its warning
    assert len(warned) == 1


def test_without_the_patch_the_padding_check_fails_under_vmap():
    """What the patch is for (stock transformers); guards the test above from passing vacuously."""
    model = _padded_gpt2()
    with pytest.raises(RuntimeError, match="vmap"):
        _per_example_grads(model, torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]]))


def test_the_padding_check_patch_is_removed_with_the_runtime_patches():
    import transformers.modeling_utils as mu

    stock = mu.PreTrainedModel.warn_if_padding_and_no_attention_mask
    apply_runtime_patches()
    patched_check = mu.PreTrainedModel.warn_if_padding_and_no_attention_mask
    assert patched_check is not stock
    assert patched_check._opake_patch == "vmap_checkpointing"
    apply_runtime_patches()  # idempotent
    assert mu.PreTrainedModel.warn_if_padding_and_no_attention_mask is patched_check
    remove_runtime_patches()
    assert mu.PreTrainedModel.warn_if_padding_and_no_attention_mask is stock


@pytest.mark.parametrize("options", [{"vmap_checkpointing": False}, {"save_on_cpu": False}])
def test_the_padding_check_patch_comes_with_either_runtime_patch(options):
    """Not only with checkpointing: ``apply_model_patches`` keeps runtime patches a caller
    installed without ``vmap_checkpointing``, and a padded GPT-2 then failed under ``vmap``
    depending on what ran before."""
    import transformers.modeling_utils as mu

    remove_runtime_patches()
    stock = mu.PreTrainedModel.warn_if_padding_and_no_attention_mask
    try:
        apply_runtime_patches(**options)
        ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
        grads = _per_example_grads(_padded_gpt2(), ids)
        assert all(torch.isfinite(g).all() for g in grads.values())
        flipped = {name: not value for name, value in options.items()}
        apply_runtime_patches(**flipped)  # the other patch alone: the check stays patched
        assert mu.PreTrainedModel.warn_if_padding_and_no_attention_mask is not stock
    finally:
        remove_runtime_patches()
    assert mu.PreTrainedModel.warn_if_padding_and_no_attention_mask is stock


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_every_supported_family_runs_its_per_example_forward_with_a_pad_id(patched):
    """Each family of opake-models (its tiny model, pad id set, dropout on where the family has
    it, padding at the end and no attention mask) under ``vmap(grad)`` with the runtime patches."""
    testing = pytest.importorskip("opake.models.testing")
    from opake.models import family_names

    failed = {}
    for family in family_names():
        model = testing.tiny_model(family).train()
        if model.config.pad_token_id is None:
            model.config.pad_token_id = 0
        params = {k: v.detach() for k, v in model.named_parameters()}
        ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
        ids[:, -1] = model.config.pad_token_id
        extra = {"use_cache": False} if hasattr(model.config, "use_cache") else {}

        def loss(p, x, model=model, extra=extra):
            out = torch.func.functional_call(model, p, (), {"input_ids": x[None], **extra})
            return out.logits.float().logsumexp(-1).mean()

        try:
            torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0), randomness="different")(
                params, ids
            )
        except RuntimeError as err:
            failed[family] = str(err)[:120]
    assert failed == {}
