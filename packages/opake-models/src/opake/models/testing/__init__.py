"""Test helpers for model families — opake-models' own and any third party's.

- :func:`tiny_model`: the tiny task model a :class:`~opake.models.FamilySpec` describes.

>>> from opake.models.testing import tiny_model
>>> tiny_model("llama").config.num_hidden_layers
2
"""

from __future__ import annotations

from opake.models.testing._tiny import tiny_model

__all__ = ["tiny_model"]
