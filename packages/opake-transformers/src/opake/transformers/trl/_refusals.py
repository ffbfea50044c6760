"""What the DP TRL trainers refuse, beyond what ``DPTrainer`` refuses: TRL features that would
break DP — several records in one row, a loss that mixes examples — or that the DP step does not
carry out, each with the reason and what to do instead.

Checked on the config before TRL prepares any data (:func:`check_sft_config`,
:func:`check_dpo_config`), and on what TRL built from it after (:func:`check_built`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = ["DPO_REFUSED", "SFT_REFUSED", "check_built", "check_dpo_config", "check_sft_config"]

_Entry = tuple[str, Callable[[Any], bool], str]

_UNIT = "a record is the privacy unit, and each must be clipped on its own"
_COMMON: tuple[_Entry, ...] = (
    (
        "activation_offloading",
        lambda a: bool(getattr(a, "activation_offloading", False)),
        (
            "its context wraps TRL's backward, which the DP step replaces; use "
            "gradient_checkpointing=True to save activation memory"
        ),
    ),
    (
        "use_liger_kernel",
        lambda a: bool(getattr(a, "use_liger_kernel", False)),
        (
            "Liger's kernels are not checked under per-example gradients; apply Opake's model "
            "patches (opake.patches.apply_model_patches) for fused kernels and the loss-only head"
        ),
    ),
    (
        "padding_free",
        lambda a: bool(getattr(a, "padding_free", False)),
        f"it flattens the batch's records into one row; {_UNIT}. Leave padding_free=False",
    ),
)

#: (setting, refused when, why) for DPSFTTrainer, beyond DPTrainer's list
SFT_REFUSED: tuple[_Entry, ...] = (
    (
        "packing",
        lambda a: bool(a.packing),
        (
            f"it packs several records into one row, whose gradient would be clipped as one; "
            f"{_UNIT}. Leave packing=False (padding costs compute, never privacy)"
        ),
    ),
    *_COMMON,
    (
        "loss_type",
        lambda a: a.loss_type != "nll",
        (
            "DPSFTTrainer's per-example loss is the completion negative log-likelihood ('nll'); "
            "other loss types are not implemented per example"
        ),
    ),
)

#: (setting, refused when, why) for DPDPOTrainer, beyond DPTrainer's list
DPO_REFUSED: tuple[_Entry, ...] = (
    *_COMMON,
    (
        "loss_type",
        lambda a: list(a.loss_type) != ["sigmoid"],
        (
            "DPDPOTrainer implements the DPO loss per pair (loss_type=['sigmoid']); other loss "
            "types (some sort or pair examples across the batch) are not implemented per example"
        ),
    ),
    (
        "loss_weights",
        lambda a: a.loss_weights not in (None, [1.0]),
        "only the single 'sigmoid' loss is implemented per pair",
    ),
    (
        "f_divergence_type",
        lambda a: a.f_divergence_type != "reverse_kl",
        "only standard DPO (reverse_kl) is implemented per pair",
    ),
    (
        "label_smoothing",
        lambda a: float(a.label_smoothing) != 0.0,
        (
            "the per-pair loss is the plain sigmoid DPO loss: conservative DPO's label smoothing "
            "is not implemented per pair (it would be silently ignored); leave it at 0"
        ),
    ),
    (
        "ld_alpha",
        lambda a: a.ld_alpha is not None,
        "LD-DPO's length weighting is not implemented per pair",
    ),
    (
        "use_weighting",
        lambda a: bool(a.use_weighting),
        "WPO weighting is not implemented per pair",
    ),
    (
        "sync_ref_model",
        lambda a: bool(a.sync_ref_model),
        (
            "the reference model is fixed for the run (a frozen copy, the adapters disabled, or "
            "log-probabilities computed once); TR-DPO's reference updates are not supported"
        ),
    ),
    (
        "torch_compile",
        lambda a: bool(a.torch_compile),
        (
            "each pair's two rows are clipped as one privacy unit, and the plan that keeps a "
            "unit's rows together does not trace into the compiled step; train DPO with "
            "torch_compile=False"
        ),
    ),
    (
        "world_size",
        lambda a: a.world_size > 1,
        (
            "a pair's two rows are clipped as one privacy unit, which the DP step supports in one "
            "process only (no sampler shards the batch by unit yet); train DPO in one process"
        ),
    ),
)


def _check(trainer: str, args: Any, entries: tuple[_Entry, ...]) -> None:
    for name, refused, why in entries:
        if hasattr(args, name) and refused(args):
            raise ConfigurationError(f"{trainer}: {name}={getattr(args, name)!r}: {why}")


def check_sft_config(args: Any) -> None:
    """Refuse the :data:`SFT_REFUSED` settings of a ``DPSFTConfig``."""
    _check("DPSFTTrainer", args, SFT_REFUSED)


def check_dpo_config(args: Any) -> None:
    """Refuse the :data:`DPO_REFUSED` settings of a ``DPDPOConfig``."""
    _check("DPDPOTrainer", args, DPO_REFUSED)


def check_built(trainer: Any) -> None:
    """Refuse what TRL built that the DP step cannot carry: a vision dataset and a
    Mixture-of-Experts load-balancing loss (computed over the whole batch)."""
    name = type(trainer).__name__
    if getattr(trainer, "_is_vision_dataset", False):
        raise ConfigurationError(
            f"{name}: vision datasets (an 'image' or 'images' column) are not supported; "
            "train on text records"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ConfigurationError(
            f"{name}: the Mixture-of-Experts load-balancing loss is computed over the whole "
            "batch, so one example would shape another's gradient; set "
            "router_aux_loss_coef=0.0"
        )
