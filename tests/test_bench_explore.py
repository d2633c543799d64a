"""bench/explore.py end to end on the tiny model: ELSA on the reference path with the defaults rule, then fixed-mask
fine-tuning from its output (the mask kept exactly), each scored on held-out text by the evaluation code."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from bench.explore import main
from elsa_ds.models import load_causal_lm
from elsa_ds.settings.defaults import elsa_settings

ARGS = ["--seqlen", "32", "--steps", "4", "--limit", "4"]


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_elsa_then_fixed_mask_fine_tuning_keep_exact_zeros(tmp_path, tiny_model_dir, text_dir, capsys):
    val = str(text_dir / "othello.txt")
    common = ["--model", str(tiny_model_dir), "--dataset", str(text_dir), "--eval", val, *ARGS]
    assert main(["--mode", "elsa", "--sparsity", "0.5", "--set", "interval=2", "--out", str(tmp_path / "elsa"), *common]) == 0
    elsa = _last_json(capsys)
    n = sum(p.numel() for p in load_causal_lm(str(tiny_model_dir), torch.float32).parameters())
    assert elsa["settings"]["lr"] == elsa_settings(n, 0.5, 4).values["lr"]     # unset: the rule's, as launch/prune.py applies it
    assert elsa["settings"]["interval"] == 2 and elsa["min_zeros"] == pytest.approx(0.5, abs=1e-3)
    assert elsa["ppl"] > 1 and json.loads((tmp_path / "elsa" / "eval.json").read_text())["ppl"][val]["ppl"] == elsa["ppl"]

    assert main(["--mode", "ft", "--start", str(tmp_path / "elsa"), "--sparsity", "0.5", "--set", "lr=0.01",
                 "--out", str(tmp_path / "ft"), *common]) == 0
    ft = _last_json(capsys)
    assert ft["settings"]["lr"] == 0.01 and ft["ppl"] != elsa["ppl"]          # it trained ...
    before, after = load_file(tmp_path / "elsa" / "model.safetensors"), load_file(tmp_path / "ft" / "model.safetensors")
    pruned = [k for k, w in before.items() if w.dim() == 2 and float((w == 0).float().mean()) > 0.4]
    assert pruned and all(k in after for k in pruned)
    for k in pruned:
        assert ((before[k] == 0) == (after[k] == 0)).all(), k                 # ... inside exactly the start's mask
    assert not (after[pruned[0]] == before[pruned[0]]).all()


def test_bad_settings_stop_before_any_training(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--mode", "ft", "--out", str(tmp_path / "x")])                   # ft without a pruned start
    with pytest.raises(SystemExit):
        main(["--set", "lr", "--out", str(tmp_path / "x")])                    # not key=value
    assert not (tmp_path / "x").exists()
