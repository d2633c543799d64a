"""One-shot pruning of a whole model, decoder layer by decoder layer: magnitude, Wanda, SparseGPT.

As in the SparseGPT and Wanda reference code: the calibration sequences enter the first decoder layer;
for each layer in turn, hooks on its pruned Linears accumulate input statistics (Wanda: per-channel
‖X_j‖₂², SparseGPT: H = 2/n Σ X Xᵀ) over all sequences run through the *dense* layer, every pruned Linear
of the layer is pruned, and the sequences are run again through the *pruned* layer to become the next
layer's inputs. Only one layer and the activations of the calibration set live on ``device``.
Magnitude pruning needs no data. The kernels are in ``masks.py``, ``wanda.py`` and ``sparsegpt.py``.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from elsa_ds.admm.projection import NM
from elsa_ds.errors import ElsaError
from elsa_ds.log import get_logger
from elsa_ds.methods import OneShot
from elsa_ds.oneshot.layerwise import capture, run_layer, stubbed
from elsa_ds.oneshot.masks import magnitude_mask, prune_counts
from elsa_ds.oneshot.sparsegpt import Hessian, sparsify_weight
from elsa_ds.oneshot.wanda import InputNorms, wanda_mask
from elsa_ds.targets import LayerGoal, decoder_layer_list, goal_zeros

log = get_logger(__name__)


def _linears_by_layer(model: torch.nn.Module, names: list[str]) -> list[dict[str, torch.nn.Linear]]:
    """For every decoder layer, its pruned Linears by parameter name; every pruned weight must sit in a layer."""
    by_module = {name.removesuffix(".weight"): name for name in names}
    layers = decoder_layer_list(model)
    where = {id(layer): i for i, layer in enumerate(layers)}
    found: list[dict[str, torch.nn.Linear]] = [{} for _ in layers]
    prefix = {id(layer): f"{model_name}." for model_name, layer in model.named_modules() if id(layer) in where}
    for layer in layers:
        for sub, module in layer.named_modules():
            full = prefix[id(layer)] + sub
            if full in by_module:
                found[where[id(layer)]][by_module.pop(full)] = module
    if by_module:
        raise ElsaError(f"one-shot methods prune Linears inside decoder layers only; {sorted(by_module)[:3]} are outside "
                        "(narrow --targets)")
    return found


@torch.no_grad()
def prune_model(model: torch.nn.Module, method: OneShot | str, goals: dict[str, LayerGoal], calibration: torch.Tensor | None,
                device: torch.device, blocksize: int = 128, percdamp: float = 0.01, exact: bool = False) -> dict[str, torch.Tensor]:
    """Prune ``model`` in place with ``method``; returns the keep-mask of every pruned weight (on the CPU).

    ``goals`` maps each pruned weight's parameter name to its sparsity or N:M pattern; ``calibration``
    [n, seqlen] token ids are needed by wanda and sparsegpt. ``exact``: the pruned weights are the export (the one-shot
    job), so a weight already sparser than its goal is refused first (a warm start's or a retrained mask's zeros train away).
    """
    from tqdm import tqdm

    method = OneShot(method)
    if method.calibrated and method not in CALIBRATED:
        raise ElsaError(f"one-shot method {method.value} has no statistics and pruning function in oneshot.methods.CALIBRATED")
    model.eval()
    per_layer = _linears_by_layer(model, list(goals))
    if exact:
        _check_not_sparser(per_layer, goals, method)
    if not method.calibrated:
        return _prune_magnitude(per_layer, goals)
    if calibration is None or calibration.shape[0] == 0:
        raise ElsaError(f"{method.value} needs calibration sequences; none were given")
    started, masks = time.time(), {}
    with stubbed(model, device) as plan:
        hidden = capture(model, plan, calibration, device)
        for layer, call, linears in tqdm(list(zip(plan.layers, plan.calls, per_layer)), desc=method.value, unit="layer"):
            layer.to(device)
            if linears:
                masks.update(_prune_layer(method, layer, call, hidden, linears, goals, device, blocksize, percdamp))
            hidden = run_layer(layer, call, hidden)     # the pruned layer feeds the next one
            layer.to(plan.home)
    log.info(f"{method.value}: {len(masks)} layers pruned with {calibration.shape[0]} calibration sequences of "
             f"{calibration.shape[1]} tokens in {time.time() - started:.1f} s")
    return masks


def _check_not_sparser(per_layer: list[dict[str, torch.nn.Linear]], goals: dict[str, LayerGoal], method: OneShot) -> None:
    """ElsaError when a weight already holds more zeros than its goal leaves: every method keeps its k largest scores, a
    zero among them, and the export then misses its exact count (an audit, 2026-12-07: a 70 % model pruned to 50 % was
    refused as "export is incomplete" after the whole pass). Where the quota is smaller than the layer (a thirteenth
    audit), per group for N:M and per row for Wanda; SparseGPT's updates refill zeros, so its export's check decides."""
    for linears in per_layer:
        for name, linear in linears.items():
            w, goal = linear.weight, goals[name]
            numel = w.numel()
            zeros, allowed = numel - int(torch.count_nonzero(w)), goal_zeros(numel, goal)
            if zeros > allowed:
                raise ElsaError(f"the model's {name} already holds {zeros:,} zeros ({zeros / numel:.1%}), more than its goal "
                                f"{goal} leaves ({allowed:,}): a pruned model can be pruned further, not less; "
                                f"{_ask_for(zeros / numel, goal, ', or ')}start from the dense model")
            if method is not OneShot.sparsegpt and (refusal := _short_quota(name, w, goal, method)):
                raise ElsaError(refusal)


def _at_least(ratio: float) -> str:
    """``ratio`` as the value --sparsity takes, rounded up at 0.001: advice that, followed, is not refused for its rounding."""
    return f"{math.ceil(ratio * 1000 - 1e-9) / 1000:.3f}"


def _ask_for(ratio: float, goal: LayerGoal, then: str) -> str:
    """The sparsity that would take a layer of ``ratio`` zeros, as advice that gets past the refusal, followed by ``then``
    (a review: an N:M job was told to ask for --sparsity, which --pattern refuses); nothing above 99.9 %, where no
    sparsity below 1 would do."""
    if math.ceil(ratio * 1000 - 1e-9) >= 1000:
        return ""
    if isinstance(goal, NM):
        return f"drop --pattern and prune it unstructured at --sparsity {_at_least(ratio)} or more{then}"
    return f"ask for at least {_at_least(ratio)} there (--sparsity, --sparsity_profile){then}"


def _short_quota(name: str, w: torch.Tensor, goal: LayerGoal, method: OneShot) -> str | None:
    """Where N:M's group or Wanda's row already holds more zeros than its own quota (the layer's count may be within)."""
    rows, cols = w.shape
    if isinstance(goal, NM):
        if cols % goal.m:
            return None  # refused by the plan's shape check
        per_group = (w == 0).reshape(rows, cols // goal.m, goal.m).sum(-1)
        if (most := int(per_group.max())) > goal.n:
            r, g = divmod(int(per_group.argmax()), cols // goal.m)
            return (f"the model's {name} already holds {most} zeros in the group of {goal.m} at row {r}, columns "
                    f"{g * goal.m}-{g * goal.m + goal.m - 1}, more than {goal} leaves ({goal.n}): each group keeps {goal.m - goal.n}; "
                    "start from the dense model, or prune it unstructured")
        return None
    if method is not OneShot.wanda:
        return None
    row_zeros = (w == 0).sum(1).cpu()
    quota = torch.tensor(prune_counts([cols] * rows, goal))
    if int((over := row_zeros - quota).max()) > 0:
        r = int(over.argmax())
        higher = _ask_for(int(row_zeros.max()) / cols, goal, ", ")
        return (f"the model's {name} already holds {int(row_zeros[r])} zeros in row {r}, more than Wanda's share of each "
                f"row at {goal:.1%} ({int(quota[r])}): {higher}prune it with --method sparsegpt or magnitude, or start from the "
                "dense model")
    return None


def _prune_magnitude(per_layer: list[dict[str, torch.nn.Linear]], goals: dict[str, LayerGoal]) -> dict[str, torch.Tensor]:
    masks = {}
    for linears in per_layer:
        for name, linear in linears.items():
            keep = magnitude_mask(linear.weight.data, goals[name])
            linear.weight.data.mul_(keep.to(linear.weight.dtype))
            masks[name] = keep.cpu()
    return masks


def _wanda(weight: torch.Tensor, stats: InputNorms, goal: LayerGoal, blocksize: int, percdamp: float) -> torch.Tensor:
    keep = wanda_mask(weight, stats.scaler_row, goal)
    weight.mul_(keep.to(weight.dtype))
    return keep


def _sparsegpt(weight: torch.Tensor, stats: Hessian, goal: LayerGoal, blocksize: int, percdamp: float) -> torch.Tensor:
    new, keep, _ = sparsify_weight(weight, stats.H, goal, blocksize, percdamp)
    weight.copy_(new)
    return keep


# The calibrated methods: the input statistics a method gathers, and how it prunes a weight (in place) from them, returning
# the keep-mask. One entry per calibrated OneShot member (tests/oneshot/test_layerwise.py holds the registry to the enum):
# a new method is a new entry, never a branch that another name could fall into.
CALIBRATED: dict[OneShot, tuple[type, Callable[..., torch.Tensor]]] = {
    OneShot.wanda: (InputNorms, _wanda),
    OneShot.sparsegpt: (Hessian, _sparsegpt),
}


def _prune_layer(method: OneShot, layer: torch.nn.Module, call, hidden: torch.Tensor, linears: dict[str, torch.nn.Linear],
                 goals: dict[str, LayerGoal], device: torch.device, blocksize: int, percdamp: float) -> dict[str, torch.Tensor]:
    """Input statistics of the dense layer's pruned Linears over the calibration activations, then each one pruned."""
    statistics, prune = CALIBRATED[method]
    stats = {name: statistics(lin.in_features, device) for name, lin in linears.items()}
    hooks = [lin.register_forward_hook(lambda _m, inp, _out, s=stats[name]: s.add_batch(inp[0].detach()))
             for name, lin in linears.items()]
    try:
        run_layer(layer, call, hidden)      # dense layer, statistics only
    finally:
        for h in hooks:
            h.remove()
    return {name: prune(lin.weight.data, stats[name], goals[name], blocksize, percdamp).cpu() for name, lin in linears.items()}
