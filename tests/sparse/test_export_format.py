"""--export_format sparse through launch/prune.py: the job publishes an elsa-sparse checkpoint that loads back to the
dense export bit for bit, with the report's per-layer zeros, and refuses a run that prunes nothing before any work."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds.sparse import from_pretrained
from tests.conftest import derived_config, run_entry, run_fails

pytestmark = pytest.mark.integration

ELSA = ["--seqlen", "64", "--steps", "4", "--interval", "2", "--lr", "1e-3", "--lmda", "0.05", "--micro_batch", "2",
        "--nsamples", "8", "--init_mask", "none", "--val_windows", "0", "--baseline", "none"]


def _prune(tmp_path, model_dir, text_dir, name, *extra, ranks=None):
    out = tmp_path / name
    run_entry("prune.py", ["--deepspeed", str(derived_config(tmp_path)), "--model", str(model_dir), "--dataset", str(text_dir),
                           *extra, "--output_dir", str(out)], ranks=ranks)
    return out, json.loads((out / "elsa_report.json").read_text())


def test_oneshot_sparse_export_loads_to_the_dense_export_bit_for_bit(tmp_path, tiny_model_dir, text_dir):
    common = ["--method", "magnitude", "--sparsity", "0.9", "--seqlen", "64", "--val_windows", "0"]
    dense_out, _ = _prune(tmp_path, tiny_model_dir, text_dir, "dense", *common)
    sparse_out, report = _prune(tmp_path, tiny_model_dir, text_dir, "sparse", *common, "--export_format", "sparse")
    meta = json.loads((sparse_out / "config.json").read_text())["elsa_sparse"]
    assert meta["format"] == "elsa-sparse" and set(meta["tensors"]) == set(report["layers"])
    assert report["export"]["format"] == "sparse" and report["export"]["pruned_ratio"] <= 0.2  # 90 %: delta8 code
    assert report["export"]["files_bytes"] < report["export"]["dense_files_bytes"]
    assert (sparse_out / "tokenizer.json").is_file() and not list(tmp_path.glob(".sparse*"))  # nothing left beside it
    expected = load_file(dense_out / "model.safetensors")
    loaded = from_pretrained(sparse_out, mode="dense").state_dict()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


def test_elsa_on_two_ranks_publishes_a_sparse_checkpoint(tmp_path, tiny_model_dir, text_dir):
    out, report = _prune(tmp_path, tiny_model_dir, text_dir, "elsa", *ELSA, "--export_format", "sparse", ranks=2)
    assert report["method"] == "elsa" and report["export"]["format"] == "sparse"
    model = from_pretrained(out, mode="dense")
    weights = dict(model.named_parameters())
    for name, layer in report["layers"].items():
        assert int((weights[name] == 0).sum()) == layer["zeros"], name   # exact sparsity survives the code
    source = json.loads((tiny_model_dir / "config.json").read_text())
    assert source.get("use_cache", True) and json.loads((out / "config.json").read_text())["use_cache"]  # was False
    sparse = from_pretrained(out, mode="sparse")
    assert sparse.generation_config.use_cache  # generate() decodes with a KV cache: one row per step, the kernel's
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        torch.testing.assert_close(sparse(ids).logits, model(ids).logits, rtol=1e-3, atol=1e-4)


def test_a_run_that_prunes_nothing_is_refused_before_work(tmp_path, tiny_model_dir, text_dir):
    out = tmp_path / "control"
    run_fails("prune.py", ["--deepspeed", str(derived_config(tmp_path)), "--model", str(tiny_model_dir), "--dataset",
                           str(text_dir), "--method", "dense", "--finetune", "full", "--export_format", "sparse",
                           "--output_dir", str(out)], "--export_format sparse", "prunes nothing")
    assert not out.exists()
