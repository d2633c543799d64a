"""The Triton next-token loss (elsa_ds/loss_kernel.py) against the readable chunks (elsa_ds/loss.py), run on CPU by
Triton's interpreter (TRITON_INTERPRET=1), and compiled for sm_90 by Triton's own ptxas with no GPU present.

Triton reads TRITON_INTERPRET when it is imported, so the cases run in one subprocess started with it set (this file run
as a script: it prints every case's figures as JSON); the tests judge them. On a GPU, tests/cuda/test_loss_gpu.py
holds the compiled kernel to the same reference.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from elsa_ds import loss as L

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (rows, vocab, block): one block, blocks with a tail, a vocabulary of one, the default block's tail
SHAPES = ((7, 101, 16), (5, 64, 64), (4, 1, 1), (3, 5000, None), (9, 33, 8))


def whole_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """transformers' arithmetic: the logits upcast whole, cross-entropy over every position but the last."""
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1).long())


def _rows_case(rows: int, vocab: int, block: int | None, dtype: torch.dtype, strided: bool) -> dict:
    from elsa_ds import loss_kernel as K

    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    wide = (5 * torch.randn(rows, vocab + (3 if strided else 0), generator=gen)).to(dtype)
    logits = wide[:, :vocab]  # rows vocab + 3 apart: the kernel's row stride
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[0] = vocab - 1
    targets[-1] = -1  # predicts nothing: no loss, a zero gradient row
    if rows > 2:
        targets[1] = 0
    count = int((targets >= 0).sum())
    grad = torch.full(logits.shape, float("nan"), dtype=dtype)
    got = K.cross_entropy_rows(logits, targets, torch.tensor([1.0 / count]), grad, block=block)
    x = logits.float().clone().requires_grad_()
    ref = F.cross_entropy(x, targets, ignore_index=-1, reduction="none")
    (ref.sum() / count).backward()
    ref_grad = x.grad.to(dtype).float()  # one rounding of the fp32 gradient
    scale = float(ref_grad.abs().max()) or 1.0
    return {"loss_err": float((got - ref.detach()).abs().max() / ref.detach().abs().max().clamp_min(1e-6)),
            "grad_err": float((grad.float() - ref_grad).abs().max()) / scale, "ignored_row_zero": bool((grad[-1] == 0).all()),
            "ignored_loss_zero": float(got[-1]) == 0.0, "loss_dtype": str(got.dtype), "grad_dtype": str(grad.dtype)}


def _autograd_cases() -> dict[str, dict]:
    out = {}
    for name, dtype in DTYPES.items():
        gen = torch.Generator().manual_seed(3)
        logits = (3 * torch.randn(3, 17, 101, generator=gen)).to(dtype)
        ids = torch.randint(0, 101, (3, 17), generator=gen, dtype=torch.int32)
        mine, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        value = L._FusedNextToken.apply(mine, L.shifted_targets(ids).reshape(-1))
        (0.25 * value).backward()  # a scaled loss, as DeepSpeed's 1 / gradient accumulation scales it
        (0.25 * whole_loss(theirs, ids)).backward()
        scale = float(theirs.grad.float().abs().max())
        out[name] = {"value": float(value), "whole": float(whole_loss(logits, ids)), "value_dtype": str(value.dtype),
                     "grad_err": float((mine.grad.float() - theirs.grad.float()).abs().max()) / scale,
                     "grad_dtype": str(mine.grad.dtype), "last_position_zero": bool((mine.grad[:, -1] == 0).all()),
                     "logits_untouched": bool(torch.equal(logits, mine.detach())),
                     "agrees": L.fused_disagrees("cpu", dtype), "at_scale": L._AT_SCALE.get(("cpu", dtype), "unchecked")}
    return out


def _evaluation_case() -> dict:
    """token_nll's fused branch (taken on CUDA) against its chunks on the same logits."""
    from elsa_ds.evaluation import perplexity as P

    gen = torch.Generator().manual_seed(4)
    logits = (4 * torch.randn(3, 13, 97, generator=gen)).to(torch.bfloat16)
    ids = torch.randint(0, 97, (3, 13), generator=gen, dtype=torch.int32)
    chunked = P.token_nll(logits, ids, row_elements=4 * 97)
    P.loss_path = lambda logits: "fused"
    fused = P.token_nll(logits, ids)
    return {"chunked": list(chunked), "fused": list(fused)}


