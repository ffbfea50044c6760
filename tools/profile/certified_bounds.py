"""What the proven clipping bounds cost on ordinary data: how far each certified bound exceeds
the computed norm, and how often the exact route runs.

    python tools/profile/certified_bounds.py                       # the DP-step benchmark model
    python tools/profile/certified_bounds.py --model smollm2 --batch 8 --seq 128
    python tools/profile/certified_bounds.py --model smollm2 --batch 4 --seq 512 --steps 1

Runs the documented path (``apply_model_patches(chunked_linear_cross_entropy=True)``, a
``BatchedLoss`` over the loss-only head, ``clipped_grad(engine="bookkeeping")``) on real text —
Python's own documentation (``pydoc_data.topics``), in the model's tokenizer for a pretrained
model, bytes modulo the vocabulary for the benchmark Llama — and records every leaf's bounds.
Per parameter kind (embedding/head, attention, MLP, norms) it prints the median and the largest
``bound / computed norm − 1`` over examples and steps, and the share of (example, parameter)
pairs that took the exact route. Recorded in docs/benchmarks.md ("What the proof costs").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the DP-step workload


def _kind(name: str) -> str:
    if "embed" in name or "lm_head" in name or "wte" in name:
        return "embedding / head"
    if "norm" in name:
        return "norms"
    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention"
    return "MLP"


def _text_ids(tok: Any, vocab: int, batch: int, seq: int, steps: int) -> list[Any]:
    import pydoc_data.topics

    import torch

    text = "\n".join(pydoc_data.topics.topics.values())
    need = batch * seq * steps
    if tok is not None:
        ids = tok(text[: need * 8], return_tensors="pt").input_ids[0][:need]
    else:
        ids = torch.tensor(list(text.encode()[:need]), dtype=torch.long) % vocab
    return list(ids.reshape(steps, batch, seq))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="smollm2, a .gguf file or an HF directory")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import torch
    from _dpsgd_workload import build, workload
    from _pretrained import resolve_model

    from opake.dpsgd.bookkeeping import BatchedLoss, _runner
    from opake.dpsgd.clipping import clipped_grad
    from opake.functional import make_functional
    from opake.patches import apply_model_patches

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = None
    label = args.model or "benchmark Llama (hidden 256, 4 layers, vocab 4096)"
    if args.model is not None:
        args.model = resolve_model(args.model)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    work = workload(args)
    model, _ = build("full", work)
    apply_model_patches(model, chunked_linear_cross_entropy=True)
    fmodel, params = make_functional(model)

    def losses(p: dict[str, Any], ids: Any) -> Any:
        out = fmodel(p, input_ids=ids, labels=ids, loss_only=True, per_example_loss=True)
        return out.loss

    records: list[Any] = []
    real = _runner.BookkeepingRunner.run

    def spy(self: Any, *a: Any, **kw: Any) -> Any:
        chunk = real(self, *a, **kw)
        records.append(chunk)
        return chunk

    _runner.BookkeepingRunner.run = spy  # type: ignore[method-assign]
    grad_fn, state = clipped_grad(
        BatchedLoss(losses, fmodel), clipping_norm=1.0, batch_argnums=(1,), engine="bookkeeping"
    )
    vocab = int(model.config.vocab_size)
    for ids in _text_ids(tok, vocab, work.batch, work.seq, args.steps):
        records.clear()
        grad_fn(params, ids, state=state)
        out: dict[str, Any] = {}
        for chunk in records:
            _summarise(list(params), chunk, out)
        for kind, (excess, exact, pairs) in out.items():
            _TOTAL.setdefault(kind, ([], 0, 0))
            e, x, n = _TOTAL[kind]
            _TOTAL[kind] = (e + excess, x + exact, n + pairs)
    print(f"{label}, batch {work.batch} × {work.seq}, {args.steps} step(s) of real text")
    print("| parameters | bound ÷ computed norm − 1: median | largest | exact route |")
    print("|---|---|---|---|")
    for kind, (excess, exact, pairs) in sorted(_TOTAL.items()):
        print(
            f"| {kind} | {statistics.median(excess):.1e} | {max(excess):.1e} | {exact} of {pairs} |"
        )
    return 0


_TOTAL: dict[str, tuple[list[float], int, int]] = {}


def _summarise(names: list[str], chunk: Any, out: dict[str, Any]) -> None:
    """Add one chunk's leaves: bound ÷ computed norm − 1 (after the exact route) and the exact
    route's (example, parameter) pairs, by parameter kind."""
    for j, name in enumerate(names):
        kind = _kind(name)
        excess, exact, pairs = out.setdefault(kind, ([], 0, 0))
        computed = chunk.leaf_sq[:, j].sqrt()
        keep = computed > 0
        ratio = (chunk.clip_sq[:, j].sqrt()[keep] / computed[keep] - 1.0).tolist()
        routed = 0 if chunk.exact is None else int(chunk.exact[:, j].sum())
        out[kind] = (excess + ratio, exact + routed, pairs + int(keep.sum()))


if __name__ == "__main__":
    sys.exit(main())
