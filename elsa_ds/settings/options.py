"""JobOptions: where a pruning job runs and writes (not ELSA settings: never in a recipe or the JSON's "elsa" block)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from elsa_ds.errors import ElsaError, SettingsError
from elsa_ds.quoting import format_validation_error
from elsa_ds.files.aside import published
from elsa_ds.files.marks import foreign_entries, written_by_elsa
from elsa_ds.files.output import REPORT_NAME
from elsa_ds.log import LogLevel, get_logger
from elsa_ds.settings.config_checks import exact_kinds
from elsa_ds.settings.config_files import usable_path

ExportFormat = Literal["dense", "sparse"]  # the --export_format choices


class JobOptions(BaseModel):
    """Where a pruning job runs and writes: not ELSA settings, so never in a recipe or the JSON's ``"elsa"`` block."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, arbitrary_types_allowed=True)

    deepspeed: str = Field(..., json_schema_extra={"group": "run", "metavar": "CFG"})
    """DeepSpeed JSON with ZeRO stage 3, by path or by the name of a shipped config (zero3, zero3_offload, zero3_nvme,
    zero3_offload_elsal)."""
    output_dir: Path = Field(..., json_schema_extra={"group": "run", "metavar": "DIR"})
    """Where the pruned model and elsa_report.json go; a non-empty directory is refused unless --overwrite or --resume."""
    overwrite: bool = Field(False, json_schema_extra={"group": "run"})
    """Replace a non-empty --output_dir that an elsa_ds job wrote (its old contents are removed only once the new output is
    complete); a folder of anything else is refused."""
    resume: bool = Field(False, json_schema_extra={"group": "run"})
    """Continue from the latest checkpoint in OUTPUT_DIR/checkpoints."""
    resume_if_any: bool = Field(False, json_schema_extra={"group": "run"})
    """--resume when OUTPUT_DIR/checkpoints has a checkpoint, else a fresh start (an earlier attempt's unpublished
    checkpoints removed, its monitor logs appended to; anything else there refused); a finished run with the same settings:
    nothing to do (exit 0), with others: refused. One command line for every attempt of a job that a scheduler requeues or
    a time limit cuts (SLURM's --requeue, a resubmitted sbatch)."""
    recipe: str | None = Field(None, json_schema_extra={"group": "run", "metavar": "NAME_OR_FILE"})
    """Settings from a recipe (recipes/*.json, by name or path): the paper's per-model, per-sparsity values."""
    ignore_memory_check: bool = Field(False, json_schema_extra={"group": "run"})
    """Start even when the pre-flight check estimates that the run does not fit this machine."""
    export_format: ExportFormat = Field("dense", json_schema_extra={"group": "run"})
    """dense: safetensors as save_pretrained writes them; sparse: the elsa-sparse checkpoint (each pruned weight as its
    nonzero values and their positions; load it with elsa_ds.sparse.from_pretrained: smaller on disk, faster decode)."""
    log_level: LogLevel = Field("info", json_schema_extra={"group": "run"})
    """Console detail: rank 0 logs at this level (debug, info, warning, error), other ranks warnings and errors only."""
    model_object: Any = Field(None, json_schema_extra={"cli": False})
    """A model already in memory (Python API only); ``model`` then names it in the report."""
    restart: bool = Field(False, json_schema_extra={"cli": False})
    """Set by --resume_if_any when OUTPUT_DIR holds an earlier attempt's leftovers and no checkpoint: its unpublished
    checkpoint folder goes (nothing can load it), its monitor logs are appended to."""
    finished: bool = Field(False, json_schema_extra={"cli": False})
    """Set by --resume_if_any when OUTPUT_DIR holds a finished run: the job ends there, with nothing to do when that run
    had its settings (``elsa_ds/plan/finished.py``), refused otherwise."""
    tokenizer_object: Any = Field(None, json_schema_extra={"cli": False})
    """The in-memory model's tokenizer (Python API only)."""

    _usable_paths = field_validator("deepspeed", "output_dir", "recipe", mode="before")(usable_path)  # the API's too
    _exact_kinds = field_validator("*", mode="before")(exact_kinds)  # ignore_memory_check="no" was read as False


def job_options(values: dict[str, Any], given_as: str = "the command line") -> JobOptions:
    """JobOptions from flags (or API arguments: ``given_as`` "the arguments"), or one ElsaError naming every bad value."""
    try:
        opts = JobOptions(**values)
    except ValidationError as err:
        raise SettingsError(format_validation_error(err, given_as, JobOptions)) from None
    return resolve_resume(opts) if opts.resume_if_any else opts


def resolve_resume(opts: JobOptions) -> JobOptions:
    """--resume_if_any as --resume or a fresh start: a checkpoint published in OUTPUT_DIR/checkpoints (its ``latest``,
    a link included: the resume's own checks refuse one) decides. A fresh start over what an earlier attempt left (a
    first save cut short, the monitor's logs: ``restart``) removes the unpublished checkpoints under the output's lock;
    anything else there is refused; a finished run is not redone (``finished``). Every rank reads the same folder before
    any writes it (the ranks' plans are compared once the process group forms)."""
    if opts.resume or opts.overwrite:
        raise ElsaError(f"--resume_if_any decides whether to resume by itself; drop --{'resume' if opts.resume else 'overwrite'}")
    out = Path(opts.output_dir).expanduser()
    if os.path.lexists(out / REPORT_NAME):  # nothing to do when it ran with this job's settings (plan/finished.py)
        return opts.model_copy(update={"finished": True})
    latest = published(out)
    if os.path.lexists(latest):  # said by the job once it owns the output (a refusal by another job's lock comes first)
        return opts.model_copy(update={"resume": True})
    left = out.is_dir() and not out.is_symlink() and any(out.iterdir())
    if others := foreign_entries(out):
        replace = ", or --overwrite in place of --resume_if_any to replace it" if written_by_elsa(out) else \
            ", or empty it yourself first (--overwrite replaces only an elsa_ds output)"
        raise ElsaError(f"--resume_if_any: {out} has no checkpoint to continue and holds {', '.join(others[:5])}, which no "
                        f"attempt of a pruning job leaves there; choose another --output_dir{replace}")
    tags = unpublished_tags(latest.parent)
    if len(tags) > 1:  # a run publishes `latest` once its first checkpoint is whole: these are not an attempt's leftovers
        raise ElsaError(f"--resume_if_any: {latest.parent} holds {len(tags)} checkpoints ({', '.join(tags[:3])}) but no "
                        f"'latest', which a run writes with its first; to continue one, write its name into {latest} (this "
                        "command then continues it); else remove them, or choose another --output_dir")
    gone = f" ({tags[0]}: never published)" if tags else ""
    get_logger(__name__).info(f"--resume_if_any: no checkpoint in {latest.parent}: starting fresh"
                              + (f"; an earlier attempt's unpublished checkpoints go{gone}, its monitor logs stay" if left else ""))
    return opts.model_copy(update={"restart": left})


def unpublished_tags(checkpoints: Path) -> list[str]:
    """The checkpoint tags (folders) in ``checkpoints``, sorted; none when it is not a folder."""
    if not checkpoints.is_dir() or checkpoints.is_symlink():
        return []
    return sorted(p.name for p in checkpoints.iterdir() if p.is_dir() and not p.is_symlink())
