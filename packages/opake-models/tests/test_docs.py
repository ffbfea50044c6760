"""The family table in docs/guide/model-families.md is the specs' own description."""

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
    return (
        f"| `{spec.name}` | {types} | `{spec.layer}` | {spec.mlp.kind} | {norm} | "
        f"{spec.rope.kind} | {mask} | {head_text} |"
    )


def test_guide_table_matches_the_specs():
    if not GUIDE.exists():
        pytest.skip("docs/ is not part of this checkout (e.g. an sdist)")
    lines = set(GUIDE.read_text().splitlines())
    missing = [_row(family_spec(n)) for n in family_names() if _row(family_spec(n)) not in lines]
    assert not missing, "update docs/guide/model-families.md:\n" + "\n".join(missing)
