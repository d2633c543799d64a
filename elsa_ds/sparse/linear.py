"""SparseLinear: an nn.Linear whose weight stays in elsa-sparse's delta8 code in memory.

Decode-sized inputs (at most 16 rows after flattening the batch and sequence dims) on CPU run the C++ delta8 kernel
(``decode_path = "kernel"``); without it, torch's CSR matmul (``"csr"``). On CUDA they run the Triton delta8 kernel
(``triton_spmv.py``, ``decode_path = "triton"``) where triton is installed; without it (``"decompress"``, the reason in
``triton_unavailable``) and for larger inputs (prefill) on any device, the weight is decompressed for the call and
multiplied densely: correct everywhere, no faster than the dense model. bench/sparse_decode.py measures the paths side
by side; docs/results.md has the figures. Every path accumulates in fp32 and returns x's dtype.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from elsa_ds.sparse import kernels as K
from elsa_ds.sparse import ops
from elsa_ds.sparse.format import DELTA8, check, decode

DECODE_PATHS = ("kernel", "csr", "reference")  # on CPU; CUDA tensors take "triton" or "decompress"


@torch.compiler.assume_constant_result
def _triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernel runs on this kind of device: asked once per trace, a constant inside a compiled graph."""
    from elsa_ds.sparse import triton_spmv

    return triton_spmv.unavailable(device_type) is None


class SparseLinear(torch.nn.Module):
    """y = x Wᵀ + b with W [out, in] held as delta8 values, deltas and row offsets (buffers, so ``.to()`` moves them)."""

    values: torch.Tensor  # the buffers register_buffer sets in __init__
    deltas: torch.Tensor
    row_offsets: torch.Tensor

    def __init__(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], bias: torch.Tensor | None = None,
                 decode_path: str | None = None, name: str = "weight"):
        super().__init__()
        check(name, DELTA8, shape, parts)
        self.out_features, self.in_features = shape
        self.register_buffer("values", parts["values"].contiguous())
        self.register_buffer("deltas", parts["deltas"].contiguous())
        self.register_buffer("row_offsets", parts["row_offsets"].contiguous())
        if bias is not None and not isinstance(bias, torch.nn.Parameter):
            bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.bias = bias  # the replaced Linear's own Parameter: a loader copying into it reaches this module
        kernels = ops.cpu_kernels() if decode_path in (None, "kernel") else None
        self.cpu_path = decode_path or ("kernel" if kernels is not None else "csr")
        if self.cpu_path not in DECODE_PATHS or (self.cpu_path == "kernel" and kernels is None):
            raise ValueError(f"decode_path {self.cpu_path!r}: choose from {DECODE_PATHS} (kernel only when built)")
        self._csr: torch.Tensor | None = None

    @property
    def decode_path(self) -> str:
        """What a decode-sized input on the weight's device runs: the CPU path, or on CUDA "triton" / "decompress"."""
        if self.values.device.type == "cpu":
            return self.cpu_path
        return "decompress" if self.triton_unavailable is not None else "triton"

    @property
    def triton_unavailable(self) -> str | None:
        """Why the Triton kernel cannot run on the weight's device (None: it can)."""
        from elsa_ds.sparse import triton_spmv  # imports triton: only when asked

        return triton_spmv.unavailable(self.values.device)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, decode_path: str | None = None) -> SparseLinear:
        """A Linear's weight in delta8 (its zeros dropped), same bias."""
        from elsa_ds.sparse.format import encode_delta8

        rows, cols = linear.weight.shape
        return cls(encode_delta8(linear.weight.detach().cpu()), (rows, cols), linear.bias, decode_path)

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, "deltas": self.deltas, "row_offsets": self.row_offsets}

    @property
    def weight_bytes(self) -> int:
        """Bytes a matrix-vector product streams: values, deltas, row offsets."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def dense_weight(self) -> torch.Tensor:
        return decode(DELTA8, (self.out_features, self.in_features), self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        path = self._path_for(flat)
        if path is None:
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if path == "csr":
            y = K.csr_matmul(self._csr_weight(), flat)
            y = (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        else:  # under torch.compile the registered operator (one opaque node), eagerly the same function without dispatch
            args = (self.values, self.deltas, self.row_offsets, flat, self.out_features, self.bias, path)
            y = ops.delta8_linear(*args) if torch.compiler.is_compiling() else ops.delta8_linear_impl(*args)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _path_for(self, flat: torch.Tensor) -> str | None:
        """The decode path for these rows of x; None: decompress and multiply densely (prefill-sized, or no kernel)."""
        if not 1 <= flat.shape[0] <= K.MAX_KERNEL_ROWS:
            return None
        if flat.device.type == "cpu":
            return self.cpu_path
        return "triton" if _triton_runs_on(flat.device.type) else None

    def _csr_weight(self) -> torch.Tensor:
        if self._csr is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
                self._csr = K.csr_tensor(self.parts, (self.out_features, self.in_features))
        return self._csr

    def extra_repr(self) -> str:
        density = self.values.numel() / max(self.out_features * self.in_features, 1)
        return f"in_features={self.in_features}, out_features={self.out_features}, entries={density:.3f}, path={self.decode_path}"
