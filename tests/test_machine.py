"""The machine checks (``elsa_ds/capacity/machine.py``): what the host lacks is named before any work."""
from __future__ import annotations

import os

from elsa_ds.capacity.machine import cpu_bf16_fallback, nvme_unavailable


def test_bf16_is_switched_off_on_a_cpu_without_a_fast_bf16_matmul_and_kept_where_there_is_one(monkeypatch):
    import torch

    import deepspeed.accelerator

    class Cpu:  # the accelerator DeepSpeed picks on a machine without a GPU (this test also runs on CUDA hosts)
        def device_name(self):
            return "cpu"

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Cpu())
    monkeypatch.delenv("ELSA_DS_CPU_BF16", raising=False)
    for fast in (False, True):  # what oneDNN reports on an AVX2 CPU / on one with AVX-512 or AMX
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda fast=fast: fast)
        ds = {"bf16": {"enabled": True}}
        message = cpu_bf16_fallback(ds)
        assert ds["bf16"]["enabled"] is fast and (message is None) is fast
        assert fast or "fp32" in message and "ELSA_DS_CPU_BF16=1" in message
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    monkeypatch.setenv("ELSA_DS_CPU_BF16", "1")  # the user keeps bf16
    ds = {"bf16": {"enabled": True}}
    assert cpu_bf16_fallback(ds) is None and ds["bf16"]["enabled"] is True
    ds = {"bf16": {"enabled": False}}  # an fp32 config is left alone
    assert cpu_bf16_fallback(ds) is None and ds == {"bf16": {"enabled": False}}


def test_nvme_offload_without_libaio_is_named_before_any_work(monkeypatch):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)  # a machine without libaio
    why = nvme_unavailable()
    assert "libaio-dev" in why and "zero3_offload.json" in why
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: True)
    assert nvme_unavailable() is None


def test_an_nvme_job_on_a_machine_without_libaio_stops_in_the_checks(tmp_path, tiny_model_dir, monkeypatch):
    """The plan's checks (plan/checks.before_work) refuse it before a weight is loaded or a file written."""
    import pytest
    from deepspeed.ops.op_builder import AsyncIOBuilder

    from elsa_ds.errors import ElsaError
    from elsa_ds.models import ModelSource
    from elsa_ds.plan import checks
    from elsa_ds.settings.config import resolve_config
    from elsa_ds.settings.options import JobOptions
    from elsa_ds.zero.ds_config import DsConfig

    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    ds_config = DsConfig.load("zero3_nvme.json")
    cfg = resolve_config(ds_config.raw, {"model": str(tiny_model_dir), "seqlen": 64, "nvme_path": str(tmp_path)})
    opts = JobOptions(deepspeed="zero3_nvme.json", output_dir=tmp_path / "out")
    with pytest.raises(ElsaError, match="libaio-dev"):
        checks.before_work(cfg, opts, ds_config, 1, ModelSource(cfg.model))
    assert not (tmp_path / "out").exists()


def test_folders_the_engine_writes_outside_the_output_are_tried_before_any_work(tmp_path, monkeypatch, tiny_model_dir):
    """An audit (OS limits and permissions, 2026-12-07): an unwritable build folder (HOME=/ in a container started with
    --user) was a traceback from inside DeepSpeed's start, after the plan; an unwritable /dev/shm hung both CPU ranks
    past SIGTERM. Each is one line now, from the plan's checks (/dev/shm from elsa-estimate --measure's too)."""
    from elsa_ds.capacity import machine
    from tests.conftest import run_entry, tmpfs

    with tmpfs(tmp_path / "ro", "ro,size=64k"):
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ro" / "not_yet"))  # made in a folder nobody can write
        assert "ro cannot be written (Read-only file system)" in (machine.host_folders_problem(1, True) or "")
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR")  # torch's default: its folder for this Python and device, below the cache
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ro" / "cache"))
        assert machine.build_folder().parent == tmp_path / "ro" / "cache" / "torch_extensions"
        assert "ro cannot be written" in (machine.host_folders_problem(1, True) or "")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        monkeypatch.setattr(machine, "SHM", str(tmp_path / "ro"))
        assert machine.host_folders_problem(1, True) is None and machine.host_folders_problem(2, False) is None
        assert "all-reduce buffer" in (machine.host_folders_problem(2, True) or "")
        monkeypatch.setenv("LOCAL_SIZE", "1")  # one rank on each of two nodes: DeepSpeed shares no buffer then
        assert machine.host_folders_problem(2, True) is None and machine.shm_problem(2) is not None
        proc = run_entry("prune.py", ["--deepspeed", "zero3_offload", "--model", str(tiny_model_dir), "--output_dir",
                                      str(tmp_path / "out")], check=False, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ro" / "x")})
        errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
        assert proc.returncode == 2 and len(errors) == 1 and "set TORCH_EXTENSIONS_DIR" in errors[0], proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_build_folder_mounted_noexec_is_refused_before_any_work(tmp_path, monkeypatch):
    """An audit (file systems, 2026-12-07): a build folder on a file system mounted noexec (a hardened /tmp or home) was
    a 59-line traceback from DeepSpeed's start ("failed to map segment from shared object"). One line now, from the
    plan's checks; the same folder mounted with exec passes."""
    from elsa_ds.capacity import machine
    from tests.conftest import tmpfs

    monkeypatch.setattr(machine, "_prebuilt_ops", lambda: False)  # a DeepSpeed installed with its ops built skips the check
    for options, refused in (("noexec,size=1m", True), ("exec,size=1m", False)):
        with tmpfs(tmp_path / options.split(",")[0], options) as folder:
            monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder / "ops"))
            why = machine.host_folders_problem(1, True)
            assert (why is not None) is refused, why
            assert not refused or f"{folder} is on a file system mounted noexec" in why and "set TORCH_EXTENSIONS_DIR" in why


