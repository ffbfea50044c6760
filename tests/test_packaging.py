"""Packaging facts are kept in one place each and checked, not copied by hand.

- a distribution's version lives in its ``_version.py`` (``pyproject.toml`` reads it);
- every ``opake-*`` requirement names a distribution of this repository, and the development
  install (``requirements/dev.txt``) installs every distribution by local path, so pip never
  resolves an ``opake-*`` name from the package index (unrelated distributions use such names);
- a third-party dependency has one version range across every ``pyproject.toml`` and the
  development requirements (whose exact pins must satisfy it), and the range a model family
  declares at run time is the one its distribution requires.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DISTS = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())


def _pyproject(dist: str) -> dict:
    with open(ROOT / "packages" / dist / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _requirements(dist: str) -> list[Requirement]:
    project = _pyproject(dist)["project"]
    reqs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def _dev_lines() -> list[str]:
    lines = (ROOT / "requirements" / "dev.txt").read_text().splitlines()
    return [line.split("#", 1)[0].strip() for line in lines if line.split("#", 1)[0].strip()]


@pytest.mark.parametrize("dist", DISTS)
def test_version_has_one_source(dist):
    data = _pyproject(dist)
    assert "version" not in data["project"], "the version lives in _version.py only"
    assert "version" in data["project"]["dynamic"]
    path = ROOT / "packages" / dist / data["tool"]["hatch"]["version"]["path"]
    tree = ast.parse(path.read_text())
    (value,) = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and node.targets[0].id == "__version__"
    ]
    assert metadata.version(dist) == value, f"reinstall {dist}: its metadata is stale"


@pytest.mark.parametrize("dist", DISTS)
def test_metadata_is_complete(dist):
    project = _pyproject(dist)["project"]
    for key in ("description", "readme", "license", "requires-python", "classifiers"):
        assert project.get(key), f"{dist}: [project] {key} is missing"
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "packages" / dist / project["readme"]).exists()


def test_every_opake_requirement_is_local_and_installed_by_path():
    dev = _dev_lines()
    for dist in DISTS:
        assert any(
            line.startswith("-e ") and Path(line[3:].split("[")[0]).name == dist for line in dev
        ), f"requirements/dev.txt must install {dist} by path (-e ./packages/{dist})"
        for req in _requirements(dist):
            if req.name.startswith("opake"):
                assert req.name in DISTS, f"{dist} requires {req}, not a distribution here"
    assert not [line for line in dev if line.startswith("opake")], (
        "an opake-* name in requirements/dev.txt would be resolved from the index"
    )


def test_third_party_ranges_agree_everywhere():
    ranges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for dist in DISTS:
        for req in _requirements(dist):
            if not req.name.startswith("opake"):
                ranges[req.name][str(req.specifier)].append(dist)
    for name, found in ranges.items():
        assert len(found) == 1, f"{name} has different ranges: {dict(found)}"
    for line in _dev_lines():
        if line.startswith("-"):
            continue
        req = Requirement(line)
        if req.name not in ranges:
            continue
        (spec,) = ranges[req.name]
        pinned = [s.version for s in req.specifier if s.operator == "=="]
        if pinned:
            assert Requirement(f"{req.name}{spec}").specifier.contains(pinned[0]), line
        else:
            assert str(req.specifier) == spec, f"requirements/dev.txt: {line} vs {spec}"


def test_model_families_declare_the_range_their_distribution_requires():
    from opake.models import _plugin, _spec

    (transformers,) = [r for r in _requirements("opake-models") if r.name == "transformers"]
    assert Requirement(_plugin.REQUIRES) == transformers
    default = _spec.FamilySpec.__dataclass_fields__["requires"].default
    assert Requirement(default) == transformers
