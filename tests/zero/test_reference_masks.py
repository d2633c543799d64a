"""ZeRO-3 with CPU offload on 1 and 2 ranks reproduces the single-process reference mask (the adaptive λ too, resumed)."""
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
from tests.conftest import derived_config, nan_at_step_env, run_entry

pytestmark = pytest.mark.integration

ARGS = ["--seqlen", "64", "--steps", "12", "--interval", "4", "--sparsity", "0.6", "--lr", "1e-3", "--lmda", "0.05",
        "--val_windows", "0", "--baseline", "none", "--micro_batch", "2", "--seed", "3", "--init_mask", "none"]


def _reference_masks(ds_path, model_dir, text_dir, **settings) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = DsConfig.load(ds_path).raw
    cfg = resolve_config(raw, {"model": str(model_dir), "dataset": str(text_dir), "seqlen": 64, "steps": 12, "interval": 4,
                               "sparsity": 0.6, "lr": 1e-3, "lmda": 0.05, "micro_batch": 2, "seed": 3, **settings})
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


def test_adaptive_lambda_on_two_ranks_reproduces_the_reference_and_resumes(tmp_path, tiny_model_dir, text_dir):
    """The adaptive λ (a λ per layer, moved at each projection from residuals summed over the ranks) through the real
    engine: two ranks of ZeRO-3 + CPU offload pick the single-process reference's masks; the per-layer λ live in the
    optimizer state, so a run stopped after its step-4 checkpoint (a NaN at step 5) and resumed ends where the
    uninterrupted run does, λ by λ."""
    ds_path = derived_config(tmp_path, bf16={"enabled": False})
    extra = ["--lmda_schedule", "adaptive", "--save_interval", "2"]
    common = ["--deepspeed", str(ds_path), "--model", str(tiny_model_dir), "--dataset", str(text_dir), *ARGS, *extra]
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "whole")], ranks=2)
    env = nan_at_step_env(5)
    out = tmp_path / "resumed"
    stopped = run_entry("prune.py", [*common, "--output_dir", str(out)], ranks=2, check=False, env=env)
    assert stopped.returncode == 2 and (out / "checkpoints" / "latest").read_text() == "global_step4", stopped.stderr[-2000:]
    resumed = run_entry("prune.py", [*common, "--output_dir", str(out), "--resume"], ranks=2)
    assert "continuing at step 4" in resumed.stdout
    whole, again = (json.loads((tmp_path / d / "elsa_report.json").read_text()) for d in ("whole", "resumed"))
    spreads = [p["lambda_range"] for p in whole["projections"] if not p["final"]]
    assert len(spreads) == 2 and spreads != [[0.05, 0.05]] * 2, spreads  # λ moved
    assert [p["lambda_range"] for p in again["projections"] if not p["final"] and p["step"] > 4] == spreads[1:]
    reference = _reference_masks(ds_path, tiny_model_dir, text_dir, lmda_schedule="adaptive")
    first, second = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    agree = total = 0
    for name, ref_mask in reference.items():
        assert torch.equal(first[name] != 0, second[name] != 0) and torch.allclose(first[name], second[name], atol=1e-5), name
        assert int((first[name] == 0).sum()) == round(0.6 * ref_mask.numel()), name
        agree += int(((first[name] != 0) == ref_mask).sum())
        total += ref_mask.numel()
    assert agree / total >= 0.999, f"mask agreement {agree / total:.5f} with the reference"
