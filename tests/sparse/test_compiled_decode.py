"""SparseLinear under torch.compile: the delta8 matmul is one registered operator (``torch.ops.elsa_ds.sparse_linear``),
so a compiled decode step holds it without a graph break, as transformers' generate() compiles the step when the cache
is static (on CUDA by itself, mode reduce-overhead: a CUDA graph; here on CPU, asked for with ``_compile_all_devices``).
The operator is held to torch's own operator checks and to the eager path; the Triton path of the same operator runs in
tests/sparse/test_triton_spmv.py under the interpreter."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.sparse import from_pretrained
from elsa_ds.sparse import kernels as K
from elsa_ds.sparse import ops
from elsa_ds.sparse.format import delta8_to_cols16, encode_delta8
from elsa_ds.sparse.linear import SparseLinear


def _parts(out_f: int = 24, in_f: int = 40, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) * (torch.rand(out_f, in_f, generator=gen) < 0.3)
    return encode_delta8(w)


@pytest.mark.parametrize("path", ["reference", "kernel", "reference-cols16"])
@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_passes_torchs_operator_checks(path, bias, request):
    if path == "kernel":
        request.getfixturevalue("kernel")
    p = _parts()
    if path == "reference-cols16":
        p, path = delta8_to_cols16(p, (24, 40)), "reference"
    positions = p["deltas"] if "deltas" in p else p["cols"]
    args = (p["values"], positions, p["row_offsets"], torch.randn(3, 40), 24, torch.randn(24) if bias else None, path)
    torch.library.opcheck(ops.sparse_linear, args)  # schema, the shape function against the real call, no aliasing
    got = ops.sparse_linear(*args)
    ref = K.reference_matmul(_parts(), args[3], 24) + (args[5] if bias else 0)
    assert got.shape == (3, 24) and torch.allclose(got, ref, atol=1e-5)


def test_an_unknown_path_is_refused_by_name():
    p = _parts()
    with pytest.raises(ValueError, match="path 'gpu'"):
        ops.sparse_linear_impl(p["values"], p["deltas"], p["row_offsets"], torch.randn(1, 40), 24, None, "gpu")


@pytest.mark.parametrize("layout", ["delta8", "cols16"])
@pytest.mark.parametrize("path", ["reference", "kernel", "csr"])
def test_a_compiled_sparse_linear_has_no_graph_break_and_equals_eager(path, layout, request):
    if path == "kernel":
        request.getfixturevalue("kernel")
    torch._dynamo.reset()
    linear = torch.nn.Linear(40, 24)
    with torch.no_grad():
        linear.weight.mul_(torch.rand(24, 40) < 0.3)
    sparse = SparseLinear.from_dense(linear, decode_path=path).to_layout(layout)
    x = torch.randn(2, 1, 40)
    with torch.no_grad():  # decoding: the operator has no backward (SparseLinear is for inference)
        explained = torch._dynamo.explain(sparse)(x)
        if sparse.decode_path != "csr":  # torch's sparse CSR matmul is outside what dynamo traces: a break, still correct
            assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(sparse, backend="inductor", fullgraph=sparse.decode_path != "csr")
        assert torch.allclose(compiled(x), sparse(x), atol=1e-6)


@pytest.mark.integration
def test_generate_with_a_static_cache_compiles_the_sparse_model_whole_and_keeps_greedy_tokens(sparse_dir):
    """generate(cache_implementation="static") with fullgraph=True: the compile fails on any graph break."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch._dynamo.reset()
    counters.clear()
    dense = from_pretrained(sparse_dir, mode="dense")
    sparse = from_pretrained(sparse_dir, mode="sparse")
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # transformers compiles on CUDA by itself; on CPU only when asked
    ids = torch.tensor([[2, 651, 1009, 576, 573]])
    want = dense.generate(ids, max_new_tokens=6, do_sample=False)
    got = sparse.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static", compile_config=config)
    assert counters["stats"]["unique_graphs"] >= 1, "generate() did not compile its decode step"
    assert got.tolist() == want.tolist()


def test_a_cuda_sparse_model_generates_with_a_static_cache_by_default(sparse_dir, monkeypatch):
    """from_pretrained(mode="sparse") on CUDA sets the static cache that makes generate() compile its decode step; the
    CPU model is left as transformers makes it. (The move itself is not done here: no GPU.)"""
    moved = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the check of the device (a GPU machine's)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = from_pretrained(sparse_dir, mode="sparse", device="cuda")
    assert moved and model.generation_config.cache_implementation == "static"
    layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
    assert layers and {m.layout for m in layers} == {"cols16"}  # the GPU layout, built at load
    assert from_pretrained(sparse_dir, mode="sparse").generation_config.cache_implementation != "static"
    assert from_pretrained(sparse_dir, mode="dense", device="cuda").generation_config.cache_implementation != "static"
