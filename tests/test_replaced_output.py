"""What a job removes, moves or replaces: never a user's file, never a finished result (an audit's finds, 2026-11-29).

A final rename that fails keeps the finished output where the error says; --overwrite sets the previous output's
checkpoints and logs aside (not deleted) and puts them back when the job does not publish; publishing into a kept
checkpoint folder leaves none of the previous output's files mixed with the new ones; a stopped sparse export leaves
nothing beside the output; an output named by a link, by . or .., or around the working directory, the Python
environment, the home directory or the Hugging Face cache is refused; evaluate never writes over a --markdown file
without --overwrite, nor over one of its inputs."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elsa_ds import cli
from elsa_ds.errors import ElsaError
from elsa_ds.files.io import write_atomic
from elsa_ds.errors import guarded, signals_held
from elsa_ds.files.aside import ALL_MOVED_OUT, aside_dir, move_out, old_dir, set_aside, settle_old
from elsa_ds.files.marks import note_entries, run_writes
from elsa_ds.files.output import PublishFailed, check_output_path, fresh_staging, publish, staging_dir
from elsa_ds.jobs.owner import kept_output, discard_unpublished, resumable_paths
from elsa_ds.sparse.export import sparse_paths
from tests.conftest import ROOT
from tests.inprocess import one_line, run_main
from tests.test_left_behind import _listing

JOB = """
import json, sys
from pathlib import Path
import elsa_ds
from elsa_ds.files.safetensors_writer import ShardedWriter
out, how = Path(sys.argv[1]), sys.argv[2]
if how == "rename fails":
    real = Path.rename
    def rename(self, target):
        if self.name.startswith(".o.partial.") and Path(target) == out:  # the final rename only
            raise PermissionError(13, "Permission denied")
        return real(self, target)
    Path.rename = rename
else:
    def write(self, name, tensor):
        raise KeyboardInterrupt
    ShardedWriter.write = write
try:
    elsa_ds.prune(sys.argv[3], sys.argv[4], output_dir=str(out), overwrite=True, deepspeed="ds_configs/zero3_offload_csv.json",
                  seqlen=64, steps=4, interval=2, sparsity=0.6, lr=1e-3, lmda=0.05, val_windows=0, baseline="none",
                  micro_batch=2, init_mask="none")
except (elsa_ds.ElsaError, KeyboardInterrupt) as err:
    print("stopped:", type(err).__name__, err)
