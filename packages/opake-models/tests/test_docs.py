"""The family tables in docs/guide/model-families.md are the specs' own description."""

from __future__ import annotations

from pathlib import Path

import pytest

from opake.models import CausalLMHead, FamilySpec, family_names, family_spec

GUIDE = Path(__file__).resolve().parents[3] / "docs" / "guide" / "model-families.md"


def _row(spec: FamilySpec) -> str:
    head = spec.head
    if isinstance(head, CausalLMHead):
        parts = [f"`{head.lm_head}`", "tied" if head.tied else "untied"]
        if head.logit_scale:
            parts.append(f"× `{head.logit_scale}`")
        if head.logit_divisor:
            parts.append(f"÷ `{head.logit_divisor}`")
        if head.final_softcap:
            parts.append(f"softcap `{head.final_softcap}`")
        head_text = ", ".join(parts)
    else:
        head_text = f"classifier `{head.classifier}`"
    mask = spec.attention.mask
    if spec.attention.sliding_window:
        mask += f", sliding `{spec.attention.sliding_window}`"
        if spec.attention.layer_types:
            mask += " per layer type"
    norm = "RMSNorm" if spec.norm.kind == "rms" else "LayerNorm"
    norm += f" {spec.norm.placement}" + (" (1 + w)" if spec.norm.offset else "")
    types = ", ".join(f"`{t}`" for t in spec.model_types)
    mlp = spec.mlp.kind if spec.mlp is not None else "—"
    if spec.moe is not None:
        mlp = f"MoE `{spec.moe.block}`" + ("" if spec.mlp is None else f" + {spec.mlp.kind}")
    return (
        f"| `{spec.name}` | {types} | `{spec.layer}` | {mlp} | {norm} | "
        f"{spec.rope.kind} | {mask} | {head_text} |"
    )


def _support_row(spec: FamilySpec) -> str:
    """family | engines | loss-only head | kernels | notes — what the adapter does for it."""
    moe = spec.moe
    frozen = spec.bookkeeping_frozen
    if moe is None:
        engines = "vmap, book-keeping"
    else:
        rules = ["`fused_experts`"]
        if spec.attention.sinks and not any("sinks" in part for part in frozen):
            rules.append("`attention_sinks`")
        plural = "rules" if len(rules) > 1 else "rule"
        engines = f"vmap (dense experts), book-keeping ({', '.join(rules)} {plural})"
    if frozen:
        engines += " with " + ", ".join(f"`{part}`" for part in frozen) + " frozen"
    head = spec.head
    if isinstance(head, CausalLMHead):
        loss_only = "yes, " + ("tied" if head.tied else "untied") + " by default"
    else:
        loss_only = "no (classifier)"
    kernels = []
    if spec.norm.kind == "rms":
        kernels.append("rms_norm")
    if spec.mlp is not None and spec.mlp.gated:
        kernels.append(spec.mlp.kind)
    if isinstance(head, CausalLMHead):
        kernels.append("linear_cross_entropy")
    attention = spec.attention
    notes = []
    if attention.sliding_window:
        notes.append("sliding window" + (" per layer type" if attention.layer_types else ""))
    if attention.linear:
        notes.append(f"linear attention `{attention.linear}`")
    if attention.qk_norm:
        notes.append("QK-norm")
    if attention.sinks:
        notes.append("attention sinks")
    if attention.softcap:
        notes.append("attention softcap")
    if spec.rope.partial:
        notes.append("partial RoPE")
    if spec.rope.skip:
        notes.append(f"no RoPE on `{spec.rope.skip}`")
    if moe is not None:
        notes.append(f"{moe.routing} routing")
        if moe.router_input_ids:
            notes.append("hash routing (token ids) on some layers")
        if moe.shared:
            notes.append("shared expert" + (" (gated)" if moe.shared_gate else ""))
        if moe.aux_loss:
            notes.append("per-example aux loss")
    return (
        f"| `{spec.name}` | {engines} | {loss_only} | {', '.join(kernels) or '—'} | "
        f"{', '.join(notes) or '—'} |"
    )


@pytest.mark.parametrize("row", [_row, _support_row])
def test_guide_tables_match_the_specs(row):
    if not GUIDE.exists():
        pytest.skip("docs/ is not part of this checkout (e.g. an sdist)")
    lines = set(GUIDE.read_text().splitlines())
    missing = [row(family_spec(n)) for n in family_names() if row(family_spec(n)) not in lines]
    assert not missing, "update docs/guide/model-families.md:\n" + "\n".join(missing)
