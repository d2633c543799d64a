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

import types
from typing import TYPE_CHECKING, Any

import torch

from elsa_ds.sparse.linear import SparseLinear
from elsa_ds.sparse.siblings import FusedLinear, SiblingSlice

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def dense_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every SparseLinear's code replaced by ``<name>.weight`` decompressed (each grouped
    sibling's its own rows and bias): the state dict of the dense model it stands for."""
    state = model.state_dict()
    dense: dict[int, torch.Tensor] = {}  # a lead's whole decompressed matrix, once

    def whole(module: SparseLinear) -> torch.Tensor:
        if id(module) not in dense:
            dense[id(module)] = module.dense_weight()
        return dense[id(module)]
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, SparseLinear):
            for part in module.parts:
                state.pop(prefix + part, None)
            if isinstance(module, FusedLinear):  # rows cut from one tensor: copies (transformers' save would take views
                rows = slice(0, module.own)      # of one storage for tied weights and drop all but one)
                state[prefix + "weight"] = whole(module)[rows].clone()
                if module.bias is not None:
                    state[prefix + "bias"] = module.bias.detach()[rows].clone()
            else:
                state[prefix + "weight"] = whole(module)
        elif isinstance(module, SiblingSlice):
            lead, rows = module.lead[0], slice(module.start, module.stop)
            state[prefix + "weight"] = whole(lead)[rows].clone()
            if lead.bias is not None:
                state[prefix + "bias"] = lead.bias.detach()[rows].clone()
    return state


def _save_pretrained_dense(self: PreTrainedModel, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
    """transformers' save_pretrained, of the dense model this sparse-mode model stands for (see the module docstring)."""
    if kwargs.get("state_dict") is None:
        kwargs["state_dict"] = dense_state_dict(self)
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)


def saves_dense(model: PreTrainedModel) -> None:
    """Make ``model.save_pretrained`` (and push_to_hub, which calls it) write its weights dense; bound to the model, so
    that a deep copy saves itself."""
    model.save_pretrained = types.MethodType(_save_pretrained_dense, model)  # type: ignore[method-assign]
