"""DPOptimizer.check_state_dict refuses every saved state its load_state_dict would refuse.

The wrapped optimizer's own state (``state["optimizer"]``) is checked like
``torch.optim.Optimizer.load_state_dict`` checks it, and for what would break the next
``step()``; a checkpoint loader relies on the check to restore nothing when the optimizer
would refuse. The two copies of σ in a saved state must agree.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from opake.core.errors import ConfigurationError
from opake.dpsgd.optimizer import DPOptimizer

SIGMA = 0.8
C = 0.5


class ClippedSum(dict):
    """What clipped_grad's grad_fn returns: summed clipped gradients carrying max_norm."""

    def __init__(self, values: dict[str, torch.Tensor], max_norm: float) -> None:
        super().__init__(values)
        self.max_norm = max_norm


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def stepped(
    factory: Callable[[torch.nn.Module], torch.optim.Optimizer], seed: int = 0
) -> tuple[torch.nn.Module, DPOptimizer]:
    """A model and its DP optimizer after one logical step (the wrapped state is filled)."""
    model = make_model(seed)
    opt = DPOptimizer(
        factory(model), model, noise_multiplier=SIGMA, expected_batch_size=4.0, seed=7
    )
    gen = torch.Generator().manual_seed(seed + 1)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
    opt.accumulate(ClippedSum(grads, max_norm=C))
    opt.step()
    return model, opt


def snapshot(model: torch.nn.Module, opt: DPOptimizer) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "wrapped": copy.deepcopy(opt.optimizer.state_dict()),
        "noise": opt.noise.state_dict(),
        "steps": opt.steps,
        "sigma": opt.noise_multiplier,
    }


def assert_same(a: Any, b: Any) -> None:
    """Equal nested states, tensors compared exactly."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict)
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def _wrapped(edit: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], None]:
    """A damage to the saved state's ``optimizer`` entry (``edit`` returns the new entry)."""

    def damage(state: dict[str, Any]) -> None:
        state["optimizer"] = edit(state["optimizer"])

    return damage


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(wrapped: dict[str, Any]) -> dict[str, Any]:
        node = wrapped
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return wrapped

    return edit


