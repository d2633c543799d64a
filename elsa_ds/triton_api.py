"""Triton, imported once for the project's kernels (the decode matmul: ``elsa_ds.sparse.triton_spmv``; the training
loss: ``elsa_ds.loss_kernel``): the modules, or why they cannot be imported, and whether Triton's interpreter runs them.

Only those modules import this one, and they only when a CUDA tensor (or a test) needs them: importing elsa_ds never
imports triton. ``TRITON_INTERPRET=1`` in the environment before triton is imported (triton decorates its own language
functions then) runs the same kernels on CPU tensors in Triton's interpreter, as the tests do.
"""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")  # as triton reads it on import
try:
    import triton
    import triton.language as tl
except Exception as err:  # noqa: BLE001 - a broken install is as unavailable as a missing one
    triton = tl = None
    IMPORT_ERROR: str | None = f"triton is not importable ({type(err).__name__}: {err})"
else:
    IMPORT_ERROR = None
    if hasattr(triton, "knobs"):  # triton >= 3.4 reads its own way ("Y" interprets): its reading, not a guess of it
        INTERPRET = bool(triton.knobs.runtime.interpret)


def unavailable(device: torch.device | str, kernel: str) -> str | None:
    """Why ``kernel`` (its name, for the reason) cannot run on ``device`` (None: it can): no triton, or no GPU and no
    interpreter."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    kind = torch.device(device).type
    if INTERPRET:
        return None if kind == "cpu" else "TRITON_INTERPRET=1 runs Triton kernels on CPU tensors only"
    if kind != "cuda":
        return f"{kernel} runs on CUDA tensors, not {torch.device(device)} ones"
    return None if torch.cuda.is_available() else "no CUDA device (torch.cuda.is_available() is False)"
