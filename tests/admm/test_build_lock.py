"""A torch extension build killed outright leaves its ``lock``, and torch then waits on it forever at every later build
(``elsa_ds/admm/kernels/build_lock.py``): a lock no process holds and older than any build takes is removed with a
warning before our builds and before DeepSpeed's; a younger one is waited for (a build elsewhere: another node or
container) until it goes or ages; one held here, by any path to it, is left to torch."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elsa_ds.admm.kernels import build, build_lock
from tests.conftest import ROOT, run_entry


def _built(name: str) -> Path | None:
    """This machine's build folder of extension ``name`` (either of torch's layouts), if built."""
    root = build_lock.extensions_root()
    return next((p for p in (root / name, *root.glob(f"*/{name}")) if (p / f"{name}.so").exists()), None)


def _extensions_with_stale_locks(tmp_path: Path, names: list[str]) -> Path:
    """A TORCH_EXTENSIONS_DIR holding copies of these builds (or empty folders: then built there), each with the lock a
    build killed before its end leaves."""
    root = tmp_path / "ext"
    for name in names:
        found = _built(name)
        if found is not None:
            shutil.copytree(found, root / name)  # mtimes kept: ninja finds it up to date
        (root / name).mkdir(parents=True, exist_ok=True)
        _old_lock(root / name / "lock")
    return root


def _old_lock(lock: Path) -> Path:
    """A lock as a build killed an hour ago left it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    return lock


def test_a_killed_builds_lock_no_longer_hangs_the_next_build(tmp_path):
    name = build.module_name()
    root = _extensions_with_stale_locks(tmp_path, [name])
    code = "from elsa_ds.admm.kernels import build; print('loaded', build.load() is not None)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCH_EXTENSIONS_DIR": str(root)})  # torch alone: waits forever
    assert proc.returncode == 0 and "loaded True" in proc.stdout, proc.stderr[-3000:]
    assert f"removed {root / name / 'lock'}" in proc.stderr and not (root / name / "lock").exists()


@pytest.mark.integration
def test_a_job_starts_past_every_stale_lock(tmp_path):
    """DeepSpeed's ops (cpu_adam; the CPU backend's shm comm, built as the process group starts) and ours, each with a
    stale lock: a two-step job ends, each lock named in a warning."""
    names = ["cpu_adam", "deepspeed_shm_comm", build.module_name()]
    root = _extensions_with_stale_locks(tmp_path, names)
    args = ["--deepspeed", "ds_configs/zero3_offload.json", "--seqlen", "64", "--micro_batch", "2", "--steps", "2",
            "--val_windows", "0", "--baseline", "none", "--output_dir", str(tmp_path / "o")]
    proc = run_entry("prune.py", args, timeout=600, env={"TORCH_EXTENSIONS_DIR": str(root)})
    for name in names:
        assert f"removed {root / name / 'lock'}" in proc.stderr, proc.stderr[-3000:]
    assert not list(root.glob("*/lock"))


def test_a_lock_held_by_a_live_build_is_left(tmp_path, caplog):
    """Left, and said: a job waiting on another's build was silent for minutes (a fourteenth audit)."""
    lock = _old_lock(tmp_path / "ext" / "op" / "lock")  # a build older than any takes: still live while held
    alias = tmp_path / "alias"
    os.link(lock, alias)  # another path to the same file (as a bind mount or another mount namespace shows it)
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; fd = os.open({str(alias)!r}, os.O_RDONLY); "
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert build_lock.held(lock) is True
        with caplog.at_level(logging.INFO, logger="elsa_ds"):
            assert build_lock.clear_stale_locks(tmp_path / "ext") == [] and lock.exists()
        assert f"another process here (this job's other rank, or another job) is building op ({lock})" in caplog.text, caplog.text
    finally:
        holder.kill()
        holder.wait()
    assert build_lock.held(lock) is False  # its holder gone: stale now
    assert build_lock.clear_stale_locks(tmp_path / "ext") == [lock] and not lock.exists()


def test_a_young_lock_nobody_here_holds_is_waited_for(tmp_path, monkeypatch, caplog):
    """A build in another container or on another node holds it unseen: its end removes it, and the wait ends; one
    that stays (a build killed outright a moment ago) is removed once older than a build takes."""
    monkeypatch.setattr(build_lock, "STALE_S", 3.0)
    monkeypatch.setattr(build_lock, "POLL_S", 0.1)
    lock = tmp_path / "ext" / "op" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    threading.Timer(0.5, lock.unlink).start()  # the build elsewhere ends
    with caplog.at_level(logging.WARNING, logger="elsa_ds"):
        assert build_lock.clear_stale_locks(tmp_path / "ext") == []
    assert "waiting for" in caplog.text and "held by no process on this machine" in caplog.text
    lock.touch()
    start = time.monotonic()
    assert build_lock.clear_stale_locks(tmp_path / "ext") == [lock] and not lock.exists()
    assert time.monotonic() - start >= 2.0  # removed once 3 s old, not at once


def test_a_lock_released_while_checked_is_not_touched(tmp_path, monkeypatch):
    """The build ends between the first look and the second (its lock closed, then removed, a new build's made): the new
    one stays."""
    lock = _old_lock(tmp_path / "ext" / "op" / "lock")

    def a_new_build_meanwhile(seconds: float) -> None:
        lock.unlink()
        _old_lock(lock.with_name("new")).rename(lock)  # another file (made while the first existed: another inode)
    monkeypatch.setattr(build_lock.time, "sleep", a_new_build_meanwhile)
    assert build_lock.clear_stale_locks(tmp_path / "ext") == [] and lock.exists()


def test_no_lock_no_wait(tmp_path, monkeypatch):
    """Every job start looks: without a lock it neither waits nor takes the removers' guard."""
    monkeypatch.setattr(build_lock.time, "sleep", lambda seconds: pytest.fail("waited without a lock"))
    (tmp_path / "ext" / "op").mkdir(parents=True)
    assert build_lock.clear_stale_locks(tmp_path / "none") == [] and build_lock.clear_stale_locks(tmp_path / "ext") == []
    assert not (tmp_path / "ext" / ".elsa_ds_build_locks").exists()


def test_torchs_flock_guarded_lock_files_are_neither_waited_for_nor_removed(tmp_path, monkeypatch):
    """An audit of the dependency ranges (2026-12-07): from torch 2.14 cpp_extension guards a build with filelock's flock,
    whose lock file stays after every build; each job after the first waited 10 minutes for it to age (14 s, then 612 s,
    on torch 2.15). Where torch takes flocks (a killed build's goes with it) a lock file is left alone, at once."""
    import types

    import filelock

    assert not build_lock.batons(types.SimpleNamespace(FileBaton=object, FileLock=filelock.FileLock))
    assert not build_lock.batons(types.SimpleNamespace(filelock=filelock))
    assert build_lock.batons(types.SimpleNamespace(FileBaton=object, os=os))  # torch up to 2.13
    monkeypatch.setattr(build_lock, "batons", lambda: False)
    monkeypatch.setattr(build_lock.time, "sleep", lambda seconds: pytest.fail("waited on a lock file torch's flock guards"))
    lock = tmp_path / "ext" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert build_lock.clear_stale_locks(tmp_path / "ext") == [] and lock.exists()
    assert build_lock.clear_stale_locks(tmp_path / "ext") == [] and _old_lock(lock).exists()
