"""Calibration sequences for the one-shot methods, drawn as the reference that published each family's numbers draws them.

Non-Gemma models: SparseGPT / Wanda (``get_c4`` / ``get_wikitext2``): ``random.seed(seed)``; per sample, random training
documents until one has more than seqlen tokens, then a random window of seqlen tokens of ``tokenizer(document)`` (BOS
only where the tokenizer puts it). Gemma: the ELSA authors' loader (their baselines' calibration), ``[BOS] + (seqlen − 1)``
tokens per window. Both in ``elsa_ds.data.sampling``. Only the training part of a source is read (never its held-out
validation documents). A source whose documents are all too short (short JSONL records, say) falls back to random
blocks of the packed stream; the returned description says which rule was used, and the report records it.
"""
from __future__ import annotations

import torch

from elsa_ds.data import documents, elsa_crops, pack_documents, wanda_crops
from elsa_ds.data.sampling import NoLongDocument
from elsa_ds.errors import ElsaError


def calibration_sequences(source: str, tokenizer, nsamples: int, seqlen: int, seed: int = 0, *, gemma: bool,
                          holdout_part: bool = True) -> tuple[torch.Tensor, str]:
    """``nsamples`` token windows [nsamples, seqlen] from the training part of ``source``, and how they were drawn."""
    docs = documents(source, "train", holdout_part)
    if len(docs.texts) == 0:
        raise ElsaError(f"calibration dataset {source!r} has no training text")
    try:
        if gemma:
            return elsa_crops(docs, tokenizer, nsamples, seqlen, seed, bos_first=True), (
                f"{nsamples} random windows of [BOS] + {seqlen - 1} tokens from random training documents longer than {seqlen} "
                f"tokens, random.seed({seed}), as the ELSA authors' loader draws them for Gemma")
        return wanda_crops(docs, tokenizer, nsamples, seqlen, seed), (
            f"{nsamples} random windows of {seqlen} tokens of tokenizer(document) from random training documents longer than "
            f"that, random.seed({seed}), as in SparseGPT/Wanda")
    except NoLongDocument:
        return _packed_fallback(docs.joined(), tokenizer, nsamples, seqlen, seed)


def _packed_fallback(docs, tokenizer, nsamples: int, seqlen: int, seed: int) -> tuple[torch.Tensor, str]:
    blocks = pack_documents(docs, tokenizer, seqlen)
    if blocks.shape[0] < nsamples:
        raise ElsaError(f"the calibration data gives {blocks.shape[0]} blocks of {seqlen} tokens, fewer than --nsamples "
                        f"{nsamples}; use more text, a shorter --seqlen or fewer --nsamples")
    pick = torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(seed))[:nsamples]
    return blocks[pick], (f"{nsamples} random blocks of the packed training stream (no document is longer than "
                          f"{seqlen} tokens), seed {seed}")
