"""NVMe offload and ELSA-L (fp8 z, bf16 u, 8-bit Adam) through the real entry point."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from elsa_ds.zero.swap_files import KEEP_ENV
from tests.conftest import derived_config, run_entry

pytestmark = pytest.mark.integration

ARGS = ["--seqlen", "64", "--steps", "8", "--interval", "4", "--sparsity", "0.7", "--lr", "1e-3", "--lmda", "0.05",
        "--val_windows", "0", "--baseline", "none", "--micro_batch", "2", "--init_mask", "none"]


def _masks(out):
    weights = load_file(out / "model.safetensors")
    report = json.loads((out / "elsa_report.json").read_text())
    return {k: weights[k] != 0 for k in report["layers"]}, report


# NVMe offload with fp32 states against CPU offload (swapped z, u and moments, the same mask): the NVMe run of
# tests/zero/test_ablation.py, which runs both configs on 2 ranks anyway.


def _elsal(tmp_path, small_model_dir, text_dir, ranks, config="zero3_offload_elsal.json", *extra, env=None):
    cfg = derived_config(tmp_path, config, bf16={"enabled": False})
    out = tmp_path / f"elsal_{ranks}_{config}"
    run_entry("prune.py", ["--deepspeed", str(cfg), "--model", str(small_model_dir), "--dataset", str(text_dir), *ARGS, *extra,
                           "--output_dir", str(out)], ranks=ranks, env=env)
    return out


@pytest.fixture(scope="module")
def elsal_two_ranks(tmp_path_factory, small_model_dir, text_dir):
    return _elsal(tmp_path_factory.mktemp("elsal"), small_model_dir, text_dir, 2)


@pytest.mark.parametrize("ranks", [None, 2])
def test_elsal_low_precision_states_under_cpu_offload(tmp_path, small_model_dir, text_dir, ranks, elsal_two_ranks):
    """The shipped ELSA-L config: fp8 z, bf16 u, elsa_ds's minifloat 8-bit Adam stepped by the fused kernel."""
    out = elsal_two_ranks if ranks == 2 else _elsal(tmp_path, small_model_dir, text_dir, ranks)
    masks, report = _masks(out)
    assert report["config"]["z_dtype"] == "fp8" and report["config"]["u_dtype"] == "bf16"
    assert report["config"]["base_optimizer"] == "adam8bit_minifloat"
    if report["kernels"]["available"]:  # the fused kernel stepped minifloat codes, nothing else
        assert set(report["kernels"]["x_steps"]) == {"adam8bit/minifloat"}, report["kernels"]
    assert report["admm_state_bytes_per_param"] <= 3.01
    if report["kernels"]["available"]:  # every projection of every CPU flat went through the fused kernels
        assert sum(report["kernels"]["projection_paths"].values()) >= len(report["projections"]), report["kernels"]
    for name, mask in masks.items():
        assert int((~mask).sum()) == round(0.7 * mask.numel()), name
    if ranks is None:  # fp8 scales per layer over all ranks: the same codes, hence the same masks, on 1 and 2 ranks
        two, _ = _masks(elsal_two_ranks)
        agree = sum(int((masks[k] == two[k]).sum()) for k in masks) / sum(m.numel() for m in masks.values())
        assert agree >= 0.999, agree


def test_elsal_with_bitsandbytes_codes_on_two_ranks(tmp_path, small_model_dir, text_dir, elsal_two_ranks):
    """--base_optimizer adam8bit (the paper's ELSA-L: bitsandbytes' 8-bit codes) under ZeRO-3 CPU offload on 2 ranks:
    its states are bitsandbytes' codes stepped by the fused kernel, the export has exact sparsity, and the run ends
    where the shipped minifloat run does (same data and settings; only the 8-bit rounding differs)."""
    out = _elsal(tmp_path, small_model_dir, text_dir, 2, "zero3_offload_elsal.json", "--base_optimizer", "adam8bit")
    masks, report = _masks(out)
    assert report["config"]["base_optimizer"] == "adam8bit"
    if report["kernels"]["available"]:  # the fused kernel stepped bitsandbytes' codes, nothing else
        assert set(report["kernels"]["x_steps"]) == {"adam8bit/bitsandbytes"}, report["kernels"]
    assert report["config"]["z_dtype"] == "fp8" and report["config"]["u_dtype"] == "bf16"
    assert report["admm_state_bytes_per_param"] <= 3.01
    if report["kernels"]["available"]:
        assert sum(report["kernels"]["projection_paths"].values()) >= len(report["projections"]), report["kernels"]
    for name, mask in masks.items():
        assert int((~mask).sum()) == round(0.7 * mask.numel()), name
    _, minifloat_report = _masks(elsal_two_ranks)
    assert report["final_loss"] == pytest.approx(minifloat_report["final_loss"], rel=0.02)
    two, _ = _masks(elsal_two_ranks)
    agree = sum(int((masks[k] == two[k]).sum()) for k in masks) / sum(m.numel() for m in masks.values())
    assert agree >= 0.9, agree


