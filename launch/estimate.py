"""Estimate the memory of an ELSA job from the model config and the DeepSpeed config alone.

    python launch/estimate.py --model google/gemma-2-27b --deepspeed ds_configs/zero3_offload_elsal.json --num_gpus 1
    python launch/estimate.py --model meta-llama/Llama-2-13b-hf --deepspeed ds_configs/zero3_nvme.json --num_gpus 8 --num_nodes 2 --json
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from elsa_ds.cli import estimate_command  # noqa: E402

if __name__ == "__main__":
    estimate_command()
