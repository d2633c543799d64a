"""DeepSpeed's NVMe swap files: its asynchronous writes never check a result, so a full disk left holes that the run read
back as zeros and published a model trained on them (exit 0). Now every step counts the swap files not wholly written
and stops the run in one line; a job owns its host's swap folders (a second job on the same --nvme_path is refused) and
removes them when it ends. A real full disk where this process may mount one (an ext4 image: DeepSpeed's O_DIRECT
writes need a real file system, not tmpfs)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from elsa_ds.files import disk_room
from elsa_ds.files.ownership import owned
from elsa_ds.zero import compat
from tests.conftest import run_entry

pytestmark = pytest.mark.integration

QUICK = ["--deepspeed", "ds_configs/zero3_nvme.json", "--seqlen", "64", "--micro_batch", "2", "--interval", "1",
         "--val_windows", "0", "--baseline", "none", "--init_mask", "none", "--steps", "2"]


def test_swap_problems_are_holes_empty_state_files_and_a_full_disk(tmp_path, monkeypatch):
    written, holed, empty, gradient = (tmp_path / n for n in ("0_45.tensor.swp", "exp_avg-0_45.tensor.swp",
                                                            "admm_z-0_45.tensor.swp", "0_45_gradient_0_64.tensor.swp"))
    written.write_bytes(os.urandom(2**16))
    for f, size in ((holed, 2**20), (empty, 0), (gradient, 2**20)):
        with f.open("wb") as fh:
            fh.truncate(size)  # what a failed write leaves: the size without its blocks, or nothing
    monkeypatch.setattr(disk_room, "_mount_of", lambda path: ("/dev/nvme0n1", Path("/"), "ext4"))
    found = disk_room.swap_problems([tmp_path, tmp_path / "absent"])
    assert found[-1] == f"{tmp_path / 'absent'} is gone", found  # removed under the run: DeepSpeed would read zeros
    assert sorted(f.split(" ")[0] for f in found[:-1]) == sorted([str(empty), str(holed)]), found  # gradients: rewritten
    monkeypatch.setattr(disk_room, "_mount_of", lambda path: ("pool", Path("/"), "zfs"))
    big = os.statvfs_result((4096, 4096, 2**20, 2**19, 2**19, 0, 0, 0, 0, 255))
    monkeypatch.setattr(disk_room.os, "statvfs", lambda path: big)
    assert disk_room.swap_problems([tmp_path]) == [f"{empty} is not fully written (0 of 0 bytes on disk)"]  # zfs compresses
    full = os.statvfs_result((4096, 4096, 2**20, 16, 16, 0, 0, 0, 0, 255))  # 64 KiB free: one 1 MiB write cannot land
    monkeypatch.setattr(disk_room.os, "statvfs", lambda path: full)
    found = disk_room.swap_problems([tmp_path, tmp_path])
    assert found[0].endswith("has 65,536 bytes free") and len(found) == 3, found  # beside a full disk holes count too


def test_a_job_owns_its_nvme_swap_folders_and_removes_them_at_its_end(tmp_path):
    """A second job on the same --nvme_path and rank is refused and leaves the first one's live swap files alone; a job
    empties its rank's folders when it starts (an earlier run's file with a hole does not stop it) and removes them at its
    end, whatever dtype its parameters are swapped in."""
    nvme = tmp_path / "nvme"
    live = [nvme / "zero_stage_3" / "optimizer" / "rank0" / "0_45.tensor.swp", nvme / "zero_stage_3" / "float32params" /
            "rank0" / "0_param.tensor.swp"]
    for f in live:
        f.parent.mkdir(parents=True)
        f.write_bytes(b"live")
    args = [*QUICK, "--nvme_path", str(nvme)]
    with owned(compat.swap_root(nvme).with_name("zero_stage_3.rank0"), "--nvme_path"):  # another job's rank 0
        proc = run_entry("prune.py", [*args, "--output_dir", str(tmp_path / "refused")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = f"elsa_ds: error: --nvme_path {nvme} is being written by another job"  # the path as given (an audit)
    assert re.search(f"^{re.escape(said)} .*; lock \\S+/\\.zero_stage_3\\.rank0\\.lock\\)", proc.stderr, re.M), proc.stderr[-2000:]
    assert not (tmp_path / "refused").exists() and all(f.read_bytes() == b"live" for f in live)
    with live[0].with_name("exp_avg-9_99.tensor.swp").open("wb") as stale:
        stale.truncate(2**20)  # a killed run's file with a hole, under a name this run never writes
    run_entry("prune.py", [*args, "--output_dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / "model.safetensors").is_file() and sorted(os.listdir(nvme)) == []  # no swap file, no lock


@pytest.mark.parametrize("at", ["zero_stage_3", "zero_stage_3/optimizer", "zero_stage_3/optimizer/rank0"])
def test_a_link_where_the_swap_files_go_is_refused_and_its_target_kept(tmp_path, at):
    """A symbolic link planted in the NVMe folder (at its zero_stage_3, a swapper's folder, or the rank's folder) would
    have DeepSpeed write its swap files through it, and the job's cleanup remove what is there: refused in one line
    before the model loads, the link's target as it was. A folder of the user's under zero_stage_3 whose name is not a
    swapper's is never removed."""
    nvme, victim = tmp_path / "nvme", tmp_path / "victim"
    (victim / "rank0").mkdir(parents=True)
    (victim / "rank0" / "0_45.tensor.swp").write_text("user data")
    (nvme / at).parent.mkdir(parents=True, exist_ok=True)
    (nvme / at).symlink_to(victim / "rank0" if at.endswith("rank0") else victim)
    proc = run_entry("prune.py", [*QUICK, "--nvme_path", str(nvme), "--output_dir", str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(rf"^elsa_ds: error: --nvme_path \S+: \S+{at} is a symbolic link", proc.stderr, re.M), proc.stderr[-2000:]
    assert [p.name for p in victim.rglob("*")] == ["rank0", "0_45.tensor.swp"] and not (tmp_path / "out").exists()
    assert (victim / "rank0" / "0_45.tensor.swp").read_text() == "user data"
    (nvme / at).unlink()
    for name in ("old_run", "old_params"):  # not a swapper's folder name
        (nvme / "zero_stage_3" / name / "rank0").mkdir(parents=True)
    (nvme / "zero_stage_3" / "bfloat16params" / "rank0").mkdir(parents=True)
    assert compat.rank_swap_folders(nvme, 0) == [nvme / "zero_stage_3" / "bfloat16params" / "rank0"]


def test_a_full_nvme_disk_stops_the_run_in_one_line_and_leaves_nothing(tmp_path):
    image, disk = tmp_path / "nvme.img", tmp_path / "nvme"
    disk.mkdir()
    with image.open("wb") as f:
        f.truncate(40 * 2**20)  # 30 MiB free once formatted: the demo's swap files take ~80 MB
    made = shutil.which("mkfs.ext4") and subprocess.run(["mkfs.ext4", "-q", str(image)], capture_output=True).returncode == 0
    if os.geteuid() != 0 or not made or subprocess.run(["mount", "-o", "loop", str(image), str(disk)], capture_output=True).returncode:
        pytest.skip("no ext4 image can be mounted here (needs root and mkfs.ext4)")
    try:
        before = sorted(os.listdir(disk))
        proc = run_entry("prune.py", [*QUICK, "--nvme_path", str(disk), "--output_dir", str(tmp_path / "out"),
                                      "--ignore_memory_check"], check=False)
        after = sorted(os.listdir(disk))
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
    assert len(errors) == 1 and re.match(r"elsa_ds: error: NVMe offload: .+ (bytes free|is not fully written)", errors[0]), errors
    assert after == before and not (tmp_path / "out").exists(), (after, errors)  # no swap file, no lock, no output
