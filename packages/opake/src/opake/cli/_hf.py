"""Typed calls into the parts of ``transformers`` the CLI uses that it leaves unannotated."""

from __future__ import annotations

__all__ = ["quiet_transformers"]


def quiet_transformers() -> None:
    """Turn ``transformers``' progress bars off: the CLI's errors stay one line on stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated there
