"""The plan: every setting of a pruning job, finished before the job is built (torchtune's ``config.parse``).

    flags or API keywords, a recipe, the JSON's "elsa" block   ─> elsa_settings ─> ElsaConfig as given  ─┐
    the DeepSpeed JSON as read                                                                            ├─> make_plan ─> Plan
    the defaults rule, a resumed checkpoint's values kept (defaults_applied.py)                          │    (frozen)
    every check that needs no weights, the JSON resolved for the engine (checks.py)                    ──┘

A job takes the :class:`Plan` and reads it; nothing after it changes a setting. Its setup builds only what needs the
process group, the data and the weights. The plan is logged once (rank 0) and kept in the report.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from elsa_ds import json_data, launch_env
from elsa_ds.errors import ElsaError
from elsa_ds.log import get_logger
from elsa_ds.models import ModelSource, config_json, shipped_config
from elsa_ds.plan.checks import before_work, builds_engine, model_source
from elsa_ds.plan.defaults_applied import apply_defaults
from elsa_ds.settings.config import ElsaConfig, load_recipe, resolve_config
from elsa_ds.settings.config_checks import refuse_unread_elsa_settings, unread_settings
from elsa_ds.settings.options import JobOptions
from elsa_ds.zero import checkpoint
from elsa_ds.zero.ds_config import DsConfig

log = get_logger(__name__)


@dataclass(frozen=True)
class Plan:
    """Everything a job is told before it is built, checked and resolved; assigning to it raises."""

    cfg: ElsaConfig         # the ELSA settings as the job runs them: the defaults rule applied (retraining: its own steps)
    opts: JobOptions        # where the job runs and writes
    ds: DsConfig            # the engine's DeepSpeed config: the JSON checked against cfg, autos resolved, batch split derived
    defaults: dict[str, Any]  # what the defaults rule filled in and why (empty for a one-shot job: the rule is ELSA's)
    world_size: int         # the ranks the checks were made for: the launcher's (1 for a one-shot job, one process)
    source: ModelSource     # the model (and tokenizer) the job loads

    @property
    def trains(self) -> bool:
        """A ZeRO-3 engine trains (ELSA, --finetune); a one-shot job alone runs none."""
        return builds_engine(self.cfg)


ARCHITECTURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size")


def same_architecture(model_id: str, hub_id: str) -> bool:
    """Whether a local folder holds the model of ``hub_id``'s shipped config (its download on a cluster's disk, where a
    recipe written for the hub id applies as it is): the same architecture and sizes."""
    try:
        mine, shipped = config_json(model_id), shipped_config(hub_id)
    except ElsaError:
        return False
    if mine is None or shipped is None:
        return False

    def sizes(config: dict) -> dict:
        text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
        return {k: text.get(k) for k in ARCHITECTURE_KEYS}
    return sizes(mine) == sizes(json_data.read(shipped))


def launched_world_size() -> int:
    """The number of ranks the launcher started (before the process group exists)."""
    return launch_env.world_size()


def elsa_settings(ds_config: DsConfig, deepspeed: str, recipe: str | None, given: dict[str, Any], spelt: str = "--") -> ElsaConfig:
    """ElsaConfig from ``given`` (flags or API keywords; None: not given) over the JSON's ``elsa`` block over a recipe,
    validated; ELSA's own settings refused for another method (``spelt``: "--" for flags, "" for keywords)."""
    settings = load_recipe(recipe) if recipe else None
    cfg = resolve_config(ds_config.raw, given, source=deepspeed, recipe=settings, recipe_source=f"recipe {recipe}",
                         given_as="the command line" if spelt else "the arguments")
    refuse_unread_elsa_settings(cfg, given, spelt)
    if launch_env.writes() and (unread := unread_settings(cfg, given, spelt)):
        log.warning(unread)
    from_recipe = settings or {}
    if from_recipe and launch_env.writes():  # where each value came from (the resolved config has no say)
        block = ds_config.raw.get("elsa", {})
        taken = [k for k in from_recipe if given.get(k) is None and k not in block]
        over = [f"{k} ({'yours' if given.get(k) is not None else 'the JSON elsa block'})" for k in from_recipe if k not in taken]
        log.info(f"from recipe {recipe}: " + ", ".join(f"{k} {from_recipe[k]}" for k in taken)
                 + (f"; set elsewhere over it: {', '.join(over)}" if over else ""))
    written_for = from_recipe.get("model")
    if written_for and cfg.model != written_for and not same_architecture(cfg.model, written_for) and \
            launch_env.writes():  # a walk: taken without a word; a local copy of that model is the model
        tuned = ", ".join(k for k in ("lr", "lmda", "steps", "batch_size") if k in from_recipe and given.get(k) is None)
        log.warning(f"recipe {recipe} was written for {written_for}; {spelt}model {cfg.model} takes its settings as they are"
                    + (f" ({tuned}: that model's; pass your own, or leave the recipe out for the defaults rule)" if tuned else ""))
    return cfg


