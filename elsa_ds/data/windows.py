"""Perplexity windows with the published protocols, chosen per model family (L = seqlen).

``stream`` — SparseGPT / Wanda (``datautils.py``, ``lib/data.py`` and ``eval_ppl``), every published Llama/OPT table::

    ids = tokenizer(text, return_tensors="pt").input_ids     # BOS only where the tokenizer puts it: once, first
    window i = ids[:, i·L:(i+1)·L]   (remainder dropped),   labels = window[1:]
    ppl = exp(Σ NLL / (n·(L−1)))                             # = exp(mean of the windows' mean losses)

``window`` — the ELSA authors' Gemma protocol (hyeondo-jang/prune_lora ``lib/eval.py``, ``calculate_ppl``, as of commit
9494189 "FIX gemma evaluation", 2025-09-14, unchanged at the repository's head ae217f7, 2025-11-18)::

    the same windows, window[0] overwritten by BOS,         labels = window[1:] (the text's tokens 1..L−1)
    ppl = exp(Σ NLL / (n·L))                                 # their denominator nsamples·seqlen, L−1 tokens predicted

``prepend`` — the same function at commit 2947127 (2025-09-12), which 9494189 replaced: BOS is put in front of the L−1
tokens that start at i·L (the window's last token is never read), labels = those L−1 tokens, the same denominator
(their batch size 1; with a larger batch that version sliced batch·(L−1) consecutive tokens, a different layout)::

    window i = [BOS] + ids[i·L : i·L+L−1],                  labels = window[1:] (the text's tokens 0..L−2)
    ppl = exp(Σ NLL / (n·L))

Beside these, ``PplWindows.per_token`` gives exp(Σ NLL / predicted tokens), the mean per predicted token (the same number
as ``perplexity`` for ``stream``).

``auto`` — ``window`` for the Gemma family (the authors' test: "Gemma" in the architecture), ``stream`` otherwise.

The text: the documents joined by a blank line (WikiText-2 test: its lines; a local source: its documents), or C4's one
text (the first 1100 validation documents joined by a space) truncated to 256·L tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from elsa_ds.data.sources import Documents, documents, evaluation_documents
from elsa_ds.errors import ElsaError

C4_WINDOWS = 256  # SparseGPT/Wanda: C4 validation truncated to 256 x seqlen tokens


class PplProtocol(str, Enum):
    auto = "auto"      # window for Gemma, stream otherwise
    stream = "stream"  # SparseGPT/Wanda: consecutive windows of the once-tokenized text
    window = "window"  # ELSA authors (Gemma): the same windows, first token of each overwritten by BOS
    prepend = "prepend"  # ELSA authors at commit 2947127 (Gemma): BOS + the first L-1 tokens of each window


LAYOUTS = {
    PplProtocol.stream: "the joined text tokenized once (tokenizer(text), BOS only where the tokenizer puts it), cut into "
                        "consecutive windows ids[i*L:(i+1)*L], remainder dropped; labels = tokens 1..L-1 of each window; "
                        "ppl = exp(sum NLL / (windows * (L-1))) (SparseGPT/Wanda eval_ppl)",
    PplProtocol.window: "the same consecutive windows with the first token of every window overwritten by BOS; labels = "
                        "the window's tokens 1..L-1; ppl = exp(sum NLL / (windows * L)) (the ELSA authors' calculate_ppl "
                        "for Gemma since commit 9494189, denominator nsamples * seqlen included)",
    PplProtocol.prepend: "BOS followed by the first L-1 tokens of each consecutive window ids[i*L:(i+1)*L] (its last token "
                         "unread); labels = those L-1 tokens; ppl = exp(sum NLL / (windows * L)) (the ELSA authors' "
                         "calculate_ppl for Gemma at commit 2947127, batch size 1)",
}


def is_gemma(model_config) -> bool:
    """The ELSA authors' test for their Gemma handling ("Gemma" in the architecture name), or a gemma model_type."""
    architectures = getattr(model_config, "architectures", None) or []
    return "gemma" in (getattr(model_config, "model_type", "") or "") or any("Gemma" in a for a in architectures[:1])


