"""Shared fixtures of the ``opake`` CLI tests: a small real corpus and a tiny-run command line."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 6 kB of real English text (the first pydoc topics), as a UTF-8 text file."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))[:6000]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def tiny_args(small_corpus, tmp_path):
    """Arguments of a run that takes a few seconds: tiny model, short blocks, few steps."""

    def make(*extra: str, out: Path | None = None) -> list[str]:
        return [
            "train",
            "--model",
            "llama-tiny",
            "--data",
            str(small_corpus),
            "--block-size",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--max-val-blocks",
            "16",
            "--no-progress",
            "--out",
            str(out or tmp_path / "run"),
            *extra,
        ]

    return make