def run_cases() -> dict:
    """Every case under the interpreter (this process must have started with TRITON_INTERPRET=1)."""
    from elsa_ds import loss_kernel as K

    assert K.INTERPRET and K.unavailable("cpu") is None, K.unavailable("cpu")
    rows = {f"{r}x{v}-b{b}-{name}-{'strided' if strided else 'whole'}": _rows_case(r, v, b, dtype, strided)
            for r, v, b in SHAPES for name, dtype in DTYPES.items() for strided in (False, True)}
    gen = torch.Generator().manual_seed(5)
    big = torch.tensor([[300.0, -300.0, 0.0, 299.0]]) + torch.randn(1, 4, generator=gen) * 0  # exp would overflow unshifted
    rows["huge"] = {"loss": K.cross_entropy_rows(big, torch.tensor([3])).tolist(),
                    "ref": F.cross_entropy(big, torch.tensor([3]), reduction="none").tolist()}
    banned = torch.randn(2, 4196, generator=gen)
    banned[:, :4096] = float("-inf")  # the first block all -inf: no -inf - -inf
    banned[1, 4100:4150] = float("-inf")
    rows["banned"] = {"loss": K.cross_entropy_rows(banned, torch.tensor([4100 + 60, 4195])).tolist(),
                      "ref": F.cross_entropy(banned, torch.tensor([4160, 4195]), reduction="none").tolist()}
    rows["past_vocabulary"] = {"loss": K.cross_entropy_rows(torch.randn(3, 50), torch.tensor([1, 50, -1])).tolist()}
    with torch.inference_mode():  # an evaluation's first loss: the check still runs its backward
        rows["inference_mode_check"] = {"reason": (L.fused_disagrees.cache_clear(), L.fused_disagrees("cpu", torch.bfloat16))[1]}
    try:
        K.cross_entropy_rows(torch.zeros(4, 6).t(), torch.zeros(6, dtype=torch.long))
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"rows": rows, "autograd": _autograd_cases(), "evaluation": _evaluation_case(), "refused": refused,
            "scale": _scale_cases()}


def _scale_cases() -> dict:
    """scale_ against torch's fp32 product rounded once, a block's tail included; a strided tensor refused."""
    from elsa_ds import loss_kernel as K

    out = {}
    for name, dtype in DTYPES.items():
        g = torch.randn(3 * K.SCALE_BLOCK + 7, generator=torch.Generator().manual_seed(6)).to(dtype)
        s = torch.tensor(1.0 / 3.0)
        want, bf16_scale = (g.float() * s).to(dtype), g * s.to(dtype)  # the latter: torch's mul_ by a 0-dim tensor
        got = K.scale_(g.clone(), s)
        ulps = ((got.float() - want.float()).abs() / torch.finfo(dtype).eps / want.float().abs().clamp_min(1e-30)).max()
        out[name] = {"equal": bool(torch.equal(got, want)), "ulps": float(ulps),
                     "unlike_rounded_scale": int((bf16_scale != want).sum())}
    try:
        K.scale_(torch.zeros(4, 6).t(), torch.tensor(2.0))
        out["refused"] = ""
    except ValueError as err:
        out["refused"] = str(err)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # the interpreter runs the kernel's blocks as numpy arrays
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_each_rows_loss_and_gradient_are_the_reference_in_every_dtype_block_and_stride(results):
    rows = results["rows"]
    assert len(rows) == len(SHAPES) * len(DTYPES) * 2 + 4
    for name, case in rows.items():
        if name in ("huge", "banned", "past_vocabulary", "inference_mode_check"):
            continue
        assert case["loss_err"] <= 1e-5, (name, case)
        assert case["grad_err"] <= (1e-6 if "float32" in name else 2**-7 if "bfloat16" in name else 2**-10), (name, case)  # 1 ulp
        assert case["ignored_row_zero"] and case["ignored_loss_zero"], (name, case)
        assert case["loss_dtype"] == "torch.float32" and case["grad_dtype"] == f"torch.{name.split('-')[2]}", (name, case)


def test_large_logits_do_not_overflow(results):
    huge = results["rows"]["huge"]
    assert huge["loss"] == pytest.approx(huge["ref"], rel=1e-6) and huge["loss"][0] == pytest.approx(1.3133, rel=1e-3)


def test_banned_logits_out_of_range_targets_and_inference_mode(results):
    """Leading -inf logits give torch's finite loss (not NaN); a target past the vocabulary a NaN loss for its row alone;
    the self-check passes when the first loss comes under torch.inference_mode (an evaluation's)."""
    rows = results["rows"]
    assert rows["banned"]["loss"] == pytest.approx(rows["banned"]["ref"], rel=1e-6)
    loss = rows["past_vocabulary"]["loss"]
    assert loss[0] > 0 and math.isnan(loss[1]) and loss[2] == 0.0
    assert rows["inference_mode_check"]["reason"] is None


