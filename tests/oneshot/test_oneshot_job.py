"""--method magnitude|wanda|sparsegpt through launch/prune.py: the ELSA output format, exact patterns, profiles."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds import torch_api
from elsa_ds.evaluation.sparsity import sparsity_report
from elsa_ds.jobs.phases import PHASE_LOG_ENV, read_phases
from tests.conftest import derived_config, run_entry, run_fails

pytestmark = pytest.mark.integration

COMMON = ["--seqlen", "64", "--nsamples", "8", "--val_windows", "4"]
REPORT_KEYS = {"model", "method", "dataset", "sparsity", "pattern", "steps", "world_size", "config", "final_loss", "lambda",
               "residual", "admm_state_bytes_per_param", "ppl", "layers", "overall_sparsity", "wall_s", "versions"}


def _run(tmp_path, tiny_model_dir, text_dir, name, *extra, ranks=None, env=None):
    out = tmp_path / name
    proc = run_entry("prune.py", ["--deepspeed", str(derived_config(tmp_path)), "--model", str(tiny_model_dir),
                                  "--dataset", str(text_dir), *COMMON, *extra, "--output_dir", str(out)], ranks=ranks, env=env)
    return out, json.loads((out / "elsa_report.json").read_text()), proc


def test_wanda_two_four_and_evaluation_at_the_end(tmp_path, tiny_model_dir, text_dir):
    from tests.evaluation.test_zeroshot import write_task

    write_task(tmp_path)
    text = str(text_dir / "macbeth.txt")
    out, report, proc = _run(tmp_path, tiny_model_dir, text_dir, "wanda", "--method", "wanda", "--pattern", "2:4",
                             "--eval_ppl", text, "--eval_tasks", "elsa_tiny_mc", "--eval_include_path", str(tmp_path / "tasks"))
    evaluation = json.loads((out / "eval.json").read_text())
    assert evaluation["sparsity"]["pattern"] == "2:4" and evaluation["seqlen"] == 64
    assert report["evaluation"]["ppl"][text] == evaluation["ppl"][text]["ppl"]
    assert report["evaluation"]["tasks"]["elsa_tiny_mc"] == evaluation["tasks"]["elsa_tiny_mc"]["acc"]
    assert (out / "eval.md").read_text().count("|") > 4
    assert REPORT_KEYS <= report.keys() and report["method"] == "wanda" and report["sparsity"] == 0.5
    assert report["calibration"]["sequences"] == 8 and "random windows" in report["calibration"]["sampling"]
    assert sparsity_report(out)["pattern"] == "2:4"                     # the evaluation's own reading of the files
    assert {layer["pattern"] for layer in report["layers"].values()} == {"2:4"}
    # validated on the held-out part of text_dir (a random model: 2:4 Wanda may move its perplexity either way)
    assert report["ppl"]["dense"] is not None and report["ppl"]["pruned"] not in (None, report["ppl"]["dense"])
    assert report["ppl"]["validation"]["source"] == str(text_dir) and "held out" in report["ppl"]["validation"]["part"]
    assert report["ppl"]["protocol"]["name"] == "window" and report["ppl"]["windows"] == 4
    assert "wanda" in proc.stdout and "calibration" in proc.stdout


def test_magnitude_four_eight_is_per_layer_magnitude(tmp_path, tiny_model_dir, text_dir):
    phases = tmp_path / "phases.jsonl"  # the phases bench/memory.py --oneshot times its memory by
    out, report, _ = _run(tmp_path, tiny_model_dir, text_dir, "mag", "--method", "magnitude", "--pattern", "4:8",
                          env={PHASE_LOG_ENV: str(phases)})
    assert [m["phase"] for m in read_phases(phases)] == ["load", "validation", "prune", "validation", "export", "verify", "publish", "done"]
    assert sparsity_report(out)["pattern"] in ("4:8", "2:4") and report["calibration"] is None
    dense, pruned = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    w, p = dense["model.layers.1.mlp.up_proj.weight"], pruned["model.layers.1.mlp.up_proj.weight"]
    kept = p != 0
    assert p.dtype == (torch.bfloat16 if torch_api.cpu_bf16_matmul_is_fast() else torch.float32)  # as ELSA's engine writes it
    w = w.to(p.dtype)  # the weights as the job held them: rounded to what it saves before anything is measured
    assert torch.equal(p[kept], w[kept])                                  # magnitude never changes a kept weight
    groups, keep = w.float().abs().view(w.shape[0], -1, 8), kept.view(w.shape[0], -1, 8)
    assert bool((keep.sum(-1) == 4).all())                                # 4 of every 8, the largest (ties either way)
    assert bool((groups.masked_fill(~keep, torch.inf).amin(-1) >= groups.masked_fill(keep, -1).amax(-1)).all())


def test_sparsegpt_profile_under_the_deepspeed_launcher(tmp_path, tiny_model_dir, text_dir):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({r"layers\.0\.self_attn": 0.3, r"layers\.1\.mlp\.down_proj": 0.9}))
    out, report, proc = _run(tmp_path, tiny_model_dir, text_dir, "sgpt", "--method", "sparsegpt", "--sparsity", "0.6",
                             "--sparsity_profile", str(profile), ranks=2)
    assert "rank 1: sparsegpt runs in one process" in proc.stdout
    assert report["calibration"]["blocksize"] == 128 and report["calibration"]["percdamp"] == 0.01
    layers = sparsity_report(out)["layers"]
    for name, layer in layers.items():
        want = 0.3 if "layers.0.self_attn" in name else 0.9 if "layers.1.mlp.down_proj" in name else 0.6
        assert layer["zeros"] == round(want * layer["numel"]), name
        assert report["layers"][name]["target"] == want
    dense, pruned = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    kept = pruned[name] != 0
    assert not torch.allclose(pruned[name][kept], dense[name][kept].to(pruned[name].dtype))  # SparseGPT updates the kept weights


def test_bad_profile_and_pattern_inputs(tmp_path, tiny_model_dir, text_dir):
    profile = tmp_path / "typo.json"
    profile.write_text(json.dumps({r"layers\.0\.self_atn": 0.3}))
    ds = str(derived_config(tmp_path))
    cases = [
        (["--sparsity_profile", str(profile)], "match no pruned layer"),
        (["--pattern", "2:4", "--sparsity", "0.7"], "means sparsity 0.5"),
        (["--pattern", "4:2"], "0 < N < M"),
        (["--method", "wanda", "--init_mask", "magnitude"], "init_mask warm-starts ELSA"),
        (["--init_mask", str(tmp_path)], "init_mask"),
        (["--init_weights"], "set --init_mask too"),
        (["--eval_tasks", "no_such_task_xyz"], "unknown task"),
    ]
    for extra, needle in cases:
        run_fails("prune.py", ["--deepspeed", ds, "--model", str(tiny_model_dir), "--dataset", str(text_dir), *COMMON, *extra,
                               "--output_dir", str(tmp_path / "o")], needle)
        assert not (tmp_path / "o").exists()


def test_random_init_builds_the_one_shot_model_from_its_config(tmp_path, tiny_model_dir, text_dir):
    """An audit (2026-12-07): --method magnitude --random_init on a folder holding a config and tokenizer alone passed the
    plan, then failed loading the weights --random_init says not to read (ELSA's engine builds from the config)."""
    import shutil

    bare = tmp_path / "config_only"
    shutil.copytree(tiny_model_dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    out, report, _ = _run(tmp_path, bare, text_dir, "random", "--method", "magnitude", "--random_init")
    assert report["config"]["random_init"] is True and report["ppl"]["pruned"] is not None
    assert all(layer["zeros"] == round(0.7 * layer["numel"]) for layer in report["layers"].values())
