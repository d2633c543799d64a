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
