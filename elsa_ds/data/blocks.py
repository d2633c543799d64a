"""Documents -> packed token blocks -> deterministic global batches.

Packing (``--sampling pack``): every block is ``[BOS] + (seqlen - 1)`` text tokens when the tokenizer has a BOS
token, else ``seqlen`` text tokens. Documents are joined with EOS; blocks never overlap; the remainder is dropped.
(Random crops as the reference code draws them are in ``sampling.py``, perplexity windows in ``windows.py``.)

The *global* batch is the invariant: global batch ``b`` is the same set of blocks for any world size,
each rank takes a fixed slice of it, so 1 rank and N ranks see the same gradients (up to reduction
order) and produce the same mask.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from elsa_ds import json_data
from elsa_ds.data.sources import FILE_NOT_MODEL, iter_texts
from elsa_ds.errors import ElsaError, is_panic


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


# A tokenizer's vocabulary, one of these per tokenizer type (fast, SentencePiece, BPE, WordPiece, tiktoken). Without one,
# transformers may still build a tokenizer from tokenizer_config.json alone: a few special tokens, every text 0 blocks.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
               "tokenizer.tiktoken")


def check_local_tokenizer(model_id: str) -> None:
    """A local model directory holds a tokenizer's vocabulary (hub ids are resolved by transformers), and its
    tokenizer.json, when it has one, is one the tokenizers library can read: ElsaError naming the file otherwise."""
    path = Path(model_id).expanduser()
    if path.is_file():  # a config.json alone: the estimate reads one, a job needs the folder
        raise ElsaError(f"model {model_id} {FILE_NOT_MODEL}")
    if not path.is_dir():
        return
    if not any((path / name).is_file() for name in VOCAB_FILES):
        raise ElsaError(f"model {model_id} has no tokenizer (none of {', '.join(VOCAB_FILES)}): copy the tokenizer files of "
                        "the folder it was saved from, or save it there with AutoTokenizer.from_pretrained(<the model's "
                        "hub id>).save_pretrained(<this folder>)")
    file = path / "tokenizer.json"
    if file.is_file():
        _check_tokenizer_json(file)


def _check_tokenizer_json(file: Path) -> None:
    """JSON, an object of the tokenizers library's shape, and one it reads (as transformers will)."""
    from tokenizers import Tokenizer

    try:
        text = json_data.read_text(file, json_data.MODEL_FILE_BYTES)
        data = json_data.loads(text, unique=False)  # the tokenizers library judges its own file
    except ValueError as err:  # not JSON, not UTF-8, too large, nested too deeply
        raise ElsaError(f"{file}: not valid JSON ({' '.join(str(err).split())}); copy the model's tokenizer again") from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) or not isinstance(data.get("added_tokens"), list):
        raise ElsaError(f"{file}: not a tokenizer (a JSON object with a \"model\" object and an \"added_tokens\" list); "
                        "copy the model's tokenizer again")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as err:  # the tokenizers library raises a bare Exception for every file it cannot read
        raise ElsaError(f"{file}: not a tokenizer the tokenizers library can read ({' '.join(str(err).split())}); "
                        "copy the model's tokenizer again") from None
    try:  # a pre-tokenizer's regex that backtracks without end panics in Rust on text like this (a walk: "(.|.)*\\d")
        for probe in TOKENIZER_PROBES:
            tokenizer.encode(probe)
    except BaseException as err:
        if not is_panic(err):
            raise
        raise ElsaError(f"{file}: its tokenizer stops on ordinary text ({' '.join(str(err).split())[:200]}): a regex of "
                        "its pre-tokenizer backtracks without end; copy the model's tokenizer again") from None


# ordinary text that a backtracking regex fails to match at length: prose, then figures and code
TOKENIZER_PROBES = ("When shall we three meet again, in thunder, lightning, or in rain? " * 12,
                    "Act 1, scene 2 (3.14 %): x = f(y) + 42; <b>café</b> 日本語\n" * 8)


# what transformers raises for tokenizer files it cannot read: its own errors, those of a value of the wrong type or a
# missing key deep in its loading code, and json's for a file nested deeper than Python's stack
TOKENIZER_ERRORS = (OSError, ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)


def load_tokenizer(model_id: str):
    """The model's tokenizer, or an ElsaError naming the model."""
    from transformers import AutoTokenizer

    check_local_tokenizer(model_id)
    try:
        return AutoTokenizer.from_pretrained(model_id, trust_remote_code=False)
    except TOKENIZER_ERRORS as err:
        text = " ".join(str(err).split()) or type(err).__name__
        raise ElsaError(f"cannot load the tokenizer of {model_id!r} ({type(err).__name__}: {text[:300]}); check its tokenizer "
                        "files (tokenizer.json, tokenizer_config.json)") from None


def pack_documents(texts: Iterable[str], tokenizer, seqlen: int, max_blocks: int | None = None) -> torch.Tensor:
    """Tokenize documents (no special tokens) and pack them into [n, seqlen] blocks (at most ``max_blocks``)."""
    token_lists = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts if text)
    return pack_blocks(token_lists, seqlen, tokenizer.bos_token_id, tokenizer.eos_token_id, max_blocks)


def load_blocks(source: str, split: str, tokenizer, seqlen: int, max_blocks: int | None = None, holdout_part: bool = True) -> torch.Tensor:
    """Pack the documents of a source's split (``sources.documents``) into [n, seqlen] blocks (at most ``max_blocks``)."""
    return pack_documents(iter_texts(source, split, holdout_part), tokenizer, seqlen, max_blocks)


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
        self._order: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation): drawn once an epoch, not once a step

    def readings(self, steps: int) -> float:
        """How many times ``steps`` global batches read each block, on average (1 or less: none read twice)."""
        return steps * self.global_batch / self.blocks.shape[0]

    def global_batch_at(self, step: int) -> torch.Tensor:
        """All blocks of global batch ``step`` (identical on every rank): [global_batch, seqlen]."""
        epoch, index = divmod(step, self.per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = epoch, torch.randperm(self.blocks.shape[0], generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.blocks[self._order[1][index * self.global_batch:(index + 1) * self.global_batch]]

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        """This rank's micro batches of global batch ``step``, in accumulation order."""
        per_rank = self.global_batch // self.world_size
        mine = self.global_batch_at(step)[self.rank * per_rank:(self.rank + 1) * per_rank]
        return list(mine.split(self.micro_batch))
