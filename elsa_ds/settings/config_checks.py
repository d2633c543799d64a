"""ElsaConfig's checks across settings and files: a training schedule whose parts the run reaches, an --init_mask
folder whose weight files are whole.

``cross_checks`` is ElsaConfig's validator, on the values as given (an error names them before anything is read). The
pre-flight check runs ``schedule_refusals`` and ``schedule_oddities`` again on the values the defaults rule resolved
(``preflight.check_schedule``): a rule-given held end or warm-up meets the user's interval or steps only there.

What the run cannot do as asked is refused; what it can do, only oddly, is said as a warning:
- a warm-up of ``steps`` or more: the lr reaches its peak on the last step (or never) and never decays: refused;
- no projection before the end (``interval`` ≥ the ADMM steps): z and u are never updated, ELSA becomes penalized
  training towards the first z and the final cut: a warning (a short smoke run does this on purpose);
- ``select_every`` beyond the projections the run makes: nothing is scored but the end: a warning;
- ``save_interval`` ≥ ``steps``: no checkpoint is ever written: a warning;
- λ 0 under a fixed schedule: the penalty is off, ELSA is dense training and the final cut: a warning.

``refuse_unread_elsa_settings``: ELSA's own settings passed explicitly with another method, which would not read them;
``unread_settings``: any other setting passed explicitly that the job does not read, said as a warning.
"""
from __future__ import annotations

import typing
from collections.abc import Iterable
from typing import Any

from elsa_ds.errors import ElsaError
from elsa_ds.files.weight_files import check_weight_files
from elsa_ds.methods import Method, oneshot_names
from elsa_ds.settings.defaults import USER_START, rule_warm_start
from elsa_ds.targets import goal_ratio


# Every whole number of the settings is a count that the estimates and the schedule also compute with in floats: past
# 2**53 a float no longer holds it exactly, and past ~1.8e308 float() overflows (an audit: a 400-digit --steps, --nsamples
# or --val_windows ended the step-time or memory estimate in an OverflowError traceback). The seed feeds torch.manual_seed
# (at most 2**64 - 1), a torch.Generator's seed + epoch (the data order) and random.Random (any int); numpy's seeders,
# should one be fed it, take at most 2**32 - 1: the seed keeps to [0, 2**32 - 1], which every one of them takes (an
# audit: --seed 2**64 was a ValueError from torch.manual_seed after the SparseGPT warm start).
INT_LIMIT, SEED_LIMIT = 2**53, 2**32 - 1


def exact_kinds(cls: Any, value: Any, info: Any) -> Any:
    """A settings model's check, before each field's own, that a boolean is given where a field takes one and only
    there, and a number where it takes one (a pair's items too): pydantic reads "yes", 1 or 0.0 as a boolean, a boolean
    as the number 1 or 0 and "5" as 5 (``"steps": true`` in a recipe ran one step, ``seed=False`` seeded 0,
    ``sparsity=True`` said "less than 1", ``overwrite="no"`` was refused while ``ignore_memory_check="no"`` was read as
    False). numpy's boolean is one; the command line's flags are typed by argparse before they come here."""
    takes = cls.model_fields[info.field_name].annotation
    leaves = {takes, *typing.get_args(takes)}
    if bool in leaves:
        if value is None or _a_bool(value):
            return value if value is None else bool(value)
        raise ValueError("must be true or false")
    items = value if isinstance(value, (list, tuple)) else (value,)
    if {int, float} & leaves and (odd := next((i for i in items if _a_bool(i) or isinstance(i, str)), None)) is not None:
        raise ValueError(f"{'a boolean' if _a_bool(odd) else 'text'}, where a number is taken")
    return value


def _a_bool(value: Any) -> bool:
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


def bounded_int(cls: Any, value: Any, info: Any) -> Any:
    """A settings model's check of each of its whole-number fields, one rule for all (a field added later included):
    ValueError naming the bound for one past INT_LIMIT, or for the seed one outside [0, SEED_LIMIT]."""
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if info.field_name == "seed" and not 0 <= value <= SEED_LIMIT:
        raise ValueError(f"a seed must be a whole number in [0, {SEED_LIMIT}] (2**32 - 1: what torch, random and numpy all "
                         "take as a seed)")
    if abs(value) > INT_LIMIT:
        raise ValueError(f"must be at most {INT_LIMIT:,} (2**53, the most a float holds exactly: more than any run counts)")
    return value


