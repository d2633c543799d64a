"""sparsify(model): a loaded, pruned model's sparse-mode twin without a checkpoint on disk. It holds the modules
from_pretrained(mode="sparse") builds from the same weights (same codes, same logits, same greedy tokens), shares every
other tensor with the model given, and leaves that model as it was; tied weights stay dense; bad input is one line."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.sparse import SparseArgumentError, SparseArgumentTypeError, SparseLinear, from_pretrained, sparsify

IDS = torch.tensor([[2, 651, 1009, 576, 573]])


@pytest.fixture(scope="module")
def dense(pruned_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(pruned_dir).eval()


def test_the_twin_is_what_from_pretrained_builds_and_the_model_given_is_untouched(dense, sparse_dir):
    with torch.no_grad():
        before = dense(IDS).logits
    twin = sparsify(dense)
    loaded = from_pretrained(sparse_dir, mode="sparse")
    kinds = {n: type(m).__name__ for n, m in twin.named_modules()}
    assert kinds == {n: type(m).__name__ for n, m in loaded.named_modules()}
    assert sum(k == "SparseLinear" for k in kinds.values()) == 4 * 7  # every pruned projection of the demo's 4 layers
    for name, module in twin.named_modules():
        if isinstance(module, SparseLinear):
            other = loaded.get_submodule(name)
            assert all(torch.equal(module.parts[p], other.parts[p]) for p in module.parts), name
            assert isinstance(dense.get_submodule(name), torch.nn.Linear)  # the dense model keeps its Linear
    with torch.no_grad():
        assert torch.equal(twin(IDS).logits, loaded(IDS).logits)
        assert torch.equal(dense(IDS).logits, before)
        assert (twin(IDS).logits - before).abs().max() <= 1e-4 * before.abs().max()
    assert twin.generate(IDS, max_new_tokens=6, do_sample=False).tolist() == dense.generate(IDS, max_new_tokens=6, do_sample=False).tolist()
    # shared, not copied: the embeddings (tied to the head), the norms; and the twin has its own config objects
    assert twin.model.embed_tokens.weight is dense.model.embed_tokens.weight and twin.lm_head.weight is twin.model.embed_tokens.weight
    assert twin.model.norm.weight is dense.model.norm.weight
    assert twin.config is not dense.config and twin.generation_config is not dense.generation_config
    assert not twin.training and twin.generation_config.cache_implementation != "static"  # static: on CUDA only


def test_a_weight_tied_to_another_module_stays_dense(tmp_path):
    """A tied LM head with zeros enough is left an nn.Linear (from_pretrained stores it once, as the embedding); an
    untied one of the same sparsity becomes a SparseLinear."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (True, False):
        cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(torch.rand_like(p) < 0.2)
        twin = sparsify(model)
        assert isinstance(twin.lm_head, SparseLinear) is not tied
        assert isinstance(twin.model.layers[0].mlp.up_proj, SparseLinear)
        with torch.no_grad():
            ids = torch.tensor([[1, 5, 9]])
            assert torch.allclose(twin(ids).logits, model(ids).logits, atol=1e-5)


def test_min_sparsity_decides_what_is_converted(dense):
    """The demo is pruned to 60 %: min_sparsity 0.7 converts nothing, which is refused; 0.5 converts every projection."""
    assert sum(isinstance(m, SparseLinear) for m in sparsify(dense, min_sparsity=0.5).modules()) == 28
    with pytest.raises(SparseArgumentError, match="has 70% or more zeros.*is this the pruned model"):
        sparsify(dense, min_sparsity=0.7)


def test_bad_input_is_one_line(dense):
    with pytest.raises(SparseArgumentTypeError, match="model=.*expected a transformers model"):
        sparsify("out/demo")
    with pytest.raises(SparseArgumentError, match="no config / generation_config"):
        sparsify(torch.nn.Linear(3, 3))
    with pytest.raises(SparseArgumentError, match="min_sparsity 0: expected a fraction"):
        sparsify(dense, min_sparsity=0)
    with pytest.raises(SparseArgumentTypeError, match="min_sparsity=True"):
        sparsify(dense, min_sparsity=True)
    with pytest.raises(SparseArgumentError, match="decode_path 'gpu'"):
        sparsify(dense, decode_path="gpu")


def test_a_model_on_two_devices_or_on_meta_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with pytest.raises(SparseArgumentError, match="on the meta device"):
        sparsify(model)
    model = LlamaForCausalLM(cfg)
    model.lm_head.weight = torch.nn.Parameter(torch.empty(32, 16, device="meta"))
    with pytest.raises(SparseArgumentError, match=r"on 2 devices \(cpu, meta\).*one device"):
        sparsify(model)


def test_the_gpu_layout_gives_the_same_model(dense, monkeypatch):
    """What ready_to_decode does on CUDA (every SparseLinear rebuilt as cols16), done here on CPU tensors: the same
    logits and greedy tokens as the delta8 twin, fewer entries (no fillers), one more byte an entry. (Its siblings
    kept apart here: their grouping has tests/sparse/test_siblings.py.)"""
    from elsa_ds.sparse.siblings import FUSE_ENV, ready_to_decode

    monkeypatch.setenv(FUSE_ENV, "0")
    twin, gpu = sparsify(dense), sparsify(dense)
    ready_to_decode(gpu, torch.device("cuda"))
    layers = {n: m for n, m in gpu.named_modules() if isinstance(m, SparseLinear)}
    assert len(layers) == 28 and {m.layout for m in layers.values()} == {"cols16"}
    assert gpu.generation_config.cache_implementation == "static"
    for name, module in layers.items():
        assert torch.equal(module.dense_weight(), twin.get_submodule(name).dense_weight())
    with torch.no_grad():
        assert torch.allclose(gpu(IDS).logits, twin(IDS).logits, atol=1e-5, rtol=1e-5)
    gpu.generation_config.cache_implementation = None  # the static cache is for CUDA's compiled step
    assert gpu.generate(IDS, max_new_tokens=6, do_sample=False).tolist() == twin.generate(IDS, max_new_tokens=6, do_sample=False).tolist()
