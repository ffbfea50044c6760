"""User-level DP vs example-level DP converted by group privacy, on real multi-record data.

The data: Python's standard library as **users** — each module is one user, its top-level
functions and classes are its records (their source, byte-tokenised, cut into blocks per user:
no block mixes two users). A tenth of the users is held out; the validation loss is the mean
next-token loss on their blocks. Every run trains the same tiny Llama from the same start for the
same number of steps on about the same number of rows per step, and protects one **user** at
the same (ε, δ):

* ``user-level``: ``DPTraining(privacy_units=...)`` — users sampled, each user's gradient clipped
  as one, ε per user directly (``--cap`` blocks of a user per step at most);
* ``group-privacy``: example-level DP-SGD (blocks sampled and clipped) calibrated so that group
  privacy at the largest group size k (the most blocks of one user) gives the same per-user
  guarantee: (ε/k, δ / (k·e^{(k−1)ε/k}))-DP per block is (ε, δ)-DP per user;
* ``example-level``: example-level DP-SGD at (ε, δ) per **block** — for reference only: it is
  not a per-user guarantee (a user with k blocks gets only group privacy from it);
* ``non-private``: plain SGD on the same batches' sizes.

The second table compares the cost of a user-level step with an example-level step of the same
rows (median wall time per step, the same process).

    python tools/bench/privacy_unit.py                      # defaults (a few minutes, 2 cores)
    python tools/bench/privacy_unit.py --steps 300 --epsilon 3

Results are recorded in docs/benchmarks.md ("User-level DP: the privacy unit").
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

EOS = 256


def user_records(max_users: int, record_bytes: int, most: int) -> dict[str, list[bytes]]:
    """Standard-library modules (users) → their first *most* top-level definitions' source
    (records)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo"}
    users: dict[str, list[bytes]] = {}
    for path in sorted(root.rglob("*.py")):
        if skip.intersection(path.relative_to(root).parts) or len(users) >= max_users:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, OSError):
            continue
        records = []
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
                text = ast.get_source_segment(source, node) or ""
                records.append(text.encode()[:record_bytes])
        if len(records) >= 3:
            users[str(path.relative_to(root))] = records[:most]
    return users


