"""Honest validation for sources without a published split: split by file name, or hold out whole documents.

Two rules, applied in this order to a local file or directory:

1. **Split by name** (a directory; the ``datasets`` keywords): a file whose name, or a folder below the directory whose
   name, holds ``train``/``training``, ``validation``/``valid``/``val``/``dev`` or ``test``/``testing``/``eval``/``evaluation``
   as a word (``train.jsonl``, ``wiki.validation.txt``, ``val/part-0.txt``) belongs to that split. When any file names a
   split, files naming none are not read. Validation is the ``validation`` files, else the ``test`` files.
2. **Hold out** otherwise: a seeded ``HOLDOUT_FRACTION`` of whole documents (at least one, ``HOLDOUT_SEED`` fixed so
   every run on the same text validates on the same documents, whatever its ``--seed``) is validation, the rest is
   training; training never sees a held-out document. A source of fewer than ``MIN_DOCUMENTS`` documents (a book as
   one .txt file) is first cut into documents at blank lines: consecutive paragraphs grouped into chunks of at least
   ``CHUNK_CHARS`` characters (fewer for a text shorter than ``MIN_DOCUMENTS`` such chunks: its length / ``MIN_DOCUMENTS``),
   so that a fraction can be held out.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path

from elsa_ds.errors import ElsaError

SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
               "test": ("test", "testing", "eval", "evaluation")}
HOLDOUT_FRACTION = 0.1
HOLDOUT_SEED = 0
MIN_DOCUMENTS = 20
CHUNK_CHARS = 10_000


def split_named(path: Path, root: Path) -> str | None:
    """The split a file's name, or a folder's name between the directory ``root`` and it, announces (None: none)."""
    parts = [p.lower() for p in path.relative_to(root).parts]
    for split, words in SPLIT_WORDS.items():
        pattern = re.compile(r"(^|[-._ 0-9])(" + "|".join(words) + r")([-._ 0-9]|$)")
        if any(pattern.search(part) for part in parts):
            return split
    return None


def files_by_split(files: Sequence[Path], root: Path) -> dict[str, list[Path]] | None:
    """``{"train": [...], "validation": [...], "test": [...]}`` when at least one file names a split, else None."""
    named = {split: [f for f in files if split_named(f, root) == split] for split in SPLIT_WORDS}
    return named if any(named.values()) else None


def paragraph_chunks(text: str, min_chars: int = CHUNK_CHARS) -> list[str]:
    """``text`` cut at blank lines, consecutive paragraphs joined by one blank line into chunks of >= ``min_chars``
    characters (the last chunk may be shorter)."""
    chunks, current, size = [], [], 0
    for paragraph in (p for p in re.split(r"\n[ \t]*\n", text) if p.strip()):
        current.append(paragraph.strip("\n"))
        size += len(paragraph)
        if size >= min_chars:
            chunks.append("\n\n".join(current))
            current, size = [], 0
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def holdout_indices(n: int, fraction: float = HOLDOUT_FRACTION, seed: int = HOLDOUT_SEED) -> set[int]:
    """The held-out document indices of ``n``: ``max(1, round(fraction · n))`` of them, seeded."""
    if n < 2:
        raise ElsaError(f"the dataset has {n} document(s) after splitting at blank lines; a validation part cannot be held out "
                        "(use more text, a directory with train/validation files, or --val_dataset)")
    return set(random.Random(seed).sample(range(n), max(1, round(fraction * n))))


def holdout(documents: list[str]) -> tuple[list[str], list[str], str]:
    """(training documents, validation documents, the rule in words) for a source without a named split."""
    rule = ""
    if len(documents) < MIN_DOCUMENTS:
        size = min(CHUNK_CHARS, max(1, sum(len(d) for d in documents) // MIN_DOCUMENTS))  # a short text: aim for 20 chunks
        documents = [chunk for doc in documents for chunk in paragraph_chunks(doc, size)]
        rule = f"fewer than {MIN_DOCUMENTS} documents, so cut at blank lines into chunks of >= {size} characters; "
    if not documents:
        return [], [], "no text"
    held = holdout_indices(len(documents))
    train = [d for i, d in enumerate(documents) if i not in held]
    validation = [d for i, d in enumerate(documents) if i in held]
    return train, validation, (f"{rule}{len(validation)} of {len(documents)} documents held out "
                               f"(random.Random({HOLDOUT_SEED}).sample, {HOLDOUT_FRACTION:.0%}); training never sees them")
