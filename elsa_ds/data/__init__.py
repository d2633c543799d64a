"""Text sources -> token blocks -> deterministic global batches (``sources.py``, ``splits.py``, ``blocks.py``,
``sampling.py``), and perplexity windows with the published protocols (``windows.py``)."""
from __future__ import annotations

from elsa_ds.data.blocks import GlobalBatches, load_blocks, load_tokenizer, pack_blocks, pack_documents
from elsa_ds.data.sampling import Sampling, elsa_crops, resolve_sampling, training_blocks, wanda_crops
from elsa_ds.data.sources import DEMO_DATASET, LOCAL_SUFFIXES, Documents, documents, evaluation_documents, iter_texts, local_files
from elsa_ds.data.windows import PplProtocol, PplWindows, is_gemma, ppl_windows, resolve_protocol, validation_windows

__all__ = ["DEMO_DATASET", "LOCAL_SUFFIXES", "Documents", "GlobalBatches", "PplProtocol", "PplWindows", "Sampling", "documents",
           "elsa_crops", "evaluation_documents", "is_gemma", "iter_texts", "load_blocks", "load_tokenizer", "local_files",
           "pack_blocks", "pack_documents", "ppl_windows", "resolve_protocol", "resolve_sampling", "training_blocks",
           "validation_windows", "wanda_crops"]
