"""Siblings' products in one launch (elsa_ds/sparse/siblings.py): q, k, v and gate, up of a pruned model grouped into
one sparse matrix give the ungrouped model's outputs bit for bit, eagerly and compiled whole (one operator per group in
the graph), on every CPU path and with biases; a sibling called with another input computes its own part."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from elsa_ds.sparse import ops, sparsify
from elsa_ds.sparse.format import delta8_to_cols16, encode_delta8
from elsa_ds.sparse.integrity import SparseArgumentError
from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.siblings import (FAMILIES, FUSE_ENV, FusedLinear, SiblingSlice, concatenated, fuse_siblings, fuse_wanted,
                                     ready_to_decode)

IDS = torch.tensor([[5, 17, 3, 99, 42, 7, 64]])


def _pruned(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p[p.abs() <= p.abs().flatten().kthvalue(int(0.7 * p.numel())).values] = 0
            elif name.endswith("proj.bias"):  # Qwen2's q, k, v biases: nonzero, so a wrong slice of them shows
                p.normal_()
    return model


def _weights(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 700, generator=g) * (torch.rand(rows, 700, generator=g) < 0.05)
    w[1] = 0                                   # an empty row, and a row whose gap needs delta8's fillers
    w[2] = 0
    w[2, 0], w[2, 699] = 1.0, -1.0
    return w


def test_concatenated_codes_are_the_codes_of_the_stacked_matrix():
    ws = [_weights(r, s) for r, s in ((5, 0), (3, 1), (4, 2))]
    stacked = torch.cat(ws)
    parts = concatenated([encode_delta8(w) for w in ws])
    for key, value in encode_delta8(stacked).items():
        assert torch.equal(parts[key], value), key
    parts = concatenated([delta8_to_cols16(encode_delta8(w), tuple(w.shape)) for w in ws])
    for key, value in delta8_to_cols16(encode_delta8(stacked), tuple(stacked.shape)).items():
        assert torch.equal(parts[key], value) and parts[key].dtype == value.dtype, key


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("path", [None, "csr", "reference"])
def test_grouped_siblings_give_the_same_tokens_and_logits(kind, path):
    dense = _pruned(kind)
    plain, grouped = sparsify(dense, decode_path=path), sparsify(dense, decode_path=path)
    assert fuse_siblings(grouped) == 4  # two layers: q, k, v and gate, up
    attn = grouped.model.layers[0].self_attn
    assert type(attn.q_proj) is FusedLinear and type(attn.k_proj) is SiblingSlice and type(attn.o_proj) is SparseLinear
    assert attn.q_proj.out_features == 64 + 2 * 32 and attn.v_proj.out_features == 32
    with torch.no_grad():
        assert torch.equal(plain(IDS).logits, grouped(IDS).logits)                   # prefill: decompressed
        out = grouped(IDS[:, :5], use_cache=True)
        ref = plain(IDS[:, :5], use_cache=True)
        step, ref_step = (m(IDS[:, 5:6], past_key_values=c.past_key_values).logits for m, c in ((grouped, out), (plain, ref)))
        assert torch.equal(step, ref_step)                                           # decode: the sparse kernels
        assert grouped.generate(IDS, max_new_tokens=6, do_sample=False).tolist() == \
            plain.generate(IDS, max_new_tokens=6, do_sample=False).tolist()
    assert attn.q_proj.pending.x is None and grouped.model.layers[1].mlp.gate_proj.pending.y is None  # nothing held


def _family(family: str) -> torch.nn.Module:
    config = getattr(transformers, f"{family}TextConfig" if family == "Gemma3" else f"{family}Config")
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "proj" in name:
                p[p.abs() <= p.abs().flatten().kthvalue(int(0.7 * p.numel())).values] = 0
            elif name.endswith("proj.bias"):
                p.normal_()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_calls_its_siblings_in_order_on_one_input(family, monkeypatch):
    """What admits a family: grouped, a decode step is the ungrouped one bit for bit, each group's product is computed
    once (no sibling computes its own: the order and the input are the lead's) and nothing is left pending."""
    dense = _family(family)
    plain, grouped = sparsify(dense), sparsify(dense)
    groups = fuse_siblings(grouped)
    assert groups >= 2  # two layers' attention at least (Mixtral's and Qwen3Moe's experts are no MLP of siblings)
    products = []
    product = FusedLinear.product
    monkeypatch.setattr(FusedLinear, "product", lambda self, x: products.append(1) or product(self, x))
    with torch.no_grad():
        out, ref = grouped(IDS[:, :5], use_cache=True), plain(IDS[:, :5], use_cache=True)
        products.clear()
        step = grouped(IDS[:, 5:6], past_key_values=out.past_key_values).logits
        assert len(products) == groups
        assert torch.equal(step, plain(IDS[:, 5:6], past_key_values=ref.past_key_values).logits)
    assert all(m.pending.x is None for m in grouped.modules() if isinstance(m, FusedLinear))


def test_one_operator_per_group_in_the_compiled_decode_step():
    dense = _pruned("llama")
    plain, grouped = sparsify(dense), sparsify(dense)
    fuse_siblings(grouped)
    counted = {}

    def counting(name):
        def backend(gm, example_inputs):
            counted[name] = sum(1 for node in gm.graph.nodes if node.target is torch.ops.elsa_ds.sparse_linear.default)
            return gm.forward
        return backend

    x = IDS[:, :1]
    with torch.no_grad():
        logits = {}
        for name, model in (("plain", plain), ("grouped", grouped)):
            torch._dynamo.reset()
            logits[name] = torch.compile(model.forward, fullgraph=True, backend=counting(name))(x).logits
    assert counted == {"plain": 2 * 7, "grouped": 2 * 4}  # q, k, v, o, gate, up, down: 7 launches a layer, now 4
    assert torch.equal(logits["plain"], logits["grouped"])
    assert grouped.model.layers[0].self_attn.q_proj.pending.x is None  # the compiled step cleared it too


def test_a_sibling_called_with_another_input_computes_its_own_part():
    """A cross-attention reads its keys from the encoder: k_proj on another tensor than q_proj's takes no slice."""
    dense = _pruned("llama")
    plain, grouped = sparsify(dense), sparsify(dense)
    fuse_siblings(grouped)
    a, b = grouped.model.layers[0].self_attn, plain.model.layers[0].self_attn
    h, other = torch.randn(1, 1, 64), torch.randn(1, 1, 64)
    with torch.no_grad():
        assert torch.equal(a.q_proj(h), b.q_proj(h))
        assert torch.equal(a.k_proj(other), b.k_proj(other))      # its own product, not h's pending one
        assert a.q_proj.pending.x is h                              # still there for v
        assert torch.equal(a.v_proj(h), b.v_proj(h)) and a.q_proj.pending.x is None


def test_only_sparse_siblings_of_one_kind_are_grouped():
    dense = _pruned("llama")
    with torch.no_grad():
        dense.model.layers[0].self_attn.v_proj.weight.normal_()  # layer 0's v stays a dense Linear
    twin = sparsify(dense)
    assert type(twin.model.layers[0].self_attn.v_proj) is torch.nn.Linear
    twin.model.layers[1].mlp.up_proj.to_layout("cols16")         # layer 1's up in another layout than its gate
    assert fuse_siblings(twin) == 2                              # layer 0's MLP, layer 1's attention
    assert type(twin.model.layers[0].self_attn.q_proj) is SparseLinear and type(twin.model.layers[1].mlp.gate_proj) is SparseLinear


def test_a_parent_outside_the_families_keeps_its_siblings_apart():
    """Another class may call them in another order or on other inputs (FalconH1's MLP: up, then gate)."""
    class Unknown(torch.nn.Module):
        def __init__(self, linears):
            super().__init__()
            self.gate_proj, self.up_proj = linears

    twin = sparsify(_pruned("llama"))
    mlp = twin.model.layers[0].mlp
    twin.model.layers[0].mlp = Unknown((mlp.gate_proj, mlp.up_proj))
    assert fuse_siblings(twin) == 3 and type(twin.model.layers[0].mlp.gate_proj) is SparseLinear


def test_readied_for_cuda_the_siblings_are_grouped_by_default_and_the_variable_turns_it_off(monkeypatch):
    """What ready_to_decode does on CUDA, done on CPU tensors: cols16 (tests/sparse/test_sparsify.py) and grouped."""
    dense = _pruned("qwen2")
    plain, gpu = sparsify(dense), sparsify(dense)
    ready_to_decode(gpu, torch.device("cuda"))
    gpu.generation_config.cache_implementation = None  # the static cache is for CUDA's compiled step
    assert type(gpu.model.layers[1].mlp.gate_proj) is FusedLinear and gpu.model.layers[1].mlp.gate_proj.layout == "cols16"
    with torch.no_grad():
        assert gpu.generate(IDS, max_new_tokens=6, do_sample=False).tolist() == \
            plain.generate(IDS, max_new_tokens=6, do_sample=False).tolist()
    assert not fuse_wanted(torch.device("cpu"))
    monkeypatch.setenv(FUSE_ENV, "0")
    assert not fuse_wanted(torch.device("cuda"))
    monkeypatch.setenv(FUSE_ENV, "1")
    assert fuse_wanted(torch.device("cpu"))
    monkeypatch.setenv(FUSE_ENV, "yes")
    with pytest.raises(SparseArgumentError, match=f"{FUSE_ENV}='yes'"):
        fuse_wanted(torch.device("cuda"))


def test_the_grouped_operator_is_the_registered_one():
    """Eagerly the lead calls the operator's function once for all its siblings."""
    grouped = sparsify(_pruned("llama"), decode_path="reference")
    fuse_siblings(grouped)
    calls = []
    impl = ops.sparse_linear_impl
    try:
        ops.sparse_linear_impl = lambda *args: calls.append(args[4]) or impl(*args)
        with torch.no_grad():
            grouped(IDS[:, :1])
    finally:
        ops.sparse_linear_impl = impl
    assert calls == [128, 64, 192, 64] * 2  # q+k+v, o, gate+up, down in each layer


def test_generate_compiles_the_grouped_step_once_with_no_break():
    """generate() with the static cache and its compiled decode step (as on CUDA by default): one graph over three
    calls, no graph break and no recompile (what the siblings leave on ``pending`` is never guarded on), the tokens the
    ungrouped model's."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    dense = _pruned("llama")
    tokens = {}
    for grouped in (False, True):
        model = sparsify(dense)
        if grouped:
            fuse_siblings(model)
        config = CompileConfig(backend="eager", mode=None)
        config._compile_all_devices = True  # a CPU compiles only when asked
        model.generation_config.cache_implementation, model.generation_config.compile_config = "static", config
        torch._dynamo.reset()
        counters.clear()
        tokens[grouped] = [model.generate(IDS, max_new_tokens=10, do_sample=False).tolist() for _ in range(3)]
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (grouped, dict(counters["graph_break"]))
    assert tokens[True] == tokens[False]
