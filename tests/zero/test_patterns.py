"""ELSA under ZeRO-3 with N:M patterns cut by partition boundaries, per-layer profiles and warm starts,
held to the single-process reference."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds.data import GlobalBatches, load_blocks
from elsa_ds.evaluation.sparsity import sparsity_report
from elsa_ds.files.mask_file import MaskReader, write_masks
from elsa_ds.methods import OneShot
from elsa_ds.models import ModelSource
from elsa_ds.oneshot.pipeline import load_host_model, prune_oneshot
from elsa_ds.reference import train_reference
from elsa_ds.settings.config import resolve_config
from elsa_ds.targets import select_targets
from elsa_ds.zero.ds_config import DsConfig
from tests.conftest import derived_config, run_entry

pytestmark = pytest.mark.integration

SETTINGS = {"seqlen": 64, "steps": 8, "interval": 4, "lr": 1e-3, "lmda": 0.05, "micro_batch": 2, "seed": 1, "nsamples": 8,
            "init_mask": "none"}  # x₀ dense unless a test warm-starts
ARGS = [a for k, v in SETTINGS.items() for a in (f"--{k}", str(v))] + ["--val_windows", "0", "--baseline", "none"]


def _reference(ds_path, model_dir, text_dir, init_masks=None, **settings) -> dict[str, torch.Tensor]:
    return _reference_run(ds_path, model_dir, text_dir, init_masks, **settings)[0]


def _reference_run(ds_path, model_dir, text_dir, init_masks=None, **settings) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The reference's masks and its trained weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    raw = DsConfig.load(ds_path).raw
    cfg = resolve_config(raw, {"model": str(model_dir), "dataset": str(text_dir), **SETTINGS, **settings})
    tok = AutoTokenizer.from_pretrained(model_dir)
    blocks = load_blocks(cfg.dataset, "train", tok, cfg.seqlen, max_blocks=cfg.steps * raw["train_batch_size"])
    batches = GlobalBatches(blocks, raw["train_batch_size"], cfg.micro_batch, 1, 0, cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    masks = train_reference(model, cfg, batches, select_targets(model, cfg.targets), raw["gradient_clipping"], init_masks)
    return masks, {n: t.detach().clone() for n, t in model.state_dict().items()}


def _agreement(out, reference) -> float:
    weights = load_file(out / "model.safetensors")
    agree = sum(int(((weights[n] != 0) == m).sum()) for n, m in reference.items())
    return agree / sum(m.numel() for m in reference.values())


def test_two_four_with_groups_cut_by_the_partition_boundary(tmp_path, ragged_model_dir, text_dir):
    """gate/up_proj [99, 36]: rank 1's partition starts at entry 1782, in the middle of a group of 4."""
    ds = derived_config(tmp_path, bf16={"enabled": False})
    targets = r"mlp\.(gate|up)_proj"
    out = tmp_path / "nm"
    run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(ragged_model_dir), "--dataset", str(text_dir), *ARGS,
                           "--pattern", "2:4", "--targets", targets, "--eval_ppl", str(text_dir / "othello.txt"),
                           "--output_dir", str(out)], ranks=2)
    report = json.loads((out / "elsa_report.json").read_text())
    assert report["evaluation"]["ppl"][str(text_dir / "othello.txt")] > 1.0    # rank 0 evaluated after the others left
    assert report["world_size"] == 2 and len(report["layers"]) == 4
    assert {v["pattern"] for v in report["layers"].values()} == {"2:4"}
    assert sparsity_report(out, targets)["pattern"] == "2:4"
    reference = _reference(ds, ragged_model_dir, text_dir, pattern="2:4", targets=targets)
    assert _agreement(out, reference) >= 0.999


