"""Prune a causal LM with ELSA under DeepSpeed ZeRO-3.

Embedded default (the shipped Shakespeare Gemma-2 model and corpus, a few minutes on 2 CPU cores):

    deepspeed --num_gpus 2 launch/prune.py --deepspeed ds_configs/zero3_offload.json --output_dir out/demo
    python launch/prune.py --deepspeed ds_configs/zero3_offload.json --output_dir out/demo     # one rank

A real model with the paper's Gemma-2-27B settings at 70% sparsity (recipes/gemma-2-27b-s70.json: C4 crops, 4096 steps of
8 x 2048 tokens, lr 2e-5, paper λ 2e-3 = 1e-3 here, cosine λ schedule; the file cites where each value comes from):

    deepspeed launch/prune.py --deepspeed ds_configs/zero3_offload.json --recipe gemma-2-27b-s70 --output_dir out/gemma2-27b-70

Every flag may also sit in the "elsa" block of the DeepSpeed JSON; the command line wins. Rank 0 logs progress at
--log_level (info; warning keeps warnings and errors only), the other ranks their warnings and errors.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.cli import prune_command  # noqa: E402

if __name__ == "__main__":
    prune_command()
