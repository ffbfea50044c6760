"""What a resumed run must train on: the saved run's data, checked by a fingerprint.

``--resume`` keeps the saved settings (``--data`` among them), but a file under the same name
may have changed. The sampler's position and the accountant's history belong to the data the
run started with, so a checkpoint carries the SHA-256 of what the sampler draws from — the
training blocks or records, their labels and privacy units, as tokenized — and a resumed run
with other data is refused.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    from opake.cli._plan import RunPlan

__all__ = ["check_resumed_data", "data_fingerprint"]


def data_fingerprint(plan: RunPlan) -> str:
    """SHA-256 (hex) of ``plan``'s training data: blocks or records, labels, units.

    >>> from types import SimpleNamespace
    >>> import torch
    >>> plan = SimpleNamespace(train=torch.arange(6).reshape(2, 3), train_labels=None, units=None)
    >>> one = data_fingerprint(plan)  # type: ignore[arg-type]
    >>> plan.train[0, 0] = 7
    >>> one == data_fingerprint(plan)  # type: ignore[arg-type]
    False
    """
    digest = hashlib.sha256()
    for part in (plan.train, plan.train_labels):
        if part is None:
            digest.update(b"-")
            continue
        digest.update(repr((tuple(part.shape), str(part.dtype))).encode())
        digest.update(part.detach().cpu().contiguous().numpy().tobytes())
    if plan.units is not None:
        digest.update("\x00".join(plan.units).encode())
    return digest.hexdigest()


def check_resumed_data(saved: object, now: str) -> None:
    """Refuse resuming on other training data (fingerprint ``now``) than the checkpoint's
    ``saved`` one (a checkpoint of an earlier version carries none: accepted)."""
    if saved is None or saved == now:
        return
    raise ConfigurationError(
        f"--resume: the training data differ from the saved run's (SHA-256 {str(saved)[:12]}… "
        f"saved, {now[:12]}… now): the sampler's draws and the accountant's history belong to "
        "the saved data. Resume with the same --data file, tokenizer and data options, or start "
        "a new run in another --out"
    )
