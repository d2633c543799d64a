"""The Triton delta8 kernel compiled for the GPU equals the readable reference, and SparseLinear on CUDA takes it.
Marked ``cuda`` (conftest.py); the same cases under Triton's CPU interpreter are tests/sparse/test_triton_spmv.py."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from elsa_ds.sparse import kernels as K
from elsa_ds.sparse.format import delta8_to_cols16, encode_delta8
from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.siblings import FusedLinear
from tests.sparse.test_triton_spmv import BATCHES, TOL, odd_weight, relative_error

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def triton_spmv():
    from elsa_ds.sparse import triton_spmv as T

    reason = T.unavailable("cuda")
    assert reason is None, f"the Triton kernel should run on this GPU host: {reason}"
    return T


@functools.cache
def cuda_parts(shape: str) -> tuple[dict[str, torch.Tensor], tuple[int, int]]:
    """One fp32 weight's delta8 parts on the GPU, encoded once per shape (a 7B MLP weight takes seconds on the CPU)."""
    if shape == "odd":
        w = odd_weight()
    else:
        dims, sparsity = shape.split("@")
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(*(int(d) for d in dims.split("x")), generator=gen)
        w = w * (torch.rand(w.shape, generator=gen) >= float(sparsity))
    return {k: v.cuda() for k, v in encode_delta8(w).items()}, tuple(w.shape)


