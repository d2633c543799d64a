"""SparseLinear: an nn.Linear whose weight stays compressed in memory: elsa-sparse's delta8 code, or on a GPU the cols16
layout built from it (elsa_ds/sparse/format.py: each column whole, no running sum to decode; ``layout``).

Decode-sized inputs (at most 16 rows after flattening the batch and sequence dims) on CPU run the C++ delta8 kernel
(``decode_path = "kernel"``); without it, or on cols16, torch's CSR matmul (``"csr"``). On CUDA they run a Triton
kernel (``triton_spmv.py``, ``decode_path = "triton"``) where triton is installed; without it (``"decompress"``, the
reason in ``triton_unavailable``) and for larger inputs (prefill) on any device, the weight is decompressed for the
call and multiplied densely: correct everywhere, no faster than the dense model. bench/sparse_decode.py and
bench/sparse_decode_gpu.py measure the paths side by side; docs/results.md has the figures. Every path accumulates in
fp32 and returns x's dtype.
"""
from __future__ import annotations

import os
import warnings
import weakref
from typing import cast

import torch
import torch.nn.functional as F

from elsa_ds.sparse import kernels as K
from elsa_ds.sparse import ops
from elsa_ds.sparse.format import COLS16, DELTA8, POSITIONS, check, check_layout, cols16_to_delta8, decode, delta8_to_cols16
from elsa_ds.sparse.integrity import SparseArgumentError, check_type
from elsa_ds.torch_api import tensor_version

DECODE_PATHS = ("kernel", "csr", "reference")  # on CPU; CUDA tensors take "triton" or "decompress"


