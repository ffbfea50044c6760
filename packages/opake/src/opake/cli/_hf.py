"""Typed calls into the parts of ``transformers`` the CLI uses that it leaves unannotated."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["quiet_transformers"]


def quiet_transformers() -> None:
    """Turn ``transformers``' progress bars off: the CLI's errors stay one line on stderr."""
    from transformers.utils import logging as hf_logging

    disable_progress_bar: Callable[[], None] = hf_logging.disable_progress_bar  # unannotated there
    disable_progress_bar()
