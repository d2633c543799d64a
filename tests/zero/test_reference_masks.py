"""ZeRO-3 with CPU offload on 1 and 2 ranks reproduces the single-process reference mask."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds.data import GlobalBatches, load_blocks
from elsa_ds.reference import train_reference
from elsa_ds.settings.config import resolve_config
from elsa_ds.targets import select_targets
from elsa_ds.zero.ds_config import DsConfig
from tests.conftest import derived_config, run_entry

pytestmark = pytest.mark.integration

ARGS = ["--seqlen", "64", "--steps", "12", "--interval", "4", "--sparsity", "0.6", "--lr", "1e-3", "--lmda", "0.05",
        "--val_windows", "0", "--baseline", "none", "--micro_batch", "2", "--seed", "3", "--init_mask", "none"]


def _reference_masks(ds_path, model_dir, text_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = DsConfig.load(ds_path).raw
    cfg = resolve_config(raw, {"model": str(model_dir), "dataset": str(text_dir), "seqlen": 64, "steps": 12, "interval": 4,
                               "sparsity": 0.6, "lr": 1e-3, "lmda": 0.05, "micro_batch": 2, "seed": 3})
    tok = AutoTokenizer.from_pretrained(model_dir)
    blocks = load_blocks(cfg.dataset, "train", tok, cfg.seqlen, max_blocks=cfg.steps * raw["train_batch_size"])
    batches = GlobalBatches(blocks, raw["train_batch_size"], 2, 1, 0, cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return train_reference(model, cfg, batches, select_targets(model, None), raw["gradient_clipping"])


def test_zero3_offload_one_and_two_ranks_reproduce_reference(tmp_path, tiny_model_dir, text_dir):
    ds_path = derived_config(tmp_path, bf16={"enabled": False})
    common = ["--deepspeed", str(ds_path), "--model", str(tiny_model_dir), "--dataset", str(text_dir), *ARGS]
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "r1")])
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "r2")], ranks=2)
    reference = _reference_masks(ds_path, tiny_model_dir, text_dir)
    for out in ("r1", "r2"):
        weights = load_file(tmp_path / out / "model.safetensors")
        report = json.loads((tmp_path / out / "elsa_report.json").read_text())
        assert report["world_size"] == (1 if out == "r1" else 2)
        agree = total = 0
        for name, ref_mask in reference.items():
            mask = weights[name] != 0
            assert int((~mask).sum()) == round(0.6 * mask.numel()), name       # exact sparsity per layer
            assert report["layers"][name]["zeros"] == round(0.6 * mask.numel())
            agree += int((mask == ref_mask).sum())
            total += mask.numel()
        print(out, agree / total)
        assert agree / total >= 0.999, f"{out}: mask agreement {agree / total:.5f} with the reference"
