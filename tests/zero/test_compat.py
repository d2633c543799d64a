"""The adapter's pieces that need no engine: the version guard and the names it derives from DeepSpeed's."""
from __future__ import annotations

import warnings

import pytest
import torch

from elsa_ds import torch_api
from elsa_ds.zero import compat
from elsa_ds.zero.dist import shm_buffer_path


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
    path = shm_buffer_path(3)
    assert path.startswith("/dev/shm/deepspeed_allreduce_buffer_")
    assert path.endswith("_10.0.0.7_29511_3")


def test_the_bf16_probe_is_what_onednn_reports(monkeypatch):
    import torch

    for fast in (False, True):
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda fast=fast: fast)
        assert torch_api.cpu_bf16_matmul_is_fast() is fast


AGREE = """
import sys
import torch.distributed as dist
from elsa_ds.zero.dist import same_on_every_rank

dist.init_process_group("gloo")
print(same_on_every_rank(sys.argv[1]), flush=True)
dist.destroy_process_group()
"""


def test_ranks_that_planned_different_jobs_are_told_so_on_every_rank():
    """Each rank makes its plan alone, before the process group: with --resume_if_any, nodes whose network file system
    cached OUTPUT_DIR/checkpoints differently could plan a resume and a fresh start (a review's find, 2026-11-30).
    Once the group forms the ranks compare their plans: two real gloo ranks, the same text and different ones."""
    import os
    import subprocess
    import sys

    from elsa_ds.zero.dist import free_port
    from tests.conftest import ROOT

    for texts, agree in ((["resume", "resume"], "True"), (["resume", "fresh"], "False")):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
               "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-c", AGREE, text], cwd=ROOT, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r, text in enumerate(texts)]
        said = [p.communicate(timeout=120) for p in procs]
        assert [out.strip().splitlines()[-1] if out.strip() else err[-2000:] for out, err in said] == [agree, agree]


def test_resume_if_any_removes_one_unpublished_tag_and_refuses_several(tmp_path):
    """A run publishes `latest` once its first checkpoint is whole, so an attempt cut short leaves one tag without it at
    most; several tags and no `latest` (a copy without it, one removed by hand) are refused, not removed (a trust
    audit's find, 2026-11-30: hours of checkpoints went with the restart)."""
    from elsa_ds.errors import ElsaError
    from elsa_ds.settings.options import JobOptions, resolve_resume

    out = tmp_path / "out"
    (out / "checkpoints" / "global_step8").mkdir(parents=True)
    opts = JobOptions(deepspeed="ds_configs/zero3_offload.json", output_dir=str(out), resume_if_any=True)
    assert resolve_resume(opts).restart and not resolve_resume(opts).resume
    (out / "checkpoints" / "global_step16").mkdir()
    with pytest.raises(ElsaError, match=r"holds 2 checkpoints \(global_step16, global_step8\) but no 'latest'"):
        resolve_resume(opts)
    (out / "checkpoints" / "latest").write_text("global_step16")
    assert resolve_resume(opts).resume


def test_deepspeed_cpu_adam_resumed_after_a_replay_steps_as_the_uninterrupted_one():
    """DeepSpeedCPUAdam keeps β^t in its C++ optimizer, multiplied up once a step; a new one loaded at step 2 takes
    pow(β, 3) at its next step, a float32 ulp away (β2 = 0.999), so its weights drift from the uninterrupted run's.
    ``compat.replay_cpu_adam`` replays the history: the resumed optimizer then ends bit for bit where the
    uninterrupted one does (without it, not: the test's own check)."""
    from types import SimpleNamespace

    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from elsa_ds.zero import compat

    def run(steps, p, opt):
        for t in steps:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t))
            opt.step()

    start = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.Parameter(start.clone())
    run(range(6), ref, DeepSpeedCPUAdam([ref], lr=1e-2))
    ends = {}
    for replay in (True, False):
        p = torch.nn.Parameter(start.clone())
        cut = DeepSpeedCPUAdam([p], lr=1e-2)
        run(range(2), p, cut)
        again = torch.nn.Parameter(p.detach().clone())
        resumed = DeepSpeedCPUAdam([again], lr=1e-2)
        resumed.load_state_dict(cut.state_dict())
        if replay:
            assert compat.replay_cpu_adam(SimpleNamespace(optimizer=SimpleNamespace(optimizer=resumed))) == 2
        run(range(2, 6), again, resumed)
        ends[replay] = again.detach()
    assert torch.equal(ends[True], ref.detach()) and not torch.equal(ends[False], ref.detach())


def test_releasing_engines_never_raises_and_leaves_the_callers_own(caplog):
    """A review of the API's engine release: a ``destroy`` that raised replaced the job's own error and left the other
    engines held; the release gave up every engine of the process, a caller's own built before the job included, and
    cleared other engines' modules from ZeRO-3's forward stack."""
    from deepspeed.runtime.zero import parameter_offload

    from elsa_ds.zero import engine as zero_engine

    class Engine:
        def __init__(self, fails: bool):
            self.module, self.fails, self.destroyed = torch.nn.Sequential(torch.nn.Linear(2, 2)), fails, False

        def destroy(self):
            self.destroyed = True
            if self.fails:
                raise RuntimeError("device lost")

    callers, failing, plain = Engine(False), Engine(True), Engine(False)
    zero_engine._BUILT.add(callers)
    kept = zero_engine.built_engines()
    zero_engine._BUILT.add(failing)
    zero_engine._BUILT.add(plain)
    stack = parameter_offload.FWD_MODULE_STACK
    stack[:] = [callers.module, failing.module, failing.module[0], plain.module]
    try:
        zero_engine.release_engines(kept)  # no exception
        assert failing.destroyed and plain.destroyed and not callers.destroyed
        assert set(zero_engine._BUILT) == {callers} and stack == [callers.module]
        assert "could not be given up (device lost)" in caplog.text
        zero_engine.release_engines(destroy=False)  # a stopped job's: nothing synchronized
        assert not callers.destroyed and not zero_engine._BUILT and stack == []
    finally:
        stack.clear()
        zero_engine._BUILT.clear()


def test_a_monitors_log_folder_is_set_aside_by_its_entry_and_copied_alone_on_resume(tmp_path):
    """--overwrite sets aside every entry of the output a file monitor writes under (not only ``monitor/``), and a
    resume copies hard-linked files of the monitors' own folders only (a review: a log folder under ``checkpoints``
    made the resume copy every checkpoint of a ``cp -al`` copy)."""
    import types

    from elsa_ds.jobs.owner import _log_dirs

    out = tmp_path / "out"
    ds = types.SimpleNamespace(raw={"csv_monitor": {"enabled": True, "output_path": str(out / "checkpoints" / "tb")},
                                    "tensorboard": {"enabled": True, "output_path": str(out / "logs"), "job_name": "run"}})
    aside, appended = _log_dirs(out, ds)
    assert aside == [out / "monitor", out / "checkpoints", out / "logs"]
    assert appended == [out / "monitor", out / "checkpoints" / "tb" / "DeepSpeedJobName", out / "logs" / "run"]
