"""Prune a causal LM with ELSA under DeepSpeed ZeRO-3.

Embedded default (the shipped Shakespeare Gemma-2 model and corpus, a few minutes on 2 CPU cores):

    deepspeed --num_gpus 2 launch/prune.py --deepspeed ds_configs/zero3_offload.json --output_dir out/demo
    python launch/prune.py --deepspeed ds_configs/zero3_offload.json --output_dir out/demo     # one rank

A real model (Gemma-2-27B, 70% sparsity, C4, paper defaults):

    deepspeed launch/prune.py --deepspeed ds_configs/zero3_offload.json \\
        --model google/gemma-2-27b --dataset c4 --sparsity 0.7 --output_dir out/gemma2-27b-70

Every flag may also sit in the "elsa" block of the DeepSpeed JSON; the command line wins.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.cli import main_prune  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_prune())
