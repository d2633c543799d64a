"""Sparse-times-dense for decode: the C++ delta8 kernel (``csrc/spmv.cpp``), torch's CSR matmul, and the readable
reference both are tested against. All three take the delta8 parts (the reference and CSR also the GPU's cols16
layout) and x [n, in] and return fp32 [n, out].

The kernel is JIT-built and cached like the ADMM kernels (``elsa_ds.admm.kernels.build``: -O3 -march=native,
OpenMP; ``ELSA_DS_KERNELS=0`` switches it off); where it cannot be built the callers take :func:`csr_matmul`.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from types import ModuleType

import torch

from elsa_ds.admm.kernels import build
from elsa_ds.sparse.format import positions
from elsa_ds.sparse.integrity import SparseArgumentError

CSRC = Path(__file__).resolve().parent / "csrc"
MAX_KERNEL_ROWS = 16  # activation rows one kernel call takes (decode: batch x 1 token)


LOOPS_ENV = "ELSA_DS_SPARSE_LOOPS"  # "portable" or "avx512": overrides prefer_portable's choice


def load() -> ModuleType | None:
    """The compiled delta8 kernel (built once, then cached), or None when switched off or unbuildable."""
    return build.load_extension("elsa_sparse", CSRC, ("spmv.cpp",), (), "sparse decode kernel")


def loops_choice() -> str | None:
    """``ELSA_DS_SPARSE_LOOPS``: "portable", "avx512" or None (unset); SparseArgumentError for anything else (an audit:
    "avx-512" was ignored, the CPU's vendor chose)."""
    if why := build.switch_problem(LOOPS_ENV, ("portable", "avx512")):  # the one reading of a switch's values
        raise SparseArgumentError(why)
    return os.environ.get(LOOPS_ENV, "").strip().lower() or None


@functools.cache
def prefer_portable() -> bool:
    """Whether batch 1 takes the portable loop where the AVX-512 gather loop is also built: on AMD CPUs (whose gathers
    are slow: on an AMD EPYC the portable loop was 3-10 % faster, cold caches, ABBA; docs/results.md), unless
    ``ELSA_DS_SPARSE_LOOPS`` says otherwise (read once per process). Larger batches always take the portable loops."""
    if (choice := loops_choice()) is not None:
        return choice == "portable"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return "AuthenticAMD" in f.read(4096)
    except OSError:
        return False


def reference_matmul(parts: dict[str, torch.Tensor], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """y[:, r] = Σ_k value_k · x[:, col_k] over row r's entries: a gather, a product, an index_add (fp32)."""
    row, col = positions(parts)
    y = torch.zeros(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    return y.index_add_(1, row, x[:, col].float() * parts["values"].float())


def kernel_matmul(kernels: ModuleType, parts: dict[str, torch.Tensor], x: torch.Tensor, out_features: int,
                  portable: bool | None = None) -> torch.Tensor:
    """The C++ kernel on CPU tensors, 1 to 16 rows of x (padded to 1, 2, 4, 8 or 16 columns of its fp32 x^T);
    ``portable``: the plain loop for batch 1 even where the AVX-512 one is built (``kernels.avx512``); None: as
    :func:`prefer_portable` says."""
    n = x.shape[0]
    if not 1 <= n <= MAX_KERNEL_ROWS:
        raise ValueError(f"the delta8 kernel takes 1 to {MAX_KERNEL_ROWS} rows, got {n}")
    nb = 1 << (n - 1).bit_length()
    xt = torch.zeros(x.shape[1], nb, dtype=torch.float32)
    xt[:, :n] = x.t()
    yt = torch.empty(out_features, nb, dtype=torch.float32)
    kernels.delta8_matmul(parts["values"], parts["deltas"], parts["row_offsets"], xt, yt,
                          prefer_portable() if portable is None else portable)
    return yt[:, :n].t()


def csr_tensor(parts: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    """The weight as a torch sparse CSR tensor (fp32 values: torch's CPU CSR matmul has no bf16)."""
    _, col = positions(parts)
    return torch.sparse_csr_tensor(parts["row_offsets"].long(), col, parts["values"].float(), size=shape, check_invariants=False)


def csr_matmul(csr: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (csr @ x.t().float()).t()
