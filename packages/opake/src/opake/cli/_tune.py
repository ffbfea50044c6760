"""``opake tune``: the largest microbatch that fits, measured on a real model.

Runs :func:`opake.profiling.tune_microbatch` on the DP-SGD step ``opake train`` runs
(``clipped_grad`` over a causal LM, per-example ``vmap(grad)``), with random tokens of the
requested shape — memory and time do not depend on the token values, and no data is read. The
model is a named config built locally (default ``llama-tiny``) or a pretrained model: a local
Hugging Face directory, a GGUF file or a Hub id, as for ``opake train``.

>>> parser = build_parser()
>>> args = parser.parse_args(["--batch-size", "4", "--budget-gb", "2"])
>>> args.model, args.batch_size, args.seq_len, args.budget_gb
('llama-tiny', 4, 16, 2.0)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.cli._settings import TrainSettings
from opake.cli._sources import model_help
from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

    from opake.cli._models import LoadedModel
    from opake.dpsgd.clipping import ClippedGradFn, ClipState

__all__ = ["build_parser", "register", "run_tune"]

#: the default model of ``opake tune``: smaller than ``opake train``'s, so that a first sweep of
#: several sizes takes seconds
DEFAULT_MODEL = "llama-tiny"
TRAIN_DEFAULT_MODEL = TrainSettings.model
#: untimed steps per candidate before the timed ones
_WARMUP = 1


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=model_help(
            DEFAULT_MODEL,
            f"; opake train's default is {TRAIN_DEFAULT_MODEL}: pass --model "
            f"{TRAIN_DEFAULT_MODEL} to tune the model a default run trains",
        ),
    )
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        help="limit on each step's peak memory in GiB (default: CUDA/MPS none, real "
        "out-of-memory errors decide; CPU the current RSS plus 80%% of free memory)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda, cuda:N, mps, or auto (CUDA, then MPS, then CPU; default)",
    )
    p.add_argument(
        "--candidates",
        default=None,
        help="comma-separated microbatch sizes to try (default: the batch size halved down to 1)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=20,
        help=f"timed steps per candidate, after {_WARMUP} warm-up step (default 20)",
    )
    p.add_argument(
        "--compare-smaller",
        type=int,
        default=2,
        help="also measure this many sizes below the chosen one (default 2)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="clipping norm C (default 1.0)")
    p.add_argument("--lora-r", type=int, default=None, help="train LoRA adapters of this rank only")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of the sweep here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (default 0)")


def build_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of the ``tune`` arguments (the ``opake`` parser registers the same)."""
    p = argparse.ArgumentParser(prog="opake tune", description=__doc__.splitlines()[0])
    _add_arguments(p)
    return p


def _candidates(text: str | None, batch_size: int) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigurationError(
            f"--candidates {text!r}: expected comma-separated whole numbers such as 8,4,2"
        ) from None
    bad = [m for m in sizes if not 1 <= m <= batch_size]
    if not sizes or bad:
        raise ConfigurationError(
            f"--candidates {text!r}: expected sizes between 1 and --batch-size {batch_size}"
        )
    return sizes


def _check(args: argparse.Namespace) -> None:
    for flag, value, minimum in (
        ("--batch-size", args.batch_size, 1),
        ("--seq-len", args.seq_len, 2),
        ("--steps", args.steps, 1),
        ("--compare-smaller", args.compare_smaller, 0),
    ):
        if value < minimum:
            raise ConfigurationError(f"{flag} {value}: expected a whole number >= {minimum}")
    if args.budget_gb is not None and not (math.isfinite(args.budget_gb) and args.budget_gb > 0):
        raise ConfigurationError(
            f"--budget-gb {args.budget_gb}: expected a positive number of GiB (leave it out for "
            "the default)"
        )
    if not (math.isfinite(args.clip) and args.clip > 0):
        raise ConfigurationError(f"--clip {args.clip}: expected a positive clipping norm")
    if args.lora_r is not None and args.lora_r < 1:
        raise ConfigurationError(f"--lora-r {args.lora_r}: expected a positive rank")
    if args.plot is not None and Path(args.plot).suffix.lower() != ".png":
        raise ConfigurationError(f"--plot {args.plot}: expected a file name ending .png")


