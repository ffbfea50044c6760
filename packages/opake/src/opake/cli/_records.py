"""Post-training records for ``opake train``: what a JSONL file holds, and its rows.

``--data FILE.jsonl`` is read by the kind of its first record:

- ``text`` (``--text-field``): language modelling on blocks, as for a text file;
- ``messages`` (a conversation): SFT through the model's chat template, the loss on the
  assistant turns only;
- ``prompt`` + ``completion`` (strings, or lists of messages for the chat template): SFT, the
  loss on the completion only;
- ``prompt`` + ``chosen`` + ``rejected``: DPO, only with ``--objective dpo`` (never chosen
  for you: it is another objective, with its own β and reference model).

Each SFT record is one row, each preference record two (prompt + chosen, prompt + rejected);
``labels`` are -100 on every token that is not a target (the prompt, other turns, padding), so
prompt tokens get no gradient. A record is one example, the privacy unit, whatever its length:
rows longer than ``--block-size`` tokens are cut on their own (keeping their start) and counted;
a record left without a target token is dropped and counted. Records are never packed.

The completion starts where the tokens of the prompt alone (a conversation's turns so far, with
the generation prompt) and of the whole record diverge (TRL's rule): a token merged across the
boundary is a target, every token the prompt shares with the record is not.

>>> common_prefix([1, 2, 3], [1, 2, 4, 5])
2
>>> targets_of([5, 6, 7, 8], [0, 0, 1, 1])
[-100, -100, 7, 8]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opake.core.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_BETA",
    "KINDS",
    "OBJECTIVES",
    "PostTraining",
    "Rows",
    "check_objective",
    "check_post",
    "common_prefix",
    "cut_rows",
    "detect_kind",
    "post_baseline",
    "read_rows",
    "targets_of",
]

#: ``--objective`` choices: ``auto`` follows the records (never to DPO)
OBJECTIVES = ("auto", "sft", "dpo")
#: record kinds, as the plan names them
KINDS = {
    "text": "text",
    "messages": "`messages`",
    "prompt-completion": "`prompt`/`completion`",
    "preference": "`prompt`/`chosen`/`rejected`",
}
#: β of DPO when ``--dpo-beta`` is not given (TRL's default)
DEFAULT_BETA = 0.1

_IGNORE = -100


def check_objective(settings: Any) -> None:
    """``--objective`` and ``--dpo-beta`` against the other options (no data needed)."""
    objective = settings.objective
    if objective not in OBJECTIVES:
        raise ConfigurationError(
            f"--objective {objective!r}: expected one of {', '.join(OBJECTIVES)}"
        )
    beta = settings.dpo_beta
    if beta is not None and objective != "dpo":
        raise ConfigurationError(
            f"--dpo-beta {beta:g} without --objective dpo: β weighs DPO's preference loss; "
            "pass --objective dpo, or drop --dpo-beta"
        )
    if beta is not None and not (beta > 0 and math.isfinite(beta)):
        raise ConfigurationError(f"--dpo-beta {beta}: expected a finite number > 0")
    if objective == "auto":
        return
    data = settings.data or "pydoc"
    if not data.lower().endswith(".jsonl"):
        raise ConfigurationError(
            f"--objective {objective} needs a JSONL file of records (--data FILE.jsonl); "
            f"{data} is text: leave --objective out to train a language model on it"
        )
    if settings.privacy_unit is not None:
        raise ConfigurationError(
            f"--objective {objective} with --privacy-unit {settings.privacy_unit}: each "
            "record is the privacy unit of SFT and DPO; drop --privacy-unit"
        )


def _kind_of(record: Any, text_field: str) -> str | None:
    if not isinstance(record, dict):
        return None
    if "chosen" in record or "rejected" in record:
        return "preference"
    if "messages" in record:
        return "messages"
    if "prompt" in record or "completion" in record:
        return "prompt-completion"
    return "text" if text_field in record else None


def detect_kind(path: Path, text_field: str) -> str:
    """The kind of the first record of the JSONL file *path* (:data:`KINDS`)."""
    from opake.cli._data import json_records

    for lineno, record in json_records(path):
        kind = _kind_of(record, text_field)
        if kind is None:
            raise ConfigurationError(
                f"--data {path}: line {lineno} is none of the records opake train reads: "
                f'{{"{text_field}": ...}} (--text-field), {{"messages": [...]}}, '
                '{"prompt": ..., "completion": ...} or, with --objective dpo, '
                '{"prompt": ..., "chosen": ..., "rejected": ...}'
            )
        return kind
    return "text"  # no record: the text reader says the corpus is empty


def check_post(post: PostTraining, *, precision: str, dropout: bool) -> None:
    """What SFT and DPO records cannot train with: fp16 (the losses apply no per-example loss
    scale) and, for DPO, active dropout."""
    if precision == "fp16":
        raise ConfigurationError(
            f"--precision fp16 with {KINDS[post.kind]} records: {post.objective.upper()}'s "
            "per-example losses apply no fp16 loss scale; use --precision bf16 (or fp32)"
        )
    if dropout and post.objective == "dpo":
        raise ConfigurationError(
            "--objective dpo with the model's dropout active: each pair's weight comes from a "
            "forward without gradient and its gradient from a second forward, which would draw "
            "different dropout masks; pass --no-dropout"
        )


def post_baseline(post: PostTraining, val_labels: torch.Tensor | None, vocab: int) -> float:
    """What the validation loss is compared with: the unigram cross-entropy of the validation
    records' target tokens (SFT), or ln 2, the DPO loss of the starting model (DPO)."""
    from opake.cli._data import unigram_entropy

    if post.objective == "dpo":
        return math.log(2.0)
    assert val_labels is not None
    targets = val_labels[:, 1:]
    return unigram_entropy(targets[targets != _IGNORE], vocab)


