"""Build hook: ship the benchmark scripts (``tools/bench/*.py``) with ``opake bench``.

The wheel holds them as package data, ``opake/cli/_bench_scripts/*.py``, where ``opake bench``
finds them when it is not run from a checkout; the sdist holds them as ``bench/*.py``, so a wheel
built from the sdist ships them too. An editable install reads the checkout's ``tools/bench``.

Every module of the folder ships: the benchmarks and their ``_*.py`` helper modules, which the
benchmarks import from their own folder (``opake bench`` lists and runs only the former). The
developer profilers of ``tools/profile`` (they reach into Opake's internals) never ship.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

#: where the scripts go in each build target
DESTINATIONS = {"wheel": "opake/cli/_bench_scripts", "sdist": "bench"}


def bench_source(root: Path) -> Path:
    """The scripts' folder: ``tools/bench`` of the checkout, else ``bench`` of an unpacked sdist."""
    for candidate in (root.parent.parent / "tools" / "bench", root / "bench"):
        if candidate.is_dir() and any(candidate.glob("*.py")):
            return candidate
    raise RuntimeError(
        f"no benchmark scripts beside {root}: build from an Opake checkout (tools/bench) or "
        "from an sdist of the opake distribution (bench/)"
    )


def shipped_files(source: Path, destination: str) -> dict[str, str]:
    """``{file: path in the archive}`` for every module (``*.py``) of the folder *source*."""
    return {str(script): f"{destination}/{script.name}" for script in sorted(source.glob("*.py"))}


class BenchScriptsHook(BuildHookInterface):  # type: ignore[type-arg]
    """Adds every ``*.py`` of the benchmark folder to the wheel or sdist being built."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        destination = DESTINATIONS.get(self.target_name)
        if destination is None or version == "editable":
            return
        source = bench_source(Path(self.root).resolve())
        build_data["force_include"].update(shipped_files(source, destination))
