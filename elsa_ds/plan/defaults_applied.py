"""Apply the defaults rule (``elsa_ds/settings/defaults.py``) to the settings a user left unset."""
from __future__ import annotations

from typing import Any

import torch
from pydantic import ValidationError

from elsa_ds.methods import DENSE
from elsa_ds.models import meta_model
from elsa_ds.settings.config import RESUME_DEFAULTS, ElsaConfig
from elsa_ds.settings.defaults import RULE_FIELDS, USER_START, elsa_settings, retrain_settings
from elsa_ds.targets import goal_ratio, overall_ratio, target_shapes


def apply_defaults(cfg: ElsaConfig, model_config, resumed: dict[str, Any] | None = None) -> tuple[ElsaConfig, dict[str, Any]]:
    """``cfg`` with every rule field the user did not set (command line, JSON ``elsa`` block, recipe, API) taken from
    the rule, and the record of what was taken and why (printed, and kept in the report). ``resumed``: the fingerprint
    of the checkpoint a ``--resume`` continues; an unset field keeps the value the run started with where the rule now
    gives another (the rule changed since), so an upgrade does not stop a run half-way."""
    meta = meta_model(model_config)
    n_params = sum(p.numel() for p in meta.parameters())
    sparsity = _pruned_ratio(cfg, meta) if cfg.method.value != DENSE else 0.0
    steps = (cfg.finetune_steps or cfg.steps) if cfg.finetune is not None else cfg.steps
    given = cfg.model_fields_set
    # the rule's start comes with the rule's lr: a user's lr, or a start of the user's, keeps the paper's dense start
    start_pruned = bool(cfg.init_mask and cfg.init_weights) if given & USER_START else None
    suggestion = (retrain_settings(n_params, steps) if cfg.finetune is not None else
                  elsa_settings(n_params, sparsity, steps, start_pruned, cfg.interval))
    unset = {k: v for k, v in suggestion.values.items() if k not in given and k in RULE_FIELDS}
    if "lr" not in unset:  # the warm-up belongs to the rule's lr: a user's lr keeps the user's warm-up
        unset.pop("warmup_steps", None)
    if cfg.select_every:  # selection picks its own end among the projections: no held end (the paper's)
        unset.pop("hold_steps", None)
    kept = _kept_from_checkpoint(cfg, unset, resumed)
    unset.update({k: value for k, (value, _) in kept.items()})
    record = {"inputs": {"n_params": n_params, "sparsity": sparsity, "steps": steps},
              "applied": {k: _plain(v) for k, v in unset.items()},
              "why": {k: (f"kept from the checkpoint --resume continues (the run started with it; unset, it would now be "
                          f"{kept[k][1]})" if k in kept else suggestion.why[k]) for k in unset},
              "set_by_user": sorted(k for k in RULE_FIELDS if k in cfg.model_fields_set),
              "kept_from_checkpoint": sorted(kept)}
    return (cfg.model_copy(update=unset) if unset else cfg), record


def _pruned_ratio(cfg: ElsaConfig, meta: torch.nn.Module) -> float:
    """The fraction of zeros the job's goals make over the weights it prunes: ``--sparsity`` (or N:M's ratio), or with a
    profile its ratios weighted by each layer's size (the rule took ``--sparsity``'s 0.7 for a profile of 0.9 everywhere:
    a 70 % run's λ and schedule for a 90 % one, an audit, 2026-12-07)."""
    if not cfg.sparsity_profile:
        return goal_ratio(cfg.goal)
    shapes = target_shapes(meta, cfg.targets)
    return overall_ratio(cfg.layer_goals(shapes), shapes)


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


def _kept_from_checkpoint(cfg: ElsaConfig, unset: dict[str, Any], resumed: dict[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """The rule fields the user left unset whose value now (the rule's, else the field's default) differs from the
    checkpoint's (a key it lacks: ``RESUME_DEFAULTS``, the value before the setting existed): {field: (the checkpoint's
    value typed as ElsaConfig's field, the value now)}. Not kept, so that the resume check refuses as before: the lr
    of a checkpoint that did not record its warm-up (the two make one schedule), a held end beside --select_every
    (they exclude each other), a value that does not validate (a damaged fingerprint)."""
    if resumed is None:
        return {}
    written = {**RESUME_DEFAULTS, **resumed}
    skip = {"lr"} if "warmup_steps" not in resumed else set()
    skip |= {"hold_steps"} if cfg.select_every else set()
    kept = {}
    for k in RULE_FIELDS:
        now = _plain(unset.get(k, getattr(cfg, k)))
        if k in cfg.model_fields_set or k in skip or k not in written or written[k] == now:
            continue
        try:  # by ElsaConfig's own checks: a type alone took lr -1.0, inf or true for a count (an eighth audit)
            setattr(probe := cfg.model_copy(), k, written[k])  # validate_assignment: the field's checks, then the model's
        except ValidationError:
            continue
        kept[k] = (getattr(probe, k), now)
    return kept