@dataclass(frozen=True)
class PostTraining:
    """What the plan says about post-training records (counts of the data: not private).

    Attributes:
        kind: the records' kind (:data:`KINDS`).
        objective: ``"sft"`` or ``"dpo"``.
        beta: DPO's β (``None`` for SFT).
        records: records read.
        truncated: records with a row cut to ``max_length`` tokens (and kept).
        dropped: records left without a target token after the cut.
        max_length: ``--block-size``, the most tokens of a row.
        chat: whether the rows went through the model's chat template.
    """

    kind: str
    objective: str
    beta: float | None
    records: int
    truncated: int
    dropped: int
    max_length: int
    chat: bool

    @property
    def rows_per_record(self) -> int:
        """Rows of the forward one record is: 2 for a preference pair, else 1."""
        return 2 if self.objective == "dpo" else 1

    def describe(self) -> str:
        """The plan's ``objective`` line (without its label)."""
        cut = (
            f"{self.truncated} of {self.records} records truncated to {self.max_length} tokens "
            f"(--block-size), {self.dropped} dropped (no target token left)"
        )
        if self.objective == "dpo":
            return (
                f"dpo (β = {self.beta:g}) against the starting model (its log-probabilities of "
                "every record, computed once before the first step); a record's chosen and "
                "rejected rows are clipped together as one privacy unit; " + cut
            )
        turns = "the assistant turns" if self.kind == "messages" else "the completion"
        return (
            f"sft: loss on {turns} only (prompt tokens get no gradient), one record one row, "
            "never packed; " + cut
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``summary.json``)."""
        return {
            "kind": self.kind,
            "objective": self.objective,
            "beta": self.beta,
            "records": self.records,
            "truncated_records": self.truncated,
            "dropped_records": self.dropped,
            "max_length": self.max_length,
            "chat_template": self.chat,
        }


@dataclass(frozen=True)
class Rows:
    """Tokenised records: each record's rows (one, or chosen and rejected) of token ids and
    their labels, uncut and unpadded, with the line they came from."""

    ids: list[list[list[int]]]
    labels: list[list[list[int]]]
    lines: list[int]
    chat: bool


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens *a* and *b* share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def targets_of(ids: Sequence[int], mask: Sequence[int]) -> list[int]:
    """``labels``: each token id where *mask* is 1, -100 elsewhere."""
    return [t if m else _IGNORE for t, m in zip(ids, mask, strict=True)]


Render = Callable[[list[dict[str, str]], bool], list[int]]


def _renderer(tokenizer: Any, encode: Callable[[str], list[int]], spec: str) -> Render:
    """Token ids of a conversation through the tokenizer's chat template (with the generation
    prompt when asked)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigurationError(
            f"--model {spec}: its tokenizer has no chat template, which conversations (messages) "
            "need; use a model whose tokenizer has one (chat_template in tokenizer_config.json), "
            "or give prompt/completion records as plain strings"
        )

    def render(messages: list[dict[str, str]], generation: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation
        )
        return encode(str(text))

    return render


