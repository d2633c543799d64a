"""Fixtures of the sparse-checkpoint tests: the shipped demo model magnitude-pruned, and its sparse checkpoint."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from elsa_ds.sparse import kernels as K

DEMO = Path(__file__).resolve().parents[2] / "elsa_ds" / "demo" / "model"
SPARSITY = 0.6  # the demo still writes text at 60 %, so greedy generate() compares real tokens


def magnitude_prune(model: torch.nn.Module, sparsity: float) -> None:
    """Zero the smallest-magnitude ``sparsity`` of every decoder Linear weight (per tensor)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                w = module.weight
                threshold = w.abs().flatten().float().kthvalue(int(w.numel() * sparsity)).values
                w.masked_fill_(w.abs() <= threshold.to(w.dtype), 0)


def pruned_demo(dst: Path, sparsity: float = SPARSITY, dtype: torch.dtype = torch.float32, **save_kwargs) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEMO, dtype=dtype)
    magnitude_prune(model, sparsity)
    model.save_pretrained(dst, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, dst / name)
    return dst


@pytest.fixture(scope="session")
def pruned_dir(tmp_path_factory) -> Path:
    return pruned_demo(tmp_path_factory.mktemp("pruned") / "demo-60")


@pytest.fixture(scope="session")
def sparse_dir(pruned_dir, tmp_path_factory) -> Path:
    from elsa_ds.sparse import compress

    out = tmp_path_factory.mktemp("sparse") / "demo-60-sparse"
    compress(pruned_dir, out)
    return out


@pytest.fixture(scope="session")
def kernel():
    k = K.load()
    if k is None:
        pytest.skip("the sparse decode kernel could not be built here (no C++ compiler?)")
    return k
