"""The C++ delta8 kernel and torch's CSR path against the readable reference; SparseLinear's paths against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from elsa_ds.sparse import kernels as K
from elsa_ds.sparse.format import encode_delta8
from elsa_ds.sparse.linear import SparseLinear

SHAPES = [(37, 1000, 0.9), (5, 3, 0.5), (64, 300, 0.99), (9, 70, 0.2), (3, 5000, 0.999), (17, 33, 1.0), (1, 1, 0.0)]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # bf16: the output is rounded to bf16


def _weight(out_f, in_f, sparsity, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen)
    w[torch.rand(out_f, in_f, generator=gen) < sparsity] = 0
    if out_f > 2:
        w[out_f // 2] = 0  # an empty row
    return w.to(dtype)


def _close(got, ref, dtype):
    scale = ref.abs().max().clamp_min(1e-6)
    assert float((got.float() - ref.float()).abs().max() / scale) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("out_f,in_f,sparsity", SHAPES)
def test_kernel_equals_reference(kernel, out_f, in_f, sparsity, rows, dtype):
    parts = encode_delta8(_weight(out_f, in_f, sparsity, dtype))
    x = torch.randn(rows, in_f).to(dtype)
    ref = K.reference_matmul(parts, x, out_f)
    got = K.kernel_matmul(kernel, parts, x, out_f)
    assert got.shape == (rows, out_f) and got.dtype == torch.float32
    # the kernel and the reference both accumulate bf16 products in fp32: equal up to summation order
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max().clamp_min(1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [True, False], ids=["portable", "avx512"])
def test_batch_one_loops_equal_the_reference(kernel, portable, dtype):
    """Batch 1's two loops (the AVX-512 gather loop where it is built, and the portable one, whichever
    prefer_portable picks by default) on full 16-entry blocks, tails, empty rows and filler entries."""
    if not portable and not kernel.avx512:
        pytest.skip("this CPU has no AVX-512: only the portable loops are built")
    for out_f, in_f, sparsity in [(40, 1000, 0.5), (29, 3000, 0.99), (7, 70, 0.0), (64, 4096, 0.9)]:
        parts = encode_delta8(_weight(out_f, in_f, sparsity, dtype, seed=out_f))
        x = torch.randn(1, in_f).to(dtype)
        ref = K.reference_matmul(parts, x, out_f)
        got = K.kernel_matmul(kernel, parts, x, out_f, portable=portable)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max().clamp_min(1))), (out_f, in_f)


@pytest.fixture
def fresh_choice():
    """prefer_portable is cached per process: cleared before and after, so no choice made here leaks out."""
    K.prefer_portable.cache_clear()
    yield
    K.prefer_portable.cache_clear()


def test_the_loop_choice_follows_the_environment(monkeypatch, fresh_choice):
    for value, want in (("portable", True), ("avx512", False)):
        monkeypatch.setenv(K.LOOPS_ENV, value)
        K.prefer_portable.cache_clear()
        assert K.prefer_portable() is want


def test_fully_empty_matrix_gives_zeros(kernel):
    parts = encode_delta8(torch.zeros(11, 40, dtype=torch.bfloat16))
    assert parts["values"].numel() == 0
    for rows in (1, 5):
        assert torch.equal(K.kernel_matmul(kernel, parts, torch.randn(rows, 40), 11), torch.zeros(rows, 11))


def test_kernel_refuses_too_many_rows(kernel):
    parts = encode_delta8(torch.eye(4))
    with pytest.raises(ValueError):
        K.kernel_matmul(kernel, parts, torch.randn(17, 4), 4)


@pytest.mark.parametrize("out_f,in_f,sparsity", SHAPES[:4])
def test_csr_equals_reference(out_f, in_f, sparsity):
    parts = encode_delta8(_weight(out_f, in_f, sparsity, torch.float32))
    x = torch.randn(4, in_f)
    got = K.csr_matmul(K.csr_tensor(parts, (out_f, in_f)), x)
    assert torch.allclose(got, K.reference_matmul(parts, x, out_f), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["delta8", "cols16"])
@pytest.mark.parametrize("path", ["kernel", "csr", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(1, 1), (2, 4), (3, 40)])  # decode, a small batch, a prefill (> 16 rows: dense)
def test_sparse_linear_matches_linear(path, dtype, lead, layout, request):
    """Every CPU path on both layouts (the C++ kernel takes delta8: on cols16 its path is csr)."""
    if path == "kernel":
        request.getfixturevalue("kernel")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 50).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(_weight(50, 96, 0.8, dtype))
    sparse = SparseLinear.from_dense(linear, decode_path=path).to_layout(layout)
    assert sparse.layout == layout and sparse.decode_path == ("csr" if (path, layout) == ("kernel", "cols16") else path)
    x = torch.randn(*lead, 96).to(dtype)
    ref = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    got = sparse(x)
    assert got.shape == (*lead, 50) and got.dtype == dtype
    _close(got, ref, dtype)
    assert sparse.weight_bytes < linear.weight.numel() * linear.weight.element_size()
    assert torch.equal(sparse.dense_weight(), linear.weight.detach())


def test_a_layout_change_keeps_the_weight_and_comes_back_bit_for_bit():
    """delta8 -> cols16 -> delta8 on the same module: its buffers swapped (no deltas beside the columns), the weight
    the same, the delta8 parts back exactly (fillers included: a 700-column row with two entries 699 apart)."""
    linear = torch.nn.Linear(700, 12)
    with torch.no_grad():
        linear.weight.copy_(_weight(12, 700, 0.95, torch.float32))
        linear.weight[3] = 0
        linear.weight[3, 0], linear.weight[3, 699] = 1.5, -2.0
    sparse = SparseLinear.from_dense(linear)
    before = {k: v.clone() for k, v in sparse.parts.items()}
    sparse.to_layout("cols16")
    assert sorted(n for n, _ in sparse.named_buffers()) == ["cols", "row_offsets", "values"]
    assert sparse.weight_bytes == sum(t.numel() * t.element_size() for t in sparse.parts.values()) and "layout=cols16" in repr(sparse)
    assert torch.equal(sparse.dense_weight(), linear.weight.detach())
    sparse.to_layout("delta8")
    assert sorted(before) == sorted(sparse.parts) and all(torch.equal(before[k], sparse.parts[k]) for k in before)
    with pytest.raises(ValueError, match="layout 'csr'"):
        sparse.to_layout("csr")


def test_the_gpu_layout_follows_the_environment(monkeypatch):
    from elsa_ds.sparse.linear import GPU_LAYOUT_ENV, gpu_layout

    monkeypatch.delenv(GPU_LAYOUT_ENV, raising=False)
    assert gpu_layout() == "cols16"
    monkeypatch.setenv(GPU_LAYOUT_ENV, "delta8")
    assert gpu_layout() == "delta8"
    monkeypatch.setenv(GPU_LAYOUT_ENV, "csr")
    with pytest.raises(ValueError, match="ELSA_DS_GPU_LAYOUT='csr': choose cols16 or delta8"):
        gpu_layout()


def test_unknown_decode_path_is_refused():
    with pytest.raises(ValueError, match="decode_path"):
        SparseLinear.from_dense(torch.nn.Linear(4, 4), decode_path="magic")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_dense_fallback():
    linear = torch.nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(_weight(48, 64, 0.7, torch.float32))
    sparse = SparseLinear.from_dense(linear).cuda()
    x = torch.randn(2, 3, 64)
    assert torch.allclose(sparse(x.cuda()).cpu(), linear(x), rtol=1e-4, atol=1e-5)


CORRUPT = {  # a part of a loaded SparseLinear rewritten: each would send a kernel past the input or the values
    "deltas": lambda parts: parts["deltas"].fill_(255),  # columns thousands past the last
    "row_offsets": lambda parts: parts["row_offsets"].__setitem__(-1, 1 << 30),  # the last row 2^30 entries long
    "middle offset": lambda parts: parts["row_offsets"].__setitem__(3, 1 << 30),  # offsets no longer rising
}


@pytest.mark.parametrize("layout", ["delta8", "cols16"])
@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_a_state_dict_that_would_read_out_of_bounds_is_refused_before_it_is_copied_in(kind, layout):
    """load_state_dict into a sparse-mode model (same shapes, other contents: a sixth audit's find drove the C++ kernel
    out of bounds, NaNs from heap bytes or a segfault) is refused naming the weight, and the module keeps its parts."""
    from elsa_ds.sparse import SparseCheckpointError

    sparse = SparseLinear.from_dense(torch.nn.Linear(300, 9)).to_layout(layout)
    state = {k: v.clone() for k, v in sparse.state_dict().items()}
    if layout == "cols16" and kind == "deltas":
        state["cols"].fill_(-1)  # column 65535
    else:
        CORRUPT[kind](state)
    before = {k: v.clone() for k, v in sparse.state_dict().items()}
    with pytest.raises(SparseCheckpointError, match="corrupt"):
        torch.nn.Sequential(sparse).load_state_dict({f"0.{k}": v for k, v in state.items()})
    assert all(torch.equal(before[k], v) for k, v in sparse.state_dict().items())


WRITTEN_IN_PLACE = """
import pickle, sys, torch
from elsa_ds.sparse import SparseCheckpointError
from elsa_ds.sparse.linear import SparseLinear
sparse = SparseLinear.from_dense(torch.nn.Linear(300, 9), decode_path=sys.argv[1])
sparse = pickle.loads(pickle.dumps(sparse))  # a copy checks its parts again, as the original does
with torch.no_grad():
    {change}
