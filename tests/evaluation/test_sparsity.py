"""Sparsity report of saved models: exact zero counts per layer and the N:M pattern."""
from __future__ import annotations

import torch
from safetensors.torch import load_file

from elsa_ds.evaluation.sparsity import nm_patterns, sparsity_report
from tests.evaluation.conftest import SPARSITY, zero_smallest, zero_two_of_four


def test_sixty_percent_is_reported_exactly(sixty_model_dir):
    report = sparsity_report(sixty_model_dir)
    assert len(report["layers"]) == 14  # 2 decoder layers x (q, k, v, o, gate, up, down)
    for name, layer in report["layers"].items():
        assert layer["zeros"] == round(SPARSITY * layer["numel"]), name
        assert abs(layer["sparsity"] - SPARSITY) <= 0.5 / layer["numel"]
        assert layer["pattern"] == "unstructured"
    zeros = sum(v["zeros"] for v in report["layers"].values())
    assert report["pruned_numel"] == sum(v["numel"] for v in report["layers"].values())
    assert report["overall"] == zeros / report["pruned_numel"]
    assert abs(report["overall"] - SPARSITY) < 1e-4
    assert report["pattern"] == "unstructured"


def test_only_decoder_weights_are_counted(sixty_model_dir):
    saved = load_file(str(sixty_model_dir / "model.safetensors"))
    layers = sparsity_report(sixty_model_dir)["layers"]
    assert "model.embed_tokens.weight" in saved and "model.embed_tokens.weight" not in layers
    assert all(".layers." in name for name in layers)


def test_two_four_model(two_four_model_dir, tiny_model_dir):
    report = sparsity_report(two_four_model_dir)
    assert report["pattern"] == "2:4"
    assert {v["pattern"] for v in report["layers"].values()} == {"2:4"}
    assert report["overall"] == 0.5
    assert sparsity_report(tiny_model_dir)["pattern"] == "dense"


def test_nm_patterns_on_tensors():
    torch.manual_seed(0)
    w = torch.randn(8, 16)
    assert nm_patterns(w) == []
    two_four = w.clone()
    zero_two_of_four(two_four)
    assert nm_patterns(two_four) == ["2:4", "4:8"]  # every 2:4 mask is a 4:8 mask
    four_eight = w.clone()
    four_eight[:, 0:4] = 0  # 4 zeros per group of 8, all in one half: 4:8 but not 2:4
    four_eight[:, 8:12] = 0
    assert nm_patterns(four_eight) == ["4:8"]
    unstructured = w.clone()
    zero_smallest(unstructured, 96)  # 75% zeros, but one row keeps a dense group of four
    unstructured[0, :4] = 1.0
    assert nm_patterns(unstructured) == []
    assert nm_patterns(torch.zeros(4, 6)) == []  # 6 inputs: no whole groups of 4 or 8
