"""The data and held-out metrics of ``post_training_demo.py`` (a helper module, not a benchmark).

Records come from Python's own documentation, ``pydoc_data.topics.topics`` (topic -> text,
shipped with Python): its prose paragraphs are cut into sentences (code blocks, grammar rules,
headings and interactive examples left out; a sentence found under several topics is kept once,
under the first topic in name order), and each sentence is **one record**, split in two at its
middle word:

* SFT: ``prompt`` = a short system message and the user's turn "In Python's documentation of
  <topic>: <first half>", ``completion`` = the assistant's turn, the rest of the sentence
  (TRL's conversational prompt/completion: the loss is on the completion only);
* DPO: the same prompt, ``chosen`` = the true rest, ``rejected`` = the rest of a sentence of a
  *different* topic, drawn (seeded) from the same side of the split.

The split is seeded and by record (a tenth held out). The held-out metrics are computed with
plain forward passes without gradient, on sequences tokenised as TRL does (the chat template of
the prompt, then of prompt + completion, the completion starting where the two diverge) and
truncated to ``max_length`` the same way (``keep_start``).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

SYSTEM = "Continue the sentence."
_HEADING = re.compile(r"[*=\-^~]{3,}")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"*])")
_WORD = re.compile(r"[A-Za-z][a-z]+[,.;:]?")


@dataclass(frozen=True)
class Record:
    """One sentence of topic *topic*: *head* (the prompt's half), *tail* (the true rest) and
    *rejected* (the rest of a sentence of another topic)."""

    topic: str
    head: str
    tail: str
    rejected: str


@dataclass(frozen=True)
class Split:
    """The records, seeded into training and held-out ones."""

    train: list[Record]
    held_out: list[Record]
    sentences: int


def _paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one topic, each on one line."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        lines = [line for line in lines if not _HEADING.fullmatch(line)]
        paragraph = " ".join(lines)
        if paragraph and ">>>" not in paragraph and "::=" not in paragraph:
            out.append(paragraph)
    return out


def sentences(min_words: int = 6, max_words: int = 48) -> list[tuple[str, str]]:
    """``(topic, sentence)`` for every prose sentence of the documentation topics, each sentence
    once: *min_words* to *max_words* words, ending with a full stop, mostly words (not code)."""
    import pydoc_data.topics

    seen: set[str] = set()
    found = []
    for topic, text in sorted(pydoc_data.topics.topics.items()):
        for paragraph in _paragraphs(text):
            for sentence in _SENTENCE_END.split(paragraph):
                words = sentence.removeprefix("* ").split()
                if not (min_words <= len(words) <= max_words and sentence.endswith(".")):
                    continue
                if sum(1 for w in words if _WORD.fullmatch(w)) < 0.6 * len(words):
                    continue
                joined = " ".join(words)
                if joined not in seen:
                    seen.add(joined)
                    found.append((topic, joined))
    return found


def _with_rejected(pairs: list[tuple[str, str, str]], rng: random.Random) -> list[Record]:
    """Each ``(topic, head, tail)`` with the tail of a random sentence of another topic."""
    records = []
    for topic, head, tail in pairs:
        while True:
            other_topic, _, other_tail = pairs[rng.randrange(len(pairs))]
            if other_topic != topic and other_tail != tail:
                break
        records.append(Record(topic, head, tail, other_tail))
    return records


def split_records(seed: int, held_out_fraction: float = 0.1) -> Split:
    """Every sentence as a record, shuffled (seeded) and split into training / held-out."""
    found = sentences()
    rng = random.Random(seed)
    pairs = []
    for topic, sentence in found:
        words = sentence.split()
        middle = len(words) // 2
        pairs.append((topic, " ".join(words[:middle]), " ".join(words[middle:])))
    rng.shuffle(pairs)
    cut = max(1, round(held_out_fraction * len(pairs)))
    held, train = pairs[:cut], pairs[cut:]
    return Split(_with_rejected(train, rng), _with_rejected(held, rng), len(found))


def prompt(record: Record) -> list[dict[str, str]]:
    """The conversational prompt of *record*: the system message and the user's turn."""
    user = f"In Python's documentation of {record.topic}: {record.head}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _turn(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def sft_row(record: Record) -> dict[str, Any]:
    """TRL's conversational prompt/completion record."""
    return {"prompt": prompt(record), "completion": _turn(record.tail)}


def dpo_row(record: Record) -> dict[str, Any]:
    """TRL's conversational preference record."""
    chosen, rejected = _turn(record.tail), _turn(record.rejected)
    return {"prompt": prompt(record), "chosen": chosen, "rejected": rejected}


# -- tokenisation and held-out scoring -----------------------------------------------------------


def _ids(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def encode(
    tokenizer: Any, record: Record, completion: str, max_length: int
) -> tuple[list[int], int, bool]:
    """``(ids, start, truncated)``: the prompt + *completion* tokens as TRL makes them, cut to
    *max_length* (``keep_start``), the completion starting at ``start``."""
    head = _ids(tokenizer, prompt(record), True)
    whole = _ids(tokenizer, prompt(record) + _turn(completion), False)
    start = 0
    while start < min(len(head), len(whole)) and head[start] == whole[start]:
        start += 1
    return whole[:max_length], start, len(whole) > max_length


def truncated(tokenizer: Any, records: list[Record], max_length: int, dpo: bool) -> tuple[int, int]:
    """``(truncated, dropped)``: how many of *records* are longer than *max_length* (for DPO:
    either sequence) and kept, and how many have no completion token left (TRL drops them)."""
    cut = dropped = 0
    for record in records:
        tails = (record.tail, record.rejected) if dpo else (record.tail,)
        encoded = [encode(tokenizer, record, tail, max_length) for tail in tails]
        if any(start >= max_length for _, start, _ in encoded):
            dropped += 1
        elif any(longer for _, _, longer in encoded):
            cut += 1
    return cut, dropped


def completion_log_probs(
    model: Any, rows: list[tuple[list[int], int, bool]], pad: int, batch: int = 16
) -> list[tuple[float, int]]:
    """``(sum of log-probabilities, tokens)`` of each row's completion under *model* (plain
    forward passes without gradient, right-padded batches)."""
    import torch

    out: list[tuple[float, int]] = []
    model.eval()
    with torch.no_grad():
        for first in range(0, len(rows), batch):
            chunk = rows[first : first + batch]
            width = max(len(ids) for ids, _, _ in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            target = torch.zeros(len(chunk), width, dtype=torch.bool)
            for i, (row, start, _) in enumerate(chunk):
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
                target[i, start : len(row)] = True
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            scored = target[:, 1:]
            sums = (logp * scored).sum(dim=1)
            out.extend(zip(sums.tolist(), scored.sum(dim=1).tolist(), strict=True))
    return out


def sft_loss(model: Any, rows: list[tuple[list[int], int, bool]], pad: int) -> float:
    """The mean over records of each record's mean NLL over its completion tokens."""
    scores = [(s, n) for s, n in completion_log_probs(model, rows, pad) if n]
    return sum(-s / n for s, n in scores) / max(1, len(scores))


@dataclass(frozen=True)
class Preference:
    """DPO's held-out metrics: ``accuracy`` (margin > 0) and the mean ``margin``."""

    accuracy: float
    margin: float


def preference(
    chosen: list[float], rejected: list[float], ref: tuple[list[float], list[float]], beta: float
) -> Preference:
    """The implicit reward margins β[(π(c) − ref(c)) − (π(r) − ref(r))] of held-out pairs."""
    margins = [
        beta * ((c - rc) - (r - rr))
        for c, r, rc, rr in zip(chosen, rejected, ref[0], ref[1], strict=True)
    ]
    n = max(1, len(margins))
    return Preference(sum(m > 0 for m in margins) / n, sum(margins) / n)
