"""Progress reaches DeepSpeed's configured monitor: the csv monitor gets the loss every step and the residual every projection."""
from __future__ import annotations

import csv
import os

import pytest

from tests.conftest import ROOT, derived_config, run_entry

pytestmark = pytest.mark.integration


def _rows(path) -> list[list[str]]:
    with path.open() as fh:
        return list(csv.reader(fh))


def test_csv_monitor_receives_step_loss_and_projection_residual(tmp_path, tiny_model_dir, text_dir):
    ds = derived_config(tmp_path, "zero3_offload_csv.json", bf16={"enabled": False})
    out = tmp_path / "out"
    run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(text_dir), "--seqlen", "64",
                           "--steps", "8", "--interval", "3", "--val_windows", "0", "--baseline", "none", "--micro_batch", "2",
                           "--output_dir", str(out)])
    logs = out / "monitor" / "elsa"  # OUTPUT_DIR/monitor/<job_name>: the default output_path, carried into the published output
    loss = _rows(logs / "elsa_loss.csv")
    assert loss[0] == ["step", "loss"] and [int(r[0]) for r in loss[1:]] == list(range(1, 9))
    assert all(float(r[1]) > 0 for r in loss[1:])
    residual = _rows(logs / "elsa_residual.csv")
    assert [int(r[0]) for r in residual[1:]] == [3, 6]  # projections after steps 3 and 6; the final projection is not one
    assert all(0 < float(r[1]) < 10 for r in residual[1:])
    assert {"elsa_lambda.csv", "elsa_lr.csv", "elsa_step_time_s.csv", "elsa_mask_flip_frac.csv"} <= {p.name for p in logs.iterdir()}


def test_a_monitors_folder_inside_the_output_is_the_runs_own_and_goes_with_it(tmp_path, tiny_model_dir, text_dir):
    """A review of the publication's re-check (a fourteenth audit's mend): logs written into the output under an
    ``output_path`` of the config's own appeared there while the job ran, and stopped its publication; before it, a
    publication replacing the output left them behind (removed with the folder the run had created)."""
    out = tmp_path / "out"
    ds = derived_config(tmp_path, "zero3.json", bf16={"enabled": False},
                        csv_monitor={"enabled": True, "output_path": str(out / "logs"), "job_name": "run"})
    args = ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(text_dir), "--seqlen", "64", "--steps",
            "4", "--interval", "2", "--val_windows", "0", "--baseline", "none", "--micro_batch", "2", "--output_dir", str(out)]
    run_entry("prune.py", args)
    assert [int(r[0]) for r in _rows(out / "logs" / "run" / "elsa_loss.csv")[1:]] == [1, 2, 3, 4]
    assert (out / "elsa_report.json").is_file()
    # a review: --overwrite set only the default monitor folder aside, and the new run's rows went after the old ones
    run_entry("prune.py", [*args, "--overwrite"])
    assert [int(r[0]) for r in _rows(out / "logs" / "run" / "elsa_loss.csv")[1:]] == [1, 2, 3, 4]


def test_a_monitor_write_that_fails_on_rank_0_stops_the_logs_not_the_run(tmp_path, tiny_model_dir, text_dir):
    """Rank 0 alone writes the monitor's files, between the step's collectives: a full disk there (here: rank 0's CSV
    writes fail with ENOSPC, ``tests/fixtures/full_disk_on_rank``) stopped rank 0 and left rank 1 in the next step until
    the launcher killed it. Now one warning, and the run (2 ranks) finishes and publishes."""
    ds = derived_config(tmp_path, "zero3_offload_csv.json", bf16={"enabled": False})
    out = tmp_path / "out"
    fixture = ROOT / "tests" / "fixtures" / "full_disk_on_rank"
    env = {"PYTHONPATH": os.pathsep.join([str(fixture), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ELSA_TEST_FULL_DISK_RANK": "0", "ELSA_TEST_FULL_DISK_AT": r"/monitor/.*\.csv$"}
    proc = run_entry("prune.py", ["--deepspeed", str(ds), "--model", str(tiny_model_dir), "--dataset", str(text_dir), "--seqlen",
                                  "64", "--steps", "4", "--interval", "2", "--val_windows", "0", "--baseline", "none",
                                  "--micro_batch", "2", "--output_dir", str(out)], ranks=2, check=False, timeout=420, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in text, text[-4000:]
    assert text.count("the monitor's logs stop here: no space left on") == 1, text[-4000:]
    assert (out / "model.safetensors").exists() and not list((out / "monitor").rglob("*.csv"))


def test_a_full_disk_without_a_file_name_names_the_monitors_folder(tmp_path, caplog):
    """A write error that names no file (a writer thread's ENOSPC) named ``monitor`` relative to the working directory;
    it names the folder DeepSpeed's monitor writes to, and the free space there."""
    import errno
    import logging
    import types

    from elsa_ds.monitor import Monitor

    def fail(events):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    folder = tmp_path / "run" / "monitor"
    master = types.SimpleNamespace(enabled=True, write_events=fail, tb_monitor=None,
                                   csv_monitor=types.SimpleNamespace(output_path=str(folder)))
    monitor = Monitor(types.SimpleNamespace(monitor=master), rank=0)
    with caplog.at_level(logging.WARNING):
        monitor.write(1, {"loss": 1.0})
        monitor.write(2, {"loss": 1.0})  # stopped: nothing more is written, nothing more said
    said = [r.getMessage() for r in caplog.records if "logs stop here" in r.getMessage()]
    assert len(said) == 1 and f"writing {folder}:" in said[0] and not monitor.enabled and master.enabled is False


TENSORBOARD_FULL = """
import os, resource, signal, sys, types
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk's with ENOSPC
import deepspeed.comm as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
from deepspeed.monitor.config import get_monitor_config
from deepspeed.monitor.monitor import MonitorMaster
from elsa_ds.log import setup_logging
from elsa_ds.monitor import Monitor
setup_logging("info", rank=0)
master = MonitorMaster(get_monitor_config({"tensorboard": {"enabled": True, "output_path": sys.argv[1], "job_name": "j"}}))
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
monitor = Monitor(types.SimpleNamespace(monitor=master), rank=0)  # what the job wraps: the engine's real MonitorMaster
step = 0
while monitor.enabled and step < 5000:
    step += 1
    monitor.write(step, {"loss": 1.0 / step, "lambda": 0.01})
print(f"logs stopped at step {step}", flush=True)
"""


def test_a_full_disk_under_tensorboards_writer_thread_is_one_warning_not_a_thread_traceback(tmp_path):
    """An audit (2026-12-03): TensorBoard writes its events from a thread of its own; a full disk there (here: a file size
    limit, the same failed write) printed "Exception in thread" and a traceback beside the monitor's one warning. Now the
    warning alone, and the writes stop (DeepSpeed's real MonitorMaster and TensorBoard writer)."""
    import socket
    import subprocess
    import sys

    pytest.importorskip("tensorboard")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", TENSORBOARD_FULL, str(tmp_path / "tb"), str(port)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "logs stopped at step" in proc.stdout, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) < 5000, proc.stdout  # the limit was reached: the monitor stopped itself
    warned = [line for line in proc.stderr.splitlines() if "the monitor's logs stop here" in line]
    assert len(warned) == 1 and "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr[-3000:]
