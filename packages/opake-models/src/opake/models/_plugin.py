"""opake-models' plugin: registers its model families through the public hook."""

from __future__ import annotations

__all__: list[str] = []
