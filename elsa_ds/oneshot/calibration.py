"""Calibration sequences for the one-shot methods, sampled as in the SparseGPT / Wanda reference code.

The references seed Python's ``random`` with 0 and draw 128 samples: a random training document with
more than seqlen tokens, then a random window of seqlen tokens inside it. Here the window is
``[BOS] + (seqlen − 1)`` tokens, the convention of every block in elsa_ds (Gemma needs the BOS). A source
whose documents are all too short (short JSONL records, say) falls back to random blocks of the packed
stream; the returned description says which rule was used, and the report records it.
"""
from __future__ import annotations

import random

import torch

from elsa_ds.data import iter_texts, pack_blocks
from elsa_ds.errors import ElsaError

TRIES_PER_SAMPLE = 200  # C4 at seqlen 2048: a few % of documents are long enough, i.e. ~30 tries a sample


def calibration_sequences(source: str, tokenizer, nsamples: int, seqlen: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """``nsamples`` token windows [nsamples, seqlen] from the training split of ``source``, and how they were drawn."""
    docs = [d for d in iter_texts(source, "train") if d]
    if not docs:
        raise ElsaError(f"calibration dataset {source!r} has no training text")
    bos = tokenizer.bos_token_id
    body = seqlen - 1 if bos is not None else seqlen
    rng = random.Random(seed)
    encoded: dict[int, list[int]] = {}
    rows: list[list[int]] = []
    for _ in range(nsamples):
        for _ in range(TRIES_PER_SAMPLE):
            i = rng.randint(0, len(docs) - 1)
            if i not in encoded:
                encoded[i] = tokenizer(docs[i], add_special_tokens=False)["input_ids"]
            ids = encoded[i]
            if len(ids) > body:
                start = rng.randint(0, len(ids) - body - 1)
                rows.append(([bos] if bos is not None else []) + ids[start:start + body])
                break
        else:
            return _packed_fallback(docs, tokenizer, nsamples, seqlen, seed)
    return torch.tensor(rows, dtype=torch.long), (
        f"{nsamples} random windows of {seqlen} tokens (BOS first) from random training documents longer than that, "
        f"random.seed({seed}) as in SparseGPT/Wanda")


def _packed_fallback(docs: list[str], tokenizer, nsamples: int, seqlen: int, seed: int) -> tuple[torch.Tensor, str]:
    blocks = pack_blocks((tokenizer(d, add_special_tokens=False)["input_ids"] for d in docs), seqlen,
                         tokenizer.bos_token_id, tokenizer.eos_token_id)
    if blocks.shape[0] < nsamples:
        raise ElsaError(f"the calibration data gives {blocks.shape[0]} blocks of {seqlen} tokens, fewer than --nsamples "
                        f"{nsamples}; use more text, a shorter --seqlen or fewer --nsamples")
    pick = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(seed))[:nsamples]
    return blocks[pick], (f"{nsamples} random blocks of the packed training stream (no document is longer than "
                          f"{seqlen} tokens), seed {seed}")