def resolve_protocol(protocol: PplProtocol | str, model_config) -> PplProtocol:
    protocol = PplProtocol(protocol)
    if protocol is PplProtocol.auto:
        return PplProtocol.window if is_gemma(model_config) else PplProtocol.stream
    return protocol


@dataclass
class PplWindows:
    """Validation windows [n, L] as the model sees them, and what they are."""

    ids: torch.Tensor
    protocol: PplProtocol
    requested: PplProtocol
    source: str
    rule: str
    documents: int
    text_tokens: int

    @property
    def seqlen(self) -> int:
        return int(self.ids.shape[1])

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])

    def perplexity(self, nll_sum: float, tokens: int) -> float:
        """exp(Σ NLL / denominator) of this protocol (``tokens`` = predicted tokens = windows · (L − 1))."""
        return math.exp(nll_sum / self.denominator(tokens)) if tokens else float("nan")

    def denominator(self, tokens: int) -> float:
        """What this protocol divides Σ NLL by: the predicted ``tokens`` (stream), or windows · L (window, prepend: the
        authors' n·L, ``tokens`` · L / (L − 1))."""
        return tokens if self.protocol is PplProtocol.stream else tokens * self.seqlen / (self.seqlen - 1)

    def per_token(self, nll_sum: float, tokens: int) -> float:
        """exp(Σ NLL / predicted tokens): the mean per predicted token, whatever the protocol's denominator."""
        return math.exp(nll_sum / tokens) if tokens else float("nan")

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "part": self.rule, "documents": self.documents, "text_tokens": self.text_tokens,
                "windows": self.count, "seqlen": self.seqlen,
                "protocol": {"name": self.protocol.value, "requested": self.requested.value, "layout": LAYOUTS[self.protocol]}}


def ppl_windows(docs: Documents, source: str, tokenizer, seqlen: int, protocol: PplProtocol, requested: PplProtocol | None = None,
                max_windows: int | None = None) -> PplWindows:
    """The windows of ``docs`` under a resolved ``protocol`` (stream or window), at most ``max_windows``."""
    if protocol is PplProtocol.auto:
        raise ValueError("resolve the protocol for the model first (resolve_protocol)")
    texts = docs.joined()
    ids = tokenizer("\n\n".join(texts), return_tensors="pt", verbose=False).input_ids[0]
    caps = [c for c in (C4_WINDOWS if source == "c4" else None, max_windows) if c is not None]
    n = min([ids.numel() // seqlen, *caps])
    windows = ids[:n * seqlen].reshape(n, seqlen).clone()
    if protocol is not PplProtocol.stream and n:
        if tokenizer.bos_token_id is None:
            raise ElsaError(f"the {protocol.value} perplexity protocol puts BOS first in every window, but this tokenizer has no "
                            "BOS token; use --ppl_protocol stream")
        if protocol is PplProtocol.prepend:
            windows = torch.cat([windows[:, :1], windows[:, :-1]], dim=1)
        windows[:, 0] = tokenizer.bos_token_id
    return PplWindows(windows, protocol, requested or protocol, source, docs.rule, len(texts), int(ids.numel()))


def validation_windows(dataset: str, val_dataset: str | None, tokenizer, seqlen: int, protocol: PplProtocol | str, model_config,
                       max_windows: int | None) -> PplWindows:
    """A pruning job's validation windows: ``val_dataset`` read like ``launch/evaluate.py --ppl`` reads it, or the
    validation part of ``dataset`` (never its training part)."""
    source, resolved = val_dataset or dataset, resolve_protocol(protocol, model_config)
    if max_windows == 0:
        return PplWindows(torch.empty(0, seqlen, dtype=torch.long), resolved, PplProtocol(protocol), source,
                          "not measured (0 windows asked for)", 0, 0)
    docs = evaluation_documents(val_dataset) if val_dataset else documents(dataset, "validation")
    return ppl_windows(docs, source, tokenizer, seqlen, resolved, PplProtocol(protocol), max_windows)
