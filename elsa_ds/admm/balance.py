"""Residual balancing of λ per layer (the ``adaptive`` schedule; the authors' ``adaptive_boyd``).

At each projection every pruned layer l moves its own λ_l by ``schedule.balanced_lambda`` from its primal residual
‖x − z‖/‖x‖ and dual residual ‖z − z_prev‖/‖z_prev‖. A layer may be cut into slices held by different ranks: the four
squared norms are summed per layer over the ranks (fp64, one all-reduce for all the layers of a call), so every rank
moves every λ alike, whatever the world size.
"""
from __future__ import annotations

import math

import torch

from elsa_ds.admm.projection import Comm
from elsa_ds.admm.schedule import balanced_lambda

EPS = 1e-8  # keeps a residual finite when a layer's x or z_prev is all zeros (the authors' value)


def residual_sums(x: torch.Tensor, z: torch.Tensor, z_old: torch.Tensor) -> list[float]:
    """This rank's share of one layer's ‖x − z‖², ‖x‖², ‖z − z_prev‖², ‖z_prev‖² (fp64)."""
    return [float((x - z).double().square().sum()), float(x.double().square().sum()),
            float((z - z_old).double().square().sum()), float(z_old.double().square().sum())]


def balanced_lambdas(sums: list[list[float]], lams: list[float], comm: Comm, mu: float, tau: float,
                     start: float | None = None) -> list[float]:
    """The next λ of each layer from this rank's ``residual_sums`` of it (one entry per layer, in the same order on every
    rank; zeros where a rank holds none of the layer), summed over the ranks, kept within ``BALANCE_SPAN`` of ``start``.
    Collective."""
    total = comm.all_reduce_sum(torch.tensor(sums, dtype=torch.float64).reshape(len(lams), 4))
    return [balanced_lambda(lam, r / (x + EPS), d / (zo + EPS), mu, tau, start)
            for lam, (r, x, d, zo) in zip(lams, total.sqrt().tolist())]


def lambda_summary(layer_lambdas: dict[str, float]) -> tuple[float, float, float] | None:
    """(geometric mean, smallest, largest) of the layers' λ (the mean over those above 0), or None without layers."""
    if not layer_lambdas:
        return None
    values = list(layer_lambdas.values())
    positive = [math.log(v) for v in values if v > 0.0]
    mean = math.exp(sum(positive) / len(positive)) if positive else 0.0
    return mean, min(values), max(values)
