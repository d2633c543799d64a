"""The GPU decode benches rehearsed on the CPU. bench/gpu_decode.py (issue 45's end-to-end figures): a tiny Llama
built, pruned, sparsified and timed through generate() with the decode step compiled (as generate() does by itself on
CUDA), the dense weights restored between cells, the issue's keys written; a budget too small for a cell starts none
(its GPU run: tests/cuda/test_triton_gpu.py). bench/sparse_decode_gpu.py's variants under Triton's interpreter.
bench/kernel_code.py: the kernels' sm_90 machine code read without a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = [sys.executable, str(ROOT / "bench" / "gpu_decode.py"), "--device", "cpu", "--tiny", "--batches", "1", "--steps", "4",
         "--rounds", "1"]


def _run(*args: str, out: Path, env: dict | None = None) -> dict:
    proc = subprocess.run([*BENCH, *args, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last
    return last


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_the_cells_run_compiled_with_the_weights_restored_between_them(tmp_path):
    r = _run("--compile", "--sparsities", "0.9,0.7", out=tmp_path / "gpu_decode.json")
    assert r["compiled"] and r["matrix"] == {"skipped": "not a CUDA device"} and r["matrix_speedup"] == {} and r["cut"] == []
    assert [(row["sparsity"], row["batch"]) for row in r["generate"]] == [(0.9, 1), (0.7, 1)]
    high, low = (row["pruned_weight_bytes"] for row in r["generate"])
    assert high["dense"] == low["dense"] and high["sparse"] < 0.2 * high["dense"] < low["sparse"]  # 70 % after 90 %: restored
    for row in r["generate"]:
        assert row["same_tokens"] is True and row["equal_token_fraction"] == 1.0
        assert row["dense"]["tokens_per_s"] > 0 and row["sparse"]["first_call_s"] > 0
    assert set(r["generate_speedup"]) == {"0.9", "0.7"} and r["generate_same_tokens"] == {"0.9@1": True, "0.7@1": True}


def test_a_budget_with_no_room_starts_no_cell(tmp_path):
    r = _run("--no_matrix", "--budget_s", "0", "--sparsities", "0.9,0.7", out=tmp_path / "cut.json")
    assert r["generate"] == [] and [(c["sparsity"], c["batch"]) for c in r["cut"]] == [(0.9, 1), (0.7, 1)]
    assert r["generate_speedup"] == {}


def test_the_generate_cells_take_the_fastest_row_groups_at_90_percent(monkeypatch):
    """The per-matrix part's rows (as bench/sparse_decode_gpu.py writes them): the fastest default-warps variant at 90 %
    summed over both weights sets ELSA_DS_TRITON_ROWS; an explicit --triton_rows wins; no rows (no CUDA): the default."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_decode

    from elsa_ds.sparse.triton_spmv import ROWS_ENV

    from elsa_ds.sparse.linear import GPU_LAYOUT_ENV

    def row(sparsity, layout, **us):
        return {"sparsity": sparsity, "batch": 1, **{f"{layout}_{k}": {"graph_us": v} for k, v in us.items()}}

    matrix = {"rows": [row(0.9, "triton", r1=9.0, r4=5.0, r16=4.0, r16w8=1.0), row(0.9, "triton", r1=18.0, r4=9.0, r16=10.5, r16w8=1.0),
                       row(0.7, "triton", r1=1.0, r4=50.0, r16=50.0, r16w8=50.0)]}
    for r in matrix["rows"]:
        r.update(row(r["sparsity"], "cols16", r2=3.0 if r["sparsity"] == 0.9 else 0.1, r8=2.0, r8w1=0.5))
        # the rows' error figures share the variants' prefix (the H200's first gpu_decode, 2026-11-28, stopped on them)
        r.update({f"{layout}_r{k}_max_rel_err_vs_dense": 2e-3 for layout in ("triton", "cols16") for k in (1, 4, 8)})
    monkeypatch.delenv(ROWS_ENV, raising=False)
    monkeypatch.setenv(GPU_LAYOUT_ENV, "delta8")
    assert gpu_decode.generate_rows(matrix, None) == 4 and os.environ[ROWS_ENV] == "4"  # 14 us against r16's 14.5 (r16w8 has other warps)
    monkeypatch.delenv(GPU_LAYOUT_ENV)  # the default GPU layout, cols16: its own variants
    assert gpu_decode.generate_rows(matrix, None) == 8 and os.environ[ROWS_ENV] == "8"
    assert gpu_decode.generate_rows(matrix, 32) == 32 and os.environ[ROWS_ENV] == "32"
    monkeypatch.delenv(ROWS_ENV)
    assert gpu_decode.generate_rows({"skipped": "no CUDA"}, None) is None and ROWS_ENV not in os.environ