class _Reader:
    """Tokenises one kind of record into rows and target masks."""

    def __init__(
        self,
        path: Path,
        kind: str,
        encode: Callable[[str], list[int]],
        eos: int | None,
        render: Callable[[], Render],
    ) -> None:
        self.path, self.kind, self.encode, self.eos = path, kind, encode, eos
        self._make_render = render
        self._render: Render | None = None
        self.chat = False

    def fail(self, lineno: int, what: str) -> ConfigurationError:
        return ConfigurationError(f"--data {self.path}: line {lineno}: {what}")

    def render(self, messages: list[dict[str, str]], generation: bool, lineno: int) -> list[int]:
        if self._render is None:
            self._render = self._make_render()
        self.chat = True
        try:
            return self._render(messages, generation)
        except ConfigurationError:
            raise
        except Exception as err:  # the template's own errors (jinja2, raise_exception)
            raise self.fail(lineno, f"the chat template refused the conversation ({err})") from err

    def messages(self, value: Any, field: str, lineno: int) -> list[dict[str, str]]:
        ok = isinstance(value, list) and all(
            isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content"))
            for m in value
        )
        if not ok:
            raise self.fail(
                lineno,
                f"{field!r} must be a list of messages like "
                '{"role": "user", "content": "..."} (text content only)',
            )
        return list(value)

    def conversation(self, record: dict[str, Any], lineno: int) -> tuple[list[int], list[int]]:
        """``messages``: the whole conversation, the assistant turns as targets."""
        messages = self.messages(record["messages"], "messages", lineno)
        full = self.render(messages, False, lineno)
        mask = [0] * len(full)
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = common_prefix(self.render(messages[:i], True, lineno), full)
            end = common_prefix(self.render(messages[: i + 1], False, lineno), full)
            mask[start:end] = [1] * max(0, end - start)
        if not any(mask):
            raise self.fail(lineno, "the conversation has no assistant turn to train on")
        return full, mask

    def completed(
        self, record: dict[str, Any], field: str, lineno: int
    ) -> tuple[list[int], list[int]]:
        """``prompt`` + *field* (``completion``, ``chosen`` or ``rejected``): one row, the
        tokens after the prompt as targets."""
        prompt, completion = record.get("prompt"), record.get(field)
        if isinstance(prompt, str) and isinstance(completion, str):
            full = self.encode(prompt + completion)
            full = full + ([] if self.eos is None else [self.eos])
            start = common_prefix(self.encode(prompt), full)
        elif isinstance(prompt, list) and isinstance(completion, list):
            head = self.messages(prompt, "prompt", lineno)
            full = self.render(head + self.messages(completion, field, lineno), False, lineno)
            start = common_prefix(self.render(head, True, lineno), full)
        else:
            raise self.fail(
                lineno,
                f"expected 'prompt' and {field!r} both strings, or both lists of messages; got "
                f"{type(prompt).__name__} and {type(completion).__name__}",
            )
        return full, [0] * start + [1] * (len(full) - start)

    def rows(self, record: Any, lineno: int) -> list[tuple[list[int], list[int]]]:
        """The record's rows (ids, target mask)."""
        kind = _kind_of(record, "\0")
        if kind != self.kind:
            raise self.fail(
                lineno,
                f"a {KINDS.get(kind or '', 'unknown')} record in a file of {KINDS[self.kind]} "
                "records (line 1's kind); one kind of record per file",
            )
        assert isinstance(record, dict)
        if kind == "messages":
            return [self.conversation(record, lineno)]
        if kind == "prompt-completion":
            return [self.completed(record, "completion", lineno)]
        return [self.completed(record, field, lineno) for field in ("chosen", "rejected")]


def read_rows(
    path: Path,
    kind: str,
    *,
    tokenizer: Any,
    encode: Callable[[str], list[int]],
    eos: int | None,
    model: str,
) -> Rows:
    """Tokenise every record of *path* (all of *kind*) into rows and labels, uncut."""
    from opake.cli._data import json_records

    reader = _Reader(path, kind, encode, eos, lambda: _renderer(tokenizer, encode, model))
    ids: list[list[list[int]]] = []
    labels: list[list[list[int]]] = []
    lines: list[int] = []
    try:
        for lineno, record in json_records(path):
            rows = reader.rows(record, lineno)
            ids.append([row for row, _ in rows])
            labels.append([targets_of(row, mask) for row, mask in rows])
            lines.append(lineno)
    except UnicodeDecodeError as err:
        raise ConfigurationError(
            f"--data {path}: not UTF-8 text ({err.reason} at byte {err.start}); convert it to UTF-8"
        ) from None
    return Rows(ids, labels, lines, reader.chat)


def cut_rows(
    rows: Rows, *, max_length: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Each record's rows cut to *max_length* tokens (keeping their start) and right-padded
    with *pad* to the longest kept row (labels -100 there); a record with a row left without a
    target token is dropped. Returns ids and labels ``[records, rows, length]`` and how many
    records were truncated and dropped."""
    import torch

    kept: list[tuple[list[list[int]], list[list[int]]]] = []
    truncated = dropped = 0
    for ids, labels in zip(rows.ids, rows.labels, strict=True):
        cut = [row[:max_length] for row in labels]
        # the first token is never predicted: a target needs a position after it
        if any(all(t == _IGNORE for t in row[1:]) for row in cut):
            dropped += 1
            continue
        truncated += any(len(row) > max_length for row in ids)
        kept.append(([row[:max_length] for row in ids], cut))
    length = max([2, *(len(row) for ids, _ in kept for row in ids)])
    per = len(rows.ids[0]) if rows.ids else 1
    out_ids = torch.full((len(kept), per, length), pad, dtype=torch.long)
    out_labels = torch.full((len(kept), per, length), _IGNORE, dtype=torch.long)
    for i, (ids, labels) in enumerate(kept):
        for j, (row, target) in enumerate(zip(ids, labels, strict=True)):
            out_ids[i, j, : len(row)] = torch.tensor(row, dtype=torch.long)
            out_labels[i, j, : len(target)] = torch.tensor(target, dtype=torch.long)
    return out_ids, out_labels, truncated, dropped
