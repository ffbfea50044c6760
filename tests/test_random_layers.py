"""A MoE router's jitter is a random layer like dropout, for every front end that looks.

An independent review found Mixtral's ``router_jitter_noise`` unseen by the three detectors
(``DPTrainer``'s ``has_dropout``, the patches' ``dropout_status``, ``opake train``'s
``config_dropout`` / ``disable_dropout``): the trainers then chose ``randomness="error"`` and
``engine="auto"`` ran the book-keeping engine on a random layer, whose check missed a small
jitter (1e-2) and whose vmap fall-back stopped with a bare torch error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")


def _mixtral(jitter: float) -> torch.nn.Module:
    from opake.models.testing import tiny_model

    return tiny_model("mixtral", router_jitter_noise=jitter)


@pytest.mark.parametrize("jitter", [0.0, 0.01])
def test_every_detector_sees_the_jitter(tmp_path: Path, jitter: float) -> None:
    from opake.cli._checks import config_dropout, disable_dropout
    from opake.patches.hf._compat import dropout_status
    from opake.transformers._losses import has_dropout

    model = _mixtral(jitter)
    assert has_dropout(model) is (jitter > 0)
    assert any("jitter" in found for found in dropout_status(model)) is (jitter > 0)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert ("router_jitter_noise" in config_dropout(str(tmp_path), True)) is (jitter > 0)
    assert disable_dropout(model) >= (1 if jitter > 0 else 0)
    assert not has_dropout(model)


def test_a_random_layer_under_randomness_error_is_a_typed_error() -> None:
    from opake.core.errors import OperationError
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    fmodel, params = make_functional(net)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fmodel(p, x[None]).square().sum()

    grad_fn, state = clipped_grad(loss, clipping_norm=1.0, engine="vmap")
    with pytest.raises(OperationError, match="randomness='different'"):
        grad_fn(params, torch.randn(4, 3), state=state)
