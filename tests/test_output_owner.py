"""One owner per output, through the real entry points: an output that is, contains or sits inside an input is refused
even with --overwrite; a second job on a locked output is refused naming the first; a dead job's lock and staging
folders do not block a new one; evaluate.py keeps an existing result file without --overwrite; a failed final rename
says where the finished output is."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.marks import note_entries
from elsa_ds.files.output import check_output_dir, check_publishable, publish, staging_dir
from elsa_ds.files.ownership import acquire, lock_path, owned
from tests.conftest import ROOT, mounted, run_entry, run_fails


def _fast(model: Path, text_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["--deepspeed", "zero3", "--model", str(model), "--dataset", str(text_dir), "--seqlen", "64", "--nsamples", "8",
            "--val_windows", "4", "--method", "magnitude", *extra, "--output_dir", str(out)]


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def model(tmp_path, tiny_model_dir) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


# ---- outputs apart from inputs ------------------------------------------------------------------------------------------
def test_output_equal_to_the_model_is_refused_even_with_overwrite(model, text_dir):
    before = _digest(model)
    line = run_fails("prune.py", _fast(model, text_dir, model, "--overwrite"), "is inside the input --model", "the very same folder",
                     "--overwrite does not change")
    assert "pass --overwrite" not in line
    assert _digest(model) == before


def test_output_inside_the_model_is_refused(model, text_dir):
    before = _digest(model)
    run_fails("prune.py", _fast(model, text_dir, model / "pruned", "--overwrite"), "is inside the input --model")
    assert _digest(model) == before and not (model / "pruned").exists()


def test_model_inside_the_output_is_refused(tmp_path, tiny_model_dir, text_dir):
    work = tmp_path / "work"
    shutil.copytree(tiny_model_dir, work / "model")
    before = _digest(work)
    run_fails("prune.py", _fast(work / "model", text_dir, work, "--overwrite"), "contains the input --model")
    assert _digest(work) == before


def test_init_mask_and_dataset_inside_the_output_are_refused(tmp_path, tiny_model_dir, text_dir):
    work = tmp_path / "work"
    shutil.copytree(tiny_model_dir, work / "mask")
    shutil.copytree(text_dir, work / "text")
    before = _digest(work)
    args = ["--deepspeed", "zero3", "--model", str(tiny_model_dir), "--dataset", str(text_dir), "--init_mask", str(work / "mask"),
            "--output_dir", str(work), "--overwrite"]
    run_fails("prune.py", args, "contains the input --init_mask")
    run_fails("prune.py", _fast(tiny_model_dir, work / "text", work, "--overwrite"), "contains the input --dataset")
    assert _digest(work) == before


# ---- one job per output ---------------------------------------------------------------------------------------------
def test_a_second_job_on_a_locked_output_is_refused_naming_the_first(tmp_path, tiny_model_dir, text_dir):
    out = tmp_path / "out"
    with owned(out, "--output_dir"):                       # this test process plays the first job
        line = run_fails("prune.py", _fast(tiny_model_dir, text_dir, out), "is being written by another job")
        assert f"pid {os.getpid()} on {socket.gethostname()} since " in line
        assert not out.exists() and not list(tmp_path.glob(".out.partial*"))
    assert not lock_path(out).exists()                       # released on the way out


def test_two_concurrent_jobs_one_refused_the_other_intact(tmp_path, tiny_model_dir, text_dir):
    """Started together with different sparsities: one publishes, the other exits 2; the output is the winner's."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    jobs = {s: subprocess.Popen([sys.executable, str(ROOT / "launch" / "prune.py"), *_fast(tiny_model_dir, text_dir, out, "--sparsity", s)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in ("0.5", "0.6")}
    done = {s: (p, *p.communicate(timeout=300)) for s, p in jobs.items()}
    codes = sorted(p.returncode for p, _, _ in done.values())
    assert codes == [0, 2], {s: err[-2000:] for s, (_, _, err) in done.items()}
    (winner,) = [s for s, (p, _, _) in done.items() if p.returncode == 0]
    (loser,) = [s for s in done if s != winner]
    errors = [line for line in done[loser][2].splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1 and "Traceback" not in done[loser][2]
    assert f"another job (pid {done[winner][0].pid} " in errors[0] or "is not empty" in errors[0], errors[0]
    assert json.loads((out / "elsa_report.json").read_text())["sparsity"] == float(winner)
    assert not lock_path(out).exists() and not list(tmp_path.glob(".out.*"))


@pytest.mark.integration
def test_under_the_launcher_rank_0_alone_takes_the_lock(tmp_path, tiny_model_dir, text_dir):
    """Held elsewhere: one error line (rank 0's), exit 2. Free: two ranks run (rank 1 taking it too would refuse one)."""
    out = tmp_path / "out"
    with owned(out, "--output_dir"):
        proc = run_entry("prune.py", _fast(tiny_model_dir, text_dir, out), ranks=2, check=False, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert proc.returncode == 2 and len(errors) == 1 and f"another job (pid {os.getpid()} " in errors[0], proc.stderr[-3000:]
    run_entry("prune.py", _fast(tiny_model_dir, text_dir, out), ranks=2, timeout=300)
    assert json.loads((out / "elsa_report.json").read_text())["world_size"] == 1 and not lock_path(out).exists()


def test_a_dead_jobs_lock_and_staging_do_not_block_a_new_one(tmp_path, tiny_model_dir, text_dir):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from elsa_ds.files.ownership import acquire; "
                               f"acquire(Path({str(out)!r}), '--output_dir'); print('held', flush=True); time.sleep(600)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)                     # no clean-up: its lock file stays, naming it
    holder.wait()
    assert json.loads(lock_path(out).read_text())["pid"] == holder.pid
    for leftover in (tmp_path / ".out.partial", tmp_path / f".out.partial.{holder.pid}"):  # old fixed name, dead job's
        leftover.mkdir()
        (leftover / "junk.bin").write_bytes(b"x")
    proc = run_entry("prune.py", _fast(tiny_model_dir, text_dir, out))
    assert "taking over the lock" in proc.stderr + proc.stdout and f"pid {holder.pid}" in proc.stderr + proc.stdout
    assert (out / "elsa_report.json").is_file() and not lock_path(out).exists()
    assert (tmp_path / ".out.partial" / "junk.bin").read_bytes() == b"x"   # named in a warning, never deleted


def test_staging_is_named_for_its_job(tmp_path):
    mine = staging_dir(tmp_path / "out")
    other = subprocess.run([sys.executable, "-c", f"from pathlib import Path; from elsa_ds.files.output import staging_dir; "
                            f"print(staging_dir(Path({str(tmp_path / 'out')!r})))"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert mine.parent == tmp_path and mine.name.startswith(".out.partial")
    assert other.stdout.strip() != str(mine)


# ---- evaluate.py --output -------------------------------------------------------------------------------------------
def test_evaluate_keeps_an_existing_result_without_overwrite(tmp_path, tiny_model_dir, text_dir):
    result = tmp_path / "result.json"
    result.write_text('{"mine": 1}\n')
    args = ["--model", str(tiny_model_dir), "--ppl", str(text_dir / "macbeth.txt"), "--seqlen", "64", "--limit", "2", "--output", str(result)]
    run_fails("evaluate.py", args, f"--output {result} exists", "--overwrite")
    assert result.read_text() == '{"mine": 1}\n'
    with owned(result, "--output"):
        line = run_fails("evaluate.py", [*args, "--overwrite"], "is being written by another job")
        assert f"pid {os.getpid()} " in line and result.read_text() == '{"mine": 1}\n'
    run_entry("evaluate.py", [*args, "--overwrite"], timeout=300)
    assert "ppl" in json.loads(result.read_text()) and not lock_path(result).exists()
    assert not list(tmp_path.glob(".result.json*"))        # no temp file, no lock left


# ---- publication ------------------------------------------------------------------------------------------------------
def test_a_failed_final_rename_says_where_the_result_is(tmp_path, monkeypatch):
    out, staging = tmp_path / "out", staging_dir(tmp_path / "out")
    out.mkdir()
    (out / "old.txt").write_text("previous")
    note_entries(out)  # the job's checks passed it
    staging.mkdir()
    (staging / "new.txt").write_text("finished")
    real_rename = Path.rename

    def failing(self, target):
        if self == staging:
            raise PermissionError(13, "Permission denied")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", failing)
    with pytest.raises(ElsaError, match="could not be moved") as err:
        publish(staging, out, keep_checkpoints=False)
    assert f"it is complete in {staging}" in str(err.value) and "Permission denied" in str(err.value)
    assert (out / "old.txt").read_text() == "previous" and (staging / "new.txt").read_text() == "finished"


def test_a_mount_point_output_is_refused_before_the_job():
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(shm.parent).st_dev:
        pytest.skip("no mount point to try here")
    with pytest.raises(ElsaError, match="is a mount point"):
        check_publishable(shm, replaced=True)


def test_mount_points_the_publication_would_meet_are_refused_before_work(tmp_path, tiny_model_dir):
    """An audit (file systems, 2026-12-07): a bind mount of the same file system as the output (elsa-prune), any mount
    as elsa-compress's output, a bind-mounted file as elsa-evaluate's --output, and with --overwrite a mount point inside
    the output (its checkpoints) were met only by the final rename (EBUSY), the run done and left in staging."""
    from elsa_ds.jobs.evaluate import check_new_files
    from elsa_ds.sparse.compress import SparseArgumentError, compress

    (source := tmp_path / "source").mkdir()
    with mounted(tmp_path / "out", "--bind", str(source)) as out:
        with pytest.raises(ElsaError, match=f"--output_dir {out} is a mount point"):
            check_output_dir(out, overwrite=False)
        with pytest.raises(SparseArgumentError, match=f"output {out} is a mount point"):
            compress(tiny_model_dir, out)
    (result := tmp_path / "result.json").write_text("{}")
    (kept := tmp_path / "kept.json").write_text("{}")
    with mounted(result, "--bind", str(kept)):
        with pytest.raises(ElsaError, match=f"--output {result} is a mount point"):
            check_new_files({"--output": result}, overwrite=True)
    previous = tmp_path / "previous"
    (previous / "checkpoints").mkdir(parents=True)
    (previous / "elsa_report.json").write_text("{}")
    (source / "latest").write_text("global_step2")
    with mounted(previous / "checkpoints", "--bind", str(source)):
        with pytest.raises(ElsaError, match=f"holds a mount point \\({previous / 'checkpoints'}\\)"):
            check_output_dir(previous, overwrite=True)
        check_output_dir(previous, overwrite=False, resume=True)  # continued in place: its folders stay where they are


def test_a_folder_overlayfs_cannot_rename_is_refused_before_work(tmp_path):
    """An audit (file systems, 2026-12-07): --overwrite of an output in an overlay's lower layer (a container image's)
    ran the whole job, then its rename aside failed (EXDEV). Refused before work now, nothing renamed to find out; a
    folder made through the overlay (its upper layer alone) renames, and is accepted."""
    for name in ("lower/out/checkpoints", "upper", "work"):
        (tmp_path / name).mkdir(parents=True)
    (tmp_path / "lower" / "out" / "elsa_report.json").write_text("{}")
    options = f"lowerdir={tmp_path / 'lower'},upperdir={tmp_path / 'upper'},workdir={tmp_path / 'work'},redirect_dir=off"
    with mounted(tmp_path / "merged", "-t", "overlay", "-o", options, "overlay") as merged:
        with pytest.raises(ElsaError, match=f"is a folder of its overlay file system's lower layer \\({tmp_path / 'lower' / 'out'}"):
            check_output_dir(merged / "out", overwrite=True)
        assert sorted(p.name for p in merged.iterdir()) == ["out"] and (merged / "out" / "elsa_report.json").exists()
        (merged / "made").mkdir()
        (merged / "made" / "elsa_report.json").write_text("{}")
        check_output_dir(merged / "made", overwrite=True)
        assert sorted(p.name for p in merged.iterdir()) == ["made", "out"]


def test_compress_refuses_an_output_another_job_writes(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    from elsa_ds.sparse.compress import compress

    pruned = tmp_path / "pruned"
    shutil.copytree(tiny_model_dir, pruned)
    weights = load_file(pruned / "model.safetensors")
    save_file({k: (v * (v.abs() > v.abs().median()) if v.dim() == 2 else v) for k, v in weights.items()}, pruned / "model.safetensors",
              metadata={"format": "pt"})
    with owned(tmp_path / "sparse", "output"):
        with pytest.raises(ElsaError, match=f"being written by another job \\(pid {os.getpid()} "):
            compress(pruned, tmp_path / "sparse", min_sparsity=0.4)
    assert not (tmp_path / "sparse").exists()
    compress(pruned, tmp_path / "sparse", min_sparsity=0.4)
    assert (tmp_path / "sparse" / "config.json").is_file() and not lock_path(tmp_path / "sparse").exists()


def test_a_job_refused_before_the_holder_wrote_its_name_waits_for_it(tmp_path, monkeypatch):
    """The holder creates, locks, then names the lock file: a job refused in between names the holder all the same
    (two jobs started together on a loaded host), and says so plainly when the name never comes."""
    import fcntl
    import threading

    out = tmp_path / "out"
    path = lock_path(out)
    held = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)   # another open file description: flock conflicts
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        named = {"pid": 4242, "host": socket.gethostname(), "started": 0.0}
        later = threading.Timer(0.3, lambda: os.pwrite(held, json.dumps(named).encode(), 0))
        later.start()
        with pytest.raises(ElsaError, match="being written by another job \\(pid 4242 on "):
            acquire(out, "--output_dir")
        later.join()
        os.ftruncate(held, 0)
        monkeypatch.setattr("elsa_ds.files.ownership.NAME_WAIT_S", 0.1)
        with pytest.raises(ElsaError, match="a job that has not written its name yet"):
            acquire(out, "--output_dir")
    finally:
        os.close(held)
    assert path.exists() and not out.exists()                   # the refused job removed nothing


def test_resume_of_a_finished_run_says_it_is_finished(tmp_path):
    """--resume on an output a run finished (no checkpoints kept) names the finished run, not a missing 'latest' in a
    checkpoints folder that is not there (a user's walk, 2026-11-30); without a report the old line stays."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.files.output import check_output_dir

    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ElsaError, match="holds no published checkpoint"):
        check_output_dir(out, overwrite=False, resume=True)
    (out / "elsa_report.json").write_text("{}")
    with pytest.raises(ElsaError, match=r"holds a finished run \(elsa_report.json\) and no checkpoint to continue"):
        check_output_dir(out, overwrite=False, resume=True)


def test_a_published_output_is_readable_as_the_process_creates_files(tmp_path):
    """transformers 5 writes model.safetensors 0600 (a private temporary file renamed): a one-shot job's export was
    unreadable to the group that reads its other files (a user's walk, 2026-11-30). Published files take 0666 less the
    umask, as the job's other files do."""
    import stat

    from elsa_ds.files.output import fresh_staging, publish

    out = tmp_path / "out"
    staging = fresh_staging(out)
    (staging / "model.safetensors").write_bytes(b"x")
    (staging / "model.safetensors").chmod(0o600)
    (staging / "config.json").write_text("{}")
    previous = os.umask(0o022)
    try:
        publish(staging, out, keep_checkpoints=False)
    finally:
        os.umask(previous)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {"model.safetensors": 0o644, "config.json": 0o644}


def test_a_requeued_finished_one_shot_job_has_nothing_to_do(tmp_path, model, text_dir):
    """--resume_if_any over a finished run (the same command of a requeue loop) ends with exit 0 and nothing touched; a
    report that is not one a job wrote (a link, not JSON, no settings) is refused in one line, the output as it was."""
    out = tmp_path / "out"
    run_entry("prune.py", _fast(model, text_dir, out))
    digest = _digest(out)
    again = run_entry("prune.py", _fast(model, text_dir, out, "--resume_if_any"), check=False)
    assert again.returncode == 0 and "finished run with these settings (elsa_report.json): nothing to do" in again.stdout
    assert _digest(out) == digest and sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]
    launched = run_entry("prune.py", _fast(model, text_dir, out, "--resume_if_any"), ranks=2, timeout=300)  # every rank ends
    assert "nothing to do" in launched.stdout and _digest(out) == digest
    report = out / "elsa_report.json"
    kept = report.read_bytes()
    elsewhere = tmp_path / "report.json"
    elsewhere.write_bytes(kept)
    for tamper, needle in ((lambda: (report.unlink(), report.symlink_to(elsewhere)), "is not a plain file, which no job writes"),
                           (lambda: report.write_text("{not json"), "cannot be read"),
                           (lambda: report.write_text('{"model": "x"}'), "records no settings to compare")):
        report.unlink()
        report.write_bytes(kept)
        tamper()
        run_fails("prune.py", _fast(model, text_dir, out, "--resume_if_any"), needle)
    report.unlink()
    report.write_bytes(kept)
    (tmp_path / "link").symlink_to(out)
    run_fails("prune.py", _fast(model, text_dir, tmp_path / "link", "--resume_if_any"), "is a symbolic link")
    assert _digest(out) == digest


def test_a_requeued_run_stopped_in_its_evaluation_is_evaluated(tmp_path, model, text_dir):
    """A run is published before its evaluation (--eval_ppl) runs; an attempt stopped there leaves a report without
    one: the requeued command evaluates the output under its lock (a review's find: it was taken as nothing to do)."""
    out = tmp_path / "out"
    args = _fast(model, text_dir, out, "--eval_ppl", str(text_dir / "macbeth.txt"), "--resume_if_any")
    run_entry("prune.py", args)
    report = json.loads((out / "elsa_report.json").read_text())
    evaluation = report.pop("evaluation")
    (out / "elsa_report.json").write_text(json.dumps(report))
    for name in ("eval.json", "eval.md"):
        (out / name).unlink()
    model_files = {k: v for k, v in _digest(out).items() if k != "elsa_report.json"}
    again = run_entry("prune.py", args)
    assert "its evaluation unfinished: evaluating it now" in again.stdout
    assert json.loads((out / "elsa_report.json").read_text())["evaluation"] == evaluation
    assert {k: v for k, v in _digest(out).items() if k not in ("elsa_report.json", "eval.json", "eval.md")} == model_files
    assert "nothing to do" in run_entry("prune.py", args).stdout


@pytest.mark.parametrize("holder", [{"pid": "abc"}, {"pid": 10**30}, {"pid": True}, {"pid": 1, "host": "elsewhere", "started": "x"},
                                    {"pid": 1, "host": "elsewhere", "started": 1e300}, {"pid": 1, "host": ["elsewhere"]}],
                         ids=["pid-text", "pid-huge", "pid-bool", "started-text", "started-huge", "host-list"])
def test_a_lock_files_odd_fields_are_data_never_a_traceback(tmp_path, holder):
    """A second audit: the lock sits in the output's parent, a folder others may write to; a stale lock naming its holder
    with fields of other types (a pid of "abc" or 10**30, a start time of 1e300) ended the refusal in a traceback. Fields
    of other types are dropped: a holder on another or an unknown host is refused in one line, a nameless one taken over."""
    from elsa_ds.files.ownership import release

    out = tmp_path / "out"
    holder = {"host": socket.gethostname(), **holder}
    lock_path(out).write_text(json.dumps(holder))
    if holder["host"] != socket.gethostname():
        with pytest.raises(ElsaError, match=r"being written by another job \(pid 1 on (elsewhere|\?) since an unknown time"):
            acquire(out, "--output")
        return
    fd = acquire(out, "--output")  # no valid pid: nobody to wait for
    assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    release(out, fd)


def test_a_folder_that_is_not_empty_is_offered_resume_only_with_a_checkpoint_to_continue(tmp_path):
    """An audit (2026-12-07): the refusal offered --resume for any folder, and --resume then said there was no checkpoint
    (with no advice); each way it offers is one that gets past it."""
    from elsa_ds.files.output import check_output_dir

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "elsa_fingerprint.json").write_text("{}")  # a run's checkpoints: an elsa_ds output
    with pytest.raises(ElsaError) as refused:
        check_output_dir(out, overwrite=False)
    assert "--overwrite to replace it, or choose another directory" in str(refused.value), refused.value
    with pytest.raises(ElsaError, match="no published checkpoint .*start over with --overwrite in place of --resume"):
        check_output_dir(out, overwrite=False, resume=True)
    check_output_dir(out, overwrite=True)
    (out / "checkpoints" / "latest").write_text("global_step4")
    with pytest.raises(ElsaError, match="--overwrite to replace it, --resume to continue it, or choose another"):
        check_output_dir(out, overwrite=False)
    check_output_dir(out, overwrite=False, resume=True)  # then taken
    check_output_dir(out, overwrite=True)


def test_overwrite_replaces_only_what_an_elsa_ds_command_wrote(tmp_path):
    """A session's leftover: --overwrite replaced any folder whole (``--output_dir ~/models --overwrite`` took every model
    in it). Now only an elsa_ds output goes; elsewhere each refusal's advice, followed, gets past it."""
    from elsa_ds.files.marks import written_by_elsa
    from elsa_ds.files.output import check_output_dir

    out = tmp_path / "models"
    (out / "llama").mkdir(parents=True)
    (out / "checkpoints").mkdir()
    (out / "notes.txt").write_text("mine")
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ElsaError) as refused:
            check_output_dir(out, **{"overwrite": False, **flags})
        assert "empty it yourself first" in str(refused.value) and "pass --overwrite" not in str(refused.value), refused.value
        assert "checkpoints, llama, notes.txt" not in str(refused.value)  # the job's own leftovers not named as the user's
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "llama", "notes.txt"]
    from elsa_ds.settings.options import job_options
    with pytest.raises(ElsaError, match=r"empty it yourself first \(--overwrite replaces only an elsa_ds output\)$"):
        job_options({"deepspeed": "ds_configs/zero3.json", "output_dir": out, "resume_if_any": True})
    (out / "checkpoints" / "elsa_fingerprint.json").write_text("{}")  # a run's checkpoints, cut short before `latest`
    with pytest.raises(ElsaError, match="or --overwrite in place of --resume_if_any to replace it$"):
        job_options({"deepspeed": "ds_configs/zero3.json", "output_dir": out, "resume_if_any": True})
    check_output_dir(out, overwrite=True)
    (out / "checkpoints" / "elsa_fingerprint.json").unlink()
    (out / "elsa_report.json").symlink_to(tmp_path / "elsewhere.json")  # a link is no job's report
    (tmp_path / "elsewhere.json").write_text("{}")
    assert not written_by_elsa(out)
    (out / "elsa_report.json").unlink()
    (out / "config.json").write_text('{"elsa_sparse": "not a block"}')
    assert not written_by_elsa(out)
    (out / "config.json").write_text('{"elsa_sparse": {"version": 3}}')  # a dense model saved from a sparse one carries it
    from safetensors.torch import save_file
    save_file({"w": torch.zeros(2)}, out / "model.safetensors", metadata={"format": "pt"})
    assert not written_by_elsa(out)  # a re-read: the block alone had it replaced whole
    save_file({"w": torch.zeros(2)}, out / "elsa-sparse.safetensors", metadata={"format": "pt", "elsa_sparse": "3"})
    assert written_by_elsa(out)  # elsa-compress's checkpoint: the block and its shards' mark
    check_output_dir(out, overwrite=True)
    for name in ("config.json", "model.safetensors", "elsa-sparse.safetensors"):
        (out / name).unlink()
    (out / "elsa_report.json").write_text("{}")
    check_output_dir(out, overwrite=True)
    (out / "elsa_report.json").unlink()
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").mkdir()  # a user's checkpoints of other models (a review): no run's, though named as one
    (out / "checkpoints" / "llama-70b.safetensors").write_text("weights")
    (out / "checkpoints" / "elsa_fingerprint.json").write_text("{}")
    for name in ("llama", "notes.txt"):
        (out / name).rename(tmp_path / name)
    assert not written_by_elsa(out)
    with pytest.raises(ElsaError, match=r"holds checkpoints, and no elsa_ds output's mark"):
        check_output_dir(out, overwrite=True)
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").symlink_to(tmp_path / "llama", target_is_directory=True)  # a link at the name: no run's
    assert not written_by_elsa(out)
    (out / "checkpoints").unlink()
    (out / "checkpoints").write_text("a file")
    assert not written_by_elsa(out)
    (out / "checkpoints").unlink()
    (out / "checkpoints" / "global_step4").mkdir(parents=True)  # a run's: its tags, latest, its settings, the scripts
    for name in ("latest", "elsa_fingerprint.json", "zero_to_fp32.py", ".latest.123.tmp"):
        (out / "checkpoints" / name).write_text("x")
    for name in ("llama", "notes.txt"):
        (tmp_path / name).rename(out / name)
    assert written_by_elsa(out)  # a run's checkpoints mark it, beside what the user put there
    (out / "checkpoints" / "latest").unlink()
    (out / "elsa_report.json").write_text("{}")
    for name in ("llama", "notes.txt", "elsa_report.json"):
        (out / name).rename(tmp_path / name)  # the advice followed: emptied but for the job's own leftovers
    assert written_by_elsa(out)
    check_output_dir(out, overwrite=False, restart=True)


def test_a_publication_replaces_only_what_its_jobs_checks_found(tmp_path):
    """A fourteenth audit (two commands at once): a job started without --overwrite removed another job's output finished
    inside its own meanwhile, and one with --overwrite an elsa-evaluate result written into it while it ran. Now what
    appeared stops the publication: nothing of it goes, the finished output stays where the line says."""
    from elsa_ds.files.marks import not_replaced
    from elsa_ds.files.output import PublishFailed, check_output_dir, fresh_staging

    out = tmp_path / "A"
    check_output_dir(out, overwrite=False)  # missing: nothing found there
    staging = fresh_staging(out)
    (staging / "elsa_report.json").write_text("new")
    out.mkdir()  # by another job, its output inside this one's
    with owned(out / "B", "--output_dir"):
        (out / "B").mkdir()
        (out / "B" / "elsa_report.json").write_text("B's")
        refusal = not_replaced(out, "--output_dir", overwrite=True)
        assert refusal == (f"--output_dir {out}: {out / 'B'} is being written by another job (pid {os.getpid()} on "
                           f"{socket.gethostname()} since {refusal.split(' since ')[1].split(';')[0]}; lock {out / '.B.lock'}) "
                           "inside it; wait for it to end or choose another folder"), refusal  # not "empty it yourself"
        with pytest.raises(PublishFailed, match=rf"B appeared there while the job ran \({out / 'B'} is being written"):
            publish(staging, out, keep_checkpoints=False)
    with pytest.raises(PublishFailed) as failed:  # its job ended: B's output is still no part of this one's
        publish(staging, out, keep_checkpoints=False)
    assert "B appeared there while the job ran (written by another job or program)" in str(failed.value)
    assert f"it is complete in {staging}: move it to a new path yourself (mv {staging} NEW_PATH)" in str(failed.value)
    assert (out / "B" / "elsa_report.json").read_text() == "B's" and (staging / "elsa_report.json").read_text() == "new"
    shutil.rmtree(out / "B")
    (out / "elsa_report.json").write_text("earlier")  # an elsa_ds output, replaced with --overwrite
    (out / "model.safetensors").write_text("earlier")
    (out / "evals").mkdir()
    with owned(out / "evals" / "ppl.json", "--output"):  # an elsa-evaluate writing below it: refused, not replaced
        with pytest.raises(ElsaError, match=f"{out / 'evals' / 'ppl.json'} is being written by another job"):
            check_output_dir(out, overwrite=True)
    shutil.rmtree(out / "evals")
    check_output_dir(out, overwrite=True)
    (out / "eval.json").write_text("evaluated meanwhile")
    with pytest.raises(PublishFailed, match="eval.json appeared there"):
        publish(staging, out, keep_checkpoints=False)
    assert (out / "eval.json").read_text() == "evaluated meanwhile"
    with pytest.raises(PublishFailed) as failed:  # a run that keeps its checkpoints: nothing of the old output moved yet
        publish(staging, out, keep_checkpoints=True)
    assert f"it is complete in {staging}: move it to a new path yourself (mv {staging} NEW_PATH)" in str(failed.value)
    assert (out / "model.safetensors").read_text() == "earlier" and (staging / "elsa_report.json").read_text() == "new"
    (out / "eval.json").unlink()
    publish(staging, out, keep_checkpoints=False)  # what the checks found goes
    assert sorted(p.name for p in out.iterdir()) == ["elsa_report.json"] and (out / "elsa_report.json").read_text() == "new"


def test_a_second_ablation_into_the_same_out_is_refused_before_it_measures(tmp_path):
    """The audit's other find: two ablations into one --out truncated each other's run log; the second was refused only
    after its checks and measurements, pointing at a log that no longer held its reason."""
    out = tmp_path / "ablation"
    with owned(out, "--out"):
        run_fails("ablate_offload.py", ["--configs", "ds_configs/zero3_offload.json", "--out", str(out)],
                  f"--out {out} is being written by another job (pid {os.getpid()}")
    assert not out.exists() and not lock_path(out).exists()


def test_an_output_inside_one_another_job_writes_is_refused_at_its_start(tmp_path, tiny_model_dir, text_dir):
    """The audit's nested jobs, refused before any work: the inner one's result would have stopped the outer one's
    publication hours later, or gone with its --overwrite. A job's own runs inside its folder (an ablation's) are not."""
    outer = tmp_path / "A"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from elsa_ds.files.ownership import acquire; "
                               f"acquire(Path({str(outer)!r}), '--output_dir'); print('held', flush=True); time.sleep(600)"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        said = f"is inside {outer}, which is being written by another job (pid {holder.pid} on {socket.gethostname()} since "
        run_fails("prune.py", _fast(tiny_model_dir, text_dir, outer / "B"), f"--output_dir {outer / 'B'} {said}",
                  f"lock {lock_path(outer)}); wait for it to end or choose a path outside it")
        assert not outer.exists()
        with pytest.raises(ElsaError, match="which is being written by another job"):
            with owned(outer / "deeper" / "eval.json", "--output"):
                pass
    finally:
        holder.kill()
        holder.wait()
    (outer / "deeper").mkdir(parents=True)
    with owned(outer / "deeper" / "eval.json", "--output"):  # its holder gone: a stale lock blocks nothing
        assert lock_path(outer / "deeper" / "eval.json").exists()
    with owned(outer, "--output_dir"):  # a review: two API jobs of one process, in two threads
        with pytest.raises(ElsaError, match=f"is inside {outer}, which is being written by another job \\(pid {os.getpid()} "):
            with owned(outer / "deeper", "--output_dir"):
                pass


def test_a_lock_held_on_another_host_is_refused_with_the_same_advice_everywhere(tmp_path):
    """A holder on another host cannot be seen to end from here: the lock's own check, the look above an output and
    the look below a folder to replace all call it live, and the two refusals say how to clear a stale one. The
    advice is put in its place, not substituted into the text (a review: an output named "a; wait" took it twice)."""
    from elsa_ds.files.ownership import held_inside

    out = tmp_path / "a; wait"
    lock_path(out).write_text(json.dumps({"pid": 7, "host": "elsewhere", "started": 0}))
    with pytest.raises(ElsaError) as refused:
        acquire(out, "--output_dir")
    assert str(refused.value).count("; if that job is gone, delete the lock file; wait for it to end or choose another path") == 1
    assert str(refused.value).startswith(f"--output_dir {out} is being written by another job (pid 7 on elsewhere since ")
    with pytest.raises(ElsaError, match=r"\) ?; if that job is gone, delete the lock file; wait for it to end or choose a path outside"):
        with owned(out / "inner", "--output_dir"):
            pass
    assert held_inside(tmp_path) == f"{out} is being written by another job (pid 7 on elsewhere since " \
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(0))}; lock {lock_path(out)})"