def trained_steps(cfg: Any) -> int | None:
    """Optimizer steps the job trains: ELSA's steps, or --finetune's; None for a one-shot job, which trains nothing."""
    if cfg.finetune is not None:
        return cfg.finetune_steps or cfg.steps
    return cfg.steps if cfg.method is Method.elsa else None


def _steps_name(cfg: Any) -> str:
    return "finetune_steps" if cfg.finetune is not None and cfg.finetune_steps else "steps"


def _balance_refusals(cfg: Any) -> list[str]:
    """The adaptive λ's settings moved off their defaults without that schedule (nothing would read them), or that
    schedule with λ 0 (it would stay 0)."""
    adaptive = cfg.lmda_schedule.value == "adaptive"
    fields = type(cfg).model_fields
    stray = sorted(k for k in ("balance_mu", "balance_tau") if getattr(cfg, k) != fields[k].default and not adaptive)
    found = [f"{' and '.join(stray)} tune the adaptive λ schedule; add --lmda_schedule adaptive, or drop them"] if stray else []
    if adaptive and cfg.lmda == 0.0:
        found.append("the adaptive λ schedule moves each layer's λ by a factor from lmda: lmda must be above 0")
    return found


MAX_LMDA, MIN_EPS = 1e3, 1e-30  # sanity bounds (a thirteenth audit): far past the paper's λ 0.01 and Adam's eps 1e-8


def _range_refusals(cfg: Any) -> list[str]:
    """Values the fields take whose arithmetic breaks the method without a word (a thirteenth audit), each refused only
    where the job reads it: an ELSA λ whose penalty gradient λ(x − z + u) can overflow Adam's second moment, the Fisher F
    the mask ranks by (1e22 on the demo kept "the first k entries" of every layer), and a trained run's eps that fp32
    holds as 0 (0/0 where a gradient is 0)."""
    found = []
    if cfg.method is Method.elsa and cfg.lmda > MAX_LMDA:
        found.append(f"lmda {cfg.lmda:g} is past {MAX_LMDA:g}, this project's bound: the paper's λ is 0.01, and a λ near 1e19 "
                     "over |x − z + u| overflows Adam's second moment in fp32, whose ranking the mask keeps; give lmda "
                     f"{MAX_LMDA:g} or less")
    if trained_steps(cfg) is not None and cfg.eps < MIN_EPS:
        found.append(f"eps {cfg.eps:g} is below {MIN_EPS:g}, this project's bound: fp32 holds a value below 1.4e-45 as 0, and "
                     f"Adam divides by √v + eps (0/0 where a gradient is 0); give eps {MIN_EPS:g} or more (Adam's 1e-08)")
    return found


def schedule_refusals(cfg: Any) -> list[str]:
    """What the run cannot do as asked, one sentence each (empty: nothing)."""
    steps = trained_steps(cfg)
    found = _balance_refusals(cfg) + _range_refusals(cfg)
    if steps is None:
        return found
    if cfg.warmup_steps > 1 and cfg.warmup_steps >= steps:  # one step of warm-up in a one-step run is no warm-up
        when = "reach lr only at the last step and never decay" if cfg.warmup_steps == steps else "never reach lr"
        found.append(f"warmup_steps ({cfg.warmup_steps}) must be below the {steps} {_steps_name(cfg)} it warms up: the learning "
                     f"rate would {when}; lower warmup_steps or raise {_steps_name(cfg)}")
    return found


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def schedule_oddities(cfg: Any) -> list[str]:
    """Parts of the schedule the run never reaches, though it runs: one sentence each (empty: none)."""
    steps = trained_steps(cfg)
    if steps is None:
        return []
    found = []
    if cfg.save_interval and cfg.save_interval >= steps:
        found.append(f"save_interval {cfg.save_interval} is not below the {steps} {_steps_name(cfg)}: no checkpoint is written "
                     "before the run ends (none is written at the end); lower it to be able to resume a stopped run")
    if cfg.method is not Method.elsa:
        return found
    if cfg.lmda == 0.0 and cfg.lmda_schedule.value != "adaptive":  # a thirteenth audit: accepted without a word
        found.append("lmda 0: the penalty λ/2‖x − z + u‖² is off the whole run, so ELSA becomes dense training and the final "
                     "cut x = Π(x) (u only adds up x − z); give lmda above 0 (the paper's 0.01) unless that is the ablation")
    admm = steps - cfg.hold_steps
    projections = (admm - 1) // cfg.interval  # z ← Π(x + u), u ← u + x − z before the final x = Π(x)
    held = f", before the last {cfg.hold_steps} held by hold_steps," if cfg.hold_steps else ""
    if projections == 0:
        fix = f"set interval below {admm}" if admm > 1 else "give it more steps"
        found.append(f"interval {cfg.interval}: the run's {_plural(admm, 'ADMM step')}{held} end before the first projection, "
                     "so z and u are never updated: ELSA becomes penalized training towards the first z and the final cut "
                     f"x = Π(x); {fix}")
    if cfg.select_every and projections < cfg.select_every:
        start = " and the pruned start" if cfg.init_weights and cfg.init_mask in oneshot_names() else ""  # a folder's: not one
        fix = f"set select_every to {projections} or less, or " if projections else ""
        found.append(f"select_every {cfg.select_every}: the run makes {_plural(projections, 'projection')} before its end, so "
                     f"none is scored: only the final Π(x){start} compete; {fix}shorten interval, or drop select_every")
    return found


