"""Checks of ``opake train`` that need the file system or the model's configuration, and the
warnings it gives while a run goes (all before the first step, or one line when they fire).

>>> watch = DivergenceWatch(initial=2.0, patience=2)
>>> [watch.observe(v) is None for v in (2.5, 1.9, 2.6, 2.7)]
[True, True, True, False]
>>> watch.warned
True
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from opake.core.errors import ConfigurationError

__all__ = [
    "NAMED_CONTEXT",
    "DivergenceWatch",
    "check_model_fits",
    "check_writable",
    "config_dropout",
    "disable_dropout",
    "epsilon_note",
]

#: longest block the named configs (llama-tiny, llama-small) are built for
NAMED_CONTEXT = 1024
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")


def check_writable(out: Path) -> None:
    """``--out`` must be (or become) a directory this process can write into.

    Writes and removes a probe file in ``out``, or in its nearest existing parent when ``out``
    does not exist yet (nothing is created), so a read-only directory or file system fails
    here, in one line, before anything is planned.
    """
    probe = out.absolute()
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigurationError(f"--out {out}: {probe} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".opake-write-check-"):
            pass
    except OSError as err:
        reason = err.strerror or type(err).__name__
        where = "" if probe == out.absolute() else f" (in {probe})"
        raise ConfigurationError(
            f"--out {out}: cannot write there{where}: {reason}; choose a directory you can write to"
        ) from None


def _read_config(directory: str) -> dict[str, Any]:
    try:
        config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")  # multimodal configs nest the language model's
    return {**config, **text} if isinstance(text, dict) else config


def check_model_fits(spec: str, is_directory: bool, *, block_size: int, vocab_size: int) -> None:
    """``--block-size`` within the model's context, the tokenizer's ids within its vocabulary."""
    if not is_directory:
        if block_size > NAMED_CONTEXT:
            raise ConfigurationError(
                f"--block-size {block_size}: the named model {spec} is built for blocks of at "
                f"most {NAMED_CONTEXT} tokens; use a smaller --block-size or a model directory "
                "with a longer context"
            )
        return
    config = _read_config(spec)
    context = next(
        (int(config[k]) for k in _CONTEXT_KEYS if isinstance(config.get(k), int) and config[k] > 0),
        None,
    )
    if context is not None and block_size > context:
        raise ConfigurationError(
            f"--block-size {block_size} exceeds the context of --model {spec} ({context} "
            f"positions); use --block-size {context} or less"
        )
    model_vocab = config.get("vocab_size")
    if isinstance(model_vocab, int) and model_vocab < vocab_size:
        raise ConfigurationError(
            f"--model {spec}: its vocabulary has {model_vocab} entries but the tokenizer "
            f"produces ids up to {vocab_size - 1}; use the model's own tokenizer (saved in the "
            "model directory)"
        )


def epsilon_note(
    *, target: float | None, planned: float, poisson_only: float | None, max_batch: int | None
) -> str | None:
    """Why the planned ε is below the target, when it is (by more than 1 %)."""
    if target is None or planned >= 0.99 * target:
        return None
    if max_batch is not None and poisson_only is not None and poisson_only > planned * 1.01:
        return (
            f"ε = {planned:.3g} instead of the target {target:g}: with --sampler fixed the "
            f"truncation probability of B_max = {max_batch} is charged to δ as (1 + e^ε)·T·p, "
            "which leaves less δ for the Gaussian part; a larger --batch-size headroom (more "
            "data) or --sampler poisson reaches the target"
        )
    return (
        f"ε = {planned:.3g} instead of the target {target:g}: σ is calibrated from a grid "
        "(relative tolerance 1e-3) and the accountant's ε is a pessimistic upper bound; the run "
        "spends at most the target"
    )


class DivergenceWatch:
    """Warn once when the validation loss stays above the initial one (or is not finite) for
    ``patience`` evaluations in a row."""

    def __init__(self, initial: float | None, *, patience: int = 3) -> None:
        self.initial = initial
        self.patience = patience
        self._above = 0
        self.warned = False

    def observe(self, val_loss: float) -> str | None:
        """Record one evaluation; return the warning the first time the run diverges."""
        if self.initial is None or self.warned:
            return None
        bad = not math.isfinite(val_loss) or val_loss > self.initial
        self._above = self._above + 1 if bad else 0
        if self._above < self.patience:
            return None
        self.warned = True
        return (
            f"the validation loss ({val_loss:.4g}) has been above the initial "
            f"{self.initial:.4g} for {self.patience} evaluations in a row: the run is "
            "diverging — lower --lr (now it may be far too high) or raise --batch-size"
        )


def config_dropout(spec: str, is_directory: bool) -> dict[str, float]:
    """The dropout probabilities > 0 a model directory's config sets (``*dropout*``, ``*pdrop*``
    keys, and a MoE router's ``*jitter*`` noise, random like dropout); the named configs have
    none."""
    if not is_directory:
        return {}
    config = _read_config(spec)
    return {
        key: float(value)
        for key, value in sorted(config.items())
        if ("dropout" in key or "pdrop" in key or "jitter" in key)
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value > 0
    }


def disable_dropout(model: Any) -> int:
    """Set every dropout probability of *model* to 0 (``nn.Dropout`` modules and the float
    ``*dropout*`` attributes attention layers read, and a MoE router's ``*jitter*`` noise);
    returns how many were changed."""
    import torch

    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            changed += 1
        for name, value in list(vars(module).items()):
            random = "dropout" in name or "jitter" in name
            if random and isinstance(value, float) and value > 0:
                setattr(module, name, 0.0)
                changed += 1
    return changed


def watch_divergence(watch: DivergenceWatch, val_loss: float, done: int, plan: Any) -> None:
    """Feed *val_loss* to *watch*; on divergence, note it in the plan and warn once."""
    diverging = watch.observe(val_loss)
    if diverging:
        plan.notes.append(f"at step {done}, {diverging}")
        print(f"\nopake train: warning: {diverging}", file=sys.stderr, flush=True)