def _drop(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda wrapped: {k: v for k, v in wrapped.items() if k != key}


def _split_groups(wrapped: dict[str, Any]) -> dict[str, Any]:
    (group,) = wrapped["param_groups"]
    first = {**group, "params": group["params"][:2]}
    second = {**group, "params": group["params"][2:]}
    return {**wrapped, "param_groups": [first, second]}


def _transpose_first(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(wrapped: dict[str, Any]) -> dict[str, Any]:
        wrapped["state"][0][key] = wrapped["state"][0][key].t().contiguous()
        return wrapped

    return edit


# (name, optimizer factory, damage, what the message names)
DAMAGED = [
    ("not a mapping", sgd, _wrapped(lambda w: [w]), "not a torch optimizer state_dict"),
    ("no state", sgd, _wrapped(_drop("state")), "not a torch optimizer state_dict"),
    ("state a list", sgd, _wrapped(_set(("state",), [])), "not a torch optimizer state_dict"),
    ("no param_groups", sgd, _wrapped(_drop("param_groups")), "list of mappings"),
    ("param_groups a dict", sgd, _wrapped(_set(("param_groups",), {})), "list of mappings"),
    ("group not a mapping", sgd, _wrapped(_set(("param_groups", 0), [0, 1])), "list of mappings"),
    ("group without params", sgd, _wrapped(_set(("param_groups", 0, "params"), None)), "'params'"),
    ("no groups", sgd, _wrapped(_set(("param_groups",), [])), "0 parameter group"),
    ("two groups", adam, _wrapped(_split_groups), "2 parameter group"),
    ("group too short", sgd, _wrapped(_set(("param_groups", 0, "params"), [0, 1, 2])), "holds 3"),
    ("repeated id", sgd, _wrapped(_set(("param_groups", 0, "params"), [0, 1, 2, 2])), "repeated"),
    ("foreign state id", adam, _wrapped(_set(("state", 99), {"step": 1.0})), "id 99"),
    ("state entry a list", sgd, _wrapped(_set(("state", 1), [1.0])), "expected the mapping"),
    ("momentum transposed", sgd, _wrapped(_transpose_first("momentum_buffer")), r"shape \(4, 3\)"),
    ("exp_avg transposed", adam, _wrapped(_transpose_first("exp_avg")), r"shape \(4, 3\)"),
    ("exp_avg_sq empty", adam, _wrapped(_set(("state", 2, "exp_avg_sq"), torch.zeros(0))), "shape"),
    ("exp_avg flat", adam, _wrapped(_set(("state", 0, "exp_avg"), torch.zeros(12))), r"\(12,\)"),
]


@pytest.mark.parametrize(
    ("factory", "damage", "match"),
    [case[1:] for case in DAMAGED],
    ids=[case[0] for case in DAMAGED],
)
def test_damaged_wrapped_state_is_refused_and_changes_nothing(
    factory: Callable[[torch.nn.Module], torch.optim.Optimizer],
    damage: Callable[[dict[str, Any]], None],
    match: str,
) -> None:
    _, saver = stepped(factory)
    state = copy.deepcopy(saver.state_dict())
    damage(state)
    model, opt = stepped(factory, seed=3)
    before = snapshot(model, opt)
    with pytest.raises(ConfigurationError, match=match):
        opt.check_state_dict(state)
    with pytest.raises(ConfigurationError, match=match):
        opt.load_state_dict(state)
    assert_same(snapshot(model, opt), before)


@pytest.mark.parametrize("factory", [sgd, adam], ids=["sgd-momentum", "adam"])
def test_valid_wrapped_states_still_load(
    factory: Callable[[torch.nn.Module], torch.optim.Optimizer],
) -> None:
    _, saver = stepped(factory)
    saved = copy.deepcopy(saver.state_dict())
    model = make_model(seed=5)
    opt = DPOptimizer(
        factory(model), model, noise_multiplier=SIGMA, expected_batch_size=4.0, seed=1
    )
    opt.check_state_dict(saved)
    opt.load_state_dict(saved)
    assert opt.steps == 1
    assert_same(opt.optimizer.state_dict(), saver.optimizer.state_dict())
    # a state saved before any step (no per-parameter state yet) loads too
    other = make_model()
    unstepped = DPOptimizer(
        factory(other), other, noise_multiplier=SIGMA, expected_batch_size=4.0, seed=1
    ).state_dict()
    opt.load_state_dict(unstepped)
    assert opt.optimizer.state_dict()["state"] == {}


def test_factored_adafactor_moments_are_accepted() -> None:
    adafactor = torch.optim.Adafactor
    _, saver = stepped(lambda m: adafactor(m.parameters(), lr=1e-2))
    saved = copy.deepcopy(saver.state_dict())
    assert saved["optimizer"]["state"][0]["row_var"].shape == (3, 1)
    _, opt = stepped(lambda m: adafactor(m.parameters(), lr=1e-2), seed=4)
    opt.load_state_dict(saved)
    saved["optimizer"]["state"][0]["row_var"] = torch.zeros(1, 3)
    with pytest.raises(ConfigurationError, match="row_var"):
        opt.check_state_dict(saved)


class Preconditioned(torch.optim.SGD):
    """An optimizer of another library: its state holds a tensor not shaped like the
    parameter (a preconditioner, 8-bit quantisation constants)."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["factor"] = torch.ones(param.numel() + 1)
        return out


def test_other_libraries_optimizer_state_shapes_are_left_to_them() -> None:
    _, saver = stepped(lambda m: Preconditioned(m.parameters(), lr=0.1))
    saved = copy.deepcopy(saver.state_dict())
    _, opt = stepped(lambda m: Preconditioned(m.parameters(), lr=0.1), seed=4)
    opt.check_state_dict(saved)  # the shape rule is torch.optim's
    opt.load_state_dict(saved)
    assert opt.steps == 1


@pytest.mark.parametrize(("top", "inner"), [(2.0, SIGMA), (SIGMA, 2.0)], ids=["top", "noise"])
def test_inconsistent_saved_sigma_is_refused(top: float, inner: float) -> None:
    _, saver = stepped(sgd)
    state = copy.deepcopy(saver.state_dict())
    state["noise_multiplier"] = top
    state["noise"]["noise_multiplier"] = inner
    model, opt = stepped(sgd, seed=3)
    before = snapshot(model, opt)
    with pytest.raises(ConfigurationError, match="the saved state is inconsistent"):
        opt.check_state_dict(state)
    with pytest.raises(ConfigurationError, match="the saved state is inconsistent"):
        opt.load_state_dict(state)
    assert_same(snapshot(model, opt), before)


def test_noise_without_state_is_not_compared() -> None:
    class Stateless:
        noise_multiplier = SIGMA

        def add(self, grads: Any, sensitivity: float | None = None) -> Any:
            return {n: g.clone() for n, g in grads.items()}

    model = make_model()
    opt = DPOptimizer(sgd(model), model, noise=Stateless(), expected_batch_size=4.0)
    state = opt.state_dict()
    assert state["noise"] is None
    opt.load_state_dict({**state, "noise_multiplier": 1.5})
    assert opt.noise_multiplier == 1.5


def test_checkpoint_with_damaged_wrapped_state_restores_nothing(tmp_path: Path) -> None:
    """The loader checks every part first: the model is not restored when the optimizer
    would refuse its state."""
    from opake.dpsgd.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    saved_model, saver = stepped(sgd)
    path = save_checkpoint(tmp_path / "c.pt", step=1, model=saved_model, optimizer=saver)
    payload = torch.load(path, weights_only=True)
    payload["components"]["optimizer"]["state"]["optimizer"]["param_groups"] = []
    torch.save(payload, path)
    model, opt = stepped(sgd, seed=3)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match="parameter group"):
        load_checkpoint(path, model=model, optimizer=opt)
    assert_same(snapshot(model, opt), before)


@pytest.mark.parametrize("where", ["top", "nested list", "nested dict", "quantized"])
def test_a_state_tensor_without_values_is_refused(where: str) -> None:
    # a meta tensor of the right shape passed the shape check, then failed while restoring,
    # after a checkpoint's model and sampler had been restored
    _, saver = stepped(adam)
    saved = copy.deepcopy(saver.state_dict())
    avg = saved["optimizer"]["state"][0]["exp_avg"]
    meta = torch.empty(avg.shape, device="meta")
    bad: Any = {"top": meta, "nested list": [meta], "nested dict": {"inner": meta}}.get(where)
    if where == "quantized":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated
            bad = torch.quantize_per_tensor(avg, 0.1, 0, torch.qint8)
    saved["optimizer"]["state"][0]["exp_avg"] = bad
    model, opt = stepped(adam, seed=4)
    before = snapshot(model, opt)
    with pytest.raises(ConfigurationError, match="holds no values"):
        opt.check_state_dict(saved)
    with pytest.raises(ConfigurationError, match="holds no values"):
        opt.load_state_dict(saved)
    after = snapshot(model, opt)
    assert after["steps"] == before["steps"]
    assert after["noise"] == before["noise"]
