"""The Triton delta8 kernel against the readable reference, run on CPU by Triton's interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when it is imported, so the kernel runs in one subprocess started with it set (this
file run as a script: it prints every case's error as JSON); the tests judge those errors. The same kernel compiled
for a GPU is checked in tests/cuda/test_triton_gpu.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from elsa_ds.sparse import kernels as K
from elsa_ds.sparse.format import MAX_GAP, delta8_to_cols16, encode_delta8

TOL = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}  # half dtypes: the output is rounded to them
BATCHES = (1, 3, 8, 16)
SLOW_BATCHES = (8, 16)  # ~80 s of the interpreter's ~105 on 2 cores: only with --slow (every other case always)
SHAPES = ((1, 1, 1.0), (5, 3, 0.5), (3, 2000, 0.002), (40, 33, 1.0))
ROWS = (1, 4, 16, 64)  # rows_per_program: 1 = one output row a program; more = the row-group kernel


def odd_weight(out_f: int = 67, in_f: int = 700, density: float = 0.1, seed: int = 0) -> torch.Tensor:
    """Rows not a multiple of any block; an all-zero row, a dense row, rows whose gaps need fillers (> 256 columns)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=gen) * (torch.rand(out_f, in_f, generator=gen) < density)
    w[3] = 0
    w[5] = torch.randn(in_f, generator=gen)
    w[7] = 0
    w[7, 0], w[7, in_f - 1] = 1.5, -2.0  # two fillers between them at 700 columns
    w[9] = 0
    w[9, in_f - 1] = 0.5  # the only entry, after two fillers
    w[0, -1] = 0  # row 0's entries can all move one column right (the wrong-column case)
    return w


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the reference's largest entry (sums of ~70 terms cancel elementwise)."""
    return float((got.float() - ref).abs().max()) / float(ref.abs().max().clamp_min(1e-6))


