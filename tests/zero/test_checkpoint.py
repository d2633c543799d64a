"""Checkpoint, resume after SIGKILL, corrupted checkpoints, NaN faults, and the emulated two-node launch."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from elsa_ds.capacity.memory import model_shape
from elsa_ds.capacity.resident import checkpoint_tag_bytes
from elsa_ds.settings.config import resolve_config

from tests.conftest import ROOT, derived_config, nan_at_step_env, run_entry

pytestmark = pytest.mark.integration

STEPS = 12
ARGS = ["--seqlen", "64", "--steps", str(STEPS), "--interval", "4", "--sparsity", "0.7", "--lr", "1e-3", "--lmda", "0.05",
        "--val_windows", "0", "--baseline", "none", "--micro_batch", "2"]


def _args(ds, model, text, out, *extra):
    return ["--deepspeed", str(ds), "--model", str(model), "--dataset", str(text), *ARGS, "--output_dir", str(out), *extra]


def _weights(out):
    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_model_dir, text_dir):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    ds = derived_config(tmp, bf16={"enabled": False})
    run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, tmp / "out"))
    return ds, _weights(tmp / "out")


def _latest_step(ckpt):
    latest = ckpt / "latest"
    return int(latest.read_text().removeprefix("global_step")) if latest.exists() else 0


def test_sigkill_at_random_step_then_resume_matches_uninterrupted(tmp_path, tiny_model_dir, text_dir, uninterrupted):
    ds, reference = uninterrupted
    out = tmp_path / "out"
    kill_after = random.choice([2, 4, 6, 8])  # a checkpoint every 2 steps; kill once this one is published
    cmd = [sys.executable, str(ROOT / "launch" / "prune.py"), *_args(ds, tiny_model_dir, text_dir, out, "--save_interval", "2")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    while _latest_step(out / "checkpoints") < kill_after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = _latest_step(out / "checkpoints")
    assert killed_at >= kill_after, proc.stderr.read().decode()[-3000:]
    assert not (out / "model.safetensors").exists() or killed_at == STEPS
    proc2 = run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, "--save_interval", "2", "--resume"))
    assert f"continuing at step {killed_at}" in proc2.stdout
    resumed = _weights(out)
    for name, w in reference.items():
        assert torch.equal(w != 0, resumed[name] != 0), name
        assert torch.equal(w, resumed[name]), name  # bit for bit (2026-12-01: β^t replayed on resume)
    assert len([p for p in (out / "checkpoints").iterdir() if p.name.startswith("global_step")]) <= 2  # keep_checkpoints


def test_corrupted_newest_checkpoint_falls_back_to_previous(tmp_path, tiny_model_dir, text_dir, uninterrupted):
    ds, reference = uninterrupted
    out = tmp_path / "out"
    run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, "--save_interval", "4", "--keep_checkpoints", "3"))
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step8"
    # each tag is what the estimate and the pre-flight check count a checkpoint to take (DeepSpeed's files as written)
    cfg = resolve_config(json.loads(ds.read_text()), {"model": str(tiny_model_dir)})
    each = checkpoint_tag_bytes(model_shape(AutoConfig.from_pretrained(tiny_model_dir), cfg.targets), cfg, 4)  # fp32
    for tag in ("global_step4", "global_step8"):
        written = sum(f.stat().st_size for f in (ckpt / tag).iterdir())
        assert each <= written <= 1.02 * each + 64 * 1024, (tag, written, each)
    for f in (ckpt / "global_step8").glob("*optim_states.pt"):
        f.write_bytes(f.read_bytes()[:100])  # a crash mid-write
    for f in out.glob("*.safetensors"):
        f.unlink()
    proc = run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, "--save_interval", "4", "--resume"))
    assert "global_step8 is unreadable" in proc.stdout and "continuing at step 4" in proc.stdout
    report = json.loads((out / "elsa_report.json").read_text())
    assert (report["steps"], report["resumed_at_step"]) == (STEPS, 4)  # wall_s: this attempt's, which began at step 4
    resumed = _weights(out)
    for name, w in reference.items():
        assert torch.equal(w != 0, resumed[name] != 0), name


def test_nan_stops_with_step_and_keeps_last_checkpoint(tmp_path, tiny_model_dir, text_dir):
    ds = derived_config(tmp_path, bf16={"enabled": False})
    out = tmp_path / "out"
    env_step = "5"
    env = nan_at_step_env(env_step)
    proc = run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, "--save_interval", "2", "--freeze_embeddings"),
                     check=False, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"at step {env_step}" in proc.stderr
    assert "start over with a lower --lr or --lmda (--overwrite)" in proc.stderr  # not "resume with", which is refused
    assert (out / "checkpoints" / "latest").read_text() == "global_step4"
    # a checkpoint holds the frozen embedding's partitions too, in the engine's dtype (a review's find, 2026-11-30)
    cfg = resolve_config(json.loads(ds.read_text()), {"model": str(tiny_model_dir), "freeze_embeddings": True})
    shape = model_shape(AutoConfig.from_pretrained(tiny_model_dir), cfg.targets, freeze_embeddings=True)
    each, written = checkpoint_tag_bytes(shape, cfg, 4), sum(f.stat().st_size for f in (out / "checkpoints" / "global_step4").iterdir())
    assert shape.num_params > shape.trainable_params and each <= written <= 1.02 * each + 64 * 1024, (written, each)
    assert not (out / "model.safetensors").exists()
    changed = run_entry("prune.py", [*_args(ds, tiny_model_dir, text_dir, out, "--resume"), "--sparsity", "0.5"], check=False)
    assert changed.returncode == 2 and "sparsity" in changed.stderr and "Traceback" not in changed.stderr


def test_one_command_line_for_every_attempt_of_a_requeued_job(tmp_path, tiny_model_dir, text_dir, uninterrupted):
    """SLURM requeues a job with the command line it was submitted with (a user's walk, 2026-11-30: --resume refused the
    first attempt, its absence the second). --resume_if_any starts fresh without a checkpoint, over what an attempt
    killed inside its first save left (its unpublished tag goes, its monitor log stays: reviews' finds), resumes with
    one, refuses a folder holding anything else; the attempts end where the uninterrupted run does, with nothing beside the
    output. Once it has finished, the same command has nothing to do (exit 0, the output as it was); other settings are refused."""
    ds, reference = uninterrupted
    out = tmp_path / "out"
    (out / "checkpoints" / "global_step2").mkdir(parents=True)  # an attempt killed inside its first save, and its log
    (out / "checkpoints" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"cut short")
    (out / "monitor").mkdir()
    (out / "monitor" / "loss.csv").write_text("step,loss\n")
    args = _args(ds, tiny_model_dir, text_dir, out, "--save_interval", "2", "--resume_if_any")
    first = run_entry("prune.py", args, check=False, env=nan_at_step_env(5))  # stopped after its step-4 checkpoint
    assert first.returncode == 2 and "--resume_if_any: no checkpoint in" in first.stdout, first.stderr[-2000:]
    assert "unpublished checkpoints go (global_step2: never published), its monitor logs stay" in first.stdout
    assert (out / "checkpoints" / "latest").read_text() == "global_step4"
    assert not (out / "checkpoints" / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes() == b"cut short"
    second = run_entry("prune.py", args)
    assert "--resume_if_any: continuing from the checkpoints in" in second.stdout and "continuing at step 4" in second.stdout
    resumed = _weights(out)
    for name, w in reference.items():
        assert torch.equal(w != 0, resumed[name] != 0), name
        assert torch.equal(w, resumed[name]), name  # bit for bit (2026-12-01: β^t replayed on resume)
    assert (out / "monitor" / "loss.csv").read_text().startswith("step,loss\n")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no folder set aside, nothing left beside it
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    again = run_entry("prune.py", args, check=False)  # the requeue loop's next attempt: its job is done
    assert again.returncode == 0 and "holds a finished run with these settings (elsa_report.json): nothing to do" in again.stdout
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    for extra, needle in ((["--sparsity", "0.5"], "holds a finished run with other settings (that run vs this one: sparsity 0.7 vs 0.5); "
                           "--overwrite in place of --resume_if_any replaces it"),  # not "--overwrite" beside it (an audit)
                          (["--export_format", "sparse"], 'export_format "dense" vs "sparse"'),
                          (["--output_dir", str(other)], "has no checkpoint to continue and holds notes.txt"),
                          (["--output_dir", str(other)], "or empty it yourself first (--overwrite replaces only an elsa_ds output)"),
                          (["--resume"], "--resume_if_any decides whether to resume by itself; drop --resume"),
                          (["--overwrite"], "--resume_if_any decides whether to resume by itself; drop --overwrite")):
        refused = run_entry("prune.py", [*args, *extra], check=False)
        assert refused.returncode == 2 and needle in refused.stderr, refused.stderr[-2000:]
    assert (other / "notes.txt").read_text() == "mine"


def test_emulated_two_nodes_match_one_node(tmp_path, tiny_model_dir, text_dir, uninterrupted):
    """Two emulated nodes of one rank each end with the mask of the uninterrupted one-rank run (one node); that one and
    two ranks on one node give the reference mask is tests/zero/test_reference_masks.py's."""
    ds, one_node = uninterrupted
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "multinode_local.sh"), str(ROOT / "launch" / "prune.py"),
                           *_args(ds, tiny_model_dir, text_dir, tmp_path / "two_nodes")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "two_nodes" / "elsa_report.json").read_text())
    assert report["world_size"] == 2
    a, b = one_node, _weights(tmp_path / "two_nodes")
    agree = sum(int(((a[k] != 0) == (b[k] != 0)).sum()) for k in report["layers"])
    assert agree / sum(a[k].numel() for k in report["layers"]) >= 0.999


