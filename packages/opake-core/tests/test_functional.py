from __future__ import annotations

import pytest
import torch

from opake.core import testing
from opake.core.errors import ConfigurationError, InputTypeError
from opake.functional import FunctionalModel, make_functional


def test_params_share_storage_and_call_matches_module(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)
    assert isinstance(fmodel, FunctionalModel)
    assert list(params) == [name for name, _ in mlp.named_parameters()]
    for name, p in mlp.named_parameters():
        assert not params[name].requires_grad
        assert params[name].data_ptr() == p.data_ptr()
    x, _ = mlp_batch
    assert torch.equal(fmodel(params, x), mlp(x))
    # the dict, not the module's own parameters, is used
    doubled = {name: 2 * value for name, value in params.items()}
    assert not torch.allclose(fmodel(doubled, x), mlp(x))


def test_partition_trainable_and_tuple_of_dicts(mlp, mlp_batch):
    mlp[0].weight.requires_grad_(False)
    fmodel, trainable, frozen = make_functional(mlp, partition_trainable=True)
    assert sorted(trainable) == ["0.bias", "2.bias", "2.weight"]
    assert sorted(frozen) == ["0.weight"]
    x, _ = mlp_batch
    expected = mlp(x)
    assert torch.equal(fmodel((trainable, frozen), x), expected)
    assert torch.equal(fmodel({**frozen, **trainable}, x), expected)


def test_lora_partition(tiny_llama, token_batch):
    pytest.importorskip("peft")
    model = testing.with_lora(tiny_llama, r=4)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
    assert trainable
    assert all("lora_" in name for name in trainable)
    assert not any("lora_" in name for name in frozen)
    out = fmodel((trainable, frozen), input_ids=token_batch, use_cache=False).logits
    assert torch.equal(out, model(input_ids=token_batch, use_cache=False).logits)


def test_tied_weights_appear_once_and_stay_tied(tiny_gpt2, token_batch):
    fmodel, params = make_functional(tiny_gpt2)
    assert "lm_head.weight" not in params
    assert "transformer.wte.weight" in params
    changed = dict(params)
    changed["transformer.wte.weight"] = params["transformer.wte.weight"] * 0.5
    got = fmodel(changed, input_ids=token_batch).logits
    with torch.no_grad():
        tiny_gpt2.transformer.wte.weight.mul_(0.5)  # lm_head follows: it is the same tensor
        want = tiny_gpt2(input_ids=token_batch).logits
    torch.testing.assert_close(got, want)


class _WithBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("offset", torch.tensor([1.0, -1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.offset


def test_buffers_read_from_module_and_overridable():
    module = _WithBuffer()
    fmodel, params = make_functional(module)
    assert set(params) == {"lin.weight", "lin.bias"}
    x = torch.ones(1, 2)
    assert torch.equal(fmodel(params, x), module(x))
    override = {**params, "offset": torch.zeros(2)}
    assert torch.equal(fmodel(override, x), module.lin(x))


def test_composes_with_vmap_grad(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)
    x, y = mlp_batch

    def loss(p, xb, yb):
        return torch.nn.functional.cross_entropy(fmodel(p, xb[None]), yb[None])

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    ref, _ = testing.per_example_grads_loop(loss, (params, x, y), batch_argnums=(1, 2))
    for i in range(len(x)):
        for name in params:
            torch.testing.assert_close(grads[name][i], ref[i][name])


def test_bad_params_raise(mlp, mlp_batch):
    fmodel, params = make_functional(mlp)
    x, _ = mlp_batch
    missing = {k: v for k, v in params.items() if k != "0.bias"}
    with pytest.raises(ConfigurationError, match=r"missing parameter\(s\) '0.bias'"):
        fmodel(missing, x)
    with pytest.raises(ConfigurationError, match=r"did you mean '0\.bias'"):
        fmodel({**params, "0.biass": params["0.bias"]}, x)
    with pytest.raises(ConfigurationError, match="given twice"):
        fmodel((params, {"0.bias": params["0.bias"]}), x)
    with pytest.raises(InputTypeError, match="expected a mapping"):
        fmodel([1, 2], x)


def test_bad_arguments_raise(mlp):
    with pytest.raises(InputTypeError, match=r"expected a torch\.nn\.Module"):
        make_functional(lambda x: x)
    with pytest.raises(InputTypeError, match="partition_trainable"):
        make_functional(mlp, partition_trainable="yes")
    with pytest.raises(ConfigurationError, match="unknown keyword argument 'detach'"):
        make_functional(mlp, detach=True)


def test_repr_and_properties(mlp):
    fmodel, _ = make_functional(mlp)
    assert fmodel.module is mlp
    assert fmodel.param_names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert repr(fmodel) == "FunctionalModel(Sequential, 4 parameters)"