REHEARSE_VARIANTS = """
import json, sys, torch
sys.path.insert(0, "bench")
import sparse_decode_gpu as g
from sparse_decode import prune_weight
w = torch.randn(40, 300).to(torch.bfloat16)
prune_weight(w, 0.9)
timed, row = g.variants(w, 2, g.parse(["--rows", "1,4", "--warps", "0,1", "--min_mb", "0.01"]), device="cpu")
for name, (nbytes, calls) in timed.items():
    row[name] = {"graph_us": 1.0 if name == "cols16_r4w1" else 5.0, "eager_us": 2.0, "copies": len(calls)}
g.pick_best(row)
print(json.dumps({"names": sorted(timed), "row": row}))
"""


def test_the_per_matrix_variants_run_under_the_interpreter():
    """bench/sparse_decode_gpu.py's variants on a CPU under TRITON_INTERPRET=1 (its CUDA-graph timing is the GPU's):
    dense and both layouts at every rows and warps, each call's product within bf16 of the fp32 one, the copies
    spanning --min_mb; the best variant's name parsed back into its layout, rows and warps."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", REHEARSE_VARIANTS], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    layouts = ("triton", "cols16", "cols16each")  # at 2 rows of x: cols16 holds them in one program, cols16each not
    assert out["names"] == sorted(["dense", *(f"{lay}_r{r}{w}" for lay in layouts for r in (1, 4) for w in ("", "w1"))])
    row = out["row"]
    assert row["max_rel_err_vs_dense"] <= 1e-2 and row["cols16_bytes"] > row["sparse_bytes"] * 0.99  # 4 B an entry against 3 + fillers
    assert row["triton_r1"]["copies"] > 1 and row["dense"]["copies"] >= 1
    assert (row["best_variant"], row["best_layout"], row["best_rows_per_program"], row["best_num_warps"]) == ("cols16_r4w1", "cols16", 4, 1)
    assert row["speedup_graph"] == 5.0 and row["triton"] == row["cols16_r4w1"]


def test_the_kernels_machine_code_is_read_without_a_gpu(tmp_path):
    """bench/kernel_code.py compiles every variant for sm_90 and reads its loop: the cols16 kernels issue well under
    half the instructions an entry of the delta8 ones (no running sum), the cols16 default spills nothing, and holding
    8 rows of x in one program costs well under 8 programs' instructions."""
    pytest.importorskip("triton")  # its wheel carries ptxas, nvdisasm and cuobjdump
    from elsa_ds.sparse.triton_spmv import DEFAULT_ROWS

    out = tmp_path / "code.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_code.py"), "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == r and r["target"] == "sm_90"
    per_entry = {v["name"]: v["instructions_per_entry"] for v in r["variants"] if v["batch_in_program"] == 1}
    assert all(n > 0 for n in per_entry.values())
    assert max(v for k, v in per_entry.items() if k.startswith("cols16")) < 0.5 * min(v for k, v in per_entry.items() if k.startswith("delta8"))
    batch8 = next(v for v in r["variants"] if v["name"] == "cols16_r4_b8")  # 8 rows of x in one program: far fewer than 8 x
    assert batch8["stack_bytes"] == 0 and batch8["instructions_per_entry"] < 0.6 * 8 * per_entry["cols16_r4"]
    default = next(v for v in r["variants"] if v["name"] == f"cols16_r{DEFAULT_ROWS['cols16']}")
    assert default["stack_bytes"] == 0 and default["issue_us_h200"] < r["byte_floor_us"]["cols16"]


