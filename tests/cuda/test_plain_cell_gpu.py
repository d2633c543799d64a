"""bench/plain_cell.py on a CUDA device (the budget curve's default loop): a bf16 ELSA cell from SparseGPT's start and a
retraining cell end at the goal's exact sparsity, their masks as the same cells' on the host. Marked ``cuda``
(conftest.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--deepspeed", "ds_configs/zero3.json", "--sparsity", "0.9", "--steps", "8", "--seqlen", "64",
        "--micro_batch", "4", "--val_windows", "0", "--baseline", "none", "--seed", "3"]


def _cell(device: str, out: Path, model: Path, text: Path, extra: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "bench/plain_cell.py", "--device", device, *ARGS, "--model", str(model), "--dataset",
                           str(text), "--output_dir", str(out), *extra], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "elsa_report.json").read_text())


@pytest.mark.parametrize("extra", [["--init_mask", "sparsegpt", "--init_weights", "--interval", "4", "--lmda", "0.05", "--lr", "1e-3"],
                                   ["--method", "wanda", "--finetune", "full", "--lr", "1e-3"]], ids=["elsa", "wanda+ft"])
def test_a_cell_on_the_gpu_keeps_the_goal_and_the_hosts_masks(tmp_path, tiny_model_dir, text_dir, extra):
    gpu = _cell("cuda", tmp_path / "gpu", tiny_model_dir, text_dir, extra)
    host = _cell("cpu", tmp_path / "cpu", tiny_model_dir, text_dir, extra)
    assert gpu["device"].startswith("cuda") and gpu["peak_gpu_bytes"] > 0
    assert gpu["overall_sparsity"] == pytest.approx(0.9, abs=1e-3) and host["overall_sparsity"] == pytest.approx(0.9, abs=1e-3)
    a, b = load_file(tmp_path / "gpu" / "model.safetensors"), load_file(tmp_path / "cpu" / "model.safetensors")
    agree = total = 0
    for key, w in a.items():
        if w.dim() == 2 and int((w == 0).sum()) > 0:
            agree, total = agree + int(((w != 0) == (b[key] != 0)).sum()), total + w.numel()
    assert total and agree / total >= 0.97, agree / total  # bf16 on both sides, as the engine's GPU-vs-CPU masks (97 %)


def test_a_compiled_cell_on_the_gpu_compiles_and_keeps_the_eager_cells_masks(tmp_path, tiny_model_dir, text_dir):
    """The budget curve's 2048-step cells run compiled (``--compile inductor``: Triton's kernels here, the host's C++ in
    tests/test_bench_plain_cell.py): the graphs compile (a fallback to eager would leave ``compiled_graphs`` 0), the cell
    keeps the goal, and its masks are the eager cell's but for bf16's rounding (the GPU-vs-host bound above)."""
    extra = ["--init_mask", "sparsegpt", "--init_weights", "--interval", "4", "--lmda", "0.05", "--lr", "1e-3",
             "--no-gradient_checkpointing"]
    eager = _cell("cuda", tmp_path / "eager", tiny_model_dir, text_dir, extra)
    compiled = _cell("cuda", tmp_path / "compiled", tiny_model_dir, text_dir, ["--compile", "inductor", *extra])
    assert eager["compile"] is None and compiled["compile"] == "inductor"
    assert compiled["compiled_graphs"] >= 1, compiled  # graph_breaks: 0 on the host's Gemma-3 without checkpointing
    assert compiled["overall_sparsity"] == pytest.approx(0.9, abs=1e-3)
    a, b = load_file(tmp_path / "compiled" / "model.safetensors"), load_file(tmp_path / "eager" / "model.safetensors")
    assert a.keys() == b.keys()
    agree = total = 0
    for key, w in a.items():
        if w.dim() == 2 and int((w == 0).sum()) > 0:
            agree, total = agree + int(((w != 0) == (b[key] != 0)).sum()), total + w.numel()
    assert total and agree / total >= 0.97, agree / total
