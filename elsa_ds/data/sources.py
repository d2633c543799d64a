"""Text sources: named corpora (C4, WikiText-2, the Shakespeare demo), ``datasets`` names, and local files.

Each source yields documents (strings) for a split. Local files: .txt/.md are one document per file,
.jsonl/.json one per line (a ``text`` field), .parquet one per row (a ``text`` column).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from elsa_ds.config import DEMO_DATASET
from elsa_ds.errors import ElsaError

LOCAL_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")


def _read_local(path: Path) -> Iterator[str]:
    if path.suffix in (".txt", ".md"):
        yield _read_utf8(path)
    elif path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(_read_utf8(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ElsaError(f"{path}:{n}: not a JSON line ({err.msg}); expected one object per line with a 'text' field") from None
            if not isinstance(record, dict) or "text" not in record:
                raise ElsaError(f"{path}:{n}: JSON line has no 'text' field")
            yield str(record["text"])
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "text" not in table.column_names:
            raise ElsaError(f"{path}: parquet file has no 'text' column (columns: {table.column_names})")
        yield from (str(t) for t in table.column("text").to_pylist())


def local_files(path: Path) -> list[Path]:
    """The readable text files at ``path`` (a file, or a directory searched recursively), sorted."""
    if path.is_file():
        if path.suffix not in LOCAL_SUFFIXES:
            raise ElsaError(f"{path}: unsupported file type; use one of {', '.join(LOCAL_SUFFIXES)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES)
    if not files:
        raise ElsaError(f"{path}: directory holds no {'/'.join(LOCAL_SUFFIXES)} files")
    return files


def iter_texts(source: str, split: str) -> Iterator[str]:
    """Documents of a text source for ``split`` ('train' or 'validation').

    ``source`` is ``shakespeare`` (the embedded demo corpus, split by play), ``c4``, ``wikitext2``, a
    local file or directory (.txt/.md: one document per file; .jsonl/.parquet: a ``text`` field per
    record), or any Hugging Face ``datasets`` name with a ``text`` column.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    path = Path(source).expanduser()
    if source == DEMO_DATASET:
        from elsa_ds.data.shakespeare import split_texts

        yield from split_texts(split)
    elif path.exists():
        for file in local_files(path):
            yield from _read_local(file)
    elif source.startswith((".", "/", "~")) or path.suffix in LOCAL_SUFFIXES:
        raise ElsaError(f"dataset {source!r}: no such file or directory")
    elif source == "wikitext2":
        from datasets import load_dataset

        ds = load_dataset("wikitext", "wikitext-2-raw-v1", split="test" if split == "validation" else "train")
        yield "\n\n".join(ds["text"])
    elif source == "c4":
        from datasets import load_dataset

        shard = {
            "train": "en/c4-train.00000-of-01024.json.gz",
            "validation": "en/c4-validation.00000-of-00008.json.gz",
        }[split]
        ds = load_dataset("allenai/c4", data_files={split: shard}, split=split)
        if split == "validation":  # SparseGPT/Wanda protocol: the first 1100 documents joined by a space
            yield " ".join(ds[:1100]["text"])
        else:
            yield from ds["text"]
    elif "/" in source or source.replace("_", "").replace("-", "").isalnum():
        from datasets import load_dataset

        try:
            ds = load_dataset(source, split=split)
        except Exception as err:  # datasets raises many types; the user needs one message
            raise ElsaError(f"dataset {source!r}: not a local path and could not be loaded with datasets.load_dataset ({type(err).__name__}: {err})") from None
        if "text" not in ds.column_names:
            raise ElsaError(f"dataset {source!r} has no 'text' column (columns: {ds.column_names})")
        yield from ds["text"]
    else:
        raise ElsaError(f"dataset {source!r}: no such file or directory, and not a dataset name")




def _read_utf8(path: Path) -> str:
    """A text file's contents; ElsaError (not a traceback) when it is not UTF-8 text."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ElsaError(f"{path}: not UTF-8 text (byte {err.start} is {data[err.start]:#04x}); convert it to UTF-8 "
                        "or remove it from the dataset") from None
    if "\x00" in text:
        raise ElsaError(f"{path}: holds NUL bytes, so it is binary, not text; remove it from the dataset")
    return text