def test_elsal_on_minifloat_adam_resumes_where_an_uninterrupted_run_ends(tmp_path, tiny_model_dir, text_dir):
    """ELSA-L on elsa_ds's own 8-bit Adam (minifloat codes): a run stopped after its step-4 checkpoint (a NaN at step 5)
    and resumed ends where the uninterrupted run does. The uint8 codes and their maps must come back through DeepSpeed's
    checkpoint as they were: codes read back as fp32 would send the resumed steps down bitsandbytes' 32-bit path."""
    ds = derived_config(tmp_path, "zero3_offload_elsal.json", bf16={"enabled": False})
    extra = ("--base_optimizer", "adam8bit_minifloat", "--save_interval", "2")
    run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, tmp_path / "ref", *extra))
    out = tmp_path / "out"
    env = nan_at_step_env(5)
    stopped = run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, *extra), check=False, env=env)
    assert stopped.returncode == 2 and (out / "checkpoints" / "latest").read_text() == "global_step4", stopped.stderr[-2000:]
    resumed = run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, *extra, "--resume"))
    assert "continuing at step 4" in resumed.stdout
    report = json.loads((out / "elsa_report.json").read_text())
    if report["kernels"]["available"]:  # the resumed steps stepped minifloat codes, through the fused kernel
        assert set(report["kernels"]["x_steps"]) == {"adam8bit/minifloat"}, report["kernels"]
    reference, got = _weights(tmp_path / "ref"), _weights(out)
    for name, w in reference.items():
        assert torch.equal(w != 0, got[name] != 0), name
        assert torch.equal(w, got[name]), name


