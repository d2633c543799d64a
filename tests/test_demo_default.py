"""The README's main command on the embedded default: prunes the shipped model, starting from SparseGPT's (the
defaults rule at 70 % over a short budget), and ends below that start's validation perplexity."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_entry

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # ~9 min on 2 cores: run with --slow


def test_default_run_beats_its_sparsegpt_start(tmp_path):
    out = tmp_path / "out" / "demo"  # as in the README on a fresh clone: out/ does not exist yet
    proc = run_entry("prune.py", ["--deepspeed", "ds_configs/zero3_offload.json", "--output_dir", str(out)], ranks=2, timeout=1500)
    report = json.loads((out / "elsa_report.json").read_text())
    assert report["method"] == "elsa" and report["world_size"] == 2 and report["dataset"] == "shakespeare"
    assert (report["init_mask"], report["init_weights"]) == ("sparsegpt", True)  # the rule's start, said in the report
    assert {"init_mask", "init_weights"} <= set(report["defaults"]["applied"])
    ppl = report["ppl"]
    assert ppl["pruned"] < ppl["warm_start"] and ppl["dense"] is not None, ppl
    assert "lower than its warm start (sparsegpt)" in proc.stdout
    assert len(report["layers"]) == 28  # 4 decoder layers x (q, k, v, o, gate, up, down)
    for name, layer in report["layers"].items():
        assert layer["zeros"] == round(0.7 * layer["numel"]), name

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    w = model.model.layers[0].mlp.down_proj.weight
    assert int((w == 0).sum()) == round(0.7 * w.numel())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tie survived export
    assert torch.isfinite(w).all()
