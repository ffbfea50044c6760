"""The ``summary.json`` of an ``opake train`` run, and the saved model."""

from __future__ import annotations

import math
import platform
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from opake.core import ops

if TYPE_CHECKING:
    import torch

    from opake.cli._memory import MicrobatchChoice
    from opake.cli._plan import RunPlan


def _fmt_gb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} GB"


def _max_none(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _save_model(plan: RunPlan, loaded: Any, model: Any) -> dict[str, str]:
    from opake.cli._saving import save_run_model

    return save_run_model(plan.out, loaded, model, plan.tokenizer)


def _privacy_unit(plan: RunPlan) -> str:
    """What ε protects, in words."""
    s = plan.settings
    if plan.post is not None:
        rows = (
            "its chosen and rejected rows clipped together"
            if plan.post.objective == "dpo"
            else "one row, cut on its own"
        )
        return (
            f"one record ({rows}; example-level DP over the {plan.dataset_size} training "
            "records; the validation records are not protected)"
        )
    if plan.units is None:
        return (
            f"one training block of {s.block_size} tokens (example-level DP over the training "
            "split; the validation split is not protected)"
        )
    return (
        f"one {plan.unit_name} (JSONL field {s.privacy_unit!r}) with all its blocks (user-level "
        f"DP over the {plan.population} training units; the held-out units are not protected)"
    )


def _summary(
    plan: RunPlan,
    *,
    rows: list[dict[str, Any]],
    val_loss: float,
    initial_val: float | None,
    peak_gb: float | None,
    memory_process_level: bool,
    loaded: Any,
    microbatch: MicrobatchChoice,
    resumed_from: int | None,
    wall: float,
    saved: dict[str, str],
    accountant: Any,
    patch_report: Any,
    world_size: int,
    device: torch.device,
    engine: tuple[str | None, str | None],
) -> dict[str, Any]:
    import torch

    from opake.cli._version import __version__

    s = plan.settings
    tail = rows[-max(1, len(rows) // 10) :]
    train_losses = [r["train_loss"] for r in tail if math.isfinite(r["train_loss"])]
    total_time = sum(r["step_time_sec"] for r in rows)
    total_samples = sum(r["batch_size"] for r in rows)
    epsilon = float(accountant.get_epsilon(plan.delta))
    return {
        "epsilon": epsilon,
        "delta": plan.delta,
        "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate,
        "steps": len(rows),
        "train_loss": sum(train_losses) / len(train_losses) if train_losses else None,
        "val_loss": val_loss,
        "samples_per_second": total_samples / total_time if total_time > 0 else None,
        "peak_memory_gb": peak_gb,
        "peak_memory_scope": "process RSS" if memory_process_level else "device allocator",
        "unigram_baseline": plan.baseline,
        "initial_val_loss": initial_val,
        "val_loss_below_baseline": plan.baseline - val_loss,
        "planned_epsilon": plan.planned_epsilon,
        "accountant": s.accountant,
        "randomness": plan.randomness,
        "privacy_unit": _privacy_unit(plan),
        "units": plan.population if plan.units is not None else None,
        "post_training": None if plan.post is None else plan.post.to_dict(),
        "clipping_rate_mean": sum(r["clipping_rate"] for r in rows) / max(1, len(rows)),
        "diagnostics_are_private": False,
        "dataset_size": plan.dataset_size,
        "val_blocks": int(plan.val.shape[0]),
        "expected_batch_size": plan.sample_rate * plan.population,
        "max_batch_size": plan.max_batch_size,
        "microbatch_size": microbatch.microbatch,
        "microbatch_choice": microbatch.to_dict(),
        "corpus": plan.corpus.name,
        "corpus_characters": plan.corpus.num_chars,
        "model_source": loaded.source,
        "parameters": loaded.num_parameters,
        "trainable_parameters": loaded.num_trainable,
        "train_time_sec": total_time,
        "wall_time_sec": wall,
        "resumed_from_step": resumed_from,
        "device": str(device),
        "world_size": world_size,
        "clipping_engine": engine[0],
        "clipping_engine_reason": engine[1],
        "model_patches": _patches(patch_report),
        "outputs": saved,
        "notes": plan.notes,
        "versions": {
            "opake": __version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "settings": s.to_dict(),
    }


def _patches(report: Any) -> dict[str, Any] | None:
    """The model family and kernels patched in (``None``: the model ran unpatched)."""
    if report is None:
        return None
    return {
        "family": report.family,
        "kernels": {op: use.backend for op, use in report.kernels.items()},
        # the logits-free loss path, for either engine (book-keeping takes lm_head's
        # per-example norms from the kernel's example-grads op)
        "loss_only": ops.LINEAR_CROSS_ENTROPY in report.kernels,
    }
