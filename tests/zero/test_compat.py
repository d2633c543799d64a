"""The adapter's pieces that need no engine: the version guard and the names it derives from DeepSpeed's."""
from __future__ import annotations

import warnings

import pytest

from elsa_ds.zero import compat


def test_an_untested_deepspeed_release_is_warned_about_and_a_tested_one_is_not(monkeypatch):
    import deepspeed

    tested = "%d.%d.3" % compat.TESTED_DEEPSPEED[0]
    monkeypatch.setattr(deepspeed, "__version__", tested)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.check_deepspeed_version()
    monkeypatch.setattr(deepspeed, "__version__", "9.1.0")
    with pytest.warns(UserWarning, match=r"not 9\.1\.0.*elsa_ds/zero/compat\.py"):
        compat.check_deepspeed_version()


def test_the_shm_buffer_path_follows_deepspeeds_name_format(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29511")
    path = compat.shm_buffer_path(3)
    assert path.startswith("/dev/shm/deepspeed_allreduce_buffer_")
    assert path.endswith("_10.0.0.7_29511_3")


def test_the_bf16_probe_is_what_onednn_reports(monkeypatch):
    import torch

    for fast in (False, True):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda fast=fast: fast)
        assert compat.cpu_bf16_matmul_is_fast() is fast
