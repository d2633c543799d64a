"""The machine checks (``elsa_ds/capacity/machine.py``): what the host lacks is named before any work."""
from __future__ import annotations

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


def _read_only_mount(where):
    """A read-only tmpfs at ``where`` (root can write anywhere else), or a skip where none can be mounted."""
    import os
    import subprocess

    import pytest

    where.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip("no tmpfs can be mounted here (needs root)")
    return lambda: subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_folders_the_engine_writes_outside_the_output_are_tried_before_any_work(tmp_path, monkeypatch, tiny_model_dir):
    """An audit (OS limits and permissions, 2026-12-07): an unwritable build folder (HOME=/ in a container started with
    --user, another user's cache) was a traceback from inside DeepSpeed's start, after the plan; an unwritable /dev/shm
    hung both CPU ranks past SIGTERM. Each is one line now, from the plan's checks and from elsa-estimate --measure."""
    from elsa_ds.capacity import machine
    from tests.conftest import run_entry

    unmount = [_read_only_mount(tmp_path / "ro"), _read_only_mount(tmp_path / "ext" / "an_op")]
    try:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ro" / "not_yet"))  # made in a folder nobody can write
        assert "ro cannot be written (Read-only file system)" in (machine.host_folders_problem(1, True) or "")
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # writable, but an op's folder in it is not
        assert "an_op cannot be written" in (machine.host_folders_problem(1, True) or "")
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "fresh"))
        monkeypatch.setattr(machine, "SHM", str(tmp_path / "ro"))
        assert machine.host_folders_problem(1, True) is None and machine.host_folders_problem(2, False) is None
        assert "all-reduce buffer" in (machine.host_folders_problem(2, True) or "")
        env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ro" / "ext")}
        for script, args in (("prune.py", ["--model", str(tiny_model_dir), "--output_dir", str(tmp_path / "out")]),
                             ("estimate.py", ["--accelerator", "cpu", "--num_gpus", "1", "--measure"])):
            proc = run_entry(script, ["--deepspeed", "zero3_offload", *args], check=False, env=env, timeout=300)
            errors = [line for line in proc.stderr.splitlines() if line.startswith("elsa_ds: error")]
            assert proc.returncode == 2 and len(errors) == 1 and "set TORCH_EXTENSIONS_DIR" in errors[0], proc.stderr[-3000:]
            assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
    finally:
        for undo in unmount:
            undo()


def test_a_resumed_run_whose_checkpoints_folder_cannot_be_written_is_refused_before_it_loads(tmp_path, tiny_model_dir):
    """An audit (OS permissions, 2026-12-07): ``--resume --save_interval`` into a checkpoints folder the user cannot write
    was refused only after the model, the engine and the checkpoint had loaded (hours at 27B). A folder on a read-only
    mount stands for it here (as root, a permission stops nothing)."""
    import subprocess

    import pytest

    from elsa_ds.errors import ElsaError
    from elsa_ds.models import ModelSource
    from elsa_ds.plan import checks
    from elsa_ds.settings.config import resolve_config
    from elsa_ds.settings.options import JobOptions
    from elsa_ds.zero.ds_config import DsConfig

    ckpt = tmp_path / "out" / "checkpoints"
    unmount = _read_only_mount(ckpt)
    try:
        subprocess.run(["mount", "-o", "remount,rw", str(ckpt)], check=True)
        (ckpt / "latest").write_text("global_step3")
        subprocess.run(["mount", "-o", "remount,ro", str(ckpt)], check=True)
        ds_config = DsConfig.load("zero3_offload.json")
        opts = JobOptions(deepspeed="zero3_offload.json", output_dir=tmp_path / "out", resume=True)
        for interval, refused in ((1, True), (0, False)):
            cfg = resolve_config(ds_config.raw, {"model": str(tiny_model_dir), "seqlen": 64, "save_interval": interval})
            with pytest.raises(ElsaError) as err:  # without --save_interval: the resume's own checks go on (no tag here)
                checks.before_work(cfg, opts, ds_config, 1, ModelSource(cfg.model))
            assert ("checkpoints cannot be written (Read-only file system)" in str(err.value)) is refused, str(err.value)
    finally:
        unmount()