try:
    sparse(torch.randn(1, 300))
except SparseCheckpointError as err:
    print("refused:", err)
else:
    print("decoded")
"""


@pytest.mark.parametrize("path", ["kernel", "csr"])
@pytest.mark.parametrize("change", ["sparse.deltas.fill_(255)", "sparse.row_offsets[3] = 1 << 40"])
def test_a_part_written_in_place_is_checked_again_before_a_kernel_reads_it(path, change, request):
    """Parts changed after the module was built (an in-place write bumps the tensor's version) are checked again at the
    next product, once: refused in one line, never read past the input (run apart: the old code crashed its process)."""
    import subprocess
    import sys

    if path == "kernel":
        request.getfixturevalue("kernel")
    proc = subprocess.run([sys.executable, "-c", WRITTEN_IN_PLACE.replace("{change}", change), path], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("refused: weight: "), (proc.returncode, proc.stdout, proc.stderr[-2000:])


def test_the_kernel_checks_the_sizes_it_is_given(kernel):
    """The C++ kernel's own O(1) checks: offsets that do not end at the values' count are an error, not a read past them."""
    parts = encode_delta8(_weight(9, 300, 0.9, torch.float32))
    parts["row_offsets"] = parts["row_offsets"].clone()
    parts["row_offsets"][-1] = 1 << 40
    with pytest.raises(RuntimeError, match="row_offsets do not run from 0"):
        K.kernel_matmul(kernel, parts, torch.randn(1, 300), 9)


def test_parts_made_under_inference_mode_decode_and_stranger_parts_are_refused():
    """A review: a SparseLinear built or moved under torch.inference_mode() (a usual way to load a model) failed at its
    first product (inference tensors keep no version counter); a non-contiguous part given with assign=True (a stride-0
    expand, which a crafted file can carry) passed the check, and the Triton kernel takes raw pointers."""
    from elsa_ds.sparse import SparseCheckpointError

    linear, x = torch.nn.Linear(300, 9), torch.randn(1, 300)
    ref = F.linear(x, linear.weight, linear.bias).detach()
    with torch.inference_mode():
        built = SparseLinear.from_dense(linear)
        _close(built(x), ref, torch.float32)
    moved = SparseLinear.from_dense(linear)  # the Linear's own bias: moved with it
    with torch.inference_mode():
        _close(moved.to(torch.bfloat16)(x.bfloat16()), ref, torch.bfloat16)
    sparse = SparseLinear.from_dense(torch.nn.Linear(300, 9))
    state = dict(sparse.state_dict())
    state["deltas"] = torch.zeros(1, dtype=torch.uint8).expand(state["deltas"].numel())
    with pytest.raises(SparseCheckpointError, match="not contiguous tensors on one device"):
        sparse.load_state_dict(state, assign=True)
