"""A sparse-mode model used as a transformers model is (a user's walk): ``save_pretrained`` writes what transformers
loads (each pruned weight dense, grouped siblings cut back out), gradients reach the layers below a SparseLinear, a
``.half()`` after loading decodes, the folder's generation_config.json is the one ``generate()`` uses, a device the
machine lacks is refused before the load, a sparse-mode model is not converted again."""
from __future__ import annotations

import copy
import json
import logging
import pickle
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from elsa_ds.sparse import from_pretrained, sparsify
from elsa_ds.sparse.integrity import SparseArgumentError
from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.siblings import FUSE_ENV, FusedLinear
from tests.sparse.test_siblings import _pruned

IDS = torch.tensor([[1, 5, 9, 13, 2, 7]])


def _reloaded(folder) -> dict[str, torch.Tensor]:
    """The folder as transformers loads it, every tensor found (none missing, none unexpected, none initialised)."""
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.state_dict()


def test_save_pretrained_of_a_sparse_mode_model_writes_the_dense_model(sparse_dir, tmp_path):
    model = from_pretrained(sparse_dir, mode="sparse")
    model.save_pretrained(tmp_path / "saved")
    expected = from_pretrained(sparse_dir, mode="dense").state_dict()
    reloaded = _reloaded(tmp_path / "saved")
    assert reloaded.keys() == expected.keys()
    assert all(torch.equal(reloaded[k], t) for k, t in expected.items())
    twin = copy.deepcopy(model)  # a copy saves itself, not the model it was copied from
    with torch.no_grad():
        twin.model.norm.weight.add_(1.0)
    twin.save_pretrained(tmp_path / "copy")
    assert torch.equal(_reloaded(tmp_path / "copy")["model.norm.weight"], expected["model.norm.weight"] + 1.0)


def test_a_sparse_mode_model_pickles_and_a_given_state_dict_is_saved_dense(sparse_dir, tmp_path):
    """torch.save / pickle of the model (its save bound by a partial, not a method pickle cannot find), and a state
    dict passed in (accelerate's and Trainer's ``save_pretrained(state_dict=...)``) written as the dense model."""
    model = from_pretrained(sparse_dir, mode="sparse")
    again = pickle.loads(pickle.dumps(model))
    again.save_pretrained(tmp_path / "unpickled", state_dict=model.state_dict())
    expected = from_pretrained(sparse_dir, mode="dense").state_dict()
    reloaded = _reloaded(tmp_path / "unpickled")
    assert all(torch.equal(reloaded[k], t) for k, t in expected.items())


def test_the_saved_generation_config_is_the_loaded_one(sparse_dir, tmp_path, monkeypatch):
    """On CUDA the loader sets a static cache for decoding; the save writes the generation config as it was loaded."""
    model = from_pretrained(sparse_dir, mode="sparse")
    model.generation_config.cache_implementation = "static"  # as ready_to_decode sets it on CUDA
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "generation_config.json").read_text())
    assert saved.get("cache_implementation") is None and model.generation_config.cache_implementation == "static"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_grouped_siblings_save_as_the_model_they_came_from(kind, tmp_path, monkeypatch):
    """q, k, v (gate, up) grouped into one product (on CUDA by default): each saved with its own rows and bias (Qwen2's
    q, k, v biases nonzero)."""
    monkeypatch.setenv(FUSE_ENV, "1")
    dense = _pruned(kind)
    twin = sparsify(dense)
    assert any(isinstance(m, FusedLinear) for m in twin.modules())
    twin.save_pretrained(tmp_path / "saved")
    reloaded = _reloaded(tmp_path / "saved")
    expected = dense.state_dict()
    assert reloaded.keys() == expected.keys()
    assert all(torch.equal(reloaded[k], t) for k, t in expected.items())


def test_gradients_reach_the_layers_below_a_sparse_linear(sparse_dir):
    dense, sparse = (from_pretrained(sparse_dir, mode=m) for m in ("dense", "sparse"))
    sparse.requires_grad_(True)  # loaded frozen (inference); a user who wants gradients asks for them
    for model in (dense, sparse):
        model(IDS[:, :1], labels=IDS[:, :1]).loss.backward()  # one token: a decode-sized input, the kernel's path
    below = dict(sparse.named_parameters())  # the pruned Linears' weights are codes there, not parameters
    compared = [n for n in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight") if n in below]
    assert compared
    for name in compared:
        assert below[name].grad is not None, name  # before: None, the graph cut at every SparseLinear
        torch.testing.assert_close(below[name].grad, dict(dense.named_parameters())[name].grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():  # no gradient asked for: the kernel as before
        torch.testing.assert_close(sparse(IDS[:, :1]).logits, dense(IDS[:, :1]).logits, rtol=1e-4, atol=1e-5)
    fresh = from_pretrained(sparse_dir, mode="sparse")  # a plain forward, outside no_grad, of the model as loaded
    taken = []
    for module in fresh.modules():
        if isinstance(module, SparseLinear):
            module.register_forward_hook(lambda m, args, out: taken.append(m._path_for(args[0].reshape(-1, m.in_features))))
    fresh(IDS[:, :1])
    assert taken and None not in taken  # the kernels (its parameters frozen: nothing asks for a gradient)


def test_a_half_after_loading_decodes(sparse_dir):
    sparse = from_pretrained(sparse_dir, mode="sparse").half()
    dense = from_pretrained(sparse_dir, mode="dense").half()
    with torch.no_grad():
        torch.testing.assert_close(sparse(IDS[:, :1]).logits.float(), dense(IDS[:, :1]).logits.float(), rtol=2e-2, atol=2e-2)
    assert sparse.generate(IDS, max_new_tokens=4, do_sample=False).shape == (1, IDS.shape[1] + 4)


def test_the_folders_generation_config_is_the_one_generate_uses(sparse_dir, tmp_path, caplog):
    folder = shutil.copytree(sparse_dir, tmp_path / "ckpt")
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 3, "use_cache": True}))
    for mode in ("dense", "sparse"):
        model = from_pretrained(folder, mode=mode)
        assert model.generation_config.max_new_tokens == 3 and model.generation_config.use_cache
        assert model.generate(IDS, do_sample=False).shape == (1, IDS.shape[1] + 3)
    (folder / "generation_config.json").write_text("{not json")  # as transformers loads it: config.json's defaults
    with caplog.at_level(logging.WARNING, logger="elsa_ds"):
        assert from_pretrained(folder).generation_config.max_new_tokens != 3
    assert "generation_config.json cannot be read" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "meta"])
def test_a_device_the_machine_lacks_is_refused_before_the_load(sparse_dir, device, monkeypatch):
    monkeypatch.setattr("elsa_ds.sparse.loader.sparse_meta", lambda *a: pytest.fail("read the checkpoint first"))
    with pytest.raises(SparseArgumentError, match=f"device={device!r}"):
        from_pretrained(sparse_dir, mode="sparse", device=device)


def test_a_sparse_mode_model_is_not_converted_again(sparse_dir):
    with pytest.raises(SparseArgumentError, match="in sparse mode already"):
        sparsify(from_pretrained(sparse_dir, mode="sparse"))