@pytest.mark.parametrize("schedule", ["constant", "adaptive"])
def test_a_bf16_run_resumed_before_its_first_projection_ends_bit_for_bit_where_the_uninterrupted_one_does(
        tmp_path, tiny_model_dir, text_dir, schedule):
    """The shipped configs train in bf16 (a walk, 2026-12-01: a demo run killed and resumed ended with 64 other mask
    entries). A resumed first step took β^t as ``pow`` where the uninterrupted run multiplied it up (a float32 ulp apart
    at t = 3), the masters moved an ulp, bf16 rounded some of them the other way, and the runs parted. Resumed from step
    2, the run ends with the uninterrupted run's bytes: the fused x-step (constant λ) and DeepSpeedCPUAdam's own step
    (the adaptive λ's eager path) alike."""
    ds = derived_config(tmp_path, bf16={"enabled": True})
    extra = ("--lmda_schedule", schedule)
    run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, tmp_path / "ref", *extra))
    out = tmp_path / "out"
    first = run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, "--save_interval", "2", *extra), check=False,
                      env=nan_at_step_env(3))
    assert first.returncode == 2 and (out / "checkpoints" / "latest").read_text() == "global_step2"
    run_entry("prune.py", _args(ds, tiny_model_dir, text_dir, out, "--resume", *extra))
    reference, resumed = _weights(tmp_path / "ref"), _weights(out)
    assert [k for k in reference if not torch.equal(reference[k], resumed[k])] == []
