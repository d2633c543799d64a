"""A job killed outright (SIGKILL on a rank: the kernel's out-of-memory killer, kill -9) runs no exit path: rank 0's
watchdog (``elsa_ds/files/watchdog.py``) says one line naming the kill, the phase and the memory, and leaves the output folder
and its parent as they were (no staging, lock or warm-start mask; what an earlier job left stays). A clean end and a
handled error: not a word from it. The embedded demo model: one plain process, and 2 ranks under the deepspeed launcher,
rank 0 or rank 1 killed, or the launcher's whole process group (the watchdog then the only one left to speak)."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from elsa_ds.zero.dist import free_port
from tests.conftest import ROOT, nan_at_step_env, run_entry
from tests.test_interrupts import _run_and_signal
from tests.test_left_behind import ERROR_LINE, QUICK, _listing, _previous_output

pytestmark = pytest.mark.integration

KILLED = re.compile(r"^elsa_ds: error: the job was killed \((SIGKILL, rank (\d) pid \d+|rank 0 pid \d+ vanished without running its "
                    r"exit path: SIGKILL, or a crash)\) during training step \d+ of 100000; host memory peaked at [\d.]+ of "
                    r"[\d.]+ GiB \(the job's processes [\d.]+ GiB.*\); .+; nothing unfinished was published")


def _rank(proc: subprocess.Popen, rank: int) -> psutil.Process:
    """The process of ``rank`` under the launcher ``proc`` (or ``proc`` itself, a plain run)."""
    for child in psutil.Process(proc.pid).children(recursive=True):
        if child.environ().get("RANK") == str(rank) and "LOCAL_RANK" in child.environ():
            return child
    return psutil.Process(proc.pid)


def _killed_line(text: str) -> re.Match:
    """The watchdog's line, the only ``elsa_ds: error`` line but a surviving rank's own: its collective failed (gloo:
    connection closed by peer), and it says so in one line unless the launcher's SIGTERM came first. No traceback."""
    errors = [line for line in text.splitlines() if line.startswith(ERROR_LINE) and "another rank of this job ended" not in line]
    assert len(errors) == 1 and "Traceback" not in text, text[-4000:]
    assert (m := KILLED.match(errors[0])), errors[0]
    return m


def _no_watchdog_left(out: Path) -> None:
    """No watchdog of this job is left running (it exits once its line is out, or on the job's clean end)."""
    lock = str(out.parent / f".{out.name}.lock")
    mine = [p for p in psutil.process_iter(["cmdline"]) if "elsa_ds.files.watchdog" in (p.info["cmdline"] or []) and
            lock in (p.info["cmdline"] or [])]
    _, left = psutil.wait_procs(mine, timeout=5)  # the last moments of its exit
    assert not left, [p.cmdline() for p in left]


@pytest.mark.parametrize("ranks,victim", [(None, 0), (2, 0), pytest.param(2, 1, marks=pytest.mark.slow), (2, "group")],
                         ids=["plain", "launcher-rank0", "launcher-rank1", "launcher-group"])
def test_a_killed_job_says_one_line_and_leaves_nothing(tmp_path, ranks, victim):
    """SIGKILL during training after a magnitude warm start (its masks file beside the output). Where the watchdog cleans
    up (rank 0 gone), a stale side file of an earlier job (a retraining run's one-shot model) is no file of this job's: it
    stays. (Rank 1 killed: rank 0, stopped by the launcher, cleans up by its own exit path, which removes that too.)"""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    if victim != 1:
        (parent / ".o.oneshot").mkdir()
        (parent / ".o.oneshot" / "config.json").write_text("{}")
    before = _listing(parent)
    args = [*QUICK, "--steps", "100000", "--output_dir", str(out), "--overwrite"]
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", str(free_port())]
    cmd = [sys.executable, str(ROOT / "launch" / "prune.py"), *args] if ranks is None else [*launcher, "launch/prune.py", *args]

    def kill(proc) -> None:
        assert (parent / ".o.init_mask.safetensors").exists() and (parent / ".o.lock").exists()  # there while it trains
        if victim == "group":  # the runner, the launcher and the ranks, as a kill of their process group (not the watchdog's)
            for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
                p.kill()
        else:
            _rank(proc, victim).send_signal(signal.SIGKILL)
    _, text = _run_and_signal(cmd, "step/s", kill, timeout=240)  # returns once the watchdog, the last writer, is gone
    m = _killed_line(text)
    if ranks is not None and victim != "group":  # read from the rank's exit status before the launcher reaped it
        assert m.group(2) == str(victim), m.group(0)
    assert _listing(parent) == before, m.group(0)
    _no_watchdog_left(out)