def cross_checks(cfg: Any) -> Any:
    """ElsaConfig's validator: a schedule it can run (ValueError, reported with the settings' sources), an --init_mask
    folder whose safetensors files are whole (ElsaError naming the file)."""
    refusals = schedule_refusals(cfg)
    if refusals:
        raise ValueError("; ".join(refusals))
    if cfg.init_mask is not None and cfg.init_mask not in oneshot_names():
        check_weight_files(cfg.init_mask, f"--init_mask {cfg.init_mask}")
    return cfg


# ELSA's own settings: passed explicitly (command line, API keywords) to a one-shot method or the dense control, nothing
# would read them. The JSON's "elsa" block may carry them for any method: the shipped ELSA-L config does.
ELSA_ONLY = ("interval", "lmda", "lmda_schedule", "balance_mu", "balance_tau", "relaxation", "projection", "z_dtype",
             "u_dtype")


def _given(given: dict[str, Any], keys: Iterable[str], prefix: str) -> list[str]:
    """``keys`` that ``given`` holds (not None: given explicitly), as the user spelt them (``prefix``: "--" or "")."""
    return [f"{prefix}{k}" for k in keys if given.get(k) is not None]


def refuse_unread_elsa_settings(cfg: Any, given: dict[str, Any], prefix: str) -> None:
    """ElsaError when ``given`` (what the user passed explicitly) holds ELSA-only settings and the method is not ELSA;
    ``prefix``: how the user spelt them ("--" for flags, "" for keywords)."""
    stray = _given(given, ELSA_ONLY, prefix)
    if not stray or cfg.method is Method.elsa:
        return
    one = len(stray) == 1
    raise ElsaError(f"{', '.join(stray)} shape{'s' if one else ''} ELSA's ADMM run; with method {cfg.method.value} nothing "
                    f"reads {'it' if one else 'them'}: drop {'it' if one else 'them'} (or use method elsa)")


# what only a training job reads (ELSA, or --finetune): a one-shot job's pass trains nothing
# (--batch_size and --micro_batch are not here: a one-shot job resolves the DeepSpeed JSON's batch with them too)
TRAINING = ("steps", "sampling", "base_optimizer", "lr", "lr_final_ratio", "warmup_steps", "betas", "eps", "weight_decay",
            "gradient_checkpointing", "freeze_embeddings", "leaf_layers", "save_interval", "keep_checkpoints", "log_interval")
CALIBRATION = ("nsamples", "blocksize", "percdamp")
CALIBRATION_READ = {"sparsegpt": CALIBRATION, "wanda": ("nsamples",), "magnitude": (), "dense": ()}  # by each method
CALIBRATION_WHY = {"wanda": "Wanda's pass has no blocks or dampening (SparseGPT's)", "magnitude": "magnitude pruning reads no "
                   "calibration data", "dense": "the dense control prunes nothing"}


