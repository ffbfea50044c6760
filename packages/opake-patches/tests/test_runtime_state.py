"""apply/remove/is_runtime_patched: idempotent, reversible by identity, strict about options."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.autograd.graph as tag
import torch.utils.checkpoint as tuc

from opake.core.errors import ConfigurationError, InputTypeError
from opake.patches import (
    apply_runtime_patches,
    is_runtime_patched,
    remove_runtime_patches,
    runtime_patch_state,
)

STOCK = {
    "checkpoint": tuc.checkpoint,
    "save_on_cpu": tag.save_on_cpu,
    "disable": tag.disable_saved_tensors_hooks,
}


def _current():
    return {
        "checkpoint": tuc.checkpoint,
        "save_on_cpu": tag.save_on_cpu,
        "disable": tag.disable_saved_tensors_hooks,
    }


def test_stock_objects_before_any_patch():
    assert not is_runtime_patched()
    assert all(STOCK[k] is v for k, v in _current().items())
    assert not hasattr(tuc.checkpoint, "_opake_patch")


def test_apply_is_idempotent_and_remove_restores_identity():
    first = apply_runtime_patches()
    patched = _current()
    assert first.vmap_checkpointing
    assert first.save_on_cpu
    assert patched["checkpoint"] is not STOCK["checkpoint"]
    assert patched["checkpoint"].__wrapped__ is STOCK["checkpoint"]
    assert issubclass(patched["save_on_cpu"], STOCK["save_on_cpu"])
    assert is_runtime_patched()
    assert is_runtime_patched("save_on_cpu")

    second = apply_runtime_patches()
    assert second == first
    assert all(patched[k] is v for k, v in _current().items())  # nothing wrapped twice

    remove_runtime_patches()
    assert all(STOCK[k] is v for k, v in _current().items())
    assert not is_runtime_patched()
    remove_runtime_patches()  # removing twice is fine
    assert all(STOCK[k] is v for k, v in _current().items())


def test_module_level_copies_are_rebound_and_restored(monkeypatch):
    mod = types.ModuleType("opake_test_copy_of_checkpoint")
    mod.ckpt = tuc.checkpoint  # like `from torch.utils.checkpoint import checkpoint as ckpt`
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    state = apply_runtime_patches()
    assert mod.ckpt is tuc.checkpoint
    assert state.rebound >= 1
    late = types.ModuleType("opake_test_imported_while_patched")
    late.checkpoint = tuc.checkpoint  # imported while patched: holds the patched function
    monkeypatch.setitem(sys.modules, late.__name__, late)
    remove_runtime_patches()
    assert mod.ckpt is STOCK["checkpoint"]
    assert late.checkpoint is STOCK["checkpoint"]


def test_vmap_checkpointing_false_leaves_checkpoint_untouched():
    state = apply_runtime_patches(vmap_checkpointing=False)
    assert not state.vmap_checkpointing
    assert state.save_on_cpu
    assert tuc.checkpoint is STOCK["checkpoint"]
    assert tag.save_on_cpu is not STOCK["save_on_cpu"]
    # declarative: switching it on and off again
    assert apply_runtime_patches().vmap_checkpointing
    assert apply_runtime_patches(vmap_checkpointing=False) == runtime_patch_state()
    assert tuc.checkpoint is STOCK["checkpoint"]
    state = apply_runtime_patches(vmap_checkpointing=False, save_on_cpu=False)
    assert not is_runtime_patched()
    assert all(STOCK[k] is v for k, v in _current().items())
    del state


def test_stock_checkpoint_still_fails_under_vmap_grad_when_opted_out():
    apply_runtime_patches(vmap_checkpointing=False)
    lin = torch.nn.Linear(2, 2)
    f = torch.func.grad(lambda t: tuc.checkpoint(lin, t, use_reentrant=False).sum())
    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match="saved tensor hooks"),
    ):
        torch.func.vmap(f)(torch.ones(2, 2))


def test_unknown_keyword_lists_the_valid_ones():
    with pytest.raises(ConfigurationError, match=r"vmap_checkpointing.*save_on_cpu") as err:
        apply_runtime_patches(vmap_checkpointng=True)
    assert "vmap_checkpointng" in str(err.value)
    assert not is_runtime_patched()  # nothing was half-applied
    with pytest.raises(InputTypeError, match="True or False"):
        apply_runtime_patches(vmap_checkpointing="yes")
    with pytest.raises(ConfigurationError, match="unknown patch"):
        is_runtime_patched("nope")
    with pytest.raises(TypeError):
        apply_runtime_patches(True)  # keyword-only


def test_patches_are_removed_even_if_transformers_is_patched(tiny_llama):
    import transformers.modeling_utils as mu

    stock = mu.PreTrainedModel.enable_input_require_grads
    apply_runtime_patches()
    assert mu.PreTrainedModel.enable_input_require_grads is not stock
    assert mu.checkpoint is tuc.checkpoint  # transformers' own copy of the name
    remove_runtime_patches()
    assert mu.PreTrainedModel.enable_input_require_grads is stock
    assert mu.checkpoint is STOCK["checkpoint"]