"""


def _previous_run(parent: Path) -> Path:
    """An earlier run's output: its model, its published checkpoint and its monitor's logs."""
    out = parent / "o"
    (out / "checkpoints" / "global_step8").mkdir(parents=True)
    (out / "checkpoints" / "global_step8" / "model_states.pt").write_text("earlier run")
    (out / "checkpoints" / "latest").write_text("global_step8")
    (out / "monitor").mkdir()
    (out / "monitor" / "loss.csv").write_text("step,loss\n8,5.0\n")
    (out / "model.safetensors").write_text("earlier model")
    (out / "elsa_report.json").write_text("{}")
    note_entries(out)  # as the job's checks found it: what its publication replaces
    return out


@pytest.mark.integration
@pytest.mark.parametrize("how", ["rename fails", "interrupted"])
def test_a_job_that_does_not_publish_leaves_the_previous_output_whole(tmp_path, tiny_model_dir, text_dir, how):
    """--overwrite over an earlier run's output (checkpoints, monitor logs): the run sets them aside, and when it does not
    publish (its final rename fails, or Ctrl-C in the export) they are back, the output as it was. A failed rename keeps
    the finished output where its one line says (the exit path once removed it)."""
    parent = tmp_path / "parent"
    out = _previous_run(parent)
    before = _listing(parent)
    proc = subprocess.run([sys.executable, "-c", JOB, str(out), how, str(tiny_model_dir), str(text_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "stopped:" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
    assert "folders of earlier jobs" not in proc.stdout + proc.stderr  # what it set aside is its own (a fifth audit)
    kept = sorted(p for p in parent.iterdir() if p.name != "o")
    assert _listing(out) == {k.removeprefix("o/"): v for k, v in before.items() if k.startswith("o/")}
    if how == "rename fails":
        assert "PublishFailed" in proc.stdout and f"it is complete in {kept[0]}" in proc.stdout, proc.stdout
        assert len(kept) == 1 and kept[0].name.startswith(".o.partial.")
        assert {"model.safetensors", "elsa_report.json", "monitor"} <= {p.name for p in kept[0].iterdir()}
    else:
        assert kept == [] and _listing(parent) == before, sorted(p.name for p in parent.iterdir())


def test_an_overwrite_jobs_own_set_aside_folder_is_no_earlier_jobs_leftover(tmp_path, caplog):
    """A fifth audit (2026-12-06): every --overwrite run over checkpoints warned that its own set-aside folder (the previous
    output's checkpoints, put back if the run fails) was an earlier job's, to be deleted. Without --overwrite a folder of
    that name is an earlier job's of this process id (containers reuse ids), and is named."""
    out = _previous_run(tmp_path)
    set_aside(out, [out / "checkpoints"])
    for overwriting, named in ((True, False), (False, True)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="elsa_ds"):
            staging = fresh_staging(out, overwriting)
        assert (str(aside_dir(out)) in caplog.text) is named, caplog.text
        staging.rmdir()
    (tmp_path / ".o.old.7").mkdir()  # a killed publication's: still named
    with caplog.at_level("WARNING", logger="elsa_ds"):
        fresh_staging(out, True)
    assert ".o.old.7" in caplog.text


def test_publishing_into_kept_checkpoints_leaves_no_old_file_beside_the_new(tmp_path):
    """--save_interval or --resume: the output's folders stay (the checkpoints, the monitor's logs wherever they are set);
    every file of the previous output goes, so an old shard, index or eval.json is never read as part of the new model."""
    out = tmp_path / "o"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("global_step4")
    (out / "monitor").mkdir()
    for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "eval.json", "config.json"):
        (out / name).write_text("old")
    note_entries(out)  # the job's checks, then its run
    run_writes(out, ["tb"])
    (out / "tb").mkdir()  # a monitor's output_path set inside the output: this run's logs
    staging = staging_dir(out)
    staging.mkdir()
    for name in ("model.safetensors", "config.json", "elsa_report.json"):
        (staging / name).write_text("new")
    publish(staging, out, keep_checkpoints=True)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.json", "elsa_report.json", "model.safetensors",
                                                    "monitor", "tb"]
    assert (out / "config.json").read_text() == "new" and (out / "checkpoints" / "latest").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_a_stopped_sparse_export_leaves_nothing_beside_the_output(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for path in sparse_paths(staging_dir(out)):  # the checkpoint being checked, compress's staging and its lock
        path.mkdir() if path.suffix != ".lock" else path.write_text("")
    discard_unpublished(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and (out / "precious.txt").exists()


def test_put_back_keeps_a_resumable_runs_checkpoints(tmp_path):
    """The run published a checkpoint before it stopped: --resume continues it, so its checkpoints stay in place and the
    previous ones stay aside (named in a warning), never deleted."""
    out = _previous_run(tmp_path)
    set_aside(out, [out / "checkpoints"])
    (out / "checkpoints" / "global_step2").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("global_step2")
    discard_unpublished(out)
    assert (out / "checkpoints" / "latest").read_text() == "global_step2"
    assert (aside_dir(out) / "checkpoints" / "latest").read_text() == "global_step8"


def test_put_back_waits_out_a_checkpoint_tag_another_rank_may_still_write(tmp_path):
    """Rank 0 failed inside a save of global_step8 while rank 1 may still write that tag's files by path: put back, the
    previous checkpoints' own global_step8 would take them (its shards overwritten). They stay aside, named; a tag they do
    not hold, or none in flight, puts them back."""
    out = _previous_run(tmp_path)
    set_aside(out, [out / "checkpoints"])
    (out / "checkpoints" / "global_step8").mkdir(parents=True)  # this run's save, cut short
    discard_unpublished(out, busy=("global_step8",))
    assert (aside_dir(out) / "checkpoints" / "global_step8" / "model_states.pt").read_text() == "earlier run"
    assert not (out / "checkpoints" / "latest").exists()  # this run's, where the other rank writes
    discard_unpublished(out, busy=("global_step4",))
    assert (out / "checkpoints" / "global_step8" / "model_states.pt").read_text() == "earlier run"
    assert not aside_dir(out).exists()


def test_an_overwrite_that_fails_puts_the_previous_runs_resumable_state_back(tmp_path):
    """--overwrite over a checkpointed run whose one-shot model a --resume would read: the failed run's own side file of
    that name goes, the previous one comes back with its checkpoints (the order matters: the restored `latest` must not
    make the failed run's files look resumable). After a publication nothing set aside can come back."""
    out = _previous_run(tmp_path)
    (tmp_path / ".o.oneshot").mkdir()
    (tmp_path / ".o.oneshot" / "config.json").write_text("the previous run's")
    before = _listing(tmp_path)
    set_aside(out, [out / "checkpoints", out / "monitor", *resumable_paths(out)])
    (tmp_path / ".o.oneshot").mkdir()
    (tmp_path / ".o.oneshot" / "config.json").write_text("the failed run's")
    (out / "monitor").mkdir()
    (out / "monitor" / "loss.csv").write_text("the failed run's")
    staging_dir(out).mkdir()
    discard_unpublished(out)
    assert _listing(tmp_path) == before
    set_aside(out, [out / "checkpoints", out / "monitor", *resumable_paths(out)])
    staging = staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    publish(staging, out, keep_checkpoints=False)
    discard_unpublished(out)  # an exception after the publication: nothing is put back into the new output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"] and not aside_dir(out).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # the previous run's side file went with its output


def test_a_staging_folder_of_an_earlier_job_with_this_process_id_is_kept(tmp_path):
    """Containers reuse process ids (often 1): an earlier job's staging under this id may hold a finished output whose
    final rename failed; it is renamed, never deleted."""
    out = tmp_path / "o"
    staging_dir(out).mkdir()
    (staging_dir(out) / "model.safetensors").write_text("finished")
    assert fresh_staging(out) == staging_dir(out) and list(staging_dir(out).iterdir()) == []
    earlier = [p for p in tmp_path.iterdir() if p.name.startswith(f"{staging_dir(out).name}.earlier.")]
    assert len(earlier) == 1 and (earlier[0] / "model.safetensors").read_text() == "finished"


def test_a_signal_during_a_held_cleanup_takes_effect_after_it():
    seen = []

    def handler(signum, frame):
        seen.append(("handler", signum))

    saved = signal.signal(signal.SIGTERM, handler)
    try:
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            seen.append("cleanup done")
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert seen == ["cleanup done", ("handler", signal.SIGTERM)]


class Stopped(Exception):
    pass


def _stop(signum, frame):
    raise Stopped


@pytest.mark.parametrize("when", ["between the renames", "while the previous output goes"])
def test_a_stop_during_the_publication_waits_until_it_is_done(tmp_path, monkeypatch, when):
    """A SIGTERM (or Ctrl-C) between moving the previous output aside and moving the new one in, or while the previous
    output is removed, takes effect once the publication is done: the new output in place, nothing of the old one left
    (it once left no output at all, or the previous one half removed beside the new)."""
    out = _previous_run(tmp_path)
    staging = staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    real_rename, real_rmtree = Path.rename, shutil.rmtree

    def rename(self, target):  # the previous output moved aside: the stop comes right after
        done = real_rename(self, target)
        if self == out and when == "between the renames":
            os.kill(os.getpid(), signal.SIGTERM)
        return done

    def rmtree(path, *args, **kwargs):  # the stop comes while the previous output is removed
        if Path(path).name.startswith(".o.old.") and when != "between the renames":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    saved = signal.signal(signal.SIGTERM, _stop)
    try:
        with pytest.raises(Stopped):
            publish(staging, out, keep_checkpoints=False)
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "monitor"]  # the run's logs carried along
    assert (out / "model.safetensors").read_text() == "new"


@pytest.mark.parametrize("renamed", ["whole", "the final rename fails"])
def test_a_stop_held_through_the_publication_says_whether_the_output_is_complete(tmp_path, monkeypatch, capsys, renamed):
    """Through the entry points' guard: a SIGTERM held while the new output goes in ends the job with one line that says
    the output is complete when it is (it said "nothing unfinished was published", leaving the user to wonder), and the
    usual line when the publication failed."""
    out = _previous_run(tmp_path)
    staging = staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    real_rename = Path.rename

    def rename(self, target):
        if self == staging and renamed != "whole":
            raise OSError(28, "No space left on device")
        done = real_rename(self, target)
        if self == out:  # the previous output moved aside: the stop comes right after
            os.kill(os.getpid(), signal.SIGTERM)
        return done

    monkeypatch.setattr(Path, "rename", rename)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert guarded(lambda: publish(staging, out, keep_checkpoints=False)) == 143
    finally:  # guarded() installs the entry points' handlers: this process keeps its own
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    line = capsys.readouterr().err
    assert line.startswith("elsa_ds: terminated (SIGTERM)") and line.count("\n") == 1
    if renamed == "whole":
        assert f"{out} is complete" in line and (out / "model.safetensors").read_text() == "new"
    else:
        assert "nothing unfinished was published" in line and (staging / "model.safetensors").read_text() == "new"


def test_a_stop_held_through_the_sparse_exports_own_publication_does_not_call_the_job_complete(tmp_path, monkeypatch):
    """compress publishes the sparse checkpoint into the job's staging: a stop held through that publication is not the
    job's output being complete, so the entry point's line must not say it is."""
    from elsa_ds.sparse import export

    def compress(folder, sparse, min_sparsity):
        stop = KeyboardInterrupt()
        stop.published = sparse  # what publish() marks on a stop held through its (successful) renames
        raise stop

    def compress_failed(folder, sparse, min_sparsity):
        try:
            raise PublishFailed("compress's final rename failed", staging_dir(sparse))
        except PublishFailed:
            raise KeyboardInterrupt()  # a stop held through compress's failed publication: PublishFailed its context

    (tmp_path / "staging").mkdir()
    for fake in (compress, compress_failed):
        monkeypatch.setattr(export, "compress", fake)
        with pytest.raises(KeyboardInterrupt) as stopped:
            export.compress_in_place(tmp_path / "staging")
        assert getattr(stopped.value, "published", None) is None  # not the job's output
        assert kept_output(stopped.value) is None  # nor compress's staging folder, which the job's exit path removes


def test_a_stop_held_during_a_failed_publication_keeps_the_finished_output(tmp_path):
    """The final rename fails while a SIGTERM is held: the stop takes effect on the way out and replaces the error, and
    the exit path must still keep the staging folder the error named (it removed it)."""
    out = _previous_run(tmp_path)
    staging = staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    (staging / "sub").mkdir()
    try:
        try:
            raise PublishFailed("the final rename failed", staging)
        except PublishFailed:
            raise Stopped
    except Stopped as stop:
        discard_unpublished(out, keep=kept_output(stop))
    assert (staging / "model.safetensors").read_text() == "new"
    assert kept_output(KeyboardInterrupt()) is None


KILLED_IN_PUBLICATION = ["announced, a swap", "between the renames", "while the previous output goes",
                         "announced, files into", "moving the previous files out", "moving the new files in"]


@pytest.mark.parametrize("killed", KILLED_IN_PUBLICATION)
def test_the_watchdog_completes_a_publication_cut_short_by_a_kill(tmp_path, killed):
    """Rank 0 killed outright (SIGKILL) inside its publication, whose staging folder is the finished output: the watchdog
    completes it (the new output in place, the previous one's files gone, a kept-checkpoints output's folders kept) and
    removes what is left of the previous output, wherever the kill came."""
    out = _previous_run(tmp_path)
    (out / "index.json").write_text("earlier index")  # a previous file the new output has no namesake of
    pid = os.getpid()
    old, staging = old_dir(out, pid), staging_dir(out)
    staging.mkdir()
    for name in ("a_report.json", "model.safetensors", "z_config.json"):
        (staging / name).write_text(f"new {name}")
    kept = killed.startswith("moving") or killed == "announced, files into"
    if killed.startswith("announced"):
        pass  # rank 0 said which publication it begins, then nothing moved
    elif kept:  # _publish_into's two halves, cut short
        old.mkdir()
        (out / "index.json").rename(old / "index.json")
        if killed == "moving the new files in":
            move_out(out, old)
            (staging / "a_report.json").rename(out / "a_report.json")
    else:
        out.rename(old)
    if killed == "while the previous output goes":
        staging.rename(out)
        (old / "monitor" / "loss.csv").unlink()
        (tmp_path / f"{aside_dir(out, pid).name}.published.1").mkdir()  # what --overwrite had set aside
    assert settle_old(out, pid, "publish_into" if kept else "publish") == (True, None, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert {p.name: p.read_text() for p in out.iterdir() if p.is_file()} == {
        name: f"new {name}" for name in ("a_report.json", "model.safetensors", "z_config.json")}
    assert (out / "checkpoints" / "latest").exists() == kept  # a kept-checkpoints output keeps its folders


def test_a_publication_the_watchdog_cannot_complete_keeps_both_outputs_and_says_where(tmp_path):
    """Something else than a folder now stands at the output's name: the finished output stays staged, the previous
    one's files where the publication moved them, both named, neither removed."""
    out = _previous_run(tmp_path)
    pid = os.getpid()
    old, staging = old_dir(out, pid), staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    out.rename(old)
    out.write_text("a file put there since")
    settled = settle_old(out, pid, "publish")
    assert not settled.published and settled.kept == staging and str(staging) in settled.warning and str(old) in settled.warning
    assert (staging / "model.safetensors").read_text() == "new" and (old / "model.safetensors").read_text() == "earlier model"


@pytest.mark.parametrize("keep_checkpoints", [False, True])
def test_a_failed_publication_is_announced_and_the_watchdog_keeps_what_its_error_named(tmp_path, monkeypatch, keep_checkpoints):
    """The final rename fails (another file system, say): rank 0 tells its watchdog so before the error, and should it
    die on its way out, the watchdog keeps the finished output where the error said it is, the previous output whole."""
    out = _previous_run(tmp_path)
    pid = os.getpid()
    staging = staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    real_rename = Path.rename

    real_replace = Path.replace

    def moved(real):
        def move(self, target):
            if self.parent == staging or self == staging:
                raise OSError(18, "Invalid cross-device link")
            return real(self, target)
        return move

    monkeypatch.setattr(Path, "rename", moved(real_rename))
    monkeypatch.setattr(Path, "replace", moved(real_replace))
    announced: list[str] = []
    with pytest.raises(PublishFailed) as failed:
        publish(staging, out, keep_checkpoints=keep_checkpoints, announce=announced.append)
    monkeypatch.undo()
    assert announced == ["publish_into" if keep_checkpoints else "publish", "publish_failed"]
    assert failed.value.kept == staging and str(staging) in str(failed.value)
    settled = settle_old(out, pid, announced[-1])  # what the watchdog does after a SIGKILL in the exit path
    assert not settled.published and settled.kept == staging and str(staging) in settled.warning
    old = old_dir(out, pid)  # the previous output: whole in place, or its files where the error and the warning say
    assert (staging / "model.safetensors").read_text() == "new"
    assert ((old if keep_checkpoints else out) / "model.safetensors").read_text() == "earlier model"
    assert old.exists() == keep_checkpoints and (str(old) in settled.warning) == keep_checkpoints == (str(old) in str(failed.value))
    if keep_checkpoints:
        return
    monkeypatch.setattr(Path, "rename", moved(real_rename))

    def log_gone(phase):  # the phase log's folder removed meanwhile: its append fails (a review's find)
        if phase == "publish_failed":
            raise FileNotFoundError(2, "No such file or directory")

    with pytest.raises(PublishFailed):  # still the error that keeps the finished output, not the log's
        publish(staging, out, keep_checkpoints=False, announce=log_gone)


def test_a_publication_into_kept_checkpoints_runs_the_halves_the_watchdog_would_complete(tmp_path):
    """The publication itself, through the same two halves: the previous files out (marked done), the new ones in."""
    out = _previous_run(tmp_path)
    staging = staging_dir(out)
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    publish(staging, out, keep_checkpoints=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
    assert (out / "model.safetensors").read_text() == "new" and (out / "checkpoints" / "latest").exists()
    assert not any(p.name == ALL_MOVED_OUT for p in out.rglob("*"))


@pytest.mark.parametrize("name", ["link", "dangling link", ".", "..", "cwd parent", "venv", "home"])
def test_an_output_that_would_take_something_else_along_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling link").symlink_to(tmp_path / "nowhere")
    path = {"cwd parent": tmp_path.parent, "venv": Path(sys.prefix), "home": Path.home()}.get(name, Path(name))
    with pytest.raises(ElsaError, match="symbolic link|not /, . or ..|contains|is the|is this") as refused:
        check_output_path(path)
    assert not (tmp_path / "nowhere").exists()
    if name in (".", ".."):  # the example given is taken (an audit: "." suggested the current directory, refused in turn)
        check_output_path(Path(str(refused.value).split("(e.g. ")[1].removesuffix(")")))
    check_output_path(tmp_path / "new")  # a folder of its own, inside the working directory


def test_the_hugging_face_cache_is_found_where_the_hub_finds_it(tmp_path):
    """An audit (2026-12-06): with XDG_CACHE_HOME set (as many HPC sites do), an output over its huggingface folder was
    replaced, the cache removed with it. The hub reads its folders once, at import: a process of its own."""
    (tmp_path / "xdg" / "huggingface" / "hub").mkdir(parents=True)
    code = ("import sys; from pathlib import Path; from elsa_ds.files.output import check_output_path\n"
            "for p in sys.argv[1:]:\n    try: check_output_path(Path(p)); print('ok')\n    except Exception as e: print(e)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))} | {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    outs = [tmp_path / "xdg" / "huggingface", tmp_path / "xdg", tmp_path / "xdg" / "huggingface" / "mine"]
    said = subprocess.run([sys.executable, "-c", code, *map(str, outs)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120, check=True).stdout.splitlines()
    assert all("contains the Hugging Face cache" in line for line in said[:2]) and said[2] == "ok", said


def test_evaluate_never_writes_over_a_markdown_file_without_overwrite(tmp_path, tiny_model_dir):
    md, js = tmp_path / "table.md", tmp_path / "r.json"
    md.write_text("my notes")
    js.write_text('{"model": "m", "ppl": {}}')
    base = ["--model", str(tiny_model_dir), "--ppl", "shakespeare", "--seqlen", "64", "--limit", "2"]
    one_line(*run_main(cli.main_evaluate, [*base, "--markdown", str(md)])[:2], "--markdown", "exists")
    one_line(*run_main(cli.main_evaluate, [*base, "--output", str(md), "--markdown", str(md), "--overwrite"])[:2],
             "name the same file")
    one_line(*run_main(cli.main_evaluate, ["--compare", str(js), "--markdown", str(md)])[:2], "--markdown", "exists")
    one_line(*run_main(cli.main_evaluate, ["--compare", str(js), "--markdown", str(js), "--overwrite"])[:2], "--compare inputs")
    assert md.read_text() == "my notes" and js.read_text() == '{"model": "m", "ppl": {}}'


def test_a_refused_job_leaves_no_folder_it_made_for_its_output(tmp_path, tiny_model_dir):
    """The output's missing parents are made before the lock (it lies beside the output); a refusal under the lock (the
    plan's checks) removes those it left empty, not the folder that was there before."""
    out = tmp_path / "new" / "deeper" / "o"
    argv = ["--deepspeed", "zero3", "--model", str(tiny_model_dir), "--method", "dense", "--finetune", "full", "--export_format", "sparse"]
    one_line(*run_main(cli.main_prune, [*argv, "--output_dir", str(out)])[:2], "--export_format sparse")
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    real = os.replace

    def stopped(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(tmp_path / "latest", "global_step2")
    monkeypatch.setattr(os, "replace", real)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("checkpointed", [True, False])
def test_what_a_resume_reads_again_stays_once_a_checkpoint_is_published(tmp_path, checkpointed):
    """A retraining run's one-shot model and mask, the best projection's snapshot: a --resume of a checkpointed run reads
    them again (the checkpoint's selection record names the snapshot's step), so a failed end keeps them then."""
    out = tmp_path / "o"
    (out / "checkpoints").mkdir(parents=True)
    if checkpointed:
        (out / "checkpoints" / "latest").write_text("global_step4")
    for name in (".o.oneshot", ".o.best_projection"):
        (tmp_path / name).mkdir()
    (tmp_path / ".o.mask.safetensors").write_text("mask")
    (tmp_path / ".o.init_mask.safetensors").write_text("consumed at the start")
    staging_dir(out).mkdir()
    discard_unpublished(out)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ([".o.best_projection", ".o.mask.safetensors", ".o.oneshot", "o"] if checkpointed else ["o"]), left


def test_a_resume_whose_best_snapshot_is_gone_is_refused_before_any_step(tmp_path):
    from elsa_ds.jobs.selection import Selector

    record = {"curve": [{"step": 8, "ppl": 50.0}], "best": {"step": 8, "ppl": 50.0}, "since_best": 0, "stopped_at": None}
    selector = Selector(every=1, patience=0, directory=tmp_path / "best", rank=0)
    with pytest.raises(ElsaError, match="best projection of step 8, but its snapshot .* is gone"):
        selector.resumed(record)
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "rank0.pt").write_bytes(b"")  # damaged: refused now, not at the run's end
    with pytest.raises(ElsaError, match="snapshot .* is unreadable"):
        selector.resumed(record)
    torch.save({"shard": torch.ones(2)}, tmp_path / "best" / "rank0.pt")
    selector.resumed(record)
    assert selector.record is record
    older = {k: v for k, v in record.items() if k != "stopped_at"}  # an older elsa_ds's: completed in the state's own dict
    selector.resumed(older)
    assert selector.record is older and older["stopped_at"] is None


def test_the_demo_trainer_replaces_only_an_earlier_demo_model(tmp_path, capsys):
    from elsa_ds.demo.train_demo import check_out

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "thesis.tex").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(SystemExit) as stop:
            check_out(notes, overwrite)
        assert stop.value.code == 2
    assert "holds no demo model" in capsys.readouterr().err and (notes / "thesis.tex").read_text() == "mine"
    (notes / "training_metrics.json").write_text("{}")
    check_out(notes, overwrite=True)
    check_out(tmp_path / "new", overwrite=False)


@pytest.mark.parametrize("name", ["o'x", "new\nline"])
def test_a_failed_publications_mv_command_runs_as_written(tmp_path, monkeypatch, name):
    """A seventh audit: the command a failed final rename suggests (``mv STAGING OUTPUT``) quoted neither path, so one
    with a space (or a quote) moved the wrong files or failed; it is now quoted for a shell, both paths absolute. A
    newline in a path was kept inside shlex's quotes, and the one line the refusal is printed as then named another path:
    such a path is written as ``$'...'``. Read back by bash from the printed line."""
    from elsa_ds.quoting import one_line

    out = tmp_path / "my runs" / name
    out.parent.mkdir()
    staging = fresh_staging(out)
    (staging / "elsa_report.json").write_text("{}")
    real = Path.rename

    def rename(self, target):
        if self == staging and Path(target) == out:  # the final rename only
            raise PermissionError(13, "Permission denied")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(PublishFailed) as failed:
        publish(staging, out, keep_checkpoints=False)
    command = one_line(str(failed.value)).split("(mv ", 1)[1].rsplit(")", 1)[0]
    read = subprocess.run(["bash", "-c", "printf '%s\\0' " + command], capture_output=True, check=True).stdout
    assert read.split(b"\0")[:-1] == [os.fsencode(staging), os.fsencode(out)], command
