"""Components the two ZeRO-3 training jobs (ELSA, ``--finetune``) share: their opening (the process group, the data),
the loop, checkpoints and validation. Plain functions and small classes that know nothing of the job calling them: a
job passes in what they need and keeps what they return (torchtune's recipes over components)."""
from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elsa_ds.data import GlobalBatches, PplWindows, is_gemma, training_blocks, validation_windows
from elsa_ds.data.sources import source_name
from elsa_ds.errors import ElsaError
from elsa_ds.files.aside import START_OVER
from elsa_ds.files.marks import run_writes
from elsa_ds.step_profile import StepProfiler
from elsa_ds.log import get_logger
from elsa_ds.models import ModelSource, check_token_ids, freeze_embeddings
from elsa_ds.monitor import MONITOR_DIR, default_output_paths, entries_inside
from elsa_ds.plan import Plan
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.targets import LayerGoal, select_targets
from elsa_ds.zero import checkpoint, checkpoint_save, resume_load
from elsa_ds.zero.dist import init_distributed, same_on_every_rank
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import PartitionedModel, ZeroEngine, full_shapes, load_partitioned
from elsa_ds.zero.partitions import distributed_nll

log = get_logger(__name__)
REREAD_WARNING = 10.0  # readings of each training sequence past which the run says it trains mostly on repetition

# called after each step with (progress bar, step, loss); True stops the loop early
AfterStep = Callable[[Any, int, float], bool]


@dataclass
class RunState:
    """Everything of the loop a checkpoint must bring back (the data position is ``next_step`` itself)."""

    next_step: int = 0
    lam: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # each step's seconds, but those a step profile slowed
    dense_ppl: float | None = None
    baseline_ppl: float | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    selection: dict[str, Any] | None = None  # the validation-driven selection's curve and best (--select_every)
    computed_in: dict[str, str] = field(default_factory=dict)  # dense_ppl's and baseline_ppl's dtype and where, when measured


def run_state_problem(client: Any) -> str | None:
    """What is wrong with a checkpoint's client state (a :class:`RunState` and the RNG, as ``Checkpoints.save`` writes
    it), or None: every field there with its type (``CLIENT_FIELDS``), the RNG as ``checkpoint.rng_state()`` makes it."""
    if not isinstance(client, dict):
        return f"its loop state is a {type(client).__name__}, not a dict"
    if not {"next_step", "fingerprint", "rng"} <= set(client) <= set(CLIENT_FIELDS):  # an older run's may lack the others
        return f"its loop state's keys are {sorted(map(str, client))}, expected {sorted(CLIENT_FIELDS)}"
    bad = [key for key, ok in CLIENT_FIELDS.items() if key in client and not ok(client[key])]
    return f"its loop state's {', '.join(bad)} of the wrong type" if bad else None


