"""Pruned copies of the tiny Gemma-2: exactly 60% unstructured and 2:4, saved like an exported model."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

SPARSITY = 0.6


def zero_smallest(weight: torch.Tensor, count: int) -> None:
    """Zero exactly ``count`` entries of ``weight``: the smallest |w| (ties broken by index)."""
    weight.view(-1)[weight.abs().flatten().argsort(stable=True)[:count]] = 0


def zero_two_of_four(weight: torch.Tensor) -> None:
    """2:4 along the input dim: in each group of 4 consecutive inputs of a row, zero the 2 smallest |w|."""
    groups = weight.view(weight.shape[0], -1, 4)
    groups.scatter_(-1, groups.abs().argsort(-1)[..., :2], 0.0)


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{n}.weight": m.weight.data for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


def pruned_copy(src: Path, dst: Path, prune: Callable[[torch.Tensor], None]) -> Path:
    """src's tokenizer and config with its decoder Linear weights edited in place by ``prune``."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    for weight in decoder_linears(model).values():
        prune(weight)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def sixty_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """Every decoder Linear at round(0.6 · numel) zeros."""
    return pruned_copy(tiny_model_dir, tmp_path_factory.mktemp("sixty") / "model", lambda w: zero_smallest(w, round(SPARSITY * w.numel())))


@pytest.fixture(scope="session")
def two_four_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return pruned_copy(tiny_model_dir, tmp_path_factory.mktemp("two_four") / "model", zero_two_of_four)


@pytest.fixture
def offline(monkeypatch, tmp_path) -> None:
    """No hub: offline flags, an unreachable endpoint, and a private datasets cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
