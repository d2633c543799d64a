"""Training and calibration sequences: random crops as the reference code draws them, or packed blocks.

``crop`` for ELSA training is the ELSA authors' ``_process_and_tokenize`` (``lib/data.py``), random call for random call::

    random.seed(seed)
    documents (C4, any document source): n times, draw i = randint(0, D−1) until len(tokenizer(doc_i)) > L; keep it
    stream (WikiText-2): one text, the lines joined by "\\n\\n", tokenized
    n times: t = choice(kept);  s = randint(0, len(t) − m − 1);  crop = t[s : s+m]
    Gemma: m = L − 1 and the crop is [BOS] + crop;   otherwise m = L, the crop as it is

``tokenizer(doc)`` adds what the tokenizer adds (Llama: BOS first, so a crop at s = 0 starts with it). The calibration of
the one-shot methods follows the reference that published each family's numbers: SparseGPT / Wanda (``get_c4``,
``get_wikitext2``) for non-Gemma models — per sample draw documents until one is longer than L, then at once
s = randint(0, len − L − 1), L raw tokens; WikiText-2 lines joined by " " — and the ELSA authors' loader above for Gemma.

The global batch is the invariant: every rank computes the same crops from the same seed, and ``GlobalBatches`` gives
each rank its fixed slice of each global batch.
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from enum import Enum

import torch

from elsa_ds.data.blocks import pack_documents
from elsa_ds.data.sources import Documents, documents
from elsa_ds.errors import ElsaError


class Sampling(str, Enum):
    auto = "auto"  # crop for c4 and wikitext2 (the authors' loader), pack otherwise
    crop = "crop"  # the ELSA authors' random crops
    pack = "pack"  # documents joined by EOS, cut into BOS-first blocks


CROP_SOURCES = ("c4", "wikitext2")


def resolve_sampling(sampling: Sampling | str, dataset: str) -> Sampling:
    """auto: crop for the corpora the ELSA authors' loader reads (c4, wikitext2), pack for everything else."""
    sampling = Sampling(sampling)
    if sampling is Sampling.auto:
        return Sampling.crop if dataset in CROP_SOURCES else Sampling.pack
    return sampling


class NoLongDocument(ElsaError):
    """No document of the source is longer than the crop length."""


class _Encoded:
    """Token ids of documents by index, tokenized once; only documents longer than ``keep_over`` tokens are kept."""

    def __init__(self, texts: Sequence[str], tokenizer, keep_over: int):
        self.texts, self.tokenizer, self.keep_over = texts, tokenizer, keep_over
        self.lengths: dict[int, int] = {}
        self.kept: dict[int, torch.Tensor] = {}

    def length(self, i: int) -> int:
        if i not in self.lengths:
            ids = self.tokenizer(self.texts[i], verbose=False)["input_ids"]
            self.lengths[i] = len(ids)
            if len(ids) > self.keep_over:
                self.kept[i] = torch.tensor(ids, dtype=torch.int32)
        return self.lengths[i]

    def draw_long(self, rng: random.Random) -> int:
        """``i = randint(0, D−1)`` until document i has more than ``keep_over`` tokens (the references' while loop)."""
        if len(self.texts) == 0:
            raise NoLongDocument("the training part has no documents")
        while True:
            i = rng.randint(0, len(self.texts) - 1)
            if self.length(i) > self.keep_over:
                return i
            if len(self.lengths) == len(self.texts) and not self.kept:
                raise NoLongDocument(f"no training document is longer than {self.keep_over} tokens")


def elsa_crops(docs: Documents, tokenizer, n: int, seqlen: int, seed: int, bos_first: bool) -> torch.Tensor:
    """The ELSA authors' ``_process_and_tokenize`` crops [n, seqlen] (see the module docstring)."""
    rng = random.Random(seed)
    if docs.stream:
        sources = [_encode(tokenizer, "\n\n".join(docs.texts))]
    else:
        encoded = _Encoded(docs.texts, tokenizer, keep_over=seqlen)
        sources = [encoded.kept[encoded.draw_long(rng)] for _ in range(n)]
    bos = tokenizer.bos_token_id if bos_first else None
    return _stack([_crop(rng, rng.choice(sources), seqlen - 1 if bos_first else seqlen, bos) for _ in range(n)], seqlen)


def wanda_crops(docs: Documents, tokenizer, n: int, seqlen: int, seed: int) -> torch.Tensor:
    """SparseGPT / Wanda calibration crops [n, seqlen]: ``get_c4`` for documents, ``get_wikitext2`` for a stream."""
    rng = random.Random(seed)
    if docs.stream:
        tokens = _encode(tokenizer, " ".join(docs.texts))
        return _stack([_crop(rng, tokens, seqlen) for _ in range(n)], seqlen)
    encoded = _Encoded(docs.texts, tokenizer, keep_over=seqlen)
    return _stack([_crop(rng, encoded.kept[encoded.draw_long(rng)], seqlen) for _ in range(n)], seqlen)


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.int32)


def _crop(rng: random.Random, tokens: torch.Tensor, length: int, bos: int | None = None) -> torch.Tensor:
    """``s = randint(0, len − length − 1)``, ``tokens[s : s+length]``, after BOS when given."""
    if tokens.numel() - length - 1 < 0:
        raise NoLongDocument(f"the training text has {tokens.numel()} tokens, too few for a crop of {length}")
    start = rng.randint(0, tokens.numel() - length - 1)
    body = tokens[start:start + length].long()
    return torch.cat([torch.tensor([bos]), body]) if bos is not None else body


def _stack(rows: list[torch.Tensor], seqlen: int) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.empty(0, seqlen, dtype=torch.long)


def training_blocks(dataset: str, tokenizer, seqlen: int, n: int, sampling: Sampling | str, seed: int, gemma: bool,
                    holdout_part: bool = True) -> tuple[torch.Tensor, dict]:
    """The job's training sequences [≤ n, seqlen] (crop: exactly n) and how they were drawn, for the report."""
    chosen = resolve_sampling(sampling, dataset)
    docs = documents(dataset, "train", holdout_part)
    if chosen is Sampling.pack:
        blocks = pack_documents(docs.joined(), tokenizer, seqlen, max_blocks=n)
        how = ("documents joined by EOS, cut into blocks of [BOS] + (seqlen - 1) tokens (BOS when the tokenizer has one), "
               f"the first {blocks.shape[0]} blocks")
    else:
        try:
            blocks = elsa_crops(docs, tokenizer, n, seqlen, seed, bos_first=gemma)
        except NoLongDocument as err:
            raise ElsaError(f"--sampling crop: {err}; use --sampling pack or a shorter --seqlen") from None
        how = (f"{n} random crops as the ELSA authors' _process_and_tokenize draws them (random.seed({seed}); "
               + ("one text, a random window in it" if docs.stream
                  else f"random documents longer than {seqlen} tokens, a random window in each")
               + ("; [BOS] + (seqlen - 1) tokens, Gemma)" if gemma else "; seqlen tokens of tokenizer(document))"))
    digest = hashlib.sha256(blocks.numpy().tobytes()).hexdigest()[:16]  # equal on every rank and for every world size
    return blocks, {"source": dataset, "part": docs.rule, "sampling": chosen.value, "requested": Sampling(sampling).value,
                    "rule": how, "sequences": int(blocks.shape[0]), "seqlen": seqlen, "sha256": digest}