def _shallow(value: Any, depth: int) -> bool:
    """Whether ``value``'s dicts and lists nest at most ``depth`` deep, every dict's keys strings (a walk: a fingerprint
    nested 100,000 deep passed the type check and failed in the refusal's text, a traceback)."""
    if isinstance(value, dict):
        return depth > 0 and all(isinstance(k, str) and _shallow(v, depth - 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return depth > 0 and all(_shallow(v, depth - 1) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


PER_RANK = ("step_times", "rng")  # the loop state's parts each rank holds its own of: its steps' seconds, its RNG


def shared_state(client: dict) -> str:
    """The loop state every rank of a run holds alike (:func:`run_state_problem` has passed it), as text."""
    return json.dumps({k: v for k, v in client.items() if k not in PER_RANK}, sort_keys=True)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(x) for x in value)


def _rng_state_ok(rng: Any) -> bool:
    """``checkpoint.rng_state()``'s shape: torch's state a uint8 tensor, Python's (version, 625 ints, gauss_next)."""
    if not isinstance(rng, dict) or set(rng) != {"torch", "python"}:
        return False
    torch_state, python_state = rng["torch"], rng["python"]
    return (isinstance(torch_state, torch.Tensor) and torch_state.dtype == torch.uint8
            and torch_state.shape == torch.get_rng_state().shape
            and isinstance(python_state, tuple) and len(python_state) == 3 and python_state[0] == 3
            and isinstance(python_state[1], tuple) and len(python_state[1]) == 625
            and all(isinstance(x, int) and 0 <= x < 2**32 for x in python_state[1]) and python_state[1][-1] <= 624
            and (python_state[2] is None or isinstance(python_state[2], float)))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


PROJECTION_NUMBERS = ("loss", "lambda", "residual", "mask_flip_frac", "admm_state_bytes_per_param")


def _projection_ok(entry: Any) -> bool:
    """A ``history`` entry as ``ElsaJob._after_step`` writes it (the loop and the report read each of these; an audit:
    ``[{}]`` resumed and failed at the next projection, a KeyError)."""
    spread = entry.get("lambda_range") if isinstance(entry, dict) else None
    return (isinstance(entry, dict) and _shallow(entry, 2) and _count(entry.get("step")) and isinstance(entry.get("final"), bool)
            and all(_number(entry.get(k)) for k in PROJECTION_NUMBERS)
            and (spread is None or (_list_of(_number)(spread) and len(spread) == 2)))


def _scored(ppl: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A point of the selection's curve: ``{"step", "ppl"[, "final"]}``."""
    return lambda p: (isinstance(p, dict) and {"step", "ppl"} <= set(p) <= {"step", "ppl", "final"} and _count(p["step"])
                      and ppl(p["ppl"]) and isinstance(p.get("final", False), bool))


def _selection_ok(record: Any) -> bool:
    """``Selection.record``: its curve, best, patience count, early stop and choice, each as the selection reads it (an
    audit: a curve of ``{}`` resumed and failed at the next score, after a step had run)."""
    keys = {"curve", "best", "since_best"}
    return (isinstance(record, dict) and keys <= set(record) <= keys | {"stopped_at", "chosen"}
            and _list_of(_scored(_number))(record["curve"]) and _optional(_scored(_number))(record["best"])
            and _count(record["since_best"]) and _optional(_count)(record.get("stopped_at"))
            and _optional(_scored(_optional(_number)))(record.get("chosen")))


CLIENT_FIELDS: dict[str, Callable[[Any], bool]] = {
    "next_step": _count, "lam": _number, "history": _list_of(_projection_ok), "losses": _list_of(_number),
    "step_times": _list_of(_number), "dense_ppl": _optional(_number), "baseline_ppl": _optional(_number),
    "fingerprint": lambda v: isinstance(v, dict) and _shallow(v, 2), "selection": _optional(_selection_ok),
    "computed_in": lambda v: isinstance(v, dict) and len(v) <= 8 and all(isinstance(k, str) and isinstance(x, str)
                                                                        and len(x) <= 200 for k, x in v.items()),
    "rng": _rng_state_ok}


@dataclass
class TrainingData:
    """The run's text: the global batches (identical on every rank: each computes them from the seed), the validation
    windows, the tokenizer that made both, and how the training sequences were drawn (the report's training_data)."""

    tokenizer: Any
    batches: GlobalBatches
    validation: PplWindows
    sampling: dict[str, Any]


@dataclass(frozen=True)
class Opened:
    """What both training jobs open with: this rank of the started process group, and the run's text."""

    rank: int
    world: int
    data: TrainingData


def load_for_training(cfg: ElsaConfig, ds: DsConfig, source: ModelSource, start: ModelSource | None,
                      ) -> tuple[PartitionedModel, dict[int, str], dict[str, LayerGoal]]:
    """The model a training job steps, in ZeRO-3 partitions: ``start`` (a pruned warm start, a one-shot result) or the
    source (random with --random_init when nothing starts it); its embeddings frozen with --freeze_embeddings (both
    jobs: the same weights trained, the same states held); the layers --targets prunes (id(weight) -> name) and each
    one's goal."""
    partitioned = load_partitioned(start or source, ds, cfg.gradient_checkpointing, cfg.random_init and start is None,
                                   cfg.leaf_layers)
    if cfg.freeze_embeddings:
        freeze_embeddings(partitioned.model)
    pruned = select_targets(partitioned.model, cfg.targets)
    return partitioned, pruned, cfg.layer_goals(full_shapes(partitioned.model, pruned))


def open_training(plan: Plan) -> Opened:
    """The two training jobs' opening: point DeepSpeed's file monitors into the output, start the process group, load
    the training sequences for ``cfg.steps`` global batches and the validation windows. Collective."""
    opts = plan.opts
    default_output_paths(plan.ds.raw, opts.output_dir)
    run_writes(opts.output_dir, entries_inside(plan.ds.raw, opts.output_dir))  # the logs the run writes in its output
    rank, world = init_distributed()
    if world != plan.world_size:
        raise ElsaError(f"the process group has {world} ranks, but the plan was checked for {plan.world_size} (WORLD_SIZE)")
    if not same_on_every_rank(json.dumps([opts.resume, plan.cfg.resume_fingerprint(world)], sort_keys=True, default=str)):
        raise ElsaError("the ranks planned different jobs (whether to resume, or the settings a checkpoint records): nodes "
                        "that read --output_dir, a recipe or the DeepSpeed JSON differently (a network file system's "
                        "caches with --resume_if_any); give --resume or leave it out, and the same files to every node")
    return Opened(rank, world, load_data(plan, rank, world))


def load_data(plan: Plan, rank: int, world: int) -> TrainingData:
    """Training sequences for ``cfg.steps`` global batches and the validation windows."""
    cfg, source, ds = plan.cfg, plan.source, plan.ds
    tokenizer = source.load_tokenizer()
    global_batch, micro = ds.train_batch_size, ds.micro_batch_size
    blocks, sampling = training_blocks(cfg.dataset, tokenizer, cfg.seqlen, cfg.steps * global_batch, cfg.sampling, cfg.seed,
                                       is_gemma(source.config()), holdout_part=cfg.val_dataset is None)
    check_token_ids(blocks, source.config(), cfg.model, f"training data {source_name(cfg.dataset)}")
    batches = GlobalBatches(blocks, global_batch, micro, world, rank, cfg.seed)
    validation = validation_windows(cfg.dataset, cfg.val_dataset, tokenizer, cfg.seqlen, cfg.ppl_protocol, source.config(),
                                    cfg.val_windows)
    readings = batches.readings(cfg.steps)
    log.info(f"training data {source_name(cfg.dataset)} ({sampling['sampling']}): {blocks.shape[0]} sequences x {cfg.seqlen} "
             f"tokens; global batch {global_batch} = {micro} micro x {world} ranks x {batches.grad_accum} accumulation"
             + (f"; {cfg.steps} steps read each {readings:.1f} times" if readings > 1 else ""))
    if readings > REREAD_WARNING:  # a small folder of text and a long run: mostly repetition
        log.warning(f"the training text fills {1 / readings:.1%} of the {cfg.steps * global_batch:,} sequences that "
                    f"{cfg.steps} steps of {global_batch} take: each is read {readings:.0f} times; give more text "
                    "(--dataset) or fewer --steps, unless repetition is what you want")
    log.info(f"validation {validation.source}: {validation.count} windows ({validation.protocol.value} "
             f"protocol) from {validation.documents} documents ({validation.rule})")
    return TrainingData(tokenizer, batches, validation, sampling)


def windows_ppl(zero: ZeroEngine, validation: PplWindows, micro_batch: int) -> float | None:
    """Perplexity of the engine's current weights on the validation windows (None without windows). Collective."""
    if validation.count == 0:
        return None
    return validation.perplexity(*distributed_nll(zero, validation.ids, micro_batch))


def train_loop(cfg: ElsaConfig, state: RunState, rank: int, train_step: Callable[[int], float], after_step: AfterStep,
               save_checkpoint: Callable[[], None]) -> None:
    """Steps ``state.next_step`` .. ``cfg.steps`` - 1: time each, stop on a non-finite loss, record the loss, let the
    job log (``after_step``, which may stop the run early), checkpoint every ``cfg.save_interval`` steps."""
    from tqdm import tqdm

    bar = tqdm(range(state.next_step, cfg.steps), desc=cfg.method.value, unit="step", disable=rank != 0,
               dynamic_ncols=True, initial=state.next_step, total=cfg.steps)
    profiler = StepProfiler.from_env(rank)  # ELSA_DS_PROFILE_STEPS: where a step's time goes (elsa_ds/step_profile.py)
    profiled: list[int] = []
    try:
        for step in bar:
            profiler.before(step)
            t0 = time.perf_counter()
            loss = train_step(step)
            state.step_times.append(time.perf_counter() - t0)
            if profiler.after(step, state.step_times[-1]):
                profiled.append(len(state.step_times) - 1)
            if not math.isfinite(loss):
                raise ElsaError(f"the loss became {loss} at step {step}; the run stopped there (its last checkpoint, if "
                                "any, is intact, but --resume replays these steps and refuses another --lr): start over "
                                "with a lower --lr or --lmda (--overwrite)")  # an audit: the old advice was refused
            state.losses.append(loss)
            state.next_step = step + 1
            if after_step(bar, step, loss):
                break
            if cfg.save_interval and (step + 1) % cfg.save_interval == 0 and step + 1 < cfg.steps:
                save_checkpoint()
    except BaseException:
        profiler.abandon()
        raise
    profiler.close()
    if len(state.step_times) - len(profiled) >= 2:  # slowed by the profiler: out of the report's mean (its first is out too)
        for i in reversed(profiled):
            del state.step_times[i]


class Checkpoints:
    """The run's DeepSpeed checkpoints in ``OUTPUT_DIR/checkpoints``, the loop's :class:`RunState` and the RNG as
    client state; a tag is published as ``latest`` once every rank wrote it."""

    def __init__(self, opts: JobOptions, keep: int):
        self.directory: Path = opts.output_dir / "checkpoints"
        self.keep: int = keep  # how many tags stay on disk
        self.resume: bool = opts.resume  # continue from the latest tag

    def load(self, engine, comm, fingerprint: dict[str, Any]) -> RunState:
        """The state the loop starts from: fresh, or (--resume) the latest loadable checkpoint's, loaded into
        ``engine`` with the RNG. Refuses a checkpoint written with other settings (``fingerprint``). Collective."""
        if not self.resume:
            return RunState(fingerprint=fingerprint)
        client = resume_load.load_latest(engine, self.directory, comm, run_state_problem, shared_state)  # checked there
        if client is None:
            raise ElsaError(f"--resume: no loadable checkpoint in {self.directory}; {START_OVER}")
        refusal = checkpoint.resume_changes(client["fingerprint"], fingerprint)  # (also checked before the model loads: plan/checks.py)
        if refusal:
            raise ElsaError(refusal)
        checkpoint.set_rng_state(client.pop("rng"))
        return RunState(**client)

    def save(self, engine, state: RunState, rank: int) -> None:
        """Save after step ``state.next_step`` - 1. Collective."""
        client = {**asdict(state), "rng": checkpoint.rng_state()}
        tag = checkpoint_save.save(engine, self.directory, state.next_step - 1, client, self.keep, rank, state.fingerprint)
        log.info(f"checkpoint {self.directory / tag}")
