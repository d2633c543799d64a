"""DeepSpeed's NVMe swap files: its asynchronous writes never check a result, so a full disk left holes that the run read
back as zeros and published a model trained on them (exit 0). Now every step counts the swap files not wholly written
and stops the run in one line; a job owns its host's swap folders (a second job on the same --nvme_path is refused) and
removes them when it ends. A real full disk where this process may mount one (an ext4 image: DeepSpeed's O_DIRECT
writes need a real file system, not tmpfs)."""
from __future__ import annotations

import os
import re
import shutil
import socket
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


def test_a_file_short_of_its_blocks_counts_as_unwritten_except_on_a_compressing_file_system(tmp_path, monkeypatch):
    written, holed = tmp_path / "written.swp", tmp_path / "holed.swp"
    written.write_bytes(os.urandom(2**16))
    with holed.open("wb") as f:
        f.truncate(2**20)  # what a failed write leaves: the size, no blocks
    assert disk_room.unwritten([tmp_path, tmp_path / "absent"]) == [holed]
    monkeypatch.setattr(disk_room, "_mount_of", lambda path: ("pool", Path("/"), "zfs"))
    assert disk_room.unwritten([tmp_path]) == []  # zfs stores a file compressed: short of blocks, no hole
    monkeypatch.setattr(disk_room.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 2**10))
    assert disk_room.unwritten([tmp_path]) == [holed]  # beside a full disk it counts


def test_a_job_owns_its_nvme_swap_folders_and_removes_them_at_its_end(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    args = [*QUICK, "--nvme_path", str(nvme)]
    with owned(compat.swap_root(nvme).with_name(f"zero_stage_3.{socket.gethostname()}"), "--nvme_path"):
        proc = run_entry("prune.py", [*args, "--output_dir", str(tmp_path / "refused")], check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"^elsa_ds: error: --nvme_path \S+zero_stage_3\.\S+ is being written by another job", proc.stderr, re.M)
    assert not (tmp_path / "refused").exists()
    run_entry("prune.py", [*args, "--output_dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / "model.safetensors").is_file() and sorted(os.listdir(nvme)) == []  # no swap file, no lock


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
    assert len(errors) == 1 and re.match(r"elsa_ds: error: NVMe offload: \d+ swap files? not fully written \(\S+\.tensor\.swp; ",
                                         errors[0]), errors
    assert after == before and not (tmp_path / "out").exists(), (after, errors)  # no swap file, no lock, no output