def test_a_failing_cell_is_recorded_and_the_rest_run_on(tmp_path, monkeypatch, capsys):
    """A cell that raises (here the 70 % one: its prune is handed a weight it cannot take) is kept in ``failed`` with its
    error; the cells after it still run, the JSON holds both, and the exit status is 1. Bad arguments: exit 2 first."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_decode

    real = gpu_decode.generate_cell

    def cell(dense, originals, sparsity, batch, args):
        if sparsity == 0.7:
            originals = {name: w[:, :-1] for name, w in originals.items()}  # one column short: copy_ raises
        return real(dense, originals, sparsity, batch, args)

    monkeypatch.setattr(gpu_decode, "generate_cell", cell)
    out = tmp_path / "gpu_decode.json"
    code = gpu_decode.main(["--device", "cpu", "--tiny", "--no_matrix", "--sparsities", "0.9,0.7,0.95", "--batches", "1",
                            "--steps", "2", "--rounds", "1", "--json", str(out)])
    r = json.loads(out.read_text())
    assert code == 1 and [row["sparsity"] for row in r["generate"]] == [0.9, 0.95]
    (failed,) = r["failed"]
    assert (failed["sparsity"], failed["batch"]) == (0.7, 1) and "RuntimeError" in failed["error"] and failed["traceback"]
    for bad in (["--sparsities", "0.9,1.2"], ["--batches", "17"], ["--steps", "0"], ["--sparsities", "ninety"]):
        with pytest.raises(SystemExit) as exit_:
            gpu_decode.parse(bad)
        assert exit_.value.code == 2
    capsys.readouterr()


@pytest.mark.integration
@pytest.mark.slow  # run with --slow (README: the full suite); CI's default run skips it
def test_another_compile_backend_takes_both_models(tmp_path):
    """--backend (cudagraphs on a GPU: inductor's CUDA graph without its code generation) set on the dense and the
    sparse model alike; rehearsed with aot_eager, the backend cudagraphs builds on, which a CPU can run, and with the
    siblings grouped as on CUDA (elsa_ds/sparse/siblings.py: q+k+v and gate+up each one launch)."""
    r = _run("--compile", "--backend", "aot_eager", "--no_matrix", "--sparsities", "0.9", out=tmp_path / "gpu_decode.json",
             env={"ELSA_DS_FUSE_SIBLINGS": "1"})
    assert r["compile_backend"] == "aot_eager" and [row["same_tokens"] for row in r["generate"]] == [True]
    assert [row["sibling_groups"] for row in r["generate"]] == [2 * 2]  # two layers: attention's and the MLP's
    r = _run("--compile", "--backend", "aot_eager", "--no_matrix", "--sparsities", "0.9", "--siblings",
             out=tmp_path / "siblings.json")  # grouped against apart: the same tokens, the ratio under its own key
    (row,) = r["generate"]
    assert r["siblings"] and row["same_tokens"] and row["sibling_groups"] == 4 and set(r["siblings_speedup"]) == {"0.9"}
    assert row["apart"]["tokens_per_s"] > 0 and row["grouped"]["tokens_per_s"] > 0 and "generate_speedup" not in r
    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_decode
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**gpu_decode.TINY, "num_hidden_layers": 1}))
    gpu_decode.compiled_with(model, "cudagraphs", everywhere=False)
    config = model.generation_config.compile_config
    assert (config.backend, config.mode, config._compile_all_devices) == ("cudagraphs", None, None)
    assert model.generation_config.cache_implementation == "static"
