"""Wanda: prune by |weight| × input activation norm, compared within each output row.

Sun et al., "A Simple and Effective Pruning Approach for Large Language Models" (locuslab/wanda):

    S_ij = |W_ij| · ‖X_j‖₂        W [out, in], X_j = input channel j over the calibration tokens

with ‖X_j‖² taken as the running mean over calibration sequences that the reference keeps in
``scaler_row`` (lib/layerwrapper.py). Deviation from lib/prune.py: each row prunes its share of exactly
round(s · numel) entries (``prune_counts``), not int(s · in), and ties keep the lower column.
"""
from __future__ import annotations

import torch

from elsa_ds.oneshot.masks import Target, row_keep_mask


class InputNorms:
    """Running ‖X_j‖² / nsamples per input channel j (the reference's ``scaler_row``)."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.scaler_row = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.nsamples = 0

    def add_batch(self, inp: torch.Tensor) -> None:
        """Fold in a batch [batch, tokens, in] (or one sequence [tokens, in]).

        scaler ← scaler · n / (n + b);  n ← n + b;  scaler += Σ_tokens x_j² / n   (b = sequences in the batch)
        """
        if inp.dim() not in (2, 3) or inp.shape[-1] != self.scaler_row.numel():
            width = self.scaler_row.numel()
            raise ValueError(f"expected input [batch, tokens, {width}] or [tokens, {width}], got {tuple(inp.shape)}")
        batch = inp.shape[0] if inp.dim() == 3 else 1
        x = inp.reshape(-1, inp.shape[-1]).to(self.scaler_row.device, torch.float32)
        self.scaler_row *= self.nsamples / (self.nsamples + batch)
        self.nsamples += batch
        self.scaler_row += x.pow(2).sum(0) / self.nsamples


def wanda_score(weight: torch.Tensor, scaler_row: torch.Tensor) -> torch.Tensor:
    """S = |W| · sqrt(scaler_row), broadcast over the output rows; fp32 [out, in]."""
    return weight.float().abs() * scaler_row.float().to(weight.device).sqrt().unsqueeze(0)


def wanda_mask(weight: torch.Tensor, scaler_row: torch.Tensor, target: Target) -> torch.Tensor:
    """Wanda keep-mask: the largest S per output row (a sparsity), or per group of M in a row (N:M)."""
    return row_keep_mask(wanda_score(weight, scaler_row), target)
