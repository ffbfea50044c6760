"""``opake epsilon``: ε for a DP-SGD schedule, or the noise multiplier σ for a target ε.

Every combination of the values given (several σ, steps, targets or δ at once) is one table row.

>>> rows = epsilon_table(sample_rates=[0.01], noise_multipliers=[1.0], steps=[1000],
...                      deltas=[1e-5], accountant="rdp")
>>> print(format_table(rows))
q     σ  steps  δ      ε
0.01  1  1000   1e-05  2.101
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Sequence
from typing import Any

from opake.core.choices import ACCOUNTANTS, TRAINING_PLD_OPTIONS
from opake.core.errors import ConfigurationError

__all__ = ["epsilon_table", "format_table", "noise_table", "register"]

#: PLD discretisation the CLI uses (pessimistic, so ε stays an upper bound; ~1e-5 relative
#: from the library default at a fraction of the cost)
PLD_OPTIONS = dict(TRAINING_PLD_OPTIONS)


def _options(accountant: str) -> dict[str, Any] | None:
    return dict(PLD_OPTIONS) if accountant == "pld" else None


def epsilon_table(
    *,
    sample_rates: Sequence[float],
    noise_multipliers: Sequence[float],
    steps: Sequence[int],
    deltas: Sequence[float],
    accountant: str = "pld",
) -> list[dict[str, Any]]:
    """ε(δ) of every combination of the inputs, one dict per row."""
    from opake import accounting

    rows = []
    for q, sigma, n, delta in itertools.product(sample_rates, noise_multipliers, steps, deltas):
        eps = accounting.epsilon(
            sample_rate=q,
            noise_multiplier=sigma,
            steps=n,
            delta=delta,
            accountant=accountant,
            accountant_options=_options(accountant),
        )
        rows.append({"q": q, "σ": sigma, "steps": n, "δ": delta, "ε": eps})
    return rows


def noise_table(
    *,
    sample_rates: Sequence[float],
    target_epsilons: Sequence[float],
    steps: Sequence[int],
    deltas: Sequence[float],
    accountant: str = "pld",
) -> list[dict[str, Any]]:
    """The smallest σ meeting each target ε, and the ε it achieves, one dict per row.

    >>> rows = noise_table(sample_rates=[0.01], target_epsilons=[2.0], steps=[1000],
    ...                    deltas=[1e-5], accountant="rdp")
    >>> round(rows[0]["σ"], 2), rows[0]["ε"] <= 2.0
    (1.02, True)
    """
    from opake import accounting

    rows = []
    for q, target, n, delta in itertools.product(sample_rates, target_epsilons, steps, deltas):
        sigma = accounting.calibrate_noise(
            target_epsilon=target,
            delta=delta,
            sample_rate=q,
            steps=n,
            accountant=accountant,
            accountant_options=_options(accountant),
        )
        eps = accounting.epsilon(
            sample_rate=q,
            noise_multiplier=sigma,
            steps=n,
            delta=delta,
            accountant=accountant,
            accountant_options=_options(accountant),
        )
        rows.append({"q": q, "target ε": target, "steps": n, "δ": delta, "σ": sigma, "ε": eps})
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Render rows (dicts with the same keys) as an aligned plain-text table."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[_fmt(row[k]) for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _sample_rates(args: argparse.Namespace) -> list[float]:
    if args.sample_rate:
        if args.batch_size or args.dataset_size:
            raise ConfigurationError(
                "give either --sample-rate or --batch-size with --dataset-size, not both"
            )
        return list(args.sample_rate)
    if args.batch_size and args.dataset_size:
        rates = []
        for b, n in itertools.product(args.batch_size, args.dataset_size):
            if b > n:
                raise ConfigurationError(
                    f"--batch-size {b} exceeds --dataset-size {n}: the expected batch must be "
                    "at most the dataset size"
                )
            rates.append(b / n)
        return rates
    raise ConfigurationError(
        "no sampling rate: give --sample-rate q, or --batch-size B and --dataset-size N (q = B / N)"
    )


def _run(args: argparse.Namespace) -> int:
    rates = _sample_rates(args)
    if args.noise_multiplier and args.target_epsilon:
        raise ConfigurationError(
            "give --noise-multiplier (to compute ε) or --target-epsilon (to compute σ), not both"
        )
    if args.noise_multiplier:
        rows = epsilon_table(
            sample_rates=rates,
            noise_multipliers=args.noise_multiplier,
            steps=args.steps,
            deltas=args.delta,
            accountant=args.accountant,
        )
    elif args.target_epsilon:
        rows = noise_table(
            sample_rates=rates,
            target_epsilons=args.target_epsilon,
            steps=args.steps,
            deltas=args.delta,
            accountant=args.accountant,
        )
    else:
        raise ConfigurationError(
            "nothing to compute: give --noise-multiplier σ (prints ε) or --target-epsilon ε "
            "(prints the smallest σ that meets it)"
        )
    if args.json:
        print(json.dumps({"accountant": args.accountant, "rows": rows}, ensure_ascii=False))
    else:
        print(f"accountant: {args.accountant} (Poisson-subsampled Gaussian, add/remove adjacency)")
        print(format_table(rows))
    return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number > 0")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be an integer >= 1")
    return value


def register(sub: Any) -> None:
    """Add the ``epsilon`` subcommand to the ``opake`` parser."""
    p = sub.add_parser(
        "epsilon",
        help="ε for q/σ/steps/δ, or σ for a target ε, as a table",
        description=(
            "Privacy accounting for DP-SGD with Poisson sampling. With --noise-multiplier: "
            "prints ε. With --target-epsilon: prints the smallest σ that meets it. Several "
            "values per option give one row per combination."
        ),
    )
    p.add_argument("--sample-rate", "-q", type=_positive_float, nargs="+", metavar="Q")
    p.add_argument("--batch-size", type=_positive_int, nargs="+", metavar="B",
                   help="expected batch size (with --dataset-size: q = B / N)")  # fmt: skip
    p.add_argument("--dataset-size", type=_positive_int, nargs="+", metavar="N")
    p.add_argument("--noise-multiplier", "-s", type=_positive_float, nargs="+", metavar="SIGMA")
    p.add_argument("--target-epsilon", "-e", type=_positive_float, nargs="+", metavar="EPS")
    p.add_argument("--steps", "-t", type=_positive_int, nargs="+", required=True, metavar="T")
    p.add_argument("--delta", "-d", type=_positive_float, nargs="+", required=True, metavar="D")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="pld",
                   help="pld: tight (default); rdp: faster, looser")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(run=_run)
