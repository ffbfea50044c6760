"""``dpsgd_step.py --check``: each private method's clipped sum against a per-example loop.

On a smaller Llama (:data:`CHECK_CONFIG`, batch 4 × 16) with C set to the median per-example
gradient norm, a method's clipped sum (before noise) must match ``Σ_i min(1, C/‖g_i‖) g_i`` from
a Python loop of plain autograd to 1e-4 relative, for every trainable parameter.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

from _dpsgd_methods import method_step
from _dpsgd_runs import collect, header, print_baseline_ratios
from _dpsgd_workload import CHECK_BATCH, CHECK_CONFIG, CHECK_SEQ, Workload, build

TOLERANCE = 1e-4


def reference(mode: str, work: Workload) -> tuple[list[dict[str, Any]], list[float]]:
    """Per-example gradients by a Python loop of plain autograd (batches of one), and norms."""
    import torch

    model, ids = build(mode, work)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    grads, norms = [], []
    for i in range(work.batch):
        x = ids[i : i + 1]
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        g = torch.autograd.grad(loss, [p for _, p in named])
        grads.append({name: t.double() for (name, _), t in zip(named, g, strict=True)})
        norms.append(math.sqrt(sum(float(t.double().square().sum()) for t in g)))
    return grads, norms


def check_one(mode: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The method's clipped sum (no noise) against Σ_i min(1, C/‖g_i‖) g_i from a loop."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    base = Workload(CHECK_CONFIG, CHECK_BATCH, CHECK_SEQ, 1.0, model=args.model)
    grads, norms = reference(mode, base)
    clip = statistics.median(norms)  # half the examples are clipped, half are not
    work = Workload(CHECK_CONFIG, CHECK_BATCH, CHECK_SEQ, clip, model=args.model)
    ref = {
        name: sum(min(1.0, clip / n) * g[name] for g, n in zip(grads, norms, strict=True))
        for name in grads[0]
    }
    model, ids = build(mode, work)
    _, clipped = method_step(method, model, ids, args, work)
    if clipped is None:
        raise SystemExit(f"{method}: no clipped sum to check")
    got = {name: t.double() for name, t in clipped().items()}
    missing = sorted(set(ref) - set(got))
    diff = sum((got[k] - ref[k]).square().sum() for k in ref if k in got)
    total = sum(r.square().sum() for r in ref.values())
    worst = max(
        (float((got[k] - ref[k]).norm() / ref[k].norm().clamp(min=1e-30)), k)
        for k in ref
        if k in got
    )
    return {
        "mode": mode,
        "method": method,
        "clip": clip,
        "norms": norms,
        "params": len(ref),
        "missing": missing,
        "rel_diff": float(torch.sqrt(diff / total)),
        "worst_param_rel_diff": worst[0],
        "worst_param": worst[1],
    }


def report_checks(args: argparse.Namespace) -> int:
    """Check every private method of ``--methods``; exit status 1 if one is off or missing."""
    methods = [m for m in args.methods if m != "nonprivate"]
    runs, notes = collect([(mode, m) for mode in args.modes for m in methods], args)
    header(args)
    model = args.model_label or f"Llama {CHECK_CONFIG}"
    print(
        f"clipped sum (no noise) vs a per-example autograd loop: {model}, "
        f"batch {CHECK_BATCH} × {CHECK_SEQ}, C = median per-example norm"
    )
    print()
    print("| mode | method | C | parameters | missing | rel. diff (all) | worst parameter |")
    print("|---|---|---:|---:|---:|---:|---|")
    bad = bool(notes)
    results = []
    for (mode, method), rounds in runs.items():
        r = rounds[0]
        results.append(r)
        bad |= bool(r["missing"]) or r["rel_diff"] > TOLERANCE
        print(
            f"| {mode} | {method} | {r['clip']:.4g} | {r['params']} | {len(r['missing'])} | "
            f"{r['rel_diff']:.1e} | {r['worst_param_rel_diff']:.1e} (`{r['worst_param']}`) |"
        )
    print_baseline_ratios(results)
    for note in notes:
        print(f"\n- {note}")
    if args.json:
        args.json.write_text(json.dumps({"checks": results, "notes": notes}, indent=2))
    return 1 if bad else 0
