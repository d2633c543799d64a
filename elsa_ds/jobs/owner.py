"""A pruning job as its output's one owner: inputs kept apart from --output_dir, then (on the rank that writes) the
output's lock held from before the first costly step until the job ends, however it ends (``elsa_ds/files/ownership.py``).

However it ends short of publishing (an error, a NaN loss, a full disk, Ctrl-C, SIGTERM), nothing of it stays beside the
output: its staging folder and side files go, then its lock; its checkpoints (resumable) and the previous output stay
(with --overwrite the previous checkpoints and logs the run set aside go back, unless the run published a checkpoint).
A full disk ends it with one line saying where, how much the write needed and how much is free once they are gone.
A rank killed outright (SIGKILL: the kernel's out-of-memory killer) runs no exit path: rank 0's watchdog
(``elsa_ds/files/watchdog.py``), started once the output is owned, removes the same files and says one line instead."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from elsa_ds import launch_env, std_streams
from elsa_ds.errors import ElsaError, first_line, signals_held, stream_of
from elsa_ds.files.aside import published, put_back, set_aside
from elsa_ds.files.disk_room import disk_full, disk_full_errno
from elsa_ds.files.output import (REPORT_NAME, RESUMABLE, PublishFailed, check_output_dir, check_output_path, missing_folders,
                                  remove_if_empty, side_path, staging_dir)
from elsa_ds.files.handed import check_plain_tree, own_copies
from elsa_ds.files.ownership import check_apart, check_output_names, lock_path, owned
from elsa_ds.files.watchdog import Watchdog
from elsa_ds.jobs import make_job, run_job
from elsa_ds.jobs.phases import PhaseLog
from elsa_ds.jobs.report import evaluate_saved_model
from elsa_ds.log import get_logger
from elsa_ds.methods import oneshot_names
from elsa_ds.monitor import MONITOR_DIR, entries_inside, folders_inside
from elsa_ds.plan import log_plan, make_plan
from elsa_ds.plan.checks import builds_engine
from elsa_ds.plan.finished import finished_run
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.options import JobOptions
from elsa_ds.sparse.export import sparse_paths
from elsa_ds.zero import checkpoint_save
from elsa_ds.zero.ds_config import DsConfig
from elsa_ds.zero.swap_files import swap_files_owned

# the side files beside the output (files/output.side_path, as jobs/warm_start.py, finetune.py and selection.py name them;
# "mask.safetensors" is the retraining's one-shot mask, oneshot_paths' ".oneshot" suffix replaced)
SIDE_FILES = ("init_mask.safetensors", "init_weights", "oneshot", "mask.safetensors", "best_projection")


def job_inputs(cfg: ElsaConfig, opts: JobOptions) -> dict[str, str | Path | None]:
    """Every local path the job reads, by its flag (hub names and sources that are not paths are skipped later)."""
    inputs: dict[str, str | Path | None] = {
        "--model": cfg.model, "--init_mask": None if cfg.init_mask in oneshot_names() else cfg.init_mask,
        "--dataset": cfg.dataset, "--val_dataset": cfg.val_dataset, "--sparsity_profile": cfg.sparsity_profile,
        "--eval_include_path": cfg.eval_include_path, "--deepspeed": opts.deepspeed, "--recipe": opts.recipe,
    }
    for i, source in enumerate(cfg.eval_ppl):
        inputs[f"--eval_ppl{'' if i == 0 else f' (entry {i + 1})'}"] = source
    return inputs


def _log_dirs(out: Path, ds_config: DsConfig) -> tuple[list[Path], list[Path]]:
    """(what ``--overwrite`` sets aside, what a resumed run appends to) of the file monitors' logs in the output:
    ``monitor`` (their default there) and the entries (the folders) any ``output_path`` of the DeepSpeed JSON's own
    puts inside it (with ``--overwrite`` those kept the previous run's logs, after which the new run's CSV rows went;
    a review: a resume copies the monitor's folder alone, never a whole ``checkpoints`` a log folder sits in)."""
    entries = [out / name for name in dict.fromkeys([MONITOR_DIR, *entries_inside(ds_config.raw, out)])]
    return entries, [out / MONITOR_DIR, *(out / folder for folder in folders_inside(ds_config.raw, out))]


def run_owned(cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig) -> dict[str, Any] | None:
    """Run the job ``cfg`` (the settings as given) names, owning ``opts.output_dir``: its plan made under the lock (the
    defaults rule, every check that needs no weights), logged once, then the job built from it. Rank 0 (the rank that
    writes) takes the lock and starts the watchdog, the other ranks of a launcher rely on them. The watchdog hears of the
    job's end once the lock is released."""
    if why := launch_env.problem(group=builds_engine(cfg)):  # which rank writes: before the output's lock is taken or not
        raise ElsaError(why)
    if opts.finished:  # --resume_if_any over a finished run: nothing to do, or refused (another job's settings)
        return finished_output(cfg, opts)
    check_output_names(opts.output_dir, "--output_dir", utf8=True)
    check_apart(opts.output_dir, "--output_dir", job_inputs(cfg, opts))
    check_side_paths(Path(opts.output_dir))
    created = missing_folders(opts.output_dir)
    check_output_dir(opts.output_dir, opts.overwrite, opts.resume, opts.restart)  # again under the lock, by the plan's checks
    writer = launch_env.writes()
    dog = Watchdog()
    try:
        with owned(opts.output_dir, "--output_dir", take=writer), std_streams.marked():
            try:
                out = Path(opts.output_dir)
                logs, appended = _log_dirs(out, ds_config)
                if writer and opts.overwrite:  # the previous output's checkpoints, logs and resumable side files, until published
                    set_aside(out, [out / "checkpoints", *logs, *resumable_paths(out)])
                if writer and opts.resume and opts.resume_if_any:
                    get_logger(__name__).info(f"--resume_if_any: continuing from the checkpoints in {published(out).parent}")
                if writer and (opts.resume or opts.restart):  # the monitor's files the run appends to: none shared elsewhere
                    for folder in appended:  # no link below it, which the CSV monitor would append through
                        check_plain_tree(folder, "the monitor's logs")
                        own_copies(folder)
                if writer and opts.restart and not published(out).exists():  # --resume_if_any over an attempt that published
                    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # no checkpoint: nothing can load its tags
                plan = make_plan(cfg, opts, ds_config)
                log_plan(plan)
                job = make_job(plan)
                if writer:  # the loop's step count: the plan's (a fine-tuning job's own count)
                    dog.start(lock_path(out), unpublished_paths(out), plan.cfg.steps, resumable_paths(out), out)
                    if isinstance(phases := getattr(job, "phases", None), PhaseLog):
                        phases.forward = dog.mark  # the training step a killed job had reached
                with swap_files_owned(plan.ds):  # NVMe offload: this rank's swap folders, locked, removed at the end
                    return run_job(job, dog.mark)
            except BaseException as err:  # every way out short of publishing; the lock goes right after
                if writer:  # a finished output whose final rename failed stays where the error says
                    with signals_held():
                        discard_unpublished(out, keep=kept_output(err), busy=checkpoint_save.take_tags_being_written())
                if (stream := stream_of(err)) is not None:  # a Python caller's own console, not the output
                    what = "output" if stream == "stdout" else "error"
                    mend = "free room there or send it elsewhere" if disk_full_errno(err) else "keep its reader open"
                    raise ElsaError(f"the job stopped: a write to its standard {what} failed ({first_line(err)}) where that "
                                    f"goes, not under --output_dir {out}; {mend} (a command-line job goes on without "
                                    "it)") from None
                if (full := disk_full(err, out)) is not None:  # one line (ElsaError), measured with the partial files gone
                    swaps = [Path(cfg.nvme_path)] if cfg.nvme_path else [Path(p) for p in ds_config.nvme_paths]
                    if any(Path(os.path.realpath(full.path)).is_relative_to(os.path.realpath(p)) for p in swaps):  # not --output_dir
                        full = full.measured_again("choose another --nvme_path")
                    raise full from None
                raise
    finally:
        dog.end()
        if writer:  # the folders made for an output that is not there: a refused or failed job leaves no empty folder
            remove_if_empty(created)


def finished_output(cfg: ElsaConfig, opts: JobOptions) -> dict[str, Any]:
    """--resume_if_any over a finished run with this job's settings (``finished_run``, under the output's lock: a job
    replacing it is named): nothing to do, unless an attempt was stopped inside the evaluation that follows the
    publication (``--eval_ppl``/``--eval_tasks`` and no ``evaluation`` in the report), which rank 0 runs now."""
    log = get_logger(__name__)
    writer = launch_env.writes()
    out = Path(opts.output_dir).expanduser()
    check_output_path(out)  # before its lock is named from the path
    with owned(out, "--output_dir", take=writer):
        report, planned = finished_run(cfg, opts)
        if (planned.eval_ppl or planned.eval_tasks) and "evaluation" not in report:
            log.info(f"--resume_if_any: {out} holds a finished run with these settings, its evaluation unfinished: "
                     "evaluating it now")
            if writer:
                evaluate_saved_model(out, planned)
            return report
    log.info(f"--resume_if_any: {out} holds a finished run with these settings ({REPORT_NAME}): nothing to do")
    return report


def check_side_paths(output_dir: Path) -> None:
    """ElsaError for a symbolic link where the job keeps a side file or folder beside its output (its staging folder, the
    warm start's mask and weights, a retraining run's one-shot model, the best projection's snapshot): the job would
    write through it, and a fresh run (neither --resume nor --overwrite) looks nowhere else before it does."""
    for path in [*unpublished_paths(output_dir), *resumable_paths(output_dir)]:
        if path.is_symlink():
            raise ElsaError(f"--output_dir {output_dir}: {path} beside it is a symbolic link (to {os.readlink(path)}) where "
                            "the job keeps its side files, and it would write through it: remove the link or choose "
                            "another --output_dir")


def kept_output(err: BaseException | None) -> Path | None:
    """The finished output a failed final rename left (``PublishFailed.kept``), also when a Ctrl-C or SIGTERM held during
    the publication took effect on the way out and replaced the error (it is then the exception's context)."""
    while err is not None:
        if isinstance(err, PublishFailed):
            return err.kept
        if err.__suppress_context__:  # raised "from None" in its place: its context is not this job's to keep
            return None
        err = err.__context__
    return None


def unpublished_paths(output_dir: Path) -> list[Path]:
    """What a job that did not publish leaves beside its output until it ends: its staging folder and the side files a
    job keeps there until it consumes them (warm-start mask and weights, the one-shot model of a retraining run, the best
    projection) and their ``.tmp`` files, and the elsa-sparse export being built beside the staging folder. Its
    checkpoints (resumable), the previous output and what --overwrite set aside of it are not among them."""
    sides = _side_paths(output_dir, SIDE_FILES)
    return [staging_dir(output_dir), *sparse_paths(staging_dir(output_dir)), *sides, *(p.with_name(f".{p.name}.tmp") for p in sides)]


def resumable_paths(output_dir: Path) -> list[Path]:
    """The side files a --resume reads again (the one-shot model under a retraining run, the best projection's
    snapshot that a checkpoint's selection record names): kept when the run published a checkpoint."""
    return _side_paths(output_dir, RESUMABLE)


def _side_paths(output_dir: Path, names: tuple[str, ...]) -> list[Path]:
    """``.NAME.<name>`` beside the output, for each of ``names`` (where the jobs write their side files)."""
    return [side_path(output_dir, n) for n in names]


def discard_unpublished(output_dir: Path, keep: Path | None = None, busy: tuple[str, ...] = ()) -> None:
    """After a job that did not publish: remove its :func:`unpublished_paths` but ``keep`` (a finished output the final
    rename could not move, which the error names) and, once the run published a checkpoint, what a --resume reads
    again (:func:`resumable_paths`); then what an --overwrite job set aside of the previous output goes back
    (``files/aside.put_back``; it was set aside before any work, so a published checkpoint is this run's), unless
    another rank may still be writing a checkpoint tag (``busy``) that the previous checkpoints hold too."""
    kept = {keep, *(resumable_paths(output_dir) if published(output_dir).exists() else [])}
    for path in unpublished_paths(output_dir):
        if path in kept:
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
    if (left := put_back(output_dir, busy=busy)) is not None:
        get_logger(__name__).warning(left)
