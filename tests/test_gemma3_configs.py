"""The shipped Gemma-3 configs: offline resolution with the model cards' parameter counts, only the text decoder pruned
by default, and ``elsa-estimate --model google/gemma-3-27b-pt`` through the real entry point with the hub switched off."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elsa_ds.capacity.shapes import model_shape, resolve_model_config
from tests.conftest import ROOT


@pytest.mark.parametrize("size, params", [("1b", 999_885_952), ("4b", 4_300_079_472), ("12b", 12_187_325_040),
                                          ("27b", 27_432_406_640)])
def test_gemma3_configs_resolve_offline_with_the_model_cards_sizes(size, params, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = resolve_model_config(f"google/gemma-3-{size}-pt")
    shape = model_shape(config)
    assert shape.num_params == params
    text = getattr(config, "text_config", config)
    assert shape.layers == text.num_hidden_layers and "full_attention" in text.layer_types and "sliding_attention" in text.layer_types
    # pruned: the text decoder's linears only (embeddings and, on 4B-27B, the vision tower and projector are kept)
    assert 0.55 * shape.num_params < shape.pruned_params < shape.num_params - text.vocab_size * text.hidden_size


def test_estimate_gemma3_27b_offline_through_the_entry_point():
    exe = shutil.which("elsa-estimate", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, str(ROOT / "launch" / "estimate.py")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/nonexistent-hf-home"}
    proc = subprocess.run([*cmd, "--model", "google/gemma-3-27b-pt", "--deepspeed", "zero3_offload", "--num_gpus", "8", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["num_params"] == 27_432_406_640
    assert result["per_gpu_bytes"] > 0 and result["per_node_cpu_bytes"] > 0
