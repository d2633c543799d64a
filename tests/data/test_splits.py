"""Honest validation: split by file names, or whole documents held out that training never sees."""
from __future__ import annotations

import json

import pytest

from elsa_ds.data import documents, evaluation_documents, iter_texts, training_blocks, validation_windows
from elsa_ds.data.splits import CHUNK_CHARS, HOLDOUT_FRACTION, paragraph_chunks, split_named
from elsa_ds.errors import ElsaError


def marker(i: int) -> str:
    """A unique tag of letters only (the tests' tokenizer knows no digits): 17 -> [pbar]."""
    return "[p" + "".join("abcdefghijklmnopqrstuvwxyz"[i // 26 ** k % 26] for k in (2, 1, 0)) + "]"


def numbered_text(n: int, words: int = 60) -> str:
    """``n`` paragraphs separated by blank lines, each with a unique marker."""
    filler = " ".join(["the quick brown fox jumps over the lazy dog"] * (words // 9))
    return "\n\n".join(f"{marker(i)} {filler} {marker(i)}." for i in range(n)) + "\n"


def markers(text: str) -> set[str]:
    import re

    return set(re.findall(r"\[p[a-z]{3}\]", text))


def test_directory_split_by_file_names(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": f"train {i}"}) + "\n" for i in range(3)))
    (tmp_path / "wiki.validation.txt").write_text("held out")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "part-0.txt").write_text("for the end")
    (tmp_path / "notes.md").write_text("names no split: not read")
    assert list(iter_texts(str(tmp_path), "train")) == ["train 0", "train 1", "train 2"]
    val = documents(str(tmp_path), "validation")
    assert list(val.texts) == ["held out"] and "wiki.validation.txt" in val.rule
    assert list(evaluation_documents(str(tmp_path)).texts) == ["held out"]
    (tmp_path / "wiki.validation.txt").unlink()
    assert list(documents(str(tmp_path), "validation").texts) == ["for the end"]  # no validation files: the test files
    assert split_named(tmp_path / "interval.txt", tmp_path) is None and split_named(tmp_path / "dev-1.jsonl", tmp_path) == "validation"
    (tmp_path / "train.jsonl").unlink()
    with pytest.raises(ElsaError, match="none for 'train'"):
        documents(str(tmp_path), "train")


def test_single_file_holds_out_whole_chunks(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(numbered_text(1000))
    chunks = paragraph_chunks(path.read_text())
    assert all(len(c) >= CHUNK_CHARS for c in chunks[:-1]) and "\n\n".join(chunks) + "\n" == path.read_text()
    train, val = documents(str(path), "train"), documents(str(path), "validation")
    assert train.texts == [c for c in chunks if c not in val.texts] and len(val.texts) == round(HOLDOUT_FRACTION * len(chunks))
    assert set(val.texts) < set(chunks) and not set(train.texts) & set(val.texts)
    assert "held out" in val.rule and documents(str(path), "validation").texts == val.texts  # deterministic
    short = tmp_path / "short.txt"                       # a short text: smaller chunks of whole paragraphs, 10% held out
    short.write_text(numbered_text(40))
    train, val = documents(str(short), "train"), documents(str(short), "validation")
    paragraphs = [p for c in [*train.texts, *val.texts] for p in c.split("\n\n")]
    assert sorted(paragraphs) == sorted(short.read_text().strip().split("\n\n"))
    assert len(train.texts) + len(val.texts) >= 10 and len(val.texts) == round(HOLDOUT_FRACTION * (len(train.texts) + len(val.texts)))
    assert list(evaluation_documents(str(path)).texts) == [path.read_text()]                 # evaluate.py reads all of it
    assert list(documents(str(path), "train", holdout_part=False).texts) == [path.read_text()]  # --val_dataset given
    one = tmp_path / "tiny.txt"
    one.write_text("a single paragraph")
    with pytest.raises(ElsaError, match="cannot be held out"):
        documents(str(one), "train")


@pytest.mark.parametrize("sampling", ["pack", "crop"])
def test_no_validation_text_in_any_training_block(tmp_path, tiny_model_dir, sampling):
    """The job's own data functions: decoded training blocks hold training paragraphs, never a held-out one."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path / "book.txt"
    path.write_text(numbered_text(300))
    val_markers = markers("\n\n".join(documents(str(path), "validation").texts))
    blocks, info = training_blocks(str(path), tok, 64, 400, sampling, seed=0, gemma=True)
    assert info["sampling"] == sampling and "held out" in info["part"]
    seen = set().union(*(markers(tok.decode(row)) for row in blocks.tolist()))
    assert len(seen) > 50 and not seen & val_markers and len(val_markers) > 10
    windows = validation_windows(str(path), None, tok, 64, "auto", AutoConfig.from_pretrained(tiny_model_dir), None)
    assert markers(tok.decode(windows.ids.flatten().tolist())) <= val_markers
    assert windows.documents == len(documents(str(path), "validation").texts)


def test_hub_dataset_without_validation_split_holds_out(monkeypatch):
    """A ``datasets`` name with only a train split: the same seeded hold-out of whole rows (hub calls stubbed)."""
    import datasets

    rows = datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(50)]})
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name: ["train"])
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split: rows)
    train, val = documents("someone/corpus", "train"), documents("someone/corpus", "validation")
    assert len(val.texts) == 5 and len(train.texts) == 45 and not set(train.texts) & set(val.texts)
    assert "no validation split" in val.rule and sorted([*train.texts, *val.texts]) == sorted(rows["text"])
    assert list(documents("someone/corpus", "train", holdout_part=False).texts) == rows["text"]
    monkeypatch.setattr(datasets, "get_dataset_split_names", lambda name: ["train", "validation"])
    assert "split 'validation'" in documents("someone/corpus", "validation").rule


def test_val_dataset_is_read_whole_and_dataset_trains_on_everything(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    book, other = tmp_path / "book.txt", tmp_path / "other.txt"
    book.write_text(numbered_text(300))
    other.write_text(numbered_text(60))
    windows = validation_windows(str(book), str(other), tok, 64, "stream", AutoConfig.from_pretrained(tiny_model_dir), None)
    assert windows.source == str(other) and windows.documents == 1 and "every document of other.txt" in windows.rule
    everything, info = training_blocks(str(book), tok, 64, 10_000, "pack", seed=0, gemma=True, holdout_part=False)
    held, _ = training_blocks(str(book), tok, 64, 10_000, "pack", seed=0, gemma=True)
    assert "every document" in info["part"] and everything.shape[0] > held.shape[0]