def test_a_full_temporary_folder_is_not_taken_for_a_missing_libaio(tmp_path):
    """An audit (file systems, 2026-12-07): with a full TMPDIR, where DeepSpeed compiles its test program for libaio, an
    NVMe job was told to install libaio-dev, which was installed. The temporary folder is named now."""
    import subprocess
    import sys

    from tests.conftest import ROOT, tmpfs

    with tmpfs(tmp_path / "tmp", "size=64k") as temp:
        (temp / "filler").write_bytes(b"\0" * (60 * 2**10))
        proc = subprocess.run([sys.executable, "-c", "from elsa_ds.capacity.machine import nvme_unavailable; "
                               "print(nvme_unavailable())"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert f"compiles a test program in the temporary folder, but {temp} has" in line and "set TMPDIR" in line, line


def test_a_resumed_run_whose_checkpoints_folder_cannot_be_written_is_refused_before_it_loads(tmp_path, tiny_model_dir):
    """An audit (OS permissions, 2026-12-07): ``--resume --save_interval`` into a checkpoints folder the user cannot write
    was refused only after the model, the engine and the checkpoint had loaded (hours at 27B). A folder on a read-only
    mount stands for it here (as root, a permission stops nothing)."""
    import subprocess

    import pytest
    import torch

    from elsa_ds.errors import ElsaError
    from elsa_ds.models import ModelSource
    from elsa_ds.plan import checks
    from elsa_ds.settings.config import resolve_config
    from elsa_ds.settings.options import JobOptions
    from elsa_ds.zero.ds_config import DsConfig

    from tests.conftest import tmpfs

    with tmpfs(tmp_path / "out" / "checkpoints", "ro,size=64k") as ckpt:
        subprocess.run(["mount", "-o", "remount,rw", str(ckpt)], check=True)
        (ckpt / "global_step3").mkdir()  # a tag the resume's own checks read (a state of plain tensors)
        torch.save({"module": {"w": torch.ones(2)}, "global_steps": 3}, ckpt / "global_step3" / "mp_rank_00_model_states.pt")
        (ckpt / "latest").write_text("global_step3")
        subprocess.run(["mount", "-o", "remount,ro", str(ckpt)], check=True)
        ds_config = DsConfig.load("zero3_offload.json")
        opts = JobOptions(deepspeed="zero3_offload.json", output_dir=tmp_path / "out", resume=True)
        for interval, refused in ((1, True), (0, False)):
            cfg = resolve_config(ds_config.raw, {"model": str(tiny_model_dir), "seqlen": 64, "save_interval": interval})
            if refused:
                with pytest.raises(ElsaError, match="checkpoints cannot be written \\(Read-only file system\\)"):
                    checks.before_work(cfg, opts, ds_config, 1, ModelSource(cfg.model))
            else:  # without --save_interval the resume writes nothing there: the checks go on, to the (hub) dataset's
                with pytest.raises(ElsaError, match="--dataset 'c4'"):
                    checks.before_work(cfg, opts, ds_config, 1, ModelSource(cfg.model))
