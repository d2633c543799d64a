"""ZeRO-3 on 1 GPU through the real entry point: CPU offload and the optimizer on the GPU give the single-process reference
mask; ELSA-L on the GPU gives the CPU's (run with CUDA hidden). Marked ``cuda`` (tests/cuda/conftest.py)."""
from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.conftest import derived_config, run_entry
from tests.zero.test_reference_masks import ARGS, _reference_masks

pytestmark = pytest.mark.integration


def _masks(out):
    weights = load_file(out / "model.safetensors")
    report = json.loads((out / "elsa_report.json").read_text())
    return {k: weights[k] != 0 for k in report["layers"]}, report


def _agreement(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return sum(int((a[k] == b[k]).sum()) for k in a) / sum(m.numel() for m in a.values())


@pytest.mark.parametrize("config", ["zero3_offload.json", "zero3.json"])
def test_one_gpu_gives_the_reference_mask(tmp_path, tiny_model_dir, text_dir, config):
    """zero3_offload: CPU flats (fused C++ kernels), params and grads through pinned memory; zero3: the flats on the GPU
    (the compiled x-step, opted into here, the eager projection, counts all-reduced over NCCL)."""
    ds_path = derived_config(tmp_path, config, bf16={"enabled": False})
    out = tmp_path / "gpu"
    run_entry("prune.py", ["--deepspeed", str(ds_path), "--model", str(tiny_model_dir), "--dataset", str(text_dir), *ARGS,
                           "--output_dir", str(out)], ranks=1, env={"ELSA_DS_COMPILED": "1"})
    masks, report = _masks(out)
    assert report["world_size"] == 1 and report["peak_gpu_bytes"] > 0
    if config == "zero3.json":
        assert report["kernels"]["x_steps"].get("compiled", 0) > 0, report["kernels"]  # GPU flats took the compiled step
    for name, mask in masks.items():
        assert int((~mask).sum()) == round(0.6 * mask.numel()), name
    agree = _agreement(masks, _reference_masks(ds_path, tiny_model_dir, text_dir))
    print(config, agree)
    assert agree >= 0.999, f"{config}: mask agreement {agree:.5f} with the single-process reference"


@pytest.mark.parametrize("config", ["zero3.json"])
def test_elsal_on_the_gpu_gives_the_cpus_mask(tmp_path, tiny_model_dir, text_dir, config):
    """ELSA-L (fp8 z, bf16 u, minifloat 8-bit Adam) with the optimizer on the GPU, against the same job run with CUDA
    hidden (DeepSpeed's CPU accelerator). ELSA-L under CPU offload on the GPU: bench/device/check.sh's
    zero3_offload_elsal_gpu against its CPU run."""
    elsal = json.loads(derived_config(tmp_path, "zero3_offload_elsal.json").read_text())["elsa"]
    ds_path = derived_config(tmp_path, config, bf16={"enabled": False}, elsa=elsal)
    common = ["--deepspeed", str(ds_path), "--model", str(tiny_model_dir), "--dataset", str(text_dir), *ARGS]
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "gpu")], ranks=1)
    # one plain process (the deepspeed launcher would set CUDA_VISIBLE_DEVICES=0 again)
    run_entry("prune.py", [*common, "--output_dir", str(tmp_path / "cpu")], env={"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})
    gpu, report = _masks(tmp_path / "gpu")
    cpu, _ = _masks(tmp_path / "cpu")
    assert report["admm_state_bytes_per_param"] < 4  # fp8 z + bf16 u, not fp32
    for name, mask in gpu.items():
        assert int((~mask).sum()) == round(0.6 * mask.numel()), name
    agree = _agreement(gpu, cpu)
    print(config, agree)
    assert agree >= 0.99, f"{config}: ELSA-L mask agreement {agree:.5f} between GPU and CPU"
