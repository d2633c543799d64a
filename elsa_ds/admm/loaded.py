"""A resumed ADMM state is checked against the run it is loaded into: a checkpoint altered by hand or written by another
program must stop the resume in one line, not fail steps later inside a kernel (``AdmmOptimizer.load_state_dict``)."""
from __future__ import annotations

import torch

from elsa_ds.admm.settings import AdmmSettings
from elsa_ds.admm.state import LAM, U, U_SCALE, Z, Z_SCALE
from elsa_ds.admm.wrapper import OptimizerWrapper


class StateMismatch(ValueError):
    """A loaded ADMM state that does not fit the run (``AdmmOptimizer.load_state_dict``); the resume refuses the checkpoint
    on every rank (``zero/resume_load.load_latest``): DeepSpeed's load leaves its parameter groups half-set after a raise,
    so an older tag cannot be tried instead."""


def state_problem(opt: OptimizerWrapper, s: AdmmSettings) -> str | None:
    """What of the loaded z, u, their scales and the per-layer λ does not fit ``opt``'s flats (entries, dtypes as ``s``
    stores them, one scale and one λ per pruned slice), or None."""
    for flat in (p for group in opt.param_groups for p in group["params"]):
        slices, st = opt.slices_of(flat), opt.state.get(flat, {})
        if slices is None or Z not in st:
            continue  # saved before the first projection created them
        expected = {Z: (flat.numel(), s.z_dtype.torch_dtype), U: (flat.numel(), s.u_dtype.torch_dtype),
                    Z_SCALE: (len(slices), torch.float32), U_SCALE: (len(slices), torch.float32)}
        if LAM in st:
            expected[LAM] = (len(slices), torch.float32)
        for key, (numel, dtype) in expected.items():
            value = st.get(key)
            if not torch.is_tensor(value) or value.numel() != numel or value.dtype != dtype:
                found = (f"{value.numel()} {str(value.dtype).removeprefix('torch.')} entries" if torch.is_tensor(value)
                         else type(value).__name__)
                return f"{key} holds {found}, expected {numel} {str(dtype).removeprefix('torch.')}"
    return None
