"""A pruning job as its output's one owner: inputs kept apart from --output_dir, then (on the rank that writes) the
output's lock held from before the first costly step until the job ends, however it ends (``elsa_ds/ownership.py``).

However it ends short of publishing (an error, a NaN loss, a full disk, Ctrl-C, SIGTERM), nothing of it stays beside the
output: its staging folder and side files go, then its lock; its checkpoints (resumable) and the previous output stay.
A full disk ends it with one line saying where, how much the write needed and how much is free once they are gone."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from elsa_ds.config import ElsaConfig
from elsa_ds.disk_room import disk_full
from elsa_ds.jobs import make_job, run_job
from elsa_ds.methods import oneshot_names
from elsa_ds.options import JobOptions
from elsa_ds.output import check_output_dir, staging_dir
from elsa_ds.ownership import check_apart, owned
from elsa_ds.zero.ds_config import DsConfig

# the side files beside the output (jobs/warm_start.py, jobs/finetune.py, jobs/selection.py name them from the staging's;
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


def run_owned(cfg: ElsaConfig, opts: JobOptions, ds_config: DsConfig) -> dict[str, Any] | None:
    """Run the job ``cfg`` names, owning ``opts.output_dir``; rank 0 (the rank that writes) takes the lock, the other
    ranks of a launcher rely on it."""
    check_apart(opts.output_dir, "--output_dir", job_inputs(cfg, opts))
    check_output_dir(opts.output_dir, opts.overwrite, opts.resume)  # again under the lock, by the job's own checks
    writer = os.environ.get("RANK", "0") == "0"
    with owned(opts.output_dir, "--output_dir", take=writer):
        try:
            return run_job(make_job(cfg, opts, ds_config))
        except BaseException as err:  # every way out short of publishing; the lock goes right after
            if writer:
                discard_unpublished(Path(opts.output_dir))
            if (full := disk_full(err, Path(opts.output_dir))) is not None:
                raise full from None  # one line (ElsaError), its free space measured with the partial files gone
            raise


def discard_unpublished(output_dir: Path) -> None:
    """After a job that did not publish: its staging folder and the side files a job keeps beside its output until it
    consumes them (warm-start mask and weights, the one-shot model of a retraining run, the best projection) and their
    ``.tmp`` files; the checkpoints (resumable) and the previous output stay."""
    staging = staging_dir(output_dir)
    sides = [staging.with_name(f".{output_dir.name}.{s}") for s in SIDE_FILES]
    for path in (staging, *sides, *(p.with_name(f".{p.name}.tmp") for p in sides)):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)