@pytest.mark.parametrize("nan", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["success", "handled-error"])
def test_a_clean_end_gets_no_word_from_the_watchdog(tmp_path, nan):
    """A run that publishes, and one that stops on a NaN loss (exit 2, its own one line): nothing from the watchdog, which
    is gone by the time the job's output pipes close."""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    env = nan_at_step_env(1)
    proc = run_entry("prune.py", [*QUICK, "--steps", "2", "--output_dir", str(out), "--overwrite"], check=False,
                     env=env if nan else None, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR_LINE)]
    if nan:
        assert proc.returncode == 2 and len(errors) == 1 and "the loss became nan" in errors[0], proc.stderr[-3000:]
    else:
        assert proc.returncode == 0 and not errors and (out / "elsa_report.json").exists(), proc.stderr[-3000:]
    assert "killed" not in proc.stderr + proc.stdout
    assert sorted(p.name for p in parent.iterdir()) == ["o"]
    _no_watchdog_left(out)


def test_the_watchdog_cleans_only_under_the_dead_jobs_lock(tmp_path):
    """Its cleanup on its own: what changed since the watch began goes, with the lock, while the lock names the dead rank 0;
    a lock naming another job (it took the output over) leaves every file as it is. Once the job published a checkpoint,
    what a --resume reads again (the best projection's snapshot) stays."""
    from argparse import Namespace

    from elsa_ds.files.watchdog import Rank, Watch, cleanup, path_state

    old, new, lock = tmp_path / ".o.oneshot", tmp_path / ".o.partial.123", tmp_path / ".o.lock"
    best, latest = tmp_path / ".o.best_projection", tmp_path / "o" / "checkpoints" / "latest"
    old.write_text("an earlier job's")
    w = Watch(Namespace(lock=str(lock), pid=123, resumable=[str(best)], output=str(tmp_path / "o")))
    w.ranks[123] = Rank(0, 123, "456")
    w.before = {str(p): path_state(p) for p in (old, new, best)}
    new.mkdir()
    (new / "model.safetensors").write_text("half")
    best.mkdir()
    latest.parent.mkdir(parents=True)
    latest.write_text("global_step4")
    lock.write_text('{"pid": 999, "pid_start": "1"}')
    assert "names another job" in cleanup(w) and new.exists() and lock.exists()
    lock.write_text('{"pid": 123, "pid_start": "456"}')
    assert "its lock and 1 unfinished file beside the output are removed" in cleanup(w)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".o.best_projection", ".o.oneshot", "o"]
    assert "already released" in cleanup(w)


def test_the_watchdog_completes_a_publication_the_kill_cut_short_and_says_so(tmp_path):
    """Killed between the publication's two renames (the previous output moved aside, the finished one still staged):
    the cleanup puts the finished output in place, removes the previous one and its lock, and its line says the output
    is whole (not that nothing was published)."""
    from argparse import Namespace

    from elsa_ds.files.aside import old_dir
    from elsa_ds.files.watchdog import Rank, Watch, cleanup, path_state

    out, staging, lock = tmp_path / "o", tmp_path / ".o.partial.123", tmp_path / ".o.lock"
    w = Watch(Namespace(lock=str(lock), pid=123, resumable=[], output=str(out)))
    w.ranks[123] = Rank(0, 123, "456")
    w.before, w.phase = {str(staging): path_state(staging)}, {"phase": "publish", "step": None}  # rank 0 announced it
    out.mkdir()
    (out / "model.safetensors").write_text("earlier")
    staging.mkdir()
    (staging / "model.safetensors").write_text("new")
    out.rename(old_dir(out, 123))
    lock.write_text('{"pid": 123, "pid_start": "456"}')
    said = cleanup(w)
    assert f"its output {out} is published, whole" in said, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"] and (out / "model.safetensors").read_text() == "new"