@torch.compiler.assume_constant_result
def _triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernel runs on this kind of device: asked once per trace, a constant inside a compiled graph."""
    from elsa_ds.sparse import triton_spmv

    return triton_spmv.unavailable(device_type) is None


def _default_cpu_path() -> str:
    return "kernel" if ops.cpu_kernels() is not None else "csr"


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ kernel takes; other dtypes default to csr


def check_decode_path(decode_path: str | None, mode: str = "sparse") -> None:
    """A ``decode_path`` argument of from_pretrained or sparsify (``mode``: the loader's), or one line saying what is
    wrong with it (SparseArgumentTypeError / SparseArgumentError)."""
    if decode_path is None:
        return
    check_type("decode_path", decode_path, str, f"one of {', '.join(DECODE_PATHS)}, or None")
    if decode_path not in DECODE_PATHS:
        raise SparseArgumentError(f"decode_path {decode_path!r}: choose from {', '.join(DECODE_PATHS)}, or None for the default")
    if mode != "sparse":
        raise SparseArgumentError(f"decode_path {decode_path!r} picks SparseLinear's CPU path: it needs mode='sparse'")
    if decode_path == "kernel" and ops.cpu_kernels() is None:
        raise SparseArgumentError("decode_path 'kernel': the C++ decode kernel could not be built here; choose 'csr', or None")


def default_path(dtype: torch.dtype, decode_path: str | None) -> str | None:
    """SparseLinear's decode_path for values of ``dtype``: the one asked for, else the default (None) where the C++
    kernel takes the dtype, else csr."""
    return decode_path or (None if dtype in KERNEL_DTYPES else "csr")


GPU_LAYOUT_ENV = "ELSA_DS_GPU_LAYOUT"


def gpu_layout() -> str:
    """The layout SparseLinear takes on a GPU: ``ELSA_DS_GPU_LAYOUT`` (cols16 or delta8), cols16 by default: its
    kernel issues ~16 instructions an entry against delta8's 55-80 (read off the sm_90 code, not yet timed: delta8's
    1-row kernel is the one measured on a GPU, docs/results.md), for one byte more an entry."""
    layout = (os.environ.get(GPU_LAYOUT_ENV) or COLS16).strip().lower()
    if layout not in (COLS16, DELTA8):
        raise SparseArgumentError(f"{GPU_LAYOUT_ENV}={layout!r}: choose {COLS16} or {DELTA8}")
    return layout


class SparseLinear(torch.nn.Module):
    """y = x Wᵀ + b with W [out, in] held as buffers (so ``.to()`` moves them): values, row offsets and the positions,
    delta8's deltas or cols16's columns (``layout``; built from delta8 parts, :meth:`to_layout` converts)."""

    values: torch.Tensor  # the buffers register_buffer sets
    row_offsets: torch.Tensor

    def __init__(self, parts: dict[str, torch.Tensor], shape: tuple[int, int], bias: torch.Tensor | None = None,
                 decode_path: str | None = None, name: str = "weight"):
        super().__init__()
        check(name, DELTA8, shape, parts)
        self.name, (self.out_features, self.in_features) = name, shape
        self.register_buffer("values", parts["values"].contiguous())
        self.register_buffer("deltas", parts["deltas"].contiguous())
        self.register_buffer("row_offsets", parts["row_offsets"].contiguous())
        self.layout = DELTA8
        if bias is not None and not isinstance(bias, torch.nn.Parameter):
            bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.bias = bias  # the replaced Linear's own Parameter: a loader copying into it reaches this module
        if decode_path is not None and (decode_path not in DECODE_PATHS or (decode_path == "kernel" and ops.cpu_kernels() is None)):
            raise ValueError(f"decode_path {decode_path!r}: choose from {DECODE_PATHS} (kernel only when built)")
        # the CPU path by default: the C++ kernel where it is built. Built on a GPU, the weight may never reach the CPU:
        # the lookup (a JIT build on a machine that has none yet) waits until it does
        self._cpu_path = decode_path or (None if self.values.device.type != "cpu" else _default_cpu_path())
        self._csr: torch.Tensor | None = None
        self._checked_parts = self._snapshot()

    def _snapshot(self) -> tuple[tuple[weakref.ref, ...], tuple[int, ...]]:
        parts = (self.values, self.positions, self.row_offsets)
        return tuple(weakref.ref(t) for t in parts), tuple(tensor_version(t) for t in parts)

    def _check_parts(self) -> None:
        """The kernels (C++, Triton, CSR) read positions and row offsets without bounds checks: parts changed since they
        were checked (load_state_dict, an in-place op on a part, ``.to()``, a new layout) are checked again before any
        reads them (format.check_layout, a pass over the parts, once per change; ~3 µs a product when none changed).
        Writes the version counter does not see (through ``.data`` or numpy, into a tensor made under inference_mode)
        are the caller's own, as with any tensor."""
        refs, versions = self._checked_parts
        parts = (self.values, self.positions, self.row_offsets)
        if (len(refs) != 3 or refs[0]() is not parts[0] or refs[1]() is not parts[1] or refs[2]() is not parts[2]
                or versions != (tensor_version(parts[0]), tensor_version(parts[1]), tensor_version(parts[2]))):
            check_layout(self.name, self.layout, (self.out_features, self.in_features), self.parts)
            self._checked_parts, self._csr = self._snapshot(), None

    def __getstate__(self):  # pickled or deep-copied: its parts are checked again at the copy's first product
        return {**super().__getstate__(), "_checked_parts": ((), ())}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # refused before anything is copied in
        given = {p: state_dict.get(prefix + p, t) for p, t in self.parts.items()}
        tensors = all(torch.is_tensor(t) and not t.is_meta for t in given.values())  # else torch's own message, or no data
        if tensors and any(t is not self.parts[p] for p, t in given.items()):
            check_layout(prefix + "weight", self.layout, (self.out_features, self.in_features), given)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @property
    def cpu_path(self) -> str:
        """What a decode-sized input takes on CPU: ``kernel``, ``csr`` or ``reference``."""
        if self._cpu_path is None:
            self._cpu_path = _default_cpu_path()
        return self._cpu_path

    @property
    def decode_path(self) -> str:
        """What a decode-sized input on the weight's device runs: the CPU path, or on CUDA "triton" / "decompress"."""
        if self.values.device.type == "cpu":
            return self._cpu_decode_path()
        return "decompress" if self.triton_unavailable is not None else "triton"

    def _cpu_decode_path(self) -> str:
        kernel_takes = self.layout == DELTA8 and self.values.dtype in KERNEL_DTYPES  # a .half() after loading included
        return "csr" if self.cpu_path == "kernel" and not kernel_takes else self.cpu_path

    def _apply(self, fn, recurse=True):  # .to(), .half(), .cuda(): the cached CSR copy would keep the old dtype, device
        self._csr = None
        return super()._apply(fn, recurse)

    @property
    def triton_unavailable(self) -> str | None:
        """Why the Triton kernel cannot run on the weight's device (None: it can)."""
        from elsa_ds.sparse import triton_spmv  # imports triton: only when asked

        return triton_spmv.unavailable(self.values.device)

    @classmethod
    def from_dense(cls, linear: torch.nn.Linear, decode_path: str | None = None) -> SparseLinear:
        """A Linear's weight in delta8 (its zeros dropped), on its device, same bias."""
        from elsa_ds.sparse.format import encode_delta8

        rows, cols = linear.weight.shape
        return cls(encode_delta8(linear.weight.detach()), (rows, cols), linear.bias, decode_path)

    @property
    def positions(self) -> torch.Tensor:
        """The deltas (delta8) or the columns (cols16)."""
        return cast(torch.Tensor, getattr(self, POSITIONS[self.layout]))

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        return {"values": self.values, POSITIONS[self.layout]: self.positions, "row_offsets": self.row_offsets}

    @property
    def weight_bytes(self) -> int:
        """Bytes a matrix-vector product streams: values, positions, row offsets."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def dense_weight(self) -> torch.Tensor:
        return decode(self.layout, (self.out_features, self.in_features), self.parts)

    def to_layout(self, layout: str) -> SparseLinear:
        """This module with its weight in ``layout`` (delta8 or cols16), converted in place on its device; the product
        is the same (entries are not rounded, delta8's zero fillers are dropped or put back)."""
        if layout not in (DELTA8, COLS16):
            raise ValueError(f"layout {layout!r}: choose {DELTA8} or {COLS16}")
        if layout != self.layout:
            shape = (self.out_features, self.in_features)
            parts = delta8_to_cols16(self.parts, shape) if layout == COLS16 else cols16_to_delta8(self.parts, shape)
            delattr(self, POSITIONS[self.layout])  # a buffer: Module.__delattr__ drops it
            for name, tensor in parts.items():
                self.register_buffer(name, tensor)
            self.layout, self._csr = layout, None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        path = self._path_for(flat)
        if path is None:
            return F.linear(x, self.dense_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if not torch.compiler.is_compiling():  # compiled: the checks at construction and at load_state_dict only
            self._check_parts()
        if path == "csr":
            y = K.csr_matmul(self._csr_weight(), flat)
            y = (y if self.bias is None else y + self.bias.float()).to(x.dtype)
        else:  # under torch.compile the registered operator (one opaque node), eagerly the same function without dispatch
            args = (self.values, self.positions, self.row_offsets, flat, self.out_features, self.bias, path)
            y = ops.sparse_linear(*args) if torch.compiler.is_compiling() else ops.sparse_linear_impl(*args)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _path_for(self, flat: torch.Tensor) -> str | None:
        """The decode path for these rows of x; None: decompress and multiply densely (prefill-sized, no kernel, or a
        gradient wanted: the kernels have no backward, F.linear's carries x's gradient)."""
        if not 1 <= flat.shape[0] <= K.MAX_KERNEL_ROWS or (flat.requires_grad and torch.is_grad_enabled()):
            return None
        if flat.device.type == "cpu":
            return self._cpu_decode_path()
        return "triton" if _triton_runs_on(flat.device.type) else None

    def _csr_weight(self) -> torch.Tensor:
        if self._csr is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
                self._csr = K.csr_tensor(self.parts, (self.out_features, self.in_features))
        return self._csr

    def extra_repr(self) -> str:
        density = self.values.numel() / max(self.out_features * self.in_features, 1)
        return (f"in_features={self.in_features}, out_features={self.out_features}, entries={density:.3f}, layout={self.layout}, "
                f"path={self.decode_path}")
