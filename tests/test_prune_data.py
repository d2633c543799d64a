"""The pruning job's data through launch/prune.py: validation files named by split, validated exactly as
launch/evaluate.py measures them, and random crops that give the same global batches on 1 and 2 ranks."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import derived_config, play_text, run_entry

pytestmark = pytest.mark.integration

SEQLEN, VAL_WINDOWS = 64, 8


def test_split_directory_validation_and_crops_on_one_and_two_ranks(tmp_path, tiny_model_dir):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.txt").write_text(play_text("macbeth"), encoding="utf-8")
    (data / "validation.txt").write_text(play_text("othello")[:20000], encoding="utf-8")
    ds_path = derived_config(tmp_path, bf16={"enabled": False})
    common = ["--deepspeed", str(ds_path), "--model", str(tiny_model_dir), "--dataset", str(data), "--sampling", "crop",
              "--seqlen", str(SEQLEN), "--steps", "6", "--interval", "2", "--sparsity", "0.6", "--lr", "1e-3", "--lmda", "0.05",
              "--val_windows", str(VAL_WINDOWS), "--baseline", "none", "--micro_batch", "2", "--seed", "1"]
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "r1")])
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "r2")], ranks=2)
    r1, r2 = (json.loads((tmp_path / r / "elsa_report.json").read_text()) for r in ("r1", "r2"))

    # validation: the file named for it, never the training file; the protocol of launch/evaluate.py
    ppl = r1["ppl"]
    assert ppl["validation"]["source"] == str(data) and "validation.txt" in ppl["validation"]["part"]
    assert ppl["windows"] == VAL_WINDOWS and ppl["protocol"]["name"] == "window" and ppl["protocol"]["requested"] == "auto"
    out = tmp_path / "dense.json"
    run_entry("evaluate.py", ["--model", str(tiny_model_dir), "--ppl", str(data / "validation.txt"), "--seqlen", str(SEQLEN),
                              "--limit", str(VAL_WINDOWS), "--output", str(out)], timeout=300)
    dense = json.loads(out.read_text())
    assert dense["ppl"][str(data / "validation.txt")]["windows"] == VAL_WINDOWS and dense["protocol"]["ppl"] == "window"
    assert abs(ppl["dense"] / dense["ppl"][str(data / "validation.txt")]["ppl"] - 1) < 1e-5, (ppl["dense"], dense["ppl"])

    # training: the ELSA authors' crops of train.txt, identical on 1 and 2 ranks, hence the same steps and masks
    t1, t2 = r1["training_data"], r2["training_data"]
    assert t1["sampling"] == "crop" and "train.txt" in t1["part"] and t1["sequences"] == 6 * 8
    assert t1["sha256"] == t2["sha256"] and r1["world_size"] == 1 and r2["world_size"] == 2
    for a, b in zip(r1["projections"], r2["projections"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    w1, w2 = load_file(tmp_path / "r1" / "model.safetensors"), load_file(tmp_path / "r2" / "model.safetensors")
    agree = sum(int(((w1[k] != 0) == (w2[k] != 0)).sum()) for k in r1["layers"])
    assert agree / sum(w1[k].numel() for k in r1["layers"]) >= 0.999