def run_tune(args: argparse.Namespace) -> dict[str, Any]:
    """Build the model and the step, run the tuner, print the table; returns the result dict."""
    _check(args)
    candidates = _candidates(args.candidates, args.batch_size)
    import torch

    from opake.cli._models import resolve_model
    from opake.cli._plan import resolve_device
    from opake.profiling import NoMicrobatchFitsError, tune_microbatch

    source, is_dir = resolve_model(args.model)  # a bad --model fails before anything is built
    device = resolve_device(args.device, auto=True)
    loaded = _load(args, source, is_dir=is_dir)
    model = loaded.model.to(device)
    make_grad_fn, trainable, frozen = _step_factory(model, args.clip)
    model_config: Any = model.config
    vocab = int(model_config.vocab_size)
    probe = torch.randint(
        0, vocab, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0)
    ).to(device)
    if not args.json:
        print(
            f"opake tune: {loaded.source} ({loaded.num_parameters:,} parameters, "
            f"{loaded.num_trainable:,} trainable), batch {args.batch_size} x {args.seq_len} "
            f"tokens on {device}, {_WARMUP} warm-up + {args.steps} timed step(s) per candidate "
            "(the table's steps column counts both)",
            flush=True,
        )
    try:
        result = tune_microbatch(
            make_grad_fn,
            (trainable, frozen, probe),
            batch_size=args.batch_size,
            device=device,
            memory_budget_gb=args.budget_gb,
            candidates=candidates,
            steps=args.steps,
            warmup_steps=_WARMUP,
            compare_smaller=args.compare_smaller,
            plot=args.plot,
        )
    except NoMicrobatchFitsError as err:
        if not args.json:
            print(err.result.table(), flush=True)
        raise
    out = result.to_dict()
    out["model"] = loaded.source
    out["seq_len"] = args.seq_len
    _print_result(args, result, out)
    return out


def _load(args: argparse.Namespace, source: str, *, is_dir: bool) -> LoadedModel:
    """The model of ``--model`` (random token ids: no tokenizer), its positions checked."""
    from opake.cli._hf import quiet_transformers
    from opake.cli._models import load_model

    quiet_transformers()  # errors stay one line on stderr
    if is_dir:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(source, local_files_only=True)
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and args.seq_len > limit:
            raise ConfigurationError(
                f"--seq-len {args.seq_len}: the model takes at most {limit} positions"
            )
    with warnings.catch_warnings():
        # peft and transformers deprecate each other's helpers; not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        return load_model(
            args.model,
            tokenizer=None,  # random token ids: no tokenizer needed
            block_size=args.seq_len,
            lora_r=args.lora_r,
            seed=args.seed,
        )


def _step_factory(model: Any, clip: float) -> tuple[Callable[[int], Any], Any, Any]:
    """``make_grad_fn(microbatch)`` (a clipped-gradient step of one example's causal-LM loss),
    and the trainable and frozen parameters it takes."""
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional

    fmodel, trainable, frozen = make_functional(model, partition_trainable=True)

    def loss_fn(
        trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        ids = x.unsqueeze(0)  # one example
        loss: torch.Tensor = fmodel(
            (trainable, frozen), input_ids=ids, labels=ids, use_cache=False
        ).loss
        return loss

    def make_grad_fn(microbatch: int) -> tuple[ClippedGradFn, ClipState]:
        return clipped_grad(
            loss_fn, argnums=0, clipping_norm=clip, batch_argnums=2, microbatch_size=microbatch
        )

    return make_grad_fn, trainable, frozen


def _print_result(args: argparse.Namespace, result: Any, out: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(result.table())
        print(
            "diagnostics (memory, time) describe random tokens of this shape, not your data; "
            "the microbatch size does not change the gradients or the privacy guarantee"
        )
        if args.plot is not None:
            print(f"plot written to {args.plot}")
    sys.stdout.flush()


def _run(args: argparse.Namespace) -> int:
    run_tune(args)
    return 0


def register(sub: Any) -> None:
    """Add the ``tune`` subcommand to the ``opake`` parser."""
    p = sub.add_parser(
        "tune",
        help="the largest DP-SGD microbatch that fits in memory, with time and peak per size",
        description=__doc__.splitlines()[0],
    )
    _add_arguments(p)
    p.set_defaults(run=_run)