def run_cases(batches: tuple[int, ...] = BATCHES) -> dict[str, dict]:
    """Every case under the interpreter (this process must have started with TRITON_INTERPRET=1)."""
    from elsa_ds.sparse import triton_spmv as T

    assert T.INTERPRET and T.unavailable("cpu") is None, T.unavailable("cpu")
    out: dict[str, dict] = {}

    def record(name, parts, x, out_f, bias=None, ref=None):
        ref = K.reference_matmul(parts, x, out_f) if ref is None else ref
        cols16 = delta8_to_cols16(parts, (out_f, x.shape[1]))
        # the delta8 kernels; the cols16 ones: a program for each row of x, and every row of x in one program
        layouts = {"": (parts, None), "c16-": (cols16, False), "c16b-": (cols16, True)}
        for prefix, (layout, batch_in_program) in layouts.items():
            for rows in ROWS:
                got = T.delta8_linear(layout, x, out_f, bias, rows_per_program=rows, batch_in_program=batch_in_program)
                out[f"{prefix}{name}-r{rows}"] = {"err": relative_error(got, ref), "shape": list(got.shape),
                                                  "dtype": str(got.dtype).split(".")[-1],
                                                  "empty_row_zero": bool((got[:, 3] == 0).all()) if out_f > 3 else None}

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        parts = encode_delta8(odd_weight().to(dtype))
        for n in batches:
            record(f"odd-{str(dtype).split('.')[-1]}-{n}", parts, torch.randn(n, 700).to(dtype), 67)
    for out_f, in_f, density in SHAPES:
        w = torch.randn(out_f, in_f) * (torch.rand(out_f, in_f) < density)
        record(f"shape-{out_f}x{in_f}", encode_delta8(w), torch.randn(2, in_f), out_f)
    from elsa_ds.sparse.siblings import concatenated  # q, k and v grouped (siblings.py): three matrices' rows as one

    siblings = concatenated([encode_delta8(odd_weight(seed=s)[:rows]) for s, rows in ((0, 67), (1, 20), (2, 20))])
    record("siblings", siblings, torch.randn(2, 700), 107)
    parts, bias, x = encode_delta8(odd_weight().to(torch.bfloat16)), torch.randn(67).to(torch.bfloat16), torch.randn(4, 700)
    record("bias", parts, x.to(torch.bfloat16), 67, bias, K.reference_matmul(parts, x.to(torch.bfloat16), 67) + bias.float())
    from elsa_ds.sparse import ops  # the operator a compiled decode step calls (tests/sparse/test_compiled_decode.py)

    got = ops.sparse_linear(parts["values"], parts["deltas"], parts["row_offsets"], x.to(torch.bfloat16), 67, bias, "triton")
    ref = K.reference_matmul(parts, x.to(torch.bfloat16), 67) + bias.float()
    out["operator"] = {"err": relative_error(got, ref), "shape": list(got.shape), "dtype": str(got.dtype).split(".")[-1]}
    os.environ[T.ROWS_ENV] = "16"  # the operator with no rows given takes them from the environment (the benchmarks')
    got = ops.sparse_linear(parts["values"], parts["deltas"], parts["row_offsets"], x.to(torch.bfloat16), 67, bias, "triton")
    out["operator-16-rows"] = {"err": relative_error(got, ref), "default_rows": T.default_rows()}
    del os.environ[T.ROWS_ENV]
    parts = encode_delta8(odd_weight())
    moved = dict(parts, deltas=parts["deltas"].clone())
    moved["deltas"][0] += 1  # row 0's first entry one column right, and the rest of the row with it
    x = torch.randn(1, 700)
    record("wrong-column", moved, x, 67, ref=K.reference_matmul(parts, x, 67))
    c16 = delta8_to_cols16(parts, (67, 700))
    c16["cols"][0] += 1  # cols16: row 0's first entry alone one column right
    got = T.delta8_linear(c16, x, 67)
    out["c16-wrong-column"] = {"err": relative_error(got, K.reference_matmul(parts, x, 67))}
    try:
        T.delta8_linear(parts, x, 67, rows_per_program=3)
        out["3-rows-a-program"] = {"refused": ""}
    except ValueError as err:
        out["3-rows-a-program"] = {"refused": str(err)}
    x3, guard = torch.randn(3, 700), torch.full((4 * 67,), float("nan"))  # 3 rows padded to 4: y's 4th row is past y
    y3 = guard[:3 * 67].view(3, 67)
    c16 = delta8_to_cols16(parts, (67, 700))  # whole again
    T._batch_kernel()[(T.triton.cdiv(67, 4),)](c16["values"], c16["cols"], c16["row_offsets"], x3, y3, y3, 3, 700, 67,
                                                HAS_BIAS=False, ROWS=4, BLOCK=T.tile_block(16, 10), BLOCK_B=4)
    out["c16b-padding-rows"] = {"err": relative_error(y3, K.reference_matmul(parts, x3, 67)),
                                "past_y_untouched": bool(guard[3 * 67:].isnan().all())}
    launched, batch_kernel = [], T._batch_kernel  # which cols16 kernel runs when the caller does not say
    T._batch_kernel = lambda: launched.append(1) or batch_kernel()
    for n in (1, 3):
        T.delta8_linear(c16, torch.randn(n, 700), 67)
    T._batch_kernel = batch_kernel
    out["c16-default"] = {"batch_kernel_launches": len(launched)}
    try:
        T.delta8_linear(parts, x, 67, batch_in_program=True)
        out["delta8-batch-in-program"] = {"refused": ""}
    except ValueError as err:
        out["delta8-batch-in-program"] = {"refused": str(err)}
    try:
        T.delta8_linear(parts, torch.randn(17, 700), 67)
        out["17-rows"] = {"refused": ""}
    except ValueError as err:
        out["17-rows"] = {"refused": str(err)}
    return out