def test_the_fused_function_is_the_whole_upcast_loss_and_passes_its_own_check(results):
    for name, case in results["autograd"].items():
        assert case["value"] == pytest.approx(case["whole"], rel=1e-6), name
        assert case["value_dtype"] == "torch.float32" and case["grad_dtype"] == f"torch.{name}"
        assert case["grad_err"] <= (1e-6 if name == "float32" else torch.finfo(DTYPES[name]).eps), (name, case)
        assert case["last_position_zero"] and case["logits_untouched"], (name, case)
        assert case["agrees"] is None, (name, case)  # the self-check a CUDA process runs before its first fused loss
        assert case["at_scale"] is None, (name, case)  # its first loss held to the chunks at its own shape


def test_evaluation_takes_the_kernels_rows_summed_in_fp64(results):
    chunked, fused = results["evaluation"]["chunked"], results["evaluation"]["fused"]
    assert fused[1] == chunked[1] == 3 * 12 and fused[0] == pytest.approx(chunked[0], rel=1e-6)


def test_rows_that_are_not_contiguous_are_refused(results):
    assert "contiguous rows" in results["refused"]


def test_the_backwards_scale_is_one_fp32_product_rounded_once(results):
    """The fused loss's backward scales its gradient by grad_output in fp32 (1 / 3 stays 1 / 3; torch's mul_ by a 0-dim
    tensor rounds the scale to bf16 first, and some products with it): torch's fp32 product rounded once (to nearest on a
    GPU: tests/cuda/test_loss_gpu.py and the compile below; Triton's interpreter truncates to bf16, within one ulp)."""
    scale = results["scale"]
    for name in DTYPES:
        assert scale[name]["equal"] or name == "bfloat16" and scale[name]["ulps"] <= 1.0, (name, scale[name])
    assert scale["bfloat16"]["unlike_rounded_scale"] > 0  # the case tells the two roundings apart
    assert "a contiguous tensor" in scale["refused"]


def test_the_kernel_compiles_for_sm90_with_vectorized_loads():
    """Triton's own ptxas, no GPU: what a CUDA rank would run at Gemma's vocabulary. Each bf16 row is read (and its
    gradient written) 16 bytes an instruction; without the alignment Triton's launcher detects, 2 bytes."""
    pytest.importorskip("triton")
    from elsa_ds import loss_kernel as K

    if K.INTERPRET:
        pytest.skip("the interpreter replaces the compiler in this process")
    for write in (True, False):
        ptx = K.compile_ahead("bf16", write_grad=write).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, ptx[:2000]
        assert ("st.global.v4.b32" in ptx) == write
    assert "ld.global.v4" not in K.compile_ahead("bf16", aligned=False).asm["ptx"]
    ptx = K.compile_scale_ahead("bf16").asm["ptx"]  # the backward's scale: 16 bytes in, 16 out, rounded to nearest
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx and "cvt.rn.bf16" in ptx, ptx[:2000]


def test_the_speed_bench_times_the_chunks_here_and_says_why_not_the_kernel(tmp_path, capsys, monkeypatch):
    """bench/loss_speed.py on CPU (the kit's ``loss_gpu`` step rehearses it so): the chunks timed, the kernel not run and
    why, the figures as the last line and in --json; a user's ELSA_DS_LOSS is left as it was."""
    from bench import loss_speed

    monkeypatch.setenv(L.LOSS_ENV, "auto")
    assert loss_speed.main(["--device", "cpu", "--batch", "2", "--seqlen", "16", "--vocab", "300", "--rounds", "1",
                            "--json", str(tmp_path / "f.json")]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert out == json.loads((tmp_path / "f.json").read_text()) and os.environ[L.LOSS_ENV] == "auto"
    assert out["fused_unavailable"] == "not a CUDA device" and "fused" not in out and out["chunked"]["train_s"] > 0
    assert out["fused_bytes"] == 3 * 2 * 16 * 300 * 2


def test_a_job_imports_triton_only_for_the_kernel():
    """The CLI, the plan's checks and the evaluation job, which imported no triton before the loss kernel, still do not
    once they check ELSA_DS_LOSS: only a CUDA tensor's loss, or ELSA_DS_LOSS=fused, imports it there."""
    code = ("import sys, elsa_ds.cli, elsa_ds.plan.checks, elsa_ds.jobs.evaluate\n"
            "from elsa_ds.loss import check_loss_choice\n"
            "check_loss_choice('cpu')\n"
            "print('triton' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != L.LOSS_ENV})
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "False", proc.stderr[-2000:]


if __name__ == "__main__":
    print(json.dumps(run_cases()))
