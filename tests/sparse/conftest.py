"""Fixtures of the sparse-checkpoint tests: the shipped demo model magnitude-pruned, and its sparse checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from elsa_ds.files.weight_files import SPARSE_INDEX, SPARSE_STEM
from elsa_ds.sparse import kernels as K

DEMO = Path(__file__).resolve().parents[2] / "elsa_ds" / "demo" / "model"
SPARSITY = 0.6  # the demo still writes text at 60 %, so greedy generate() compares real tokens
SPARSE_FILE, SPARSE_SHARDS = f"{SPARSE_STEM}.safetensors", f"{SPARSE_STEM}-*.safetensors"


def as_model_named(ckpt: Path, version: int = 2) -> Path:
    """``ckpt`` (written as version 3) laid out as versions 1 and 2 wrote it: weight files named as transformers' (the
    ``elsa_sparse`` block's version set, a version 2 block resealed over the same content, version 1's checksums dropped)."""
    from elsa_ds.sparse.meta import seal

    for file in sorted(ckpt.glob(f"{SPARSE_STEM}*.safetensors")):
        file.rename(ckpt / file.name.replace(SPARSE_STEM, "model", 1))
    if (ckpt / SPARSE_INDEX).is_file():
        index = json.loads((ckpt / SPARSE_INDEX).read_text())
        index["weight_map"] = {k: v.replace(SPARSE_STEM, "model", 1) for k, v in index["weight_map"].items()}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
        (ckpt / SPARSE_INDEX).unlink()
    config = json.loads((ckpt / "config.json").read_text())
    config["elsa_sparse"]["version"] = version
    if version == 1:
        del config["elsa_sparse"]["checksum"]
    (ckpt / "config.json").write_text(json.dumps(seal(config) if version > 1 else config))
    return ckpt


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


def tiny_pruned(dst: Path) -> Path:
    """A one-layer Llama (hidden 16, MLP 256, vocab 32; fp32), attention 60 % and MLP 95 % pruned: down_proj takes delta8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in name:
                w = module.weight
                w.masked_fill_(w.abs() <= w.abs().flatten().kthvalue(int(w.numel() * (0.95 if ".mlp." in name else 0.6))).values, 0)
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="session")
def tiny_sparse_dir(tmp_path_factory) -> Path:
    """The tiny model's sparse checkpoint in 2 KB shards (an index and several shard files); copy it before changing it."""
    from elsa_ds.sparse import compress

    root = tmp_path_factory.mktemp("tiny")
    compress(tiny_pruned(root / "pruned"), root / "sparse", max_shard_size="2KB")
    return root / "sparse"
