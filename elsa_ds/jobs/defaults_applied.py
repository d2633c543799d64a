"""Apply the defaults rule (``elsa_ds/defaults.py``) to the settings a user left unset."""
from __future__ import annotations

from typing import Any

from elsa_ds.config import ElsaConfig
from elsa_ds.methods import DENSE
from elsa_ds.defaults import RULE_FIELDS, elsa_settings, retrain_settings
from elsa_ds.models import meta_model
from elsa_ds.targets import goal_ratio


def apply_defaults(cfg: ElsaConfig, model_config) -> tuple[ElsaConfig, dict[str, Any]]:
    """``cfg`` with every rule field the user did not set (command line, JSON ``elsa`` block, recipe, API) taken from
    the rule, and the record of what was taken and why (printed, and kept in the report)."""
    n_params = sum(p.numel() for p in meta_model(model_config).parameters())
    sparsity = goal_ratio(cfg.goal) if cfg.method.value != DENSE else 0.0
    steps = (cfg.finetune_steps or cfg.steps) if cfg.finetune is not None else cfg.steps
    given = cfg.model_fields_set
    # the rule's start comes with the rule's lr: a user's lr, or a start of the user's, keeps the paper's dense start
    start_pruned = bool(cfg.init_mask and cfg.init_weights) if given & {"lr", "init_mask", "init_weights"} else None
    suggestion = (retrain_settings(n_params, steps) if cfg.finetune is not None else
                  elsa_settings(n_params, sparsity, steps, start_pruned))
    unset = {k: v for k, v in suggestion.values.items() if k not in given and k in RULE_FIELDS}
    if "lr" not in unset:  # the warm-up belongs to the rule's lr: a user's lr keeps the user's warm-up
        unset.pop("warmup_steps", None)
    if cfg.select_every:  # selection picks its own end among the projections: no held end (the paper's)
        unset.pop("hold_steps", None)
    record = {"inputs": {"n_params": n_params, "sparsity": sparsity, "steps": steps},
              "applied": {k: v.value if hasattr(v, "value") else v for k, v in unset.items()},
              "why": {k: suggestion.why[k] for k in unset}, "set_by_user": sorted(k for k in RULE_FIELDS if k in cfg.model_fields_set)}
    return (cfg.model_copy(update=unset) if unset else cfg), record
