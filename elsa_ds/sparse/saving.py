"""``save_pretrained`` of a sparse-mode model writes what transformers can load: every pruned weight dense.

A sparse-mode model's state dict holds each SparseLinear's code (``values``, ``deltas`` or ``cols``, ``row_offsets``)
where the nn.Linear it replaced had ``weight``, and a grouped model's (``siblings.py``) holds a layer's q, k, v under
the lead alone. Written as it is, transformers finds no ``weight`` for those layers, initialises them at random and
loads the folder without an error (a user's walk: perplexity 28424 for a model scoring 68). So the models
``from_pretrained(..., mode="sparse")`` and ``sparsify`` return save their weights decompressed, under the names the
dense model has (a grouped sibling's rows and bias cut back out of its lead's): the folder ``mode="dense"``'s save
writes, bit for bit. For the compressed checkpoint, compress that folder (``elsa_ds.sparse.compress``) or keep the
elsa-sparse folder the model came from.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.siblings import FusedLinear, SiblingSlice

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def dense_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` (default ``model.state_dict()``) with every SparseLinear's code in it replaced by ``<name>.weight``
    decompressed, on the CPU one at a time (each grouped sibling's own rows and bias): the state dict of the dense
    model it stands for. A state dict given with dense weights already is left as it is."""
    state = dict(model.state_dict() if state is None else state)
    names = {id(m): n for n, m in model.named_modules()}
    dense: dict[int, torch.Tensor] = {}  # a lead's whole decompressed matrix, once

    def whole(module: SparseLinear) -> torch.Tensor:
        if id(module) not in dense:
            dense[id(module)] = module.dense_weight().cpu()  # a GPU that holds the model compressed may not hold it dense
        return dense[id(module)]
    coded = {k for k in state if k.endswith(".values")}  # the codes in it (a state dict given dense has none)
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        lead = module.lead[0] if isinstance(module, SiblingSlice) else module
        if not isinstance(lead, SparseLinear) or f"{names[id(lead)]}.values" not in coded:
            continue
        if lead is module:
            for part in module.parts:
                state.pop(prefix + part, None)
        if isinstance(module, SiblingSlice):
            rows = slice(module.start, module.stop)
        elif isinstance(module, FusedLinear):
            rows = slice(0, module.own)
        else:
            state[prefix + "weight"] = whole(module)
            continue
        # rows cut from one tensor: copies (transformers' save takes views of one storage for tied weights, drops all but one)
        state[prefix + "weight"] = whole(lead)[rows].clone()
        if lead.bias is not None:
            state[prefix + "bias"] = lead.bias.detach()[rows].cpu().clone()
    return state


def _save_pretrained_dense(self: PreTrainedModel, cache_implementation: str | None, save_directory: Any, *args: Any,
                           **kwargs: Any) -> Any:
    """transformers' save_pretrained, of the dense model this sparse-mode model stands for (see the module docstring),
    with the generation config it was loaded with (not the static cache set for decoding on CUDA)."""
    kwargs["state_dict"] = dense_state_dict(self, kwargs.get("state_dict"))
    generation = self.generation_config
    decoding, generation.cache_implementation = generation.cache_implementation, cache_implementation
    try:
        return type(self).save_pretrained(self, save_directory, *args, **kwargs)
    finally:
        generation.cache_implementation = decoding


def saves_dense(model: PreTrainedModel) -> None:
    """Make ``model.save_pretrained`` (and push_to_hub, which calls it) write its weights dense; called before the model
    is readied for decoding (its generation config as loaded); bound to the model by a partial, so that a deep copy
    saves itself and the model pickles."""
    model.save_pretrained = functools.partial(  # type: ignore[method-assign]
        _save_pretrained_dense, model, model.generation_config.cache_implementation)