def test_profile_and_wanda_warm_start_match_the_reference(tmp_path, tiny_model_dir, text_dir):
    """--init_mask wanda computed on rank 0 of 2 = the same Wanda masks handed to the reference; the profile holds exactly."""
    ds = derived_config(tmp_path, bf16={"enabled": False})
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({r"layers\.0\.": 0.5, r"down_proj": 0.8}))
    out = tmp_path / "warm"
    proc = run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(text_dir), *ARGS,
                                  "--sparsity", "0.6", "--sparsity_profile", str(profile), "--init_mask", "wanda",
                                  "--output_dir", str(out)], ranks=2)
    assert "z warm-started from wanda" in proc.stdout
    assert not list(tmp_path.glob(".*init_mask*"))                       # the hand-over file is cleaned up
    report = json.loads((out / "elsa_report.json").read_text())
    for name, layer in report["layers"].items():
        want = 0.5 if "layers.0." in name else 0.8 if "down_proj" in name else 0.6
        assert layer["zeros"] == round(want * layer["numel"]), name

    settings = {"sparsity": 0.6, "sparsity_profile": str(profile)}
    cfg = resolve_config(DsConfig.load(ds).raw, {"model": str(tiny_model_dir), "dataset": str(text_dir), **SETTINGS, **settings})
    from transformers import AutoTokenizer

    model = load_host_model(ModelSource(str(tiny_model_dir)))
    done = prune_oneshot(cfg, OneShot.wanda, AutoTokenizer.from_pretrained(tiny_model_dir), model)
    write_masks(tmp_path / "wanda.safetensors", done.masks)
    warm = _reference(ds, tiny_model_dir, text_dir, MaskReader(tmp_path / "wanda.safetensors"), **settings)
    cold = _reference(ds, tiny_model_dir, text_dir, **settings)
    assert _agreement(out, warm) >= 0.999
    assert _agreement(out, cold) < _agreement(out, warm)                  # the warm start really changed the run


def test_sparsegpt_warm_start_of_x_matches_the_reference(tmp_path, tiny_model_dir, text_dir):
    """--init_mask sparsegpt --init_weights: x₀ is SparseGPT's pruned (reconstructed) model, computed on rank 0 of 2 and
    handed over through a directory that is gone by the end; the run matches the reference started from that model."""
    ds = derived_config(tmp_path, bf16={"enabled": False})
    out = tmp_path / "warm_x"
    proc = run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(text_dir), *ARGS,
                                  "--init_mask", "sparsegpt", "--init_weights", "--val_windows", "4", "--output_dir", str(out)], ranks=2)
    assert "z warm-started from sparsegpt, x too" in proc.stdout
    assert not list(tmp_path.glob(".*init_*"))                           # the masks and the x₀ copy are cleaned up
    report = json.loads((out / "elsa_report.json").read_text())
    ppl = report["ppl"]
    assert report["init_weights"] is True and ppl["magnitude_oneshot"] is None and report["vs_magnitude"] is None
    # dense: measured on rank 0 before pruning (the engine only ever held the pruned x₀), so it differs from the start's
    assert ppl["dense"] != pytest.approx(ppl["warm_start"], rel=1e-3) and "warm start (sparsegpt)" in proc.stdout

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = resolve_config(DsConfig.load(ds).raw, {"model": str(tiny_model_dir), "dataset": str(text_dir), **SETTINGS})
    done = prune_oneshot(cfg, OneShot.sparsegpt, tok, load_host_model(ModelSource(str(tiny_model_dir))))
    write_masks(tmp_path / "sparsegpt.safetensors", done.masks)
    done.model.save_pretrained(tmp_path / "sparsegpt")
    tok.save_pretrained(tmp_path / "sparsegpt")
    masks = MaskReader(tmp_path / "sparsegpt.safetensors")
    warm_x, x_weights = _reference_run(ds, tmp_path / "sparsegpt", text_dir, masks)
    _, z_weights = _reference_run(ds, tiny_model_dir, text_dir, masks)     # z warm-started only: x₀ dense
    assert _agreement(out, warm_x) >= 0.999
    trained = load_file(out / "model.safetensors")

    def distance(reference: dict[str, torch.Tensor]) -> float:
        return max(float((w.float() - reference[n]).abs().max()) for n, w in trained.items() if n in reference)

    assert distance(x_weights) * 10 < distance(z_weights)               # x₀ really was SparseGPT's reconstruction
