"""The sparse decode matmul as one torch operator, ``torch.ops.elsa_ds.sparse_linear``, so that torch.compile keeps it.

transformers' ``generate()`` compiles a model's decode step by itself when the cache is static
(``cache_implementation="static"``; on CUDA, mode ``reduce-overhead``: the step replayed as one CUDA graph, no Python
and no kernel launch from Python per layer). Traced as Python, SparseLinear's kernels would break that graph (a C++
extension and a Triton launch with host-side block sizes); as a registered operator with a shape function they are one
opaque node that the graph calls and a CUDA graph captures. Eager calls skip the operator's dispatch and call the same
function (:func:`sparse_linear_impl`), so the two are the same computation by construction.

``positions``: delta8's deltas (uint8), or the cols16 layout's columns (int16; elsa_ds/sparse/format.py). ``path``:
"triton" (CUDA tensors, or CPU ones under ``TRITON_INTERPRET=1``; either layout), "kernel" (the C++ kernel, CPU, delta8),
"reference" (the readable gather and index_add, any device, either layout). Every path accumulates in fp32, adds the
bias in fp32 and returns x's dtype, y [n, out_features] (contiguous) for x [n, in_features], 1 <= n <= 16.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from elsa_ds.sparse import kernels as K

PATHS = ("triton", "kernel", "reference")


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The C++ kernels (None: not built here), looked up once a process: ``kernels.load`` hashes the sources to name the
    build, too slow for every call and every SparseLinear of a model."""
    return K.load()


def sparse_linear_impl(values: torch.Tensor, positions: torch.Tensor, row_offsets: torch.Tensor, x: torch.Tensor,
                       out_features: int, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """y = x Wᵀ (+ bias) in x's dtype, W in delta8 or cols16 (``values``, ``positions``, ``row_offsets``), by ``path``."""
    parts = {"values": values, "cols" if positions.dtype == torch.int16 else "deltas": positions, "row_offsets": row_offsets}
    if path == "triton":
        from elsa_ds.sparse import triton_spmv  # imports triton: only on this path

        return triton_spmv.delta8_linear(parts, x, out_features, bias)
    if path == "kernel":
        kernels = cpu_kernels()
        if kernels is None or "deltas" not in parts:
            raise RuntimeError("the C++ kernel takes delta8 parts and is built here only where a compiler is: take the "
                               "reference or csr path")
        y = K.kernel_matmul(kernels, parts, x, out_features)
    elif path == "reference":
        y = K.reference_matmul(parts, x, out_features)
    else:
        raise ValueError(f"sparse_linear path {path!r}: choose from {', '.join(PATHS)}")
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).contiguous()  # the C++ kernel's y is a transposed view: the operator's shape function is row-major


@torch.library.custom_op("elsa_ds::sparse_linear", mutates_args=())
def sparse_linear(values: torch.Tensor, positions: torch.Tensor, row_offsets: torch.Tensor, x: torch.Tensor,
                  out_features: int, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    # a fresh tensor, never one of the inputs (an operator's output may not alias them): .to() of an fp32 y is y itself,
    # and y is the path's own allocation
    return sparse_linear_impl(values, positions, row_offsets, x, out_features, bias, path)


@sparse_linear.register_fake
def _sparse_linear_shape(values, positions, row_offsets, x, out_features, bias, path):
    """What the operator returns, for tracing: [n, out_features] in x's dtype, on x's device."""
    return x.new_empty(x.shape[0], out_features)
