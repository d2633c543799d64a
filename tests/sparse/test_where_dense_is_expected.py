"""An elsa-sparse checkpoint given where a model is expected: transformers finds none of its pruned weights under their
names (values and positions are stored) and builds them at random with a warning only, so the evaluation read 5019
where the dense export reads 69 (a user's walk through the README). The evaluation loads it through its own loader,
decompressed, and scores what the dense export scores; a pruning job refuses it as --model or --init_mask, one line."""
from __future__ import annotations

import json

import pytest

from elsa_ds.cli import main_evaluate, main_prune

EVAL = ["--ppl", "shakespeare", "--seqlen", "64", "--limit", "4", "--batch_size", "4"]


def test_the_evaluation_scores_a_sparse_checkpoint_as_the_dense_export_it_was_made_from(pruned_dir, sparse_dir, tmp_path):
    results = {}
    for name, model in (("dense", pruned_dir), ("sparse", sparse_dir)):
        out = tmp_path / f"{name}.json"
        assert main_evaluate(["--model", str(model), *EVAL, "--output", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    dense, sparse = results["dense"], results["sparse"]
    assert sparse["ppl"]["shakespeare"]["ppl"] == dense["ppl"]["shakespeare"]["ppl"]  # bit for bit: the same weights
    assert sparse["sparsity"]["overall"] == pytest.approx(dense["sparsity"]["overall"]) and dense["sparsity"]["overall"] > 0.5
    assert sparse["sparsity"]["layers"].keys() == dense["sparsity"]["layers"].keys()


@pytest.mark.parametrize("flag", ["--model", "--init_mask"])
def test_a_pruning_job_refuses_a_sparse_checkpoint_in_one_line(sparse_dir, tmp_path, capsys, flag):
    args = ["--deepspeed", "zero3_offload", "--output_dir", str(tmp_path / "out"), "--steps", "2"]
    args += ["--model", str(sparse_dir)] if flag == "--model" else ["--init_mask", str(sparse_dir)]
    assert main_prune(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1 and f"{flag} {sparse_dir} is an elsa-sparse checkpoint" in errors[0], errors
    assert not (tmp_path / "out").exists()
