"""OptimizerWrapper: a torch optimizer around a base optimizer, sharing its state, for ZeRO-3's basic-optimizer slot.

ZeRO-3 fills and empties ``param_groups[*]["params"]`` around every step and keys the state by its flat fp32
partitions, so a wrapper must read both through the base. It also knows which ranges (``Slice``s) of each flat
belong to which pruned layer. AdmmOptimizer (ELSA) and MaskedOptimizer (fixed-mask retraining) are two.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from elsa_ds.admm.projection import Slice


class OptimizerWrapper(torch.optim.Optimizer):
    """Shares ``base``'s ``param_groups``, ``state`` and ``defaults``; ``step`` is the subclass's."""

    def __init__(self, base: torch.optim.Optimizer):
        self.base = base
        # torch.optim.Optimizer bookkeeping that hooks and profilers expect, without re-registering params
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._slices: dict[int, tuple[torch.Tensor, list[Slice]]] = {}

    # base.load_state_dict replaces its state and param_groups objects: always read them through base
    @property
    def param_groups(self):
        return self.base.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.base.param_groups = value

    @property
    def state(self):
        return self.base.state

    @state.setter
    def state(self, value):
        self.base.state = value

    @property
    def defaults(self):
        return self.base.defaults

    @defaults.setter
    def defaults(self, value):
        self.base.defaults = value

    def assign(self, flat: torch.Tensor, slices: list[Slice]) -> None:
        """Declare which entries of ``flat`` belong to pruned layers (order must match across ranks)."""
        self._slices[id(flat)] = (flat, list(slices))

    def slices_of(self, flat: torch.Tensor) -> list[Slice] | None:
        entry = self._slices.get(id(flat))
        return entry[1] if entry is not None and entry[0] is flat else None

    def state_dict(self):
        return self.base.state_dict()

    def load_state_dict(self, state_dict):
        """Load the base optimizer's state, then give every state tensor back its saved dtype (torch casts states to
        the parameter's dtype, fp32 here: a bool mask, fp8 z or 8-bit codes would come back as fp32 values)."""
        saved = {(i, k): v.dtype for i, st in state_dict["state"].items() for k, v in st.items() if torch.is_tensor(v)}
        result = self.base.load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            st = self.state.get(p, {})
            for k, v in list(st.items()):
                dtype = saved.get((i, k))
                if torch.is_tensor(v) and dtype is not None and v.dtype != dtype:
                    st[k] = v.to(dtype)
        return result

    def zero_grad(self, set_to_none: bool = True):
        return self.base.zero_grad(set_to_none=set_to_none)
