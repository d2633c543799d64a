"""Components the two ZeRO-3 training jobs (ELSA, ``--finetune``) share: the process group start, the data, the
loop, checkpoints and validation. Plain functions and small classes that know nothing of the job calling them: a
job passes in what they need and keeps what they return (torchtune's recipes over components)."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from elsa_ds import machine
from elsa_ds.config import ElsaConfig
from elsa_ds.options import JobOptions
from elsa_ds.data import GlobalBatches, PplWindows, is_gemma, training_blocks, validation_windows
from elsa_ds.errors import ElsaError
from elsa_ds.jobs.interface import Printer
from elsa_ds.models import ModelSource, check_token_ids
from elsa_ds.monitor import MONITOR_DIR, default_output_paths
from elsa_ds.zero import checkpoint
from elsa_ds.zero.dist import init_distributed
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.engine import ZeroEngine
from elsa_ds.zero.partitions import distributed_nll

# called after each step with (progress bar, step, loss); True stops the loop early
AfterStep = Callable[[Any, int, float], bool]


@dataclass
class RunState:
    """Everything of the loop a checkpoint must bring back (the data position is ``next_step`` itself)."""

    next_step: int = 0
    lam: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    dense_ppl: float | None = None
    baseline_ppl: float | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    selection: dict[str, Any] | None = None  # the validation-driven selection's curve and best (--select_every)


@dataclass
class TrainingData:
    """The run's text: the global batches (identical on every rank: each computes them from the seed), the validation
    windows, the tokenizer that made both, and how the training sequences were drawn (the report's training_data)."""

    tokenizer: Any
    batches: GlobalBatches
    validation: PplWindows
    sampling: dict[str, Any]


def launched_world_size() -> int:
    """The number of ranks the launcher started (before the process group exists)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_process_group(cfg: ElsaConfig, opts: JobOptions, ds: DsConfig, defaults: dict[str, Any]) -> tuple[int, int, Printer]:
    """Point DeepSpeed's file monitors into the output, start the process group, print the resolved settings.
    Returns (rank, world size, rank-0 printer). Collective."""
    monitor_dir = opts.output_dir / MONITOR_DIR if default_output_paths(ds.raw, opts.output_dir) else None
    rank, world = init_distributed()
    say = Printer(rank)
    for warning in machine.stale_build_locks():
        say(warning)
    if monitor_dir is not None and rank == 0 and not opts.resume and monitor_dir.exists():
        shutil.rmtree(monitor_dir)  # an overwritten run's logs; DeepSpeed's csv monitor would append to them
    say("[elsa_ds] resolved ELSA config:\n" + json.dumps(cfg.model_dump(mode="json"), indent=2))
    if defaults["applied"]:
        kept = " or the checkpoint resumed" if defaults["kept_from_checkpoint"] else ""
        say(f"[elsa_ds] from the defaults rule (elsa_ds/defaults.py){kept}: "
            + "; ".join(f"{k} {v} ({defaults['why'][k]})" for k, v in defaults["applied"].items()))
    say("[elsa_ds] DeepSpeed config:\n" + json.dumps(ds.raw, indent=2))
    return rank, world, say


def load_data(cfg: ElsaConfig, source: ModelSource, ds: DsConfig, rank: int, world: int, say: Printer) -> TrainingData:
    """Training sequences for ``cfg.steps`` global batches and the validation windows."""
    tokenizer = source.load_tokenizer()
    global_batch, micro = ds.train_batch_size, ds.micro_batch_size
    blocks, sampling = training_blocks(cfg.dataset, tokenizer, cfg.seqlen, cfg.steps * global_batch, cfg.sampling, cfg.seed,
                                       is_gemma(source.config()), holdout_part=cfg.val_dataset is None)
    check_token_ids(blocks, source.config(), cfg.model, f"training data {cfg.dataset}")
    batches = GlobalBatches(blocks, global_batch, micro, world, rank, cfg.seed)
    validation = validation_windows(cfg.dataset, cfg.val_dataset, tokenizer, cfg.seqlen, cfg.ppl_protocol, source.config(),
                                    cfg.val_windows)
    say(f"[elsa_ds] training data {cfg.dataset} ({sampling['sampling']}): {blocks.shape[0]} sequences x {cfg.seqlen} "
        f"tokens; global batch {global_batch} = {micro} micro x {world} ranks x {batches.grad_accum} accumulation")
    say(f"[elsa_ds] validation {validation.source}: {validation.count} windows ({validation.protocol.value} "
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
    for step in bar:
        t0 = time.perf_counter()
        loss = train_step(step)
        state.step_times.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            raise ElsaError(f"the loss became {loss} at step {step}; the run stopped there (the last checkpoint, if any, "
                            f"is intact; resume with a lower --lr or --lmda)")
        state.losses.append(loss)
        state.next_step = step + 1
        if after_step(bar, step, loss):
            break
        if cfg.save_interval and (step + 1) % cfg.save_interval == 0 and step + 1 < cfg.steps:
            save_checkpoint()


class Checkpoints:
    """The run's DeepSpeed checkpoints in ``OUTPUT_DIR/checkpoints``, the loop's :class:`RunState` and the RNG as
    client state; a tag is published as ``latest`` once every rank wrote it."""

    def __init__(self, opts: JobOptions, keep: int):
        self.directory: Path = opts.output_dir / "checkpoints"
        self.keep: int = keep  # how many tags stay on disk
        self.resume: bool = opts.resume  # continue from the latest tag
        self.overwrite: bool = opts.overwrite  # an older run's tags go first

    def load(self, engine, comm, fingerprint: dict[str, Any], rank: int, say: Printer) -> RunState:
        """The state the loop starts from: fresh, or (--resume) the latest loadable checkpoint's, loaded into
        ``engine`` with the RNG. Refuses a checkpoint written with other settings (``fingerprint``). Collective."""
        if self.overwrite and rank == 0 and self.directory.exists():
            shutil.rmtree(self.directory)  # a fresh run never mixes its checkpoints with an older run's
        if not self.resume:
            return RunState(fingerprint=fingerprint)
        client = checkpoint.load_latest(engine, self.directory, say, comm)
        if client is None:
            raise ElsaError(f"--resume: no loadable checkpoint in {self.directory}; run without --resume to start over")
        refusal = checkpoint.resume_changes(client["fingerprint"], fingerprint)  # (also checked before the model loads: checks.py)
        if refusal:
            raise ElsaError(refusal)
        checkpoint.set_rng_state(client.pop("rng"))
        return RunState(**client)

    def save(self, engine, state: RunState, rank: int, say: Printer) -> None:
        """Save after step ``state.next_step`` - 1. Collective."""
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            checkpoint.write_fingerprint(self.directory, state.fingerprint)
        torch.distributed.barrier()
        client = {**asdict(state), "rng": checkpoint.rng_state()}
        tag = checkpoint.save(engine, self.directory, state.next_step - 1, client, self.keep, rank)
        say(f"[elsa_ds] checkpoint {self.directory / tag}")
