"""Text sources: named corpora (C4, WikiText-2, the Shakespeare demo), ``datasets`` names, and local files.

A source gives :class:`Documents` for a split ('train' or 'validation') with the rule that chose them in words, so a
report can say what it validated on. Local files: .txt/.md are one document per file, .jsonl/.json one per line (a
``text`` field), .parquet one per row (a ``text`` column). Validation never overlaps training (``splits.py``).
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, overload

from elsa_ds import json_data
from elsa_ds.data.splits import files_by_split, holdout, holdout_indices
from elsa_ds.errors import ElsaError, described
from elsa_ds.quoting import as_json, shown

DEMO_DATASET = "shakespeare"
LOCAL_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")


FILE_NOT_MODEL = "is a file, not a model: give the folder that holds its config.json, weights and tokenizer, or a hub id"


IN_MEMORY_FOLDER = "elsa_ds_documents_"  # the prefix of the Python API's temporary folder for documents given in memory
IN_MEMORY_FILE = re.compile(r"documents-(\d+)-([0-9a-f]{64})\.jsonl")


def write_documents(texts: Iterable[str], folder: Path) -> Path:
    """Documents given in memory (the Python API) as ``folder/documents-N-SHA256.jsonl`` (one JSON object a line), for
    the job to read as any local file; the name carries what they are (``in_memory_name``)."""
    digest, count, part = hashlib.sha256(), 0, folder / "documents.partial"
    with part.open("w", encoding="utf-8") as fh:  # one document at a time: the caller's list is the only whole copy
        for text in texts:
            line = json.dumps({"text": text}) + "\n"
            digest.update(line.encode())
            fh.write(line)
            count += 1
    return part.rename(folder / f"documents-{count}-{digest.hexdigest()}.jsonl")


def in_memory_name(source: str | None) -> str | None:
    """What the report and a resume call documents given in memory, by their count and content (the temporary file
    they were read from is gone once the call returns: a resume with the same documents was refused for its new path,
    an audit, 2026-12-07); None for any other source."""
    path = Path(source or "")
    if path.parent.name.startswith(IN_MEMORY_FOLDER) and (m := IN_MEMORY_FILE.fullmatch(path.name)):
        return f"in-memory documents ({m.group(1)}, sha256 {m.group(2)})"
    return None


def source_name(source: str) -> str:
    """A source as a report or a log line names it: documents given in memory by their count and content."""
    return in_memory_name(source) or source


def looks_local(source: str) -> bool:
    """Whether ``source`` names a path (``./``, ``/`` or ``~`` first, or a text file's suffix), not a dataset name."""
    return source.startswith((".", "/", "~")) or Path(source).suffix in LOCAL_SUFFIXES
C4_SHARDS = {"train": "en/c4-train.00000-of-01024.json.gz", "validation": "en/c4-validation.00000-of-00008.json.gz"}
C4_VALIDATION_DOCUMENTS = 1100  # SparseGPT/Wanda: the first 1100 validation documents, joined by a space


@dataclass
class Documents:
    """The documents of one split of a source and the rule that chose them.

    ``stream``: the texts are the lines of one text (WikiText-2), joined by each reader's own separator.
    """

    texts: Sequence[str]
    rule: str
    stream: bool = False

    def joined(self, separator: str = "\n\n") -> Sequence[str]:
        """The texts as documents: a stream's lines joined into one, otherwise as they are."""
        return [separator.join(self.texts)] if self.stream else self.texts


def documents(source: str, split: str, holdout_part: bool = True) -> Documents:
    """Documents of ``source`` for ``split``.

    ``shakespeare`` (the demo corpus, split by play), ``c4`` (train shard 0; validation: the first 1100 documents of
    validation shard 0 joined by a space), ``wikitext2`` (train / test lines), a local file or directory, or a
    ``datasets`` name with a ``text`` column. A local source without train/validation file names, and a ``datasets``
    name without a validation split, hold out whole documents for validation; ``holdout_part=False`` trains on all of
    them (a separate ``--val_dataset`` validates).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    path = Path(source).expanduser()
    if source == DEMO_DATASET:
        from elsa_ds.data.shakespeare import VALIDATION_PLAYS, split_texts

        return Documents(split_texts(split), f"the Shakespeare demo corpus; validation = the plays {', '.join(VALIDATION_PLAYS)}, "
                                             "training = every other play")
    if path.exists():
        return _local(path, split, holdout_part)
    if looks_local(source):
        raise ElsaError(f"dataset {source!r}: no such file or directory")
    if source == "wikitext2":
        name = "test" if split == "validation" else "train"
        ds = _download(source, "wikitext", "wikitext-2-raw-v1", split=name)
        return Documents(list(ds["text"]), f"wikitext-2-raw-v1 {name} split, its lines joined into one text", stream=True)
    if source == "c4":
        ds = _download(source, "allenai/c4", data_files={split: C4_SHARDS[split]}, split=split)
        if split == "validation":
            return Documents([" ".join(ds[:C4_VALIDATION_DOCUMENTS]["text"])],
                             f"allenai/c4 {C4_SHARDS[split]}: the first {C4_VALIDATION_DOCUMENTS} documents joined by a space")
        return Documents(_TextColumn(ds), f"allenai/c4 {C4_SHARDS[split]}, every document")
    if "/" in source or source.replace("_", "").replace("-", "").isalnum():
        return _hub(source, split, holdout_part)
    raise ElsaError(f"dataset {source!r}: no such file or directory, and not a dataset name")


def evaluation_documents(source: str) -> Documents:
    """What ``launch/evaluate.py --ppl`` and ``--val_dataset`` score: a local file or an unsplit directory entirely
    (the user named that text), the validation (else test) files of a split directory, a named or ``datasets``
    source's validation split."""
    path = Path(source).expanduser()
    if source != DEMO_DATASET and path.exists():
        files = local_files(path)
        named = files_by_split(files, path) if path.is_dir() else None
        if named is None:
            return Documents(_read_all(files), f"every document of {_names(files, path)}")
        return _local(path, "validation", True)
    return documents(source, "validation")


def iter_texts(source: str, split: str, holdout_part: bool = True) -> Iterator[str]:
    """The documents of ``documents(source, split, holdout_part)`` one by one (a stream's lines joined by blank lines)."""
    yield from documents(source, split, holdout_part).joined()


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


def _local(path: Path, split: str, holdout_part: bool) -> Documents:
    files = local_files(path)
    named = files_by_split(files, path) if path.is_dir() else None
    if named is not None:
        part = named["train"] if split == "train" else named["validation"] or named["test"]
        if not part and split == "train":
            raise ElsaError(f"dataset {path}: files are named for splits but none for 'train' (e.g. train.jsonl)")
        if part:
            return Documents(_read_all(part), f"the files named for the split: {_names(part, path)}")
        files = named["train"]  # a directory with only training files: hold out from those
    docs = _read_all(files)
    if not holdout_part:
        return Documents(docs, f"every document of {_names(files, path)} (validation comes from --val_dataset)")
    train, validation, rule = holdout(docs)
    return Documents(train if split == "train" else validation, f"{_names(files, path)}: {rule}")


def _download(source: str, *args, **kwargs):
    """``datasets.load_dataset(*args, **kwargs)``; a failure (offline, no such dataset, a broken cache) as one ElsaError
    naming ``source`` and the way out."""
    from datasets import load_dataset

    try:
        return load_dataset(*args, **kwargs)
    except Exception as err:  # datasets and huggingface_hub raise many types; the user needs one line
        raise ElsaError(f"dataset {source!r} could not be downloaded ({described(err)}); without network, "
                        "give a local file or folder instead (.txt, .md, .jsonl, .parquet)") from None


def _hub(source: str, split: str, holdout_part: bool) -> Documents:
    from datasets import get_dataset_split_names, load_dataset

    try:
        splits = get_dataset_split_names(source)
        has_validation = "validation" in splits
        ds = load_dataset(source, split=split if has_validation or split == "train" else "train")
    except Exception as err:  # datasets raises many types; the user needs one message
        raise ElsaError(f"dataset {source!r}: not a local path and could not be loaded with datasets.load_dataset "
                        f"({type(err).__name__}: {err})") from None
    if "text" not in ds.column_names:
        raise ElsaError(f"dataset {source!r} has no 'text' column (columns: {ds.column_names})")
    if has_validation or (split == "train" and not holdout_part):
        return Documents(_TextColumn(ds), f"datasets {source!r}, split {split!r}")
    held = holdout_indices(len(ds))
    rows = sorted(held) if split == "validation" else [i for i in range(len(ds)) if i not in held]
    return Documents(_TextColumn(ds.select(rows)), f"datasets {source!r} has no validation split: {len(held)} of {len(ds)} "
                                                   f"training documents held out, {'these' if split == 'validation' else 'not these'}")


class _TextColumn(Sequence[str]):
    """The ``text`` column of a ``datasets.Dataset``, read row by row from its memory map (never copied whole)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        return self.ds[i]["text"]  # a slice of a Dataset is a dict of columns: its texts, a list

    def __iter__(self) -> Iterator[str]:
        for batch in self.ds.iter(batch_size=1024):
            yield from batch["text"]


def _names(files: list[Path], root: Path) -> str:
    listed = [str(f.relative_to(root)) if root.is_dir() else f.name for f in files]
    return ", ".join(listed[:5]) + (f" and {len(listed) - 5} more files" if len(listed) > 5 else "")


def _read_all(files: list[Path]) -> list[str]:
    return [doc for f in files for doc in _read_local(f)]


def _read_local(path: Path) -> Iterator[str]:
    if path.suffix in (".txt", ".md"):
        yield _read_utf8(path)
    elif path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(_read_utf8(path).splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json_data.loads(line, unique=False)  # a corpus's line, read as ``datasets`` reads it
            except ValueError as err:  # not JSON, nested too deeply
                raise ElsaError(f"{path}:{n}: not a JSON line ({getattr(err, 'msg', err)}); expected one object per line with a "
                                "'text' field") from None
            if not isinstance(record, dict) or "text" not in record:
                raise ElsaError(f"{path}:{n}: JSON line has no 'text' field")
            if (text := record["text"]) is None:  # no document, as a ``datasets`` corpus's None is none
                continue
            if not isinstance(text, str):
                _not_text(f"{path}:{n}: its 'text' is {shown(text, 60, as_json)}")
            yield text
    elif path.suffix == ".parquet":
        yield from _parquet_texts(path)


def _not_text(what: str) -> NoReturn:
    """A corpus's text that is not text (a number, a list, bytes): refused, where ``str()`` made it the text trained or
    scored on ("None", "b'...'", "['a list']": an audit's run ended exit 0, trained on them)."""
    raise ElsaError(f"{what}, not a string: a corpus's 'text' must be text (null for none); convert it, or drop those records")


def _values_type(kind: Any) -> Any:
    """The type of an Arrow column's values (a dictionary-coded column's entries), and whether they are strings."""
    import pyarrow as pa

    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    return values, pa.types.is_string(values) or pa.types.is_large_string(values)  # what a Parquet file's strings read as


PARQUET_EXPANSION, PARQUET_FLOOR = 64, 64 * 2**20  # text read from a Parquet file: at most 64x its size, + 64 MiB
ROW_BYTES = 64  # what a row costs in memory besides its text (a Python str and its list entry), charged to the same cap


def _parquet_texts(path: Path) -> Iterator[str]:
    """The ``text`` column of a Parquet file, one row group at a time, its size known before any row is built: the file is
    data from elsewhere, and a 1 KB file naming one 16 MiB string 64 times (a dictionary page) took 21 GB to read whole
    (a sixth audit). Text past ``PARQUET_EXPANSION`` x the file's size (+ ``PARQUET_FLOOR``) is refused; real text
    compresses 2-5x."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    cap = PARQUET_EXPANSION * path.stat().st_size + PARQUET_FLOOR
    try:
        pf = pq.ParquetFile(path, read_dictionary=["text"])  # repeated strings stay one entry each, as stored
        if "text" not in pf.schema_arrow.names:
            raise ElsaError(f"{path}: parquet file has no 'text' column (columns: {pf.schema_arrow.names})")
        values, strings = _values_type(pf.schema_arrow.field("text").type)
        if not strings:
            _not_text(f"{path}: its 'text' column holds {values}")
        meta, groups = pf.metadata, range(pf.metadata.num_row_groups)
        declared = sum(meta.row_group(g).column(c).total_uncompressed_size for g in groups for c in range(meta.num_columns)
                       if meta.row_group(g).column(c).path_in_schema.split(".")[0] == "text")  # its leaves, not another's
        if declared > cap:
            raise _too_much_text(path, declared, cap)
        total = 0
        for g in groups:
            total += ROW_BYTES * meta.row_group(g).num_rows  # a row costs its string and list entry: 10^9 empty rows are GBs
            if total > cap:
                raise _too_much_text(path, total, cap)
            text = pf.read_row_group(g, columns=["text"]).column("text").combine_chunks()
            total += int(pc.sum(_text_lengths(text)).as_py() or 0)
            if total > cap:
                raise _too_much_text(path, total, cap)
            yield from (t for t in text.to_pylist() if t is not None)  # a null: no document
    except ElsaError:
        raise
    except Exception as err:  # pyarrow's ArrowInvalid / ArrowException, OSError: a corrupt or foreign file
        raise ElsaError(f"{path}: not a readable Parquet file ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                        "give a Parquet file with a 'text' column, or a .txt / .jsonl file") from None


def _text_lengths(text: Any) -> Any:
    """The bytes of each row of a string column, dictionary-coded or not (``_values_type`` checked that it holds strings)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    lengths = pc.binary_length(text.dictionary if pa.types.is_dictionary(text.type) else text)
    return lengths.take(text.indices) if pa.types.is_dictionary(text.type) else lengths


def _too_much_text(path: Path, size: int, cap: int) -> ElsaError:
    return ElsaError(f"{path}: its 'text' column holds {size:,} bytes or more (each row counted {ROW_BYTES} bytes beside its "
                     f"text), over {cap:,} ({PARQUET_EXPANSION}x the file's "
                     f"{path.stat().st_size:,} bytes + {PARQUET_FLOOR // 2**20} MiB): refused as a decompression bomb; give the "
                     "text as .txt or .jsonl, or split it into Parquet files that compress it less")


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
