"""``opake train`` refuses a model whose rotary embedding depends on the batch's sequence
length (rows are padded to the longest record: one record would move every other record's
gradient)."""

from __future__ import annotations

import pytest

from opake.cli._setup import _check_positions
from opake.core.errors import ConfigurationError
from opake.core.testing import tiny_llama


def test_a_longrope_model_is_refused_and_a_default_one_is_not():
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * 4,
        "long_factor": [50.0] * 4,
    }
    with pytest.raises(ConfigurationError, match=r"--model phi.*rope_type='longrope'"):
        _check_positions(tiny_llama(max_position_embeddings=64, rope_parameters=rope), "phi")
    _check_positions(tiny_llama(), "llama")
