"""DP-SGD step time and peak memory per model family, with ``apply_model_patches`` vs without.

Every (family, mode) runs in a fresh Python process (its peak RSS is its own). The model is the
family's ``tiny_config`` scaled to a small CPU configuration (hidden 128, 2 layers, 4 heads,
intermediate 344, vocabulary 16384; the family's quirks — sliding windows, softcaps, logit
scales, tied heads — kept), built from the config with eager attention (no download). One DP
step: ``clipped_grad`` over all parameters (batch 8 × sequence 128 of random tokens, no padding,
microbatches of 4, C = 1) then ``DPOptimizer`` (σ = 1, AdamW). ``--warmup`` steps, then the
median of ``--steps`` timed steps, as wall time and as process CPU time (robust to other
processes sharing the machine), one intra-op thread.

- ``stock``: the unpatched model; the per-example loss is transformers' own (full logits).
- ``patched``: ``apply_model_patches(model)`` (automatic kernel selection: the ``chunked``
  backend on CPU) and ``loss_only=True``: RMSNorm and gated-MLP kernels, and the loss from
  ``linear_cross_entropy`` without the ``(tokens, vocab)`` logits. BERT (a classifier) has no
  loss-only path and no RMSNorm/gated MLP: only the compatibility patches apply.

``peak`` is the process's peak RSS; ``extra`` is that peak minus the RSS just before the first
step (the step's own working memory: per-example gradients, activations, logits).

    python tools/bench/model_families.py                       # every family, markdown table
    python tools/bench/model_families.py --families llama gpt2 --steps 5
    python tools/bench/model_families.py --json results.json

Results are recorded in docs/benchmarks.md ("Model families (opake-models)").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = ("stock", "patched")
SIZES = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 16384,
    "max_position_embeddings": 256,
}
GPT2_SIZES = {"n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 16384, "n_positions": 256}
BERT_SIZES = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
BATCH, SEQ, MICROBATCH = 8, 128, 4


def _config(family: str) -> dict[str, Any]:
    from opake.models import family_spec

    spec = family_spec(family)
    sizes = {"gpt2": GPT2_SIZES, "bert": BERT_SIZES}.get(family, SIZES)
    config = {**spec.tiny_config, **sizes}
    if "head_dim" in config:
        config["head_dim"] = 32
    return config


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(family: str, mode: str, steps: int, warmup: int) -> dict[str, Any]:
    """One (family, mode) measurement, in this process."""
    import torch

    torch.set_num_threads(1)
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional
    from opake.models import family_spec
    from opake.models.testing import tiny_model
    from opake.patches import apply_model_patches

    spec = family_spec(family)
    model: Any = tiny_model(family, **_config(family))
    patched = mode == "patched"
    report = apply_model_patches(model) if patched else None
    causal = spec.task == "causal_lm"
    fmodel, params = make_functional(model)
    n_params = sum(p.numel() for p in params.values())

    def loss_fn(p: dict[str, torch.Tensor], ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": ids[None], "labels": y[None]}
        if causal:
            kwargs["use_cache"] = False
            if patched:
                kwargs["loss_only"] = True
        loss: torch.Tensor = fmodel(p, **kwargs).loss
        return loss

    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    labels = ids if causal else torch.randint(0, int(model.config.num_labels), (BATCH,))
    grad_fn, state = clipped_grad(
        loss_fn, clipping_norm=1.0, batch_argnums=(1, 2), microbatch_size=MICROBATCH
    )
    optimizer = DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4),
        params,
        noise_multiplier=1.0,
        expected_batch_size=float(BATCH),
        seed=0,
    )
    before = _rss_bytes()
    walls, cpus = [], []
    for i in range(warmup + steps):
        wall, cpu = time.perf_counter(), time.process_time()
        _, state = optimizer.logical_step(grad_fn, params, [(ids, labels)], state=state)
        if i >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "family": family,
        "mode": mode,
        "params": n_params,
        "step_wall_s": statistics.median(walls),
        "step_cpu_s": statistics.median(cpus),
        "peak_rss_mib": peak / 2**20,
        "extra_rss_mib": (peak - before) / 2**20,
        "kernels": {op: use.backend for op, use in report.kernels.items()} if report else {},
    }


def run(families: list[str], steps: int, warmup: int) -> list[dict[str, Any]]:
    """Every (family, mode) in a fresh interpreter."""
    rows = []
    for family in families:
        for mode in MODES:
            cmd = [sys.executable, __file__, "--worker", family, mode]
            cmd += ["--steps", str(steps), "--warmup", str(warmup)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{family}/{mode} failed:\n{proc.stderr[-3000:]}")
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{family:8s} {mode:8s} done", file=sys.stderr)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per family, stock vs patched side by side."""
    by = {(r["family"], r["mode"]): r for r in rows}
    lines = [
        (
            "| family | params | step CPU s stock → patched | ratio | peak RSS MiB stock → "
            "patched | step extra MiB stock → patched | kernels (patched) |"
        ),
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for family in dict.fromkeys(r["family"] for r in rows):
        s, p = by[(family, "stock")], by[(family, "patched")]
        kernels = ", ".join(f"{op}={b}" for op, b in sorted(p["kernels"].items())) or "—"
        lines.append(
            f"| `{family}` | {s['params'] / 1e6:.2f} M | {s['step_cpu_s']:.2f} → "
            f"{p['step_cpu_s']:.2f} | {p['step_cpu_s'] / s['step_cpu_s']:.2f}× | "
            f"{s['peak_rss_mib']:.0f} → {p['peak_rss_mib']:.0f} | "
            f"{s['extra_rss_mib']:.0f} → {p['extra_rss_mib']:.0f} | {kernels} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=None, help="default: every family")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", default=None, help="also write the raw rows here")
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        family, mode = args.worker
        print(json.dumps(worker(family, mode, args.steps, args.warmup)))
        return 0
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    from opake.models import family_names

    families = args.families or list(family_names())
    unknown = sorted(set(families) - set(family_names()))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {list(family_names())}")
    rows = run(families, args.steps, args.warmup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    import torch
    import transformers

    print(
        f"batch {BATCH} x seq {SEQ}, microbatch {MICROBATCH}, {args.steps} steps after "
        f"{args.warmup} warm-up; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {platform.machine()} {os.cpu_count()} cores, 1 thread"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
