"""A review found that a rotary embedding whose frequencies depend on the batch's sequence
length (``rope_type`` ``"longrope"``: Phi-3-128k, Phi-3.5, Phi-4-mini; ``"dynamic"``: NTK
scaling) lets one long record change every other record's gradient — batches are padded to
their longest record — so the clipped sum moved by 7–11·C (book-keeping engine, one long
record among 16 short ones). The DP front ends (``DPTrainer`` and the TRL trainers through
``check_model``, ``opake train``) refuse such models.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from opake.core.errors import ConfigurationError
from opake.core.testing import tiny_llama

_spec = importlib.util.spec_from_file_location(
    "_hf_helpers_positions", Path(__file__).with_name("_hf_helpers.py")
)
assert _spec is not None
assert _spec.loader is not None
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": 16,
    "short_factor": [1.0] * 4,
    "long_factor": [50.0] * 4,
}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}


def _model(rope: dict[str, object] | None):
    options = {} if rope is None else {"rope_parameters": rope}
    return tiny_llama(max_position_embeddings=256, **options)


@pytest.mark.parametrize("rope", [LONGROPE, DYNAMIC], ids=["longrope", "dynamic"])
def test_length_dependent_rope_is_detected_and_dptrainer_refuses_it(tmp_path, rope):
    from opake.transformers import DPTrainer, length_dependent_rope

    model = _model(rope)
    assert length_dependent_rope(model) == rope["rope_type"]
    with pytest.raises(ConfigurationError, match=r"rope_type=.*longest sequence of each batch"):
        DPTrainer(model=model, args=H.dp_args(tmp_path), train_dataset=H.token_data())


def test_a_fixed_rope_is_not_refused():
    from opake.transformers import length_dependent_rope

    assert length_dependent_rope(_model(None)) is None
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert length_dependent_rope(_model(linear)) is None