def read_settings(opts: JobOptions, given: dict[str, Any], spelt: str = "--") -> tuple[ElsaConfig, DsConfig]:
    """The ELSA settings as their sources give them (:func:`elsa_settings`) and the DeepSpeed JSON ``opts`` names, as read."""
    ds_config = DsConfig.load(opts.deepspeed)
    return elsa_settings(ds_config, opts.deepspeed, opts.recipe, given, spelt), ds_config


def make_plan(cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig) -> Plan:
    """The finished plan of the job ``cfg.method`` names: the defaults rule applied to what the user left unset (keeping
    a resumed checkpoint's values), then every check that needs no weights, which resolves the DeepSpeed JSON for the
    engine. Runs on every rank, before any collective."""
    source = model_source(cfg, opts)
    if not builds_engine(cfg) and opts.resume:
        raise ElsaError(f"--resume continues an ELSA run; {cfg.method.value} has no checkpoints (it is one pass)")
    cfg, defaults, world = planned_settings(cfg, opts, source)
    return Plan(cfg, opts, before_work(cfg, opts, ds_config, world, source), defaults, world, source)


def planned_settings(cfg: ElsaConfig, opts: JobOptions, source: ModelSource) -> tuple[ElsaConfig, dict[str, Any], int]:
    """The settings the job runs (``cfg`` as given, the defaults rule applied, a resumed checkpoint's values kept; a
    retraining run's own steps), what the rule filled in, and the ranks they are for: no check made, nothing loaded."""
    if not builds_engine(cfg):
        return cfg, {}, 1
    if cfg.finetune is not None:  # the loop runs cfg.steps: the retraining's own count
        cfg = cfg.model_copy(update={"steps": cfg.finetune_steps or cfg.steps})
    cfg, defaults = apply_defaults(cfg, source.config(), checkpoint.resumed_fingerprint(opts.output_dir, opts.resume))
    return cfg, defaults, launched_world_size()


def log_plan(plan: Plan) -> None:
    """The plan on the console, once (rank 0): the ELSA settings, what the defaults rule filled in and why, and the
    engine's DeepSpeed config (a one-shot job runs no engine)."""
    log.info("resolved ELSA config:\n" + json.dumps(plan.cfg.model_dump(mode="json"), indent=2))
    if plan.defaults.get("applied"):
        kept = " or the checkpoint resumed" if plan.defaults["kept_from_checkpoint"] else ""
        log.info(f"from the defaults rule (elsa_ds/settings/defaults.py){kept}: "
                 + "; ".join(f"{k} {v} ({plan.defaults['why'][k]})" for k, v in plan.defaults["applied"].items()))
    if plan.trains:
        log.info("DeepSpeed config:\n" + json.dumps(plan.ds.raw, indent=2))
