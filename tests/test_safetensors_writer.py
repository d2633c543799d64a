"""The streamed safetensors writer: files safetensors reads back exactly, shards cut as huggingface_hub cuts them."""
from __future__ import annotations

import json

import pytest
import torch

from elsa_ds.errors import ElsaError
from elsa_ds.files.safetensors_writer import INDEX_NAME, ShardedWriter, TensorSpec, parse_size, plan_shards


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),   # 1280 bytes: larger than a shard
        "layers.0.norm.weight": torch.randn(16, generator=g),                            # fp32, odd size
        "scale": torch.tensor(3.0),                                                      # 0-dim
        "layers.1.proj.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }


def _write(tmp_path, tensors, max_shard_size):
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    with ShardedWriter(tmp_path, specs, max_shard_size) as writer:
        for k, v in tensors.items():
            writer.write(k, v)
    return specs


@pytest.mark.parametrize("max_shard_size", [300, "1KB", "5GB"])
def test_files_read_back_exactly_and_shard_like_huggingface_hub(tmp_path, max_shard_size):
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import safe_open

    tensors = _tensors()
    _write(tmp_path, tensors, max_shard_size)
    hub = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == sorted(hub.filename_to_tensors)
    if hub.is_sharded:
        index = json.loads((tmp_path / INDEX_NAME).read_text())
        assert index["weight_map"] == hub.tensor_to_filename
        assert index["metadata"]["total_size"] == hub.metadata["total_size"]
    else:
        assert not (tmp_path / INDEX_NAME).exists()
    read = {}
    for name in files:
        with safe_open(str(tmp_path / name), framework="pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            read.update({k: fh.get_tensor(k) for k in fh.keys()})
    assert read.keys() == tensors.keys()
    for k, v in tensors.items():
        assert read[k].dtype == v.dtype and torch.equal(read[k], v), k


def test_out_of_order_wrong_shape_and_missing_tensors_are_errors(tmp_path):
    tensors = _tensors()
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    with pytest.raises(ElsaError, match="out of order"):
        with ShardedWriter(tmp_path / "a", specs) as writer:
            writer.write("scale", tensors["scale"])
    with pytest.raises(ElsaError, match="header says"):
        with ShardedWriter(tmp_path / "b", specs) as writer:
            writer.write("embed.weight", tensors["embed.weight"].float())
    with pytest.raises(ElsaError, match="stopped after 1 of"):
        with ShardedWriter(tmp_path / "c", specs) as writer:
            writer.write("embed.weight", tensors["embed.weight"])


def test_sizes_parse_like_transformers():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8 and parse_size("4GiB") == 4 * 2**30
    assert parse_size(123) == 123
    assert parse_size("1.5GB") == 15 * 10**8 and parse_size(".5MB") == 5 * 10**5
    for bad in ("5 gigs", "1..5GB", "0GB", 0, -3, True):  # "1..5GB" was float()'s traceback; 0 and True were taken
        with pytest.raises(ElsaError, match="max_shard_size"):
            parse_size(bad)
    specs = [TensorSpec(str(i), (10,), torch.float32) for i in range(5)]   # 40 bytes each
    assert [len(s) for s in plan_shards(specs, 100)] == [2, 2, 1]
