"""Text sources -> token blocks -> deterministic global batches (``sources.py``, ``blocks.py``)."""
from __future__ import annotations

from elsa_ds.data.blocks import GlobalBatches, load_blocks, load_tokenizer, pack_blocks
from elsa_ds.data.sources import DEMO_DATASET, LOCAL_SUFFIXES, iter_texts, local_files

__all__ = ["DEMO_DATASET", "LOCAL_SUFFIXES", "GlobalBatches", "iter_texts", "load_blocks", "load_tokenizer", "local_files", "pack_blocks"]
