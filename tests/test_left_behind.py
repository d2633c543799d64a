"""Nothing left behind on any way out of a job: a full disk during the export or the warm start, a NaN loss, SIGTERM to
a Python API call. The output folder and its parent read the same afterwards as before (every name, every byte); a
command-line job says one line and exits 2. The full disk is a real one, a small tmpfs, where this process may mount
it; elsewhere a file size limit (RLIMIT_FSIZE) makes the same writes fail (EFBIG). The embedded demo model, 2-4 steps."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from elsa_ds.files.disk_room import DiskFull, disk_full, disk_full_errno
from elsa_ds.files.ownership import lock_path
from elsa_ds.jobs.warm_start import warm_start_path
from elsa_ds.settings.config import DEMO_MODEL_DIR
from tests.conftest import ROOT, nan_at_step_env, run_entry, tmpfs
from tests.test_interrupts import _run_and_signal

pytestmark = pytest.mark.integration

QUICK = ["--deepspeed", "ds_configs/zero3_offload.json", "--seqlen", "64", "--micro_batch", "2", "--interval", "1", "--lr", "1e-3",
         "--lmda", "0.05", "--val_windows", "0", "--baseline", "none", "--init_mask", "magnitude"]
ERROR_LINE = "elsa_ds: error"


def _listing(folder: Path) -> dict[str, str]:
    """Every entry under ``folder``, hidden ones too: a folder as "dir", a file as the sha256 of its bytes."""
    return {str(p.relative_to(folder)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*"))}


def _previous_output(parent: Path) -> Path:
    out = parent / "o"
    out.mkdir(parents=True)
    (out / "precious.txt").write_text("keep me")
    (out / "elsa_report.json").write_text("{}")  # an earlier job's output, which --overwrite may replace
    return out


def _limit_file_size(limit: int) -> Callable[[], None]:
    def apply() -> None:  # in the child: a write past ``limit`` bytes fails with EFBIG instead of killing it (SIGXFSZ)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@contextlib.contextmanager
def _small_disk(where: Path, size: int) -> Iterator[Callable[[], None] | None]:
    """A ``size``-byte file system mounted at ``where`` (yields None), or, where mounting is not allowed, a file size limit
    of ``size`` bytes for the child process (yields its preexec_fn)."""
    where.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                                   capture_output=True).returncode == 0
    try:
        yield None if mounted else _limit_file_size(size)
    finally:
        if mounted and subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)  # busy: detached now, freed when let go


def _prune(args: list[str], preexec: Callable[[], None] | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    if preexec is None:
        return run_entry("prune.py", args, check=False, env=env, timeout=600)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "launch" / "prune.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, preexec_fn=preexec)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(ERROR_LINE)]
    assert len(errors) == 1, proc.stderr[-4000:]
    return errors[0]


# ---- a full disk ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,written", [(4 * 2**20, "model.safetensors"), (256 * 2**10, ".o.init_mask.safetensors")],
                         ids=["export", "warm-start"])
def test_a_full_disk_leaves_nothing_and_says_one_line(tmp_path, size, written):
    """The demo model's bf16 export (8.4 MB) on a 4 MiB disk, or its magnitude warm-start masks (393 kB) on 256 KiB: the
    run starts (--ignore_memory_check past the pre-flight refusal), fails writing, and leaves the disk as it found it."""
    parent = tmp_path / "disk"
    with _small_disk(parent, size) as preexec:
        out = _previous_output(parent)
        before, before_out = _listing(parent), _listing(out)
        proc = _prune([*QUICK, "--steps", "2", "--output_dir", str(out), "--overwrite", "--ignore_memory_check"], preexec)
        line = _one_error_line(proc)
        assert (_listing(parent), _listing(out)) == (before, before_out), line
    assert re.search(r"^elsa_ds: error: (no space left|file size limit reached) on .+ writing \S+: [\d,]+ bytes needed, [\d,]+ free; "
                     r"free space or choose another --output_dir$", line), line
    assert f"{written}:" in line, line


@pytest.mark.parametrize("size,export", [(2 * 2**20, []), (20 * 2**20, ["--export_format", "sparse"])], ids=["dense", "sparse"])
def test_a_disk_too_small_for_the_export_is_refused_before_work(tmp_path, size, export):
    """The pre-flight check (``preflight.py``: the export against the output's free space) refuses in seconds, before
    any weight loads, and leaves nothing; only a real small file system shows it (a file size limit leaves space free).
    The sparse export is built beside the dense one: in fp32, 20 MiB holds the demo's dense export (16.8 MB) and its
    masks, not the sparse checkpoint beside them."""
    parent = tmp_path / "disk"
    fp32 = tmp_path / "fp32.json"  # whether this CPU keeps bf16 or not, the export's bytes are fp32's
    fp32.write_text(json.dumps({**json.loads((ROOT / QUICK[1]).read_text()), "bf16": {"enabled": False}}))
    with _small_disk(parent, size) as preexec:
        if preexec is not None:
            pytest.skip("no tmpfs can be mounted here (needs root)")
        out = _previous_output(parent)
        before = _listing(parent)
        proc = _prune([*QUICK, "--steps", "2", "--output_dir", str(out), "--overwrite", *export, "--deepspeed", str(fp32)])
        line = _one_error_line(proc)
        assert _listing(parent) == before, line
    assert f"disk at {out}" in line and "--ignore_memory_check" in line and "free space there, or choose another" in line, line
    assert "one-shot magnitude masks" not in proc.stdout + proc.stderr  # refused before the warm start


# ---- a NaN loss -----------------------------------------------------------------------------------------------------
def test_a_nan_stop_leaves_nothing_beside_the_output(tmp_path):
    """A NaN loss at step 1 of 4 after a magnitude warm start: its masks file goes with the staging and the lock."""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    before, before_out = _listing(parent), _listing(out)
    env = nan_at_step_env(1)
    proc = _prune([*QUICK, "--steps", "4", "--output_dir", str(out), "--overwrite"], env=env)
    line = _one_error_line(proc)
    assert "the loss became nan at step 1" in line, line
    assert "one-shot magnitude masks" in proc.stdout + proc.stderr  # the warm start did write its masks
    assert (_listing(parent), _listing(out)) == (before, before_out)


# ---- SIGTERM to elsa_ds.prune ---------------------------------------------------------------------------------------
def test_sigterm_to_the_python_api_leaves_no_lock_and_no_init_mask(tmp_path):
    """elsa_ds.prune in a script with Python's default SIGTERM handling, signalled during training: the process still
    ends as killed by SIGTERM, and its lock, warm-start masks and staging are gone first."""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    before = _listing(parent)
    script = f"""
import elsa_ds
elsa_ds.prune({str(DEMO_MODEL_DIR)!r}, output_dir={str(out)!r}, overwrite=True, deepspeed="zero3_offload", seqlen=64,
              micro_batch=2, steps=100000, interval=2, lr=1e-3, lmda=0.05, val_windows=0, baseline="none",
              init_mask="magnitude")
"""
    during = {}

    def terminate(proc) -> None:
        during.update(lock=lock_path(out).exists(), mask=warm_start_path(out).exists())
        proc.send_signal(signal.SIGTERM)
    code, text = _run_and_signal([sys.executable, "-c", script], "step/s", terminate)
    assert during == {"lock": True, "mask": True}, text[-3000:]  # both were there while it trained
    assert code == -signal.SIGTERM and "Traceback" not in text, text[-3000:]
    assert _listing(parent) == before


# ---- recognising a full disk ----------------------------------------------------------------------------------------
def test_a_full_disk_is_recognised_through_safetensors_and_chained_errors(tmp_path):
    from safetensors import SafetensorError

    wrapped = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert disk_full_errno(wrapped) == errno.ENOSPC
    assert disk_full_errno(SafetensorError("Error while serializing: I/O error: File too large (os error 27)")) == errno.EFBIG
    assert disk_full_errno(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "f"))
        except OSError as inner:
            raise RuntimeError("writing failed") from inner
    except RuntimeError as outer:
        full = disk_full(outer, tmp_path)
    assert isinstance(full, DiskFull) and str(full).startswith("disk quota exceeded on ") and f"writing {tmp_path / 'f'}: " in str(full)
    assert disk_full(ValueError("no"), tmp_path) is None and disk_full_errno(OSError(errno.EACCES, "denied")) is None


def test_a_full_disk_at_a_checkpoint_leaves_nothing_and_says_one_line(tmp_path):
    """The first checkpoint (fp32 masters, moments, z, u: ~85 MB for the demo model) on a 16 MiB disk: torch's zip writer
    fails without an errno; the unpublished tag and the checkpoints folder this run made go, one line names the tag."""
    parent = tmp_path / "disk"
    with _small_disk(parent, 16 * 2**20) as preexec:
        out = _previous_output(parent)
        before = _listing(parent)
        proc = _prune([*QUICK, "--steps", "4", "--save_interval", "2", "--output_dir", str(out), "--overwrite",
                       "--ignore_memory_check"], preexec)
        line = _one_error_line(proc)
        after = _listing(parent)
        assert after == before, (line, set(after) ^ set(before))
    assert re.search(r"^elsa_ds: error: (no space left|file size limit reached) on .+ writing \S+checkpoints/global_step2", line), line


@pytest.mark.parametrize("rank,tag", [(1, "global_step4"), (0, "global_step2"), (0, "export"), (1, "snapshot")],
                         ids=["rank1-second", "rank0-first", "rank0-export", "rank1-snapshot"])
def test_a_full_disk_on_one_rank_stops_every_rank_in_a_line_each(tmp_path, tiny_model_dir, text_dir, rank, tag):
    """A walk: one rank's disk full at a checkpoint (a node-local disk; ``tests/fixtures/full_disk_on_rank`` fails that
    rank's writes into the tag) left the other ranks in DeepSpeed's collective after the writes until the launcher
    killed them (on several nodes: until the backend's timeout), and a failing rank 0 removed the tag under rank 1's
    writes (its traceback: "Parent directory ... does not exist"); rank 0's export failing left rank 1 in the next
    parameter's gather; rank 1's --select_every snapshot failing let rank 0 replace its own (a resume would restore
    shards of two steps). Now the ranks agree: exit 2, a line from each rank, no traceback, the tag gone; the tag
    published before stays for --resume, and a run stopped at its first checkpoint leaves nothing (its output folder
    included); no rank replaces its snapshot unless every rank wrote its own."""
    parent = tmp_path / "p"
    parent.mkdir()
    out = parent / "o"
    fixture = ROOT / "tests" / "fixtures" / "full_disk_on_rank"
    at = {"export": r"\.o\.partial\.\d+/model.*\.safetensors$", "snapshot": r"\.o\.best_projection/\.rank1\.pt\.tmp$"}.get(
        tag, re.escape(f"/{tag}/"))
    env = {"PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ELSA_TEST_FULL_DISK_RANK": str(rank), "ELSA_TEST_FULL_DISK_AT": at}
    args = ["--seqlen", "64", "--interval", "2", "--sparsity", "0.6", "--lr", "1e-3", "--lmda", "0.05", "--val_windows", "0",
            "--baseline", "none", "--micro_batch", "2", "--init_mask", "none", "--steps", "6", "--save_interval", "2",
            "--deepspeed", "ds_configs/zero3_offload.json", "--model", str(tiny_model_dir), "--dataset", str(text_dir),
            "--output_dir", str(out)]
    if tag == "snapshot":  # scored at each projection, after the checkpoint of step 1
        args += ["--save_interval", "1", "--val_windows", "4", "--select_every", "1"]
    proc = run_entry("prune.py", args, ranks=2, check=False, timeout=420, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text, text[-4000:]
    errors = sorted((line for line in proc.stderr.splitlines() if line.startswith(ERROR_LINE)), key=lambda line: "another rank" in line)
    assert len(errors) == 2, text[-4000:]
    if tag == "snapshot":
        snapshots = tmp_path / "p" / ".o.best_projection"
        assert re.search(r"^elsa_ds: error \(rank 1\): no space left on .+ writing \S+/\.rank1\.pt\.tmp", errors[0]), errors
        assert "elsa_ds: error: the best projection's snapshot in " in errors[1], errors
        assert (out / "checkpoints" / "latest").read_text() == "global_step1" and sorted(os.listdir(snapshots)) == [], errors
        return
    if tag == "export":
        assert re.search(r"^elsa_ds: error: no space left on .+ writing \S+/\.o\.partial\.\d+/model", errors[0]), errors
        assert f"elsa_ds: error (rank 1): export to {parent}/.o.partial." in errors[1], errors
        assert (out / "checkpoints" / "latest").read_text() == "global_step4" and not (out / "model.safetensors").exists()
        return
    tag_dir = out / "checkpoints" / tag
    assert re.search(rf"^elsa_ds: error( \(rank 1\))?: no space left on .+ writing {re.escape(str(tag_dir))}/", errors[0]), errors
    assert f"checkpoint {tag_dir}: another rank could not write its files" in errors[1], errors
    if tag == "global_step2":
        assert _listing(parent) == {}
    else:
        assert (out / "checkpoints" / "latest").read_text() == "global_step2"
        assert sorted(p.name for p in (out / "checkpoints").glob("global_step*")) == ["global_step2"]


@pytest.mark.parametrize("at", [r"/checkpoints/zero_to_fp32\.py$", r"/checkpoints/\.elsa_fingerprint\.json\.\d+\.tmp$"],
                         ids=["the-copy", "the-fingerprint"])
def test_a_full_disk_at_the_second_save_keeps_the_last_good_recovery_scripts(tmp_path, tiny_model_dir, text_dir, at):
    """An audit (2026-12-03): DeepSpeed copies ``zero_to_fp32.py`` beside the tags at each save, in place
    (``shutil.copyfile``); a disk that filled during the second save's copy left the first save's whole script cut to
    nothing beside the published tag. Now the save sets it aside first and a failed save puts it back; a save that
    failed before DeepSpeed wrote anything (rank 0's fingerprint, first) leaves them as they were (a second audit: the
    fix's first version removed them there). The scripts beside ``latest`` are DeepSpeed's whole files, nothing else left."""
    import deepspeed

    out = tmp_path / "o"
    fixture = ROOT / "tests" / "fixtures" / "full_disk_on_rank"
    env = {"PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ELSA_TEST_FULL_DISK_RANK": "0", "ELSA_TEST_FULL_DISK_AT": at,
           "ELSA_TEST_FULL_DISK_AFTER": "1", "ELSA_TEST_FULL_DISK_CUTS": "1"}  # the first save's write goes through
    args = [*QUICK, "--sparsity", "0.6", "--steps", "6", "--save_interval", "2", "--model", str(tiny_model_dir),
            "--dataset", str(text_dir), "--output_dir", str(out)]
    proc = run_entry("prune.py", args, ranks=1, check=False, timeout=420, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text, text[-4000:]
    assert re.search(r"^elsa_ds: error: .*no space left on .+ writing \S+/checkpoints/", proc.stderr, re.M), text[-3000:]
    ckpt = out / "checkpoints"
    assert (ckpt / "latest").read_text() == "global_step2"
    source = Path(deepspeed.__file__).parent / "utils"
    for name in ("zero_to_fp32.py", "zero_to_torch.py"):
        assert (ckpt / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in ckpt.iterdir()) == ["elsa_fingerprint.json", "global_step2", "latest", "zero_to_fp32.py",
                                                      "zero_to_torch.py"]


# ---- a disk already full: the lock, and the sparse checkpoint ---------------------------------------------------------
def test_a_lock_that_cannot_be_written_is_one_error_and_no_file(tmp_path, monkeypatch):
    """The lock is the first file every entry point writes: on a full disk its write failed with a traceback and left an
    empty lock file behind. Now a DiskFull naming the lock and the flag to change, and no file."""
    from elsa_ds.files import ownership

    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ownership.os, "pwrite", pwrite)
    with pytest.raises(DiskFull, match="choose another --output$") as full:
        ownership.acquire(tmp_path / "r.json", "--output")
    assert str(lock_path(tmp_path / "r.json")) in str(full.value) and list(tmp_path.iterdir()) == []


def test_every_entry_point_on_a_full_disk_says_one_line_and_leaves_nothing(tmp_path):
    """A file system with no byte free: prune, evaluate and compress each end in one line naming the disk, exit 2, and
    the folder reads as before (no lock file, no staging)."""
    from tests.sparse.conftest import pruned_demo

    pruned, parent = pruned_demo(tmp_path / "pruned", 0.9), tmp_path / "disk"
    with _small_disk(parent, 2**20) as preexec:
        if preexec is not None:
            pytest.skip("no tmpfs can be mounted here (needs root)")
        with contextlib.suppress(OSError):
            with (parent / "fill").open("wb") as fill:
                while fill.write(bytes(2**16)):
                    pass
        before = _listing(parent)
        runs = {"prune.py": [*QUICK, "--steps", "2", "--output_dir", str(parent / "o")],
                "evaluate.py": ["--model", str(pruned), "--ppl", "shakespeare", "--seqlen", "64", "--limit", "2",
                                "--output", str(parent / "r.json")],
                "compress.py": [str(pruned), str(parent / "sparse")]}
        for script, args in runs.items():
            line = _one_error_line(run_entry(script, args, check=False, timeout=600))
            assert re.search(r"^elsa_ds: error: no space left on .+ writing \S+\.lock: 0 free; free space or choose", line), line
            assert _listing(parent) == before, (script, line)


def test_evaluate_on_a_disk_with_no_inode_left_says_one_line_and_leaves_no_folder(tmp_path):
    """``elsa-evaluate --output new/sub/r.json`` makes the missing folders before it takes its lock: a file system with no
    inode left (mkdir's ENOSPC, as on a full ext4) was a traceback there (an audit, 2026-12-05); now one line naming the
    folder, exit 2, and the folders it made gone."""
    with tmpfs(tmp_path / "disk", "size=1m,nr_inodes=3") as parent:
        (parent / "a").mkdir()  # the last inode but one: "new" takes the last, "sub" finds none
        before = _listing(parent)
        proc = run_entry("evaluate.py", ["--model", str(DEMO_MODEL_DIR), "--ppl", "shakespeare", "--seqlen", "64", "--limit",
                                         "2", "--output", str(parent / "new" / "sub" / "r.json")], check=False, timeout=600)
        line = _one_error_line(proc)
        assert re.search(r"^elsa_ds: error: cannot create the folder \S+/new/sub: No space left on device$", line), line
        assert _listing(parent) == before, line


def test_made_folders_name_the_folder_that_failed_and_remove_those_made(tmp_path, monkeypatch):
    """What any file system refusal does inside ``made_folders`` (here a permission error on the second folder): an
    ElsaError naming it, nothing made left behind; an error of the command inside passes through as it is."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.files.output import made_folders

    real_mkdir = os.mkdir

    def mkdir(path, mode=0o777, **kw):
        if Path(path).name == "sub":
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_mkdir(path, mode, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    with pytest.raises(ElsaError, match=r"^cannot create the folder \S+/new/sub: Permission denied$"):
        with made_folders([tmp_path / "new" / "sub" / "r.json"]):
            pass
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    with pytest.raises(KeyError):
        with made_folders([tmp_path / "x" / "r.json", None]):
            assert (tmp_path / "x").is_dir()
            raise KeyError("the command's own")
    assert list(tmp_path.iterdir()) == []


def test_compress_refuses_a_disk_too_small_before_writing_and_names_a_late_full_disk_right(tmp_path):
    """elsa-compress counts what it will write (every stored part, the copied files) against the free space before
    writing anything; a write that fails anyway (here a file size limit) is one line too, its hint compress's own
    (another output folder, not prune's --output_dir), and nothing is left."""
    from tests.sparse.conftest import pruned_demo

    pruned, parent = pruned_demo(tmp_path / "pruned", 0.9), tmp_path / "disk"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "launch" / "compress.py"), str(pruned), str(parent / "sparse")]
    with _small_disk(parent, 2**20) as preexec:
        before = _listing(parent)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, preexec_fn=preexec)
        line = _one_error_line(proc)
        assert _listing(parent) == before, line
    if preexec is None:  # a real small disk: refused before the first write
        assert re.search(r"^elsa_ds: error: no space left on .+ writing \S+/sparse: [\d,]+ bytes needed, [\d,]+ free; free "
                         r"space or choose another output folder$", line), line
    with _small_disk(tmp_path / "big", 64 * 2**20):
        proc = subprocess.run([*cmd[:-1], str(tmp_path / "big" / "sparse")], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=600, preexec_fn=_limit_file_size(2**20))
        line = _one_error_line(proc)
        assert sorted(p.name for p in (tmp_path / "big").iterdir()) == [], line
    assert re.search(r"^elsa_ds: error: file size limit reached on .+ writing \S+elsa-sparse\.safetensors: [\d,]+ bytes needed, "
                     r"[\d,]+ free; free space or choose another output folder$", line), line


def test_too_few_open_files_is_one_line_and_leaves_nothing(tmp_path):
    """An audit (OS limits, 2026-12-07): under ``ulimit -n 32`` the job ended in a traceback (exit 1) from wherever the
    next file opened (a pipe after the warm start). One line naming the limit now, exit 2, the output and its parent as
    before."""
    parent = tmp_path / "parent"
    out = _previous_output(parent)
    before = _listing(parent)

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    proc = _prune([*QUICK, "--steps", "2", "--output_dir", str(out), "--overwrite"], preexec=few_files)
    line = _one_error_line(proc)
    assert "too many open files (this process may hold 32: ulimit -n)" in line and "raise the limit" in line, line
    assert _listing(parent) == before


def test_nvme_swap_files_out_of_inodes_are_one_line(tmp_path):
    """An audit (file systems, 2026-12-07): an NVMe folder on a file system with room but few inodes (tmpfs
    ``nr_inodes``, ``mkfs.ext4 -N``) passes the checks, then DeepSpeed's swapper cannot open a swap file (its "error =
    28" line) and asserts: a traceback. One line now naming the missing inodes, exit 2, no output and no swap file."""
    with tmpfs(tmp_path / "nvme", "size=500m,nr_inodes=12") as nvme:
        (nvme / "nv").mkdir()
        out = tmp_path / "out"
        proc = _prune([*QUICK[2:], "--deepspeed", "zero3_nvme", "--nvme_path", str(nvme / "nv"), "--steps", "2",
                       "--output_dir", str(out)])
        line = _one_error_line(proc)
        assert re.search(r"^elsa_ds: error: NVMe offload: .+ has no free inode: no more files can be made there\.", line), line
        assert sorted(p.name for p in (nvme / "nv").iterdir()) == [] and not out.exists()


def test_a_file_system_out_of_inodes_is_said_as_such(tmp_path):
    """An audit (file systems, 2026-12-07): a file system out of inodes, with bytes to spare, was said as "no space
    left ... 483,217,408 free; free space or ...", which contradicts itself."""
    with tmpfs(tmp_path / "few", "size=8m,nr_inodes=8") as few:
        made = 0
        with pytest.raises(OSError) as err:
            while made < 100:
                (few / f"f{made}").touch()
                made += 1
        assert err.value.errno == errno.ENOSPC and made < 100
        message = str(DiskFull(few / "config.json", None, err.value.errno))
    assert re.search(r"^no free inode left on .+ writing \S+/config\.json: the file system can hold no more files \([\d,]+ in all\), "
                     r"though [\d,]+ bytes are free; delete files there or choose another --output_dir$", message), message


TORCH_SHARES = """
import os, resource, sys
import torch
from elsa_ds.errors import guarded


def share() -> None:
    held = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    tensors = [torch.empty(4).share_memory_() for _ in range(8)]

sys.exit(guarded(share))
"""


def test_torchs_too_many_open_files_is_the_same_one_line():
    """A review (2026-12-07): torch says the open-files limit in a RuntimeError of its own ("unable to open shared memory
    object ... Too many open files (24)"), not an OSError: it was a traceback. The same one line now, exit 2."""
    proc = subprocess.run([sys.executable, "-c", TORCH_SHARES], cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = _one_error_line(proc)
    assert re.search(r"too many open files \(this process may hold \d+: ulimit -n\): unable to open shared memory", line), line