@pytest.mark.parametrize("layout", ["delta8", "cols16", "cols16-batch"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", ["odd", "4096x4096@0.9", "11008x4096@0.7"])
def test_triton_equals_reference_on_cuda(triton_spmv, shape, batch, dtype, rows, layout):
    """cols16: a program for each row of x; cols16-batch: every row of x in one program (the default past one row)."""
    fp32, (out_f, in_f) = cuda_parts(shape)
    parts = {**fp32, "values": fp32["values"].to(DTYPES[dtype])}  # same entries: both sides read these parts
    if layout.startswith("cols16"):
        parts = delta8_to_cols16(parts, (out_f, in_f))  # built on the GPU, as ready_to_decode does
    x = torch.randn(batch, in_f, device="cuda").to(DTYPES[dtype])
    batch_in_program = None if layout == "delta8" else layout == "cols16-batch"
    got = triton_spmv.delta8_linear(parts, x, out_f, rows_per_program=rows, batch_in_program=batch_in_program)
    ref = K.reference_matmul(parts, x, out_f)
    assert got.shape == (batch, out_f) and got.dtype == DTYPES[dtype] and got.is_cuda
    assert relative_error(got, ref) <= TOL[dtype]


@pytest.mark.parametrize("layout", ["delta8", "cols16"])
@pytest.mark.parametrize("batch", [1, 5, 16, 17])
def test_sparse_linear_on_cuda_takes_triton(batch, layout):
    linear = torch.nn.Linear(700, 67).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(odd_weight().to(torch.bfloat16))
    sparse = SparseLinear.from_dense(linear).cuda().to_layout(layout)
    assert sparse.decode_path == "triton", sparse.triton_unavailable
    x = torch.randn(batch, 1, 700, device="cuda").to(torch.bfloat16)
    got = sparse(x)
    ref = F.linear(x.float(), linear.weight.float().cuda(), linear.bias.float().cuda())
    assert got.shape == (batch, 1, 67) and got.dtype == torch.bfloat16
    assert relative_error(got, ref) <= TOL["bfloat16"]  # 17 rows: the decompress path, same answer


def test_generate_on_cuda_compiles_the_sparse_decode_step_into_a_cuda_graph_and_keeps_greedy_tokens(tmp_path):
    """from_pretrained(mode="sparse", device="cuda") sets the static cache; generate() then compiles the decode step
    (transformers' own choice on CUDA: mode reduce-overhead, a CUDA graph) with the Triton operator inside it, and its
    greedy tokens are the dense model's."""
    from torch._dynamo.utils import counters

    from elsa_ds.sparse import compress, from_pretrained
    from tests.sparse.conftest import pruned_demo

    sparse_dir = tmp_path / "sparse"
    compress(pruned_demo(tmp_path / "pruned"), sparse_dir)
    torch._dynamo.reset()
    counters.clear()
    dense = from_pretrained(sparse_dir, mode="dense", device="cuda")
    sparse = from_pretrained(sparse_dir, mode="sparse", device="cuda")
    assert sparse.generation_config.cache_implementation == "static"
    ids = torch.tensor([[2, 651, 1009, 576, 573]], device="cuda")
    want = dense.generate(ids, max_new_tokens=12, do_sample=False, cache_implementation="static")
    for _ in range(2):  # the second call replays what the first compiled and recorded
        got = sparse.generate(ids, max_new_tokens=12, do_sample=False)
        assert got.tolist() == want.tolist()
    assert counters["stats"]["unique_graphs"] >= 1, "generate() did not compile its decode step"


def test_speed_on_cuda_times_both_modes_there_and_generate_keeps_the_tokens(tmp_path):
    """speed_report on CUDA (launch/evaluate.py --speed on a GPU host): every phase on the GPU, the GPU memory the loads
    allocated, and generate() compiled on both sides with the sparse model's greedy tokens the dense model's."""
    from elsa_ds.sparse import compress
    from elsa_ds.sparse.speed import speed_report, speed_table
    from tests.sparse.conftest import pruned_demo

    sparse_dir = tmp_path / "sparse"
    compress(pruned_demo(tmp_path / "pruned"), sparse_dir)
    r = speed_report(sparse_dir, batches=(1, 8), prompt=8, steps=4, rounds=2, device="cuda")
    assert r["device"].startswith("cuda") and r["memory"]["sparse"]["gpu_allocated_delta_bytes"] > 0
    assert all(row["same_tokens"] for row in r["generate"]) and "| 4 new tokens after 8 | 1 |" in speed_table(r)


def test_delta8_encoded_on_the_gpu_is_the_cpu_encoding():
    """encode_delta8 runs where the weight is: on the GPU its parts are the CPU's, bit for bit (gaps past 256 included)."""
    w = odd_weight()
    want, got = encode_delta8(w), encode_delta8(w.cuda())
    assert all(got[k].device.type == "cuda" and torch.equal(got[k].cpu(), want[k]) for k in want)


def test_sparsify_on_cuda_encodes_there_takes_triton_and_keeps_greedy_tokens(tmp_path):
    """sparsify of a pruned model on the GPU: the twin's SparseLinears are encoded on the GPU (the CPU kernel is not
    looked up until one is moved to the CPU), generate() compiles with the static cache it sets, the greedy tokens are
    the dense model's; moved to the CPU, a SparseLinear picks its CPU path then."""
    from transformers import AutoModelForCausalLM

    from elsa_ds.sparse import sparsify
    from tests.sparse.conftest import pruned_demo

    dense = AutoModelForCausalLM.from_pretrained(pruned_demo(tmp_path / "pruned"), dtype=torch.bfloat16).cuda().eval()
    twin = sparsify(dense)
    layers = [m for m in twin.modules() if isinstance(m, SparseLinear)]
    grouped = [m for m in layers if isinstance(m, FusedLinear)]  # q+k+v and gate+up one product each on CUDA (siblings.py)
    assert len(layers) == 4 * 4 and len(grouped) == 4 * 2  # 4 layers: 7 products each, 4 once grouped
    assert all(m.values.is_cuda and m._cpu_path is None and m.decode_path == "triton" for m in layers)
    assert {m.layout for m in layers} == {"cols16"}  # the GPU layout, built from the GPU's delta8 encoding
    assert twin.generation_config.cache_implementation == "static"
    ids = torch.tensor([[2, 651, 1009, 576, 573]], device="cuda")
    want = dense.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert twin.generate(ids, max_new_tokens=8, do_sample=False).tolist() == want.tolist()
    moved = layers[0].to("cpu")
    assert moved.decode_path in ("kernel", "csr") and moved(torch.randn(1, moved.in_features).to(torch.bfloat16)).shape == (1, moved.out_features)


def test_the_gpu_decode_bench_runs_one_cell_on_the_device(tmp_path):
    """bench/gpu_decode.py, 2 layers of LLaMA-2-7B's shapes, one cell (90 %, batch 1), no per-matrix part: the row and
    the issue's keys (the figures themselves come from the full run)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu_decode.json"
    done = subprocess.run([sys.executable, str(root / "bench" / "gpu_decode.py"), "--layers", "2", "--sparsities", "0.9",
                           "--batches", "1", "--steps", "8", "--rounds", "1", "--no_matrix", "--json", str(out)],
                          capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["compiled"] and r["gpu_memory_gib"] > 0 and list(r["generate_speedup"]) == ["0.9"]
    row = r["generate"][0]
    assert row["same_tokens"] in (True, False) and row["pruned_weight_bytes"]["sparse"] < 0.2 * row["pruned_weight_bytes"]["dense"]