@pytest.fixture(scope="module")
def results(request) -> dict[str, dict]:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter runs the kernel's blocks as numpy arrays
    from tests.conftest import slow_enabled

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    quick = [] if slow_enabled(request.config) else ["--quick"]
    proc = subprocess.run([sys.executable, __file__, *quick], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_odd_weight_has_the_cases():
    parts = encode_delta8(odd_weight())
    per_row = parts["row_offsets"].diff()
    assert int(per_row[3]) == 0 and int(per_row[5]) == 700  # an empty row and a full one
    assert int((parts["deltas"] == MAX_GAP - 1).sum()) >= 4 and int(per_row[9]) == 3  # fillers; a row of 2 + 1


LAYOUTS = {"delta8": "", "cols16": "c16-", "cols16-batch": "c16b-"}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", TOL)
@pytest.mark.parametrize("batch", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_BATCHES else n for n in BATCHES])
def test_kernel_equals_reference(results, batch, dtype, rows, layout):
    r = results[f"{LAYOUTS[layout]}odd-{dtype}-{batch}-r{rows}"]
    assert r["shape"] == [batch, 67] and r["dtype"] == dtype and r["empty_row_zero"]
    assert r["err"] <= TOL[dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_f,in_f,density", SHAPES)
def test_small_and_extreme_shapes(results, out_f, in_f, density, rows, layout):
    """Fewer output rows than a group (1, 5, 3, 40 against 4 and 16) included."""
    assert results[f"{LAYOUTS[layout]}shape-{out_f}x{in_f}-r{rows}"]["err"] <= TOL["float32"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ROWS)
def test_bias_is_added_in_fp32(results, rows, layout):
    r = results[f"{LAYOUTS[layout]}bias-r{rows}"]
    assert r["dtype"] == "bfloat16" and r["err"] <= TOL["bfloat16"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows", ROWS)
def test_siblings_grouped_into_one_matrix_take_the_same_kernel(results, rows, layout):
    """Three matrices' codes end to end (elsa_ds/sparse/siblings.py), 107 rows: one product, the reference's."""
    r = results[f"{LAYOUTS[layout]}siblings-r{rows}"]
    assert r["shape"] == [2, 107] and r["err"] <= TOL["float32"]


def test_the_registered_operator_runs_the_triton_path(results):
    r = results["operator"]
    assert r["shape"] == [4, 67] and r["dtype"] == "bfloat16" and r["err"] <= TOL["bfloat16"]
    r = results["operator-16-rows"]
    assert r["default_rows"] == 16 and r["err"] <= TOL["bfloat16"]


@pytest.mark.parametrize("text", ["3", "0", "128", "four"])
def test_rows_from_the_environment_are_a_power_of_two(monkeypatch, text):
    pytest.importorskip("triton")
    from elsa_ds.sparse import triton_spmv as T

    monkeypatch.setenv(T.ROWS_ENV, text)
    with pytest.raises(ValueError, match=rf"ELSA_DS_TRITON_ROWS='{text}': expected a power of two from 1 to 64"):
        T.default_rows()
    monkeypatch.setenv(T.ROWS_ENV, "32")
    assert T.default_rows() == 32


@pytest.mark.parametrize("rows", ROWS)
def test_a_wrong_column_would_be_caught(results, rows):
    """The comparison is sharp: one row shifted by a column (cols16: one entry) moves the product far beyond the
    tolerance."""
    assert results[f"wrong-column-r{rows}"]["err"] > 100 * TOL["float32"]
    assert results["c16-wrong-column"]["err"] > 100 * TOL["float32"]
    assert results[f"c16b-wrong-column-r{rows}"]["err"] > 100 * TOL["float32"]


def test_cols16_holds_the_batch_in_its_program_by_default_and_delta8_cannot(results):
    """x of several rows takes the batch-in-program kernel (one launch for 1 and 3 rows: the 3's), whose padding rows
    write nothing past y; delta8 refuses it."""
    assert results["c16-default"]["batch_kernel_launches"] == 1
    padded = results["c16b-padding-rows"]  # the rows padding the batch to a power of two are computed, never stored
    assert padded["err"] <= TOL["float32"] and padded["past_y_untouched"]
    assert "cols16 layout" in results["delta8-batch-in-program"]["refused"]


def test_more_than_16_rows_are_refused_and_groups_are_powers_of_two(results):
    assert "1 to 16 rows" in results["17-rows"]["refused"]
    assert "power of two" in results["3-rows-a-program"]["refused"]


def _compile_for_h100(layout: str, rows: int, dtype: str, block: int, **options):
    """The kernel ``delta8_linear`` launches for ``layout`` and ``rows``, lowered by Triton to an sm_90 cubin (its bundled
    ptxas) with no GPU present."""
    pytest.importorskip("triton")
    from elsa_ds.sparse import triton_spmv as T

    if T.INTERPRET:
        pytest.skip("TRITON_INTERPRET is set in this process: triton.jit gives the interpreter")
    compiled = T.compile_ahead(layout, rows, dtype, block, has_bias=True, **options)
    assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]
    return compiled


@pytest.mark.parametrize("dtype,block_b,block", [("bf16", 1, 512), ("fp32", 16, 128)])
def test_kernel_compiles_for_an_h100(dtype, block_b, block):
    """The compiled path, which the interpreter does not take; running it is tests/cuda/test_triton_gpu.py's part."""
    _compile_for_h100("delta8", 1, dtype, block, block_b=block_b)


@pytest.mark.parametrize("kernel", ["delta8", "cols16"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("rows", [4, 16, 64])
def test_the_row_group_kernel_compiles_with_one_layout_in_its_loop(dtype, rows, kernel):
    """The row-group kernel at sm_90, read in Triton's GPU IR: the values, deltas and x loads of its loop share one
    layout with a warp's lanes along the entries (a row's consecutive entries: coalesced loads, x gathered at nearby
    columns), and nothing in the loop converts between layouts (a trip through shared memory each step). Its first form,
    a [rows, block] tile, failed both: Triton put the x gather's lanes across rows."""
    from elsa_ds.sparse import triton_spmv as T

    pytest.importorskip("triton")
    block = T.tile_block(rows, 410)
    ir = _compile_for_h100(kernel, rows, dtype, block).asm["ttgir"]
    loop = ir[ir.index("scf.while"):ir.index("scf.yield")]
    loads = re.findall(rf"tt\.load %\S+, %\S+, %\S+ : tensor<{block}x{rows}x!tt\.ptr<\w+>, (#\w+)>", loop)
    assert len(loads) == 3 and len(set(loads)) == 1, loads  # deltas, values, x
    layout = re.search(rf"^{loads[0]} = #ttg\.blocked<\{{(.*)\}}>", ir, re.M).group(1)
    assert "order = [0, 1]" in layout and re.search(r"threadsPerWarp = \[(\d+), 1\]", layout), layout
    assert "convert_layout" not in loop


@pytest.mark.parametrize("rows,batch", [(4, 2), (4, 8), (1, 16)])
def test_the_batch_kernel_gathers_x_with_a_warp_along_the_entries(rows, batch):
    """The kernel holding the batch in its program, at sm_90: x's gather is a [block, rows, batch] tile whose warp lanes
    run along the entries (a row's nearby columns), as the row-group kernel's; the columns and values come in once."""
    from elsa_ds.sparse import triton_spmv as T

    pytest.importorskip("triton")
    block = T.tile_block(rows * batch, 410)
    ir = _compile_for_h100("cols16", rows, "bf16", block, block_b=batch).asm["ttgir"]
    loop = ir[ir.index("scf.while"):ir.index("scf.yield")]
    gathers = re.findall(rf"tt\.load %\S+, %\S+, %\S+ : tensor<{block}x{rows}x{batch}x!tt\.ptr<bf16>, (#\w+)>", loop)
    assert len(gathers) == 1 and len(re.findall(r"tt\.load ", loop)) == 3, loop
    layout = re.search(rf"^{gathers[0]} = #ttg\.blocked<\{{(.*)\}}>", ir, re.M).group(1)
    assert "order = [0, 1, 2]" in layout and "threadsPerWarp = [32, 1, 1]" in layout, layout


def test_the_launch_sizes_are_worked_out_in_plain_python_as_triton_would():
    """Triton's next_power_of_2 and cdiv are constexpr functions costing ~3 µs of Python a call: the launch takes plain
    Python's, the same numbers (and the rows of ELSA_DS_TRITON_ROWS parsed once per text, checked as before)."""
    triton = pytest.importorskip("triton")
    from elsa_ds.sparse import triton_spmv as T

    assert all(T._next_power_of_2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert all(T._cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 300) for b in (1, 2, 3, 4, 16, 64))


def test_unavailable_names_the_reason(monkeypatch):
    from elsa_ds.sparse import triton_spmv as T

    if T.triton is not None and not T.INTERPRET and not torch.cuda.is_available():
        assert "CUDA" in T.unavailable("cpu")
    monkeypatch.setattr(T.triton_api, "IMPORT_ERROR", "triton is not importable (ImportError: test)")
    assert "not importable" in T.unavailable("cuda")


if __name__ == "__main__":
    torch.manual_seed(0)
    print(json.dumps(run_cases(tuple(n for n in BATCHES if n not in SLOW_BATCHES) if "--quick" in sys.argv else BATCHES)))
