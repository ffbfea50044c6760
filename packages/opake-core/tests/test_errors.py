from __future__ import annotations

import pytest

from opake.core import errors


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.ConfigurationError, ValueError),
        (errors.InputTypeError, TypeError),
        (errors.OperationError, RuntimeError),
    ],
)
def test_error_hierarchy(cls, builtin):
    err = cls("what was given; what was expected; what to do")
    assert isinstance(err, errors.OpakeError)
    assert isinstance(err, builtin)
    with pytest.raises(builtin):
        raise err
