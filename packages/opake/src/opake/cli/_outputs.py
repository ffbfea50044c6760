"""What ``opake train`` writes into ``--out``: metrics.csv, summary.json and PNG plots.

>>> import tempfile, pathlib
>>> out = pathlib.Path(tempfile.mkdtemp())
>>> rows = [{"step": 1, "train_loss": 2.5, "epsilon": 0.5}, {"step": 2, "train_loss": 2.0}]
>>> write_metrics(out / "metrics.csv", rows).read_text().splitlines()
['step,train_loss,epsilon', '1,2.5,0.5', '2,2.0,']
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["METRIC_COLUMNS", "plot_metrics", "write_json", "write_metrics"]

#: the columns of metrics.csv, in order (one row per logical step)
METRIC_COLUMNS = (
    "step",
    "train_loss",
    "val_loss",
    "epsilon",
    "batch_size",
    "clipping_rate",
    "step_time_sec",
    "samples_per_second",
    "peak_memory_gb",
    "lr",
)


def _atomic_text(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8", newline="") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return path


def write_metrics(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write *rows* as CSV (columns: :data:`METRIC_COLUMNS` present in any row, in that order,
    then any others); missing values are empty. Written atomically."""
    present = {key for row in rows for key in row}
    columns = [c for c in METRIC_COLUMNS if c in present]
    columns += sorted(present.difference(columns))
    lines = []

    class _Sink:
        def write(self, text: str) -> None:
            lines.append(text)

    writer = csv.DictWriter(_Sink(), fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _cell(row.get(k)) for k in columns})
    return _atomic_text(path, "".join(lines))


def _cell(value: object) -> object:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    """Write *data* as indented JSON (atomically); non-finite floats become strings."""

    def clean(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, Mapping):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        return value

    return _atomic_text(path, json.dumps(clean(data), indent=2, sort_keys=False) + "\n")


def plot_metrics(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    *,
    baseline: float | None = None,
    delta: float | None = None,
) -> list[Path]:
    """Save ``loss.png`` (train and validation loss, and the unigram *baseline*) and
    ``epsilon.png`` (ε spent) against the step; returns the files written.

    matplotlib is imported here only (with the non-interactive Agg backend).
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for row in rows:
            value = row.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                xs.append(float(row["step"]))
                ys.append(float(value))
        return xs, ys

    written = []
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key, label, style in (
        ("train_loss", "train (batch mean, not private)", "-"),
        ("val_loss", "validation", "o-"),
    ):
        xs, ys = series(key)
        if xs:
            ax.plot(xs, ys, style, label=label, markersize=3)
    if baseline is not None:
        ax.axhline(baseline, color="grey", linestyle="--", label="unigram baseline")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("opake train: loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    written.append(out / "loss.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs, ys = series("epsilon")
    ax.plot(xs, ys, "-", color="tab:red")
    ax.set_xlabel("step")
    ax.set_ylabel("ε spent" + (f" at δ = {delta:.2g}" if delta is not None else ""))
    ax.set_title("opake train: privacy spent")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "epsilon.png", dpi=100)
    plt.close(fig)
    written.append(out / "epsilon.png")
    return written