def unread_settings(cfg: Any, given: dict[str, Any], prefix: str) -> str | None:
    """A warning naming the settings ``given`` explicitly that this job does not read, and why; None when it reads them
    all. Said, not refused: scripts pass one set of flags to every method (an audit, 2026-12-07: a one-shot job took
    --lr, --steps, --lora_rank and --blocksize without a word, and recorded them in its report as if used). ELSA's own
    settings with another method are refused (``refuse_unread_elsa_settings``)."""
    def named(*keys: str) -> list[str]:
        return _given(given, keys, prefix)

    method, finetune = cfg.method.value, cfg.finetune.value if cfg.finetune is not None else None
    unread: list[tuple[list[str], str]] = []
    if method != Method.elsa.value and finetune is None:
        unread.append((named(*TRAINING), f"method {method} without {prefix}finetune trains nothing"))
    elif finetune is not None and given.get("finetune_steps") is not None:
        unread.append((named("steps"), f"{prefix}finetune_steps counts the retraining's steps"))
    if finetune != "lora":
        unread.append((named("lora_rank", "lora_alpha"), f"they shape {prefix}finetune lora's adapters"))
    if method in CALIBRATION_WHY:
        unread.append((named(*(k for k in CALIBRATION if k not in CALIBRATION_READ[method])), CALIBRATION_WHY[method]))
    elif method == Method.elsa.value and (cfg.init_mask is not None or not _rule_may_start_pruned(cfg)):  # its start
        read = CALIBRATION_READ.get(cfg.init_mask or "", ())  # magnitude's, a folder's or none: no calibration
        mask = cfg.init_mask or given.get("init_mask")  # "none" is read as None
        start = f"{prefix}init_mask {mask}" if mask else _dense_start(cfg)
        unread.append((named(*(k for k in CALIBRATION if k not in read)), f"{start} calibrates no one-shot warm start"
                       if not read else "Wanda's warm start has no blocks or dampening"))
    if method != Method.elsa.value:
        unread.append((named("baseline"), "it is the model ELSA's perplexity is compared with"))
    if not cfg.eval_tasks:
        unread.append((named("eval_include_path"), f"it holds task definitions for {prefix}eval_tasks"))
    if not cfg.save_interval and (method == Method.elsa.value or finetune is not None):
        unread.append((named("keep_checkpoints"), f"no checkpoint is written without {prefix}save_interval"))
    said = [f"{', '.join(keys)} ({why})" for keys, why in unread if keys]
    return f"not read by this job, so without effect: {'; '.join(said)}" if said else None


def _rule_may_start_pruned(cfg: Any) -> bool:
    """Whether an ELSA job with no --init_mask may start from the defaults rule's SparseGPT-pruned model, whose pass reads
    the calibration settings: the rule decides the start (no lr or start set: ``plan/defaults_applied.py``) and its
    warm start covers this sparsity and budget. A profile's ratio needs the model's shapes: it may (an audit's
    leftover, 2026-12-07: --nsamples on a dense-start ELSA job was taken without a word)."""
    if cfg.model_fields_set & USER_START:
        return False
    return bool(cfg.sparsity_profile) or rule_warm_start(goal_ratio(cfg.goal), cfg.steps)  # ELSA: no --finetune_steps


def _dense_start(cfg: Any) -> str:
    """Whose choice ELSA's dense start is, where no --init_mask is set: a given lr's or start's (flags, recipe or JSON),
    else the defaults rule's (its warm start ends at 90 % and 2048 steps)."""
    if cfg.model_fields_set & USER_START:
        return "ELSA's dense start (an lr or start set by you, a recipe or the JSON keeps the paper's)"
    return "ELSA's dense start (the defaults rule's beyond its SparseGPT start's sparsity or budget)"


def not_a_percentage(v: Any) -> Any:
    """``v`` (a sparsity, before the field's own checks), or ValueError for a percentage given for the fraction (a walk:
    --sparsity 70 said only "Input should be less than 1")."""
    try:
        value = float(v)
    except (TypeError, ValueError):
        return v  # the field's own check names it
    if 1.0 < value < 100.0:
        raise ValueError(f"a fraction of zeros in [0, 1), not a percentage: {value / 100:g} for {value:g} %")
    return v
