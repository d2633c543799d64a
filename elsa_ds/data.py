"""Text sources -> packed token blocks -> deterministic global batches.

Every block is ``[BOS] + (seqlen - 1)`` text tokens when the tokenizer has a BOS token (the ELSA
authors' choice for Gemma, applied to every model so calibration, pruning and evaluation agree), else
``seqlen`` text tokens. Documents are joined with EOS; blocks never overlap; the remainder is dropped.

The *global* batch is the invariant: global batch ``b`` is the same set of blocks for any world size,
each rank takes a fixed slice of it, so 1 rank and N ranks see the same gradients (up to reduction
order) and produce the same mask.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from elsa_ds.errors import ElsaError

LOCAL_SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")
DEMO_DATASET = "shakespeare"


def pack_blocks(
    token_lists: Iterable[list[int]],
    seqlen: int,
    bos_id: int | None,
    eos_id: int | None,
    max_blocks: int | None = None,
) -> torch.Tensor:
    """Concatenate documents (each followed by EOS) and cut into non-overlapping blocks.

    Returns a LongTensor [n_blocks, seqlen]; each row starts with BOS when ``bos_id`` is given.
    """
    if seqlen < 2:
        raise ElsaError(f"seqlen must be at least 2, got {seqlen}")
    body = seqlen - 1 if bos_id is not None else seqlen
    stream: list[int] = []
    rows: list[list[int]] = []
    for ids in token_lists:
        stream.extend(ids)
        if eos_id is not None:
            stream.append(eos_id)
        while len(stream) >= body:
            chunk, stream = stream[:body], stream[body:]
            rows.append(([bos_id] if bos_id is not None else []) + chunk)
            if max_blocks is not None and len(rows) >= max_blocks:
                return torch.tensor(rows, dtype=torch.long)
    if not rows:
        return torch.empty(0, seqlen, dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long)


def _read_local(path: Path) -> Iterator[str]:
    if path.suffix in (".txt", ".md"):
        yield path.read_text(encoding="utf-8")
    elif path.suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
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
        from elsa_ds.demo.corpus import split_texts

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


def load_tokenizer(model_id: str):
    """The model's tokenizer, or an ElsaError naming the model."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError) as err:
        raise ElsaError(f"cannot load the tokenizer of {model_id!r}: {str(err).splitlines()[0]}") from None


def load_blocks(source: str, split: str, tokenizer, seqlen: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenize a source and pack it into [n, seqlen] blocks (at most ``max_blocks``)."""
    token_lists = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in iter_texts(source, split) if text)
    return pack_blocks(token_lists, seqlen, tokenizer.bos_token_id, tokenizer.eos_token_id, max_blocks)


class GlobalBatches:
    """Deterministic global batches over a fixed set of blocks, sliced per rank and micro step.

    Epoch ``e`` visits the blocks in the order ``randperm(n, seed + e)``; global batch ``b`` is the next
    ``global_batch`` blocks of that order. Rank ``r`` takes rows ``[r*per_rank, (r+1)*per_rank)`` of
    the global batch and cuts them into micro batches of ``micro_batch``.
    """

    def __init__(self, blocks: torch.Tensor, global_batch: int, micro_batch: int, world_size: int, rank: int, seed: int):
        if blocks.shape[0] < global_batch:
            raise ElsaError(
                f"the dataset gives {blocks.shape[0]} blocks of {blocks.shape[1]} tokens, fewer than one global batch "
                f"({global_batch}); use more text, a shorter --seqlen or a smaller train_batch_size"
            )
        if global_batch % (micro_batch * world_size):
            raise ElsaError(
                f"train_batch_size {global_batch} is not divisible by micro batch {micro_batch} x world size {world_size}"
            )
        self.blocks, self.global_batch, self.micro_batch = blocks, global_batch, micro_batch
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.per_epoch = blocks.shape[0] // global_batch
        self.grad_accum = global_batch // (micro_batch * world_size)

    def global_batch_at(self, step: int) -> torch.Tensor:
        """All blocks of global batch ``step`` (identical on every rank): [global_batch, seqlen]."""
        epoch, index = divmod(step, self.per_epoch)
        order = torch.randperm(self.blocks.shape[0], generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.blocks[order[index * self.global_batch:(index + 1) * self.global_batch]]

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """This rank's micro batches of global batch ``step``, in accumulation order."""
        per_rank = self.global_batch // self.world_size
        mine = self.global_batch_at(step)[self.rank * per_rank:(self.rank + 1) * per_rank]
        return list(mine.split(self.micro_batch))