def test_an_earlier_jobs_old_folder_is_no_publication_of_this_one(tmp_path):
    """Containers reuse process ids: a `.NAME.old.PID` an earlier job left, changed by the user during this job (a file
    moved out of it; or removed, its inode number then taken again), is not this job's publication begun: only rank 0's
    announcement says that. The watchdog removes this job's half-written staging folder as unfinished and leaves the
    output and that folder alone."""
    from argparse import Namespace

    from elsa_ds.files.aside import old_dir
    from elsa_ds.files.watchdog import Rank, Watch, cleanup, path_state

    out, staging, lock = tmp_path / "o", tmp_path / ".o.partial.123", tmp_path / ".o.lock"
    out.mkdir()
    (out / "model.safetensors").write_text("earlier")
    leftover = old_dir(out, 123)
    leftover.mkdir()
    (leftover / "a.txt").write_text("the earlier job's")
    (leftover / "b.txt").write_text("the earlier job's")
    w = Watch(Namespace(lock=str(lock), pid=123, resumable=[], output=str(out)))
    w.ranks[123] = Rank(0, 123, "456")
    w.before, w.phase = {str(staging): path_state(staging)}, {"phase": "export", "step": None}
    (leftover / "b.txt").unlink()  # the user tidies it up meanwhile
    staging.mkdir()
    (staging / "model-00001-of-00002.safetensors").write_text("half an export")
    lock.write_text('{"pid": 123, "pid_start": "456"}')
    said = cleanup(w)
    assert "nothing unfinished was published" in said and not staging.exists(), said
    assert (out / "model.safetensors").read_text() == "earlier" and [p.name for p in leftover.iterdir()] == ["a.txt"]


def test_a_kill_inside_the_first_save_keeps_the_previous_checkpoints_aside(tmp_path):
    """Rank 0 killed inside its first save: other ranks (on this node or another) may still write that tag's shards by
    path. The previous checkpoints hold a tag of that name, so the watchdog keeps them aside, named, not back in place
    where those writes would land; without such a tag they go back."""
    from argparse import Namespace

    from elsa_ds.files.aside import aside_dir, set_aside
    from elsa_ds.files.watchdog import Rank, Watch, cleanup

    out, lock = tmp_path / "o", tmp_path / ".o.lock"
    (out / "checkpoints" / "global_step8").mkdir(parents=True)
    (out / "checkpoints" / "global_step8" / "shard.pt").write_text("the previous run's")
    (out / "checkpoints" / "latest").write_text("global_step8")
    set_aside(out, [out / "checkpoints"])
    aside = aside_dir(out)
    for tag, kept in (("global_step8", True), ("global_step4", False)):
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        (out / "checkpoints" / tag).mkdir(parents=True)  # this run's save, begun, never published
        w = Watch(Namespace(lock=str(lock), pid=os.getpid(), resumable=[], output=str(out)))
        w.ranks[os.getpid()] = Rank(0, os.getpid(), "456")
        w.phase = {"phase": "train", "step": 7}
        lock.write_text(f'{{"pid": {os.getpid()}, "pid_start": "456"}}')
        said = cleanup(w)
        assert (f"may still be writing checkpoint {tag}" in said) == kept and aside.exists() == kept, said
    assert (out / "checkpoints" / "global_step8" / "shard.pt").read_text() == "the previous run's"


