"""DP post-training with TRL: ``DPSFTTrainer`` and ``DPDPOTrainer`` (``opake-transformers[trl]``).

Subclasses of TRL's ``SFTTrainer`` / ``DPOTrainer`` that take TRL's configs plus the DP fields of
``DPTrainingArguments`` (:class:`DPSFTConfig`, :class:`DPDPOConfig`) and TRL's dataset formats,
and train with ``DPTrainer``'s DP-SGD step: Poisson sampling over records, one record one
example (an SFT conversation or prompt/completion; a DPO preference pair, its chosen and
rejected rows clipped together), ε/δ/σ/q in every log, the stop when the budget is spent, exact
resume, and the refusal of TRL options that would break DP (``packing`` first among them). See
``docs/guide/post-training.md``.

Names are imported on first use (``import opake.transformers.trl`` does not import TRL).

>>> import opake.transformers.trl as dp_trl
>>> sorted(dp_trl.__all__)
['DPDPOConfig', 'DPDPOTrainer', 'DPSFTConfig', 'DPSFTTrainer']
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opake.transformers.trl._config import DPDPOConfig, DPSFTConfig
    from opake.transformers.trl._dpo import DPDPOTrainer
    from opake.transformers.trl._sft import DPSFTTrainer

_LAZY = {
    "DPSFTTrainer": "_sft",
    "DPDPOTrainer": "_dpo",
    "DPSFTConfig": "_config",
    "DPDPOConfig": "_config",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'opake.transformers.trl' has no attribute {name!r}")
    import importlib

    try:
        loaded = importlib.import_module(f"opake.transformers.trl.{module}")
    except ModuleNotFoundError as err:
        if err.name != "trl" and not (err.name or "").startswith("trl."):
            raise
        from opake.core.errors import ConfigurationError

        raise ConfigurationError(
            f"opake.transformers.trl.{name} needs TRL, which is not installed: "
            "pip install 'opake-transformers[trl]'"
        ) from err
    value = getattr(loaded, name)
    globals()[name] = value
    return value


__all__ = ["DPDPOConfig", "DPDPOTrainer", "DPSFTConfig", "DPSFTTrainer"]
