"""The model side of an ``opake train`` run: build, patch, evaluate, the per-example loss,
the microbatch tuning, and the warnings the first steps are expected to give."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from opake.cli._models import load_model
from opake.core import ops
from opake.core.errors import OpakePrivacyWarning

if TYPE_CHECKING:
    import torch

    from opake.cli._memory import MicrobatchChoice
    from opake.cli._plan import RunPlan
    from opake.profiling import MemoryLine

_EVAL_BATCH = 64


def _evaluate(
    model: Any,
    val: torch.Tensor,
    device: torch.device,
    autocast: Any,
    forward_kwargs: dict[str, Any],
    *,
    labels: torch.Tensor | None = None,
) -> float:
    """The validation loss in nats per target token: every next token of a block, or the
    tokens *labels* does not mark -100 (post-training records)."""
    import torch

    was_training = model.training
    model.eval()
    total = 0.0
    count = 0
    with torch.no_grad(), autocast():
        for rows in torch.split(torch.arange(val.shape[0]), _EVAL_BATCH):
            x = val[rows].to(device)
            y = x if labels is None else labels[rows].to(device)
            tokens = int((y[:, 1:] != -100).sum())
            if not tokens:
                continue
            out = model(input_ids=x, labels=y, **forward_kwargs)
            total += float(out.loss) * tokens
            count += tokens
    model.train(was_training)
    return total / count


def _autocast_factory(precision: str, device: torch.device) -> Callable[[], Any]:
    import torch

    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device.type, dtype=dtype)


def _build_model(plan: RunPlan, device: torch.device) -> tuple[Any, Any, Any]:
    from opake.cli._hf import quiet_transformers

    s = plan.settings
    quiet_transformers()
    with warnings.catch_warnings():
        # peft and transformers deprecate each other's helpers; not the user's business
        warnings.simplefilter("ignore", FutureWarning)
        loaded = load_model(
            s.model,
            tokenizer=plan.tokenizer,
            block_size=s.block_size,
            lora_r=s.lora_r,
            lora_alpha=s.lora_alpha,
            seed=s.seed,
        )
    model = loaded.model.to(device)
    _check_positions(model, s.model)
    from opake.patches.runtime._hf import install_transformers_patch

    # transformers' checks of input values (GPT-2's padding warning) are skipped inside the
    # per-example transforms, whichever runtime patches this process holds (idempotent)
    install_transformers_patch()
    report = None
    if plan.patch:
        from opake.patches import apply_model_patches

        report = apply_model_patches(model, kernels=None if s.kernels == "auto" else s.kernels)
    if s.checkpointing:
        from opake.patches import apply_runtime_patches

        apply_runtime_patches()
        base: Any = model
        if s.lora_r is not None:
            from peft import PeftModel

            assert isinstance(model, PeftModel)  # load_model wraps it when LoRA is on
            base = model.get_base_model()
        kwargs = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return loaded, model, report


def _tune_microbatch(
    make: Callable[[int], Any],
    args: tuple[Any, ...],
    plan: RunPlan,
    *,
    device: torch.device,
    world_size: int,
    line: MemoryLine,
    available_gb: float | None,
    batch: Callable[[torch.Tensor], Any] | None = None,
) -> MicrobatchChoice:
    """``--microbatch auto``: the tuner over the sizes *line* puts within the limit
    (``--memory-budget``, else 80% of the available memory), largest first (*batch* builds
    the step's batch from the probe's token ids)."""
    import torch

    from opake.cli._memory import TUNE_FRACTION, MicrobatchChoice
    from opake.profiling import default_candidates, tune_microbatch

    budget = plan.settings.memory_budget
    # this rank's expected share of the global Poisson batch
    examples = max(1, math.ceil(plan.sample_rate * plan.dataset_size / world_size))
    # sizes whose estimated peak is beyond the budget are not tried: their step could exhaust
    # the machine's memory before the tuner measures it
    limit = budget
    if limit is None and available_gb is not None:
        limit = TUNE_FRACTION * available_gb
    sizes = [m for m in default_candidates(examples) if limit is None or line.peak_gb(m) <= limit]
    # random tokens of the real shape: memory and time do not depend on the values, and the
    # tuner never touches the private data
    probe = torch.randint(
        0,
        int(plan.train.max()) + 1,
        (examples, int(plan.train.shape[-1])),
        generator=torch.Generator().manual_seed(0),
    ).to(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        result = tune_microbatch(
            make,
            (*args, probe if batch is None else batch(probe)),
            batch_size=examples,
            device=device,
            memory_budget_gb=limit,
            candidates=sizes or [1],
            steps=1,
            warmup_steps=1,
            compare_smaller=0,
        )
    assert result.microbatch_size is not None
    m = result.microbatch_size
    skipped = (
        f"; sizes above {sizes[0]} skipped (estimated over {limit:.2f} GB)"
        if (sizes and sizes[0] < examples and limit is not None)
        else ""
    )
    reason = (
        f"--microbatch auto → {m}: the largest size the tuner measured within memory "
        f"({result.candidate(m).memory_peak_gb or 0.0:.2f} GB peak){skipped}; table in "
        "microbatch_tuning.txt"
    )
    return MicrobatchChoice(m, reason, line, limit, result.table())


def _zero_partner_lora_a(trainable: dict[str, torch.Tensor]) -> frozenset[str]:
    """LoRA ``A`` matrices whose ``B`` partner is all zeros (PEFT's initialisation).

    Their gradient is exactly zero until ``B`` moves, so the optimizer's first-step check
    ("all-zero gradient ... updated by noise alone") is expected for them, not a sign that they
    are unused: on the first step they do receive noise alone, which costs no privacy.
    """
    names = set()
    for name in trainable:
        if ".lora_A." in name:
            partner = trainable.get(name.replace(".lora_A.", ".lora_B."))
            if partner is not None and not bool(partner.count_nonzero()):
                names.add(name)
    return frozenset(names)


def _reemit(
    caught: list[warnings.WarningMessage], expected_zero: frozenset[str], names: Iterable[str]
) -> None:
    """Re-issue caught warnings, except a zero-gradient warning naming only *expected_zero*
    among the trainable *names*."""
    names = tuple(names)
    for item in caught:
        message = str(item.message)
        mentioned = {name for name in names if name in message}
        if (
            issubclass(item.category, OpakePrivacyWarning)
            and "all-zero gradient" in message
            and mentioned
            and mentioned <= expected_zero
        ):
            continue
        warnings.warn_explicit(item.message, item.category, item.filename, item.lineno)


def forward_options(patch_report: Any) -> dict[str, Any]:
    """Keyword arguments of every forward: no KV cache; the loss-only head where patched."""
    options: dict[str, Any] = {"use_cache": False}
    if patch_report is not None and ops.LINEAR_CROSS_ENTROPY in patch_report.kernels:
        options["loss_only"] = True  # the loss without materialising the logits
    return options


def per_example_loss(
    plan: RunPlan, fmodel: Any, forward_kwargs: dict[str, Any], autocast: Callable[[], Any]
) -> Callable[..., Any]:
    """The loss given to the clipped-gradient function: one example's loss (vmap engine), or a
    :class:`~opake.dpsgd.bookkeeping.BatchedLoss` (book-keeping where exact, else vmap)."""
    import torch

    from opake.dpsgd.bookkeeping import BatchedLoss, causal_lm_losses
    from opake.dpsgd.optimizer import autocast_loss

    def loss_fn(
        trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """The loss of ONE example (a block of token ids, no batch dimension)."""
        ids = x.unsqueeze(0)
        loss: torch.Tensor = fmodel(
            (trainable, frozen), input_ids=ids, labels=ids, **forward_kwargs
        ).loss
        return loss

    def batch_losses(
        trainable: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        """Per-example losses ``[B]`` of a batch, each over its own tokens only (fp32; the
        forward under bf16 autocast with ``--precision bf16``)."""
        with autocast():
            if forward_kwargs.get("loss_only"):
                # no logits at all: the book-keeping engine takes lm_head's per-example norms
                # from the chunked kernel's recorded loss, vocabulary tile by tile
                params = (trainable, frozen)
                out = fmodel(params, input_ids=x, labels=x, per_example_loss=True, **forward_kwargs)
                loss: torch.Tensor = out.loss.float()
                return loss
            out = fmodel((trainable, frozen), input_ids=x, use_cache=False)
            return causal_lm_losses(out.logits, x)

    precision = plan.settings.precision
    if plan.engine == "vmap":
        if precision == "fp32":
            return loss_fn
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        return autocast_loss(loss_fn, dtype, argnums=0)
    # one batched forward and backward per microbatch (book-keeping) where it is exact;
    # "auto" falls back to per-example vmap otherwise — the same clipped sum either way
    return BatchedLoss(batch_losses, fmodel)


def inner_optimizer(plan: RunPlan, model: Any) -> torch.optim.Optimizer:
    """The optimizer the DP step wraps (``--optimizer``, ``--lr``, ``--weight-decay``)."""
    import torch

    s = plan.settings
    params = [p for p in model.parameters() if p.requires_grad]
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.lr, momentum=0.9, weight_decay=s.weight_decay)
    if s.optimizer == "adam":
        return torch.optim.Adam(params, lr=s.lr, weight_decay=s.weight_decay)
    return torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay)


def _check_positions(model: Any, name: object) -> None:
    """Refuse a rotary embedding that depends on the batch's sequence length: rows are padded
    to the longest record, so one record would change every other record's gradient."""
    from opake.transformers import check_positions

    check_positions(model, f"--model {name}")