def test_a_stop_of_the_deepspeed_command_alone_stops_its_ranks(tmp_path):
    """SIGTERM to the `deepspeed` command alone (``kill PID`` of what the user started) ends it without a word to the
    launcher below: its ranks trained on, the output locked (a user's walk). Rank 0's watchdog sees the launcher handed to
    another parent and rank 0 go on stepping, and stops the launcher as a stop of the process group would: one line from
    it, the ranks' own (terminated, 143), every process gone, nothing left beside the previous output."""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    before = _listing(parent)
    args = [*QUICK, "--steps", "100000", "--output_dir", str(out), "--overwrite"]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "launch/prune.py", *args]
    below: list[psutil.Process] = []

    def stop_runner(proc) -> None:
        below.extend(psutil.Process(proc.pid).children(recursive=True))  # the launcher and the ranks
        assert len([p for p in below if "LOCAL_RANK" in p.environ()]) == 2
        proc.send_signal(signal.SIGTERM)
    try:
        code, text = _run_and_signal(cmd, "step/s", stop_runner, timeout=240, drain=90)  # all that its ranks said
        _, alive = psutil.wait_procs(below, timeout=90)
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        for p in below:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert code == -signal.SIGTERM
    notice = [line for line in text.splitlines() if line.startswith("elsa_ds: the deepspeed command")]
    assert len(notice) == 1 and "they are stopped now" in notice[0], text[-4000:]
    assert "Traceback" not in text and "terminated (SIGTERM)" in text, text[-4000:]
    assert _listing(parent) == before
    _no_watchdog_left(out)


def test_the_runner_is_told_apart_and_its_end_alone_stops_the_launcher_once():
    """files/runner.py on real processes: a "runner" whose child (the "launcher") outlives it; orphaned only after a mark
    (or the wait), the SIGTERM sent once; not for a runner still there; the command lines it takes for the runner."""
    from elsa_ds.files.runner import Runner, is_runner, orphaned, stop_launcher

    assert is_runner(["/venv/bin/python3", "/venv/bin/deepspeed", "--num_gpus", "2", "launch/prune.py"])
    assert is_runner(["/venv/bin/deepspeed", "launch/prune.py"]) and is_runner(["python", "-m", "deepspeed.launcher.runner"])
    assert not is_runner(["python", "launch/prune.py", "ds"]) and not is_runner(["bash", "-c", "pdsh -w n1 cd /x; ds"])
    spawn = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "print(p.pid, flush=True); time.sleep(60)"
    runner = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    launcher = psutil.Process(int(runner.stdout.readline()))
    try:
        r = Runner(psutil.Process(runner.pid), launcher)
        assert not orphaned(r, 5, 0.0)  # the runner is there
        runner.kill()
        runner.wait()
        assert not orphaned(r, 5, 1.0) and r.gone_at == 1.0  # first seen gone: waits for proof
        assert not orphaned(r, 5, 2.0)  # no mark since: a stop of the whole group looks the same
        assert orphaned(r, 6, 3.0)  # rank 0 marked another step: the ranks go on
        assert "they are stopped now" in stop_launcher(r)
        launcher.wait(timeout=10)  # ended by the SIGTERM (not a child of ours: its status is init's)
        assert not orphaned(r, 7, 4.0)  # sent once
    finally:
        with contextlib.suppress(psutil.Error):
            launcher.kill()


def test_a_rank_that_dies_in_the_start_leaves_no_shared_memory_buffer(tmp_path):
    """An audit (OS limits, 2026-12-07): a rank that died between DeepSpeed's making its 66 MiB /dev/shm all-reduce
    buffer and the job's unlink of it (an abort under a thread limit) left the buffer in /dev/shm at every try. The
    ranks that exit after it remove every local rank's buffer of the job (``tests/fixtures/die_in_start``: rank 1
    SIGKILLed right after DeepSpeed's start). The output and its parent as before."""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    before, port = _listing(parent), free_port()
    fixture = ROOT / "tests" / "fixtures" / "die_in_start"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "ELSA_TEST_DIE_IN_START": "1",
           "PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "launch/prune.py",
           *QUICK, "--steps", "2", "--output_dir", str(out), "--overwrite"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "SIGKILL, rank 1" in proc.stderr, proc.stderr[-3000:]
    left = [p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*")]
    assert left == [], left
    assert _listing(parent) == before
    _no_watchdog_left(out)