def test_nvme_path_and_buffer_errors(tmp_path):
    missing = tmp_path / "nope"
    proc = run_entry("prune.py", ["--deepspeed", "ds_configs/zero3_nvme.json", "--nvme_path", str(missing),
                                  "--output_dir", str(tmp_path / "o")], check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    cfg = json.loads(open("ds_configs/zero3_nvme.json").read())
    cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 4
    path = tmp_path / "few.json"
    path.write_text(json.dumps(cfg))
    proc = run_entry("prune.py", ["--deepspeed", str(path), "--nvme_path", str(tmp_path), "--output_dir", str(tmp_path / "o")], check=False)
    assert proc.returncode == 2 and "buffer_count" in proc.stderr and "Traceback" not in proc.stderr


def test_elsal_under_nvme_equals_cpu_offload(tmp_path, small_model_dir, text_dir, elsal_two_ranks):
    """8-bit Adam codes, fp8 z and bf16 u stay in CPU memory (DeepSpeed's swapper would read them back as fp32);
    the fp32 masters are swapped: the run is the CPU-offload run, bit for bit in the mask and the loss."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = _elsal(tmp_path, small_model_dir, text_dir, 2, "zero3_nvme.json", "--nvme_path", str(nvme), "--base_optimizer",
                 "adam8bit_minifloat", "--z_dtype", "fp8", "--u_dtype", "bf16", env={KEEP_ENV: "1"})  # swap files kept
    nvme_masks, nvme_report = _masks(out)
    cpu_masks, cpu_report = _masks(elsal_two_ranks)
    assert nvme_report["offload"]["offload_optimizer"] == "nvme" and nvme_report["admm_state_bytes_per_param"] <= 3.01
    assert all(torch.equal(nvme_masks[k], cpu_masks[k]) for k in cpu_masks)
    assert nvme_report["final_loss"] == pytest.approx(cpu_report["final_loss"], rel=1e-5)
    swapped = [p.name for p in (nvme / "zero_stage_3" / "optimizer").rglob("*.tensor.swp")]
    assert swapped and not [n for n in swapped if "-" in n], swapped  # the fp32 masters only: no named state was swapped


@pytest.mark.parametrize("config", ["zero3_offload.json", pytest.param("zero3_offload_elsal.json", marks=pytest.mark.slow)])
def test_hold_steps_end_the_run_inside_a_fixed_mask_on_two_ranks(tmp_path, small_model_dir, text_dir, config):
    """--hold_steps under ZeRO-3 on 2 ranks through the fused kernels (fp32 Adam; 8-bit Adam with fp8 z / bf16 u): the
    early x = Π(x) at step T − h, no projection after it, exact sparsity in the export."""
    out = _elsal(tmp_path, small_model_dir, text_dir, 2, config, "--steps", "12", "--interval", "5", "--hold_steps", "4")
    masks, report = _masks(out)
    assert report["config"]["hold_steps"] == 4 and report["kernels"]["available"]
    # without the hold: projections at 5 and 10, the hard one at 12; with it the hard one comes at 8 and again at 12
    assert [(p["step"], p["final"]) for p in report["projections"]] == [(5, False), (8, True), (12, True)]
    assert report["residual"] == report["projections"][0]["residual"] > 0
    for name, mask in masks.items():
        assert int((~mask).sum()) == round(0.7 * mask.numel()), name