def user_blocks(users: dict[str, list[bytes]], block: int) -> tuple[torch.Tensor, list[str]]:
    """Each user's records (each followed by EOS) concatenated and cut into full blocks."""
    rows: list[list[int]] = []
    keys: list[str] = []
    for user, records in users.items():
        stream = [t for r in records for t in (*r, EOS)]
        for i in range(len(stream) // block):
            rows.append(stream[i * block : (i + 1) * block])
            keys.append(user)
    return torch.tensor(rows, dtype=torch.long), keys


def make_model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    settings: dict[str, Any] = {
        "vocab_size": EOS + 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "attn_implementation": "eager",
    }
    config = LlamaConfig(**settings)
    return LlamaForCausalLM(config)


def val_loss(model: torch.nn.Module, val: torch.Tensor) -> float:
    from opake.dpsgd.bookkeeping import causal_lm_losses

    with torch.no_grad():
        losses = [causal_lm_losses(model(chunk).logits, chunk) for chunk in torch.split(val, 64)]
    return float(torch.cat(losses).mean())


def group_privacy(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """Per-example (ε', δ') whose group privacy for groups of k is (ε, δ)."""
    eps = epsilon / k
    return eps, delta / (k * math.exp((k - 1) * eps))


def run(
    kind: str,
    data: dict[str, Any],
    args: argparse.Namespace,
    privacy: tuple[float, float] | None,
) -> dict[str, Any]:
    """Train one configuration; its validation loss, σ, ε and step times."""
    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.training import DPTraining
    from opake.functional import make_functional

    train: torch.Tensor = data["train"]
    model = make_model(args.seed)
    fmodel, params = make_functional(model)

    def losses(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return causal_lm_losses(fmodel(p, x).logits, x)

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    options: dict[str, Any] = {
        "dataset_size": int(train.shape[0]),
        "steps": args.steps,
        "clipping_norm": args.clip,
        "accountant": "rdp",
    }
    if kind == "user-level":
        options |= {"privacy_units": data["units"], "max_records_per_unit": args.cap}
        options["expected_batch_size"] = float(args.users_per_step)
    else:
        options["expected_batch_size"] = data["rows_per_step"]
    if privacy is None:  # non-private: a DP step with no noise and no clipping that bites
        options |= {"noise_multiplier": 1e-12, "delta": 1e-5, "clipping_norm": 1e12}
    else:
        options |= {"target_epsilon": privacy[0], "delta": privacy[1]}
    from opake.core.errors import ConfigurationError

    try:
        training = DPTraining(
            BatchedLoss(losses, fmodel), optimizer, params, module=model, **options
        )
    except ConfigurationError as err:  # no σ reaches the target: nothing can be trained
        if "unreachable" not in str(err):
            raise
        return {
            "run": kind,
            "val_loss": val_loss(model, data["val"]),
            "sigma": float("inf"),
            "epsilon": float("nan"),
            "delta": privacy[1] if privacy else None,
            "rows_per_step": 0.0,
            "step_ms": float("nan"),
            "engine": "none (unreachable)",
        }
    times, rows = [], 0
    for _, idx in zip(range(args.steps), training.batches(), strict=False):
        start = time.perf_counter()
        training.step(train[idx], records=idx if kind == "user-level" else None)
        times.append(time.perf_counter() - start)
        rows += len(idx)
    return {
        "run": kind,
        "val_loss": val_loss(model, data["val"]),
        "sigma": training.noise_multiplier,
        "epsilon": training.epsilon() if privacy is not None else float("inf"),
        "delta": privacy[1] if privacy is not None else None,
        "rows_per_step": rows / max(1, args.steps),
        "step_ms": 1e3 * statistics.median(times) if times else float("nan"),
        "engine": training.grad_fn.engine,
    }


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration over repeats: medians of the validation loss and the step time."""
    out = dict(runs[0])
    for key in ("val_loss", "step_ms", "rows_per_step"):
        out[key] = statistics.median(r[key] for r in runs)
    out["val_losses"] = [r["val_loss"] for r in runs]
    return out


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    users = user_records(args.users, args.record_bytes, args.user_records)
    blocks, keys = user_blocks(users, args.block)
    names = sorted(set(keys))
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(names), generator=gen).tolist()
    held = {names[i] for i in order[: max(1, len(names) // 10)]}
    train_rows = [i for i, k in enumerate(keys) if k not in held]
    val_rows = [i for i, k in enumerate(keys) if k in held]
    units = [keys[i] for i in train_rows]
    counts = [units.count(u) for u in dict.fromkeys(units)]
    q = args.users_per_step / len(counts)
    rows_per_step = q * sum(min(c, args.cap) for c in counts)
    return {
        "train": blocks[train_rows],
        "val": blocks[val_rows][: args.max_val],
        "units": units,
        "users": len(counts),
        "blocks_per_user": (min(counts), statistics.median(counts), max(counts)),
        "rows_per_step": rows_per_step,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--users", type=int, default=150, help="standard-library modules used")
    parser.add_argument("--record-bytes", type=int, default=384, help="bytes kept per record")
    parser.add_argument(
        "--user-records", type=int, default=24, help="definitions kept per module (user)"
    )
    parser.add_argument("--block", type=int, default=64, help="tokens (bytes) per block")
    parser.add_argument("--cap", type=int, default=8, help="blocks of one user per step")
    parser.add_argument("--users-per-step", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    parser.add_argument("--max-val", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per configuration (fresh noise; medians)"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    data = prepare(args)
    k = data["blocks_per_user"][2]
    delta = 1.0 / data["users"] ** 2
    lo, med, hi = data["blocks_per_user"]
    print(
        f"data: {data['users']} training users (modules), {int(data['train'].shape[0])} blocks "
        f"of {args.block} bytes (per user min/median/max {lo}/{med:g}/{hi}), "
        f"{int(data['val'].shape[0])} validation blocks of held-out users; "
        f"~{data['rows_per_step']:.0f} rows per step; target (ε, δ) = ({args.epsilon:g}, "
        f"{delta:.2g}) per user; largest group k = {k}",
        file=sys.stderr,
    )
    initial = val_loss(make_model(args.seed), data["val"])
    plans: list[tuple[str, tuple[float, float] | None]] = [
        ("user-level", (args.epsilon, delta)),
        ("group-privacy", group_privacy(args.epsilon, delta, k)),
        ("example-level", (args.epsilon, 1.0 / int(data["train"].shape[0]) ** 2)),
        ("non-private", None),
    ]
    repeats = [
        [run(kind, data, args, privacy) for kind, privacy in plans] for _ in range(args.repeats)
    ]
    results = [_median(list(runs)) for runs in zip(*repeats, strict=True)]
    print(f"\nvalidation loss before training: {initial:.4f} nats/token\n")
    print(f"medians over {args.repeats} runs of each configuration (fresh secure noise each)\n")
    print("| run | ε per user | σ | rows/step | val loss | gain kept | step (ms) | engine |")
    print("|---|---|---|---|---|---|---|---|")
    best = results[-1]["val_loss"]
    for r in results:
        per_user = {
            "user-level": f"{r['epsilon']:.3g}",
            "group-privacy": f"{args.epsilon:g} (via k = {k})",
            "example-level": f"{r['epsilon']:.3g} per block only",
            "non-private": "∞",
        }[r["run"]]
        gain = (initial - r["val_loss"]) / (initial - best) if initial > best else float("nan")
        print(
            f"| {r['run']} | {per_user} | {r['sigma']:.3g} | {r['rows_per_step']:.1f} | "
            f"{r['val_loss']:.4f} | {100 * gain:.0f} % | {r['step_ms']:.0f} | {r['engine']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"initial": initial, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
