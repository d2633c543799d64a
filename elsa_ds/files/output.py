"""The output directory of a pruning job: checks before work, staging, atomic publication, verification.

Every job (ELSA or one-shot) builds its output in a hidden staging directory beside ``--output_dir``
and renames it into place only when complete, so an existing output is never half-overwritten. The
report's per-layer sparsity is read back from the exported files, never from memory.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from elsa_ds.admm.projection import NM
from elsa_ds.errors import ElsaError
from elsa_ds.evaluation.sparsity import sparsity_report
from elsa_ds.log import get_logger
from elsa_ds.targets import LayerGoal

REPORT_NAME = "elsa_report.json"


def check_output_dir(output_dir: Path, overwrite: bool, resume: bool = False) -> None:
    """Refuse a non-empty output directory unless overwriting or resuming; cheap, so it runs before heavy work."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ElsaError(f"--output_dir {output_dir} exists and is not a directory")
    if resume and overwrite:
        raise ElsaError("--resume and --overwrite exclude each other: --resume continues the run in --output_dir")
    if resume and not (output_dir / "checkpoints" / "latest").exists():
        raise ElsaError(f"--resume: {output_dir / 'checkpoints'} holds no published checkpoint (no 'latest' file)")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (overwrite or resume):
        raise ElsaError(f"--output_dir {output_dir} is not empty; pass --overwrite to replace it, --resume to continue it, "
                        "or choose another directory")
    parent = output_dir.resolve().parent
    try:  # the staging directory, checkpoints and warm-start masks all go beside the output
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ElsaError(f"--output_dir {output_dir}: cannot create its parent directory {parent} ({e.strerror}); "
                        "choose another path") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ElsaError(f"--output_dir {output_dir}: parent directory {parent} is not writable; choose another path")
    check_publishable(output_dir)


def check_publishable(output_dir: Path) -> None:
    """The final rename will work: an existing output is no mount point (the staging directory beside it sits on its
    parent's filesystem, and a rename cannot cross filesystems or replace a mount) and can be written into and removed."""
    if not output_dir.is_dir():
        return
    if os.stat(output_dir).st_dev != os.stat(output_dir.resolve().parent).st_dev:
        raise ElsaError(f"--output_dir {output_dir} is a mount point (another filesystem than its parent): the finished output "
                        f"is built beside it and renamed into place, which cannot cross filesystems; use a folder inside it")
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise ElsaError(f"--output_dir {output_dir} is not writable, so it cannot be continued or replaced; choose another path")


def staging_dir(output_dir: Path) -> Path:
    """Where rank 0 of this job builds the output before it is renamed into place: named for its process, so two jobs
    (or a dead job's leftover) never share one. Its siblings (warm-start masks, snapshots) take their names from it."""
    return output_dir.resolve().parent / f".{output_dir.name}.partial.{os.getpid()}"


def fresh_staging(output_dir: Path) -> Path:
    """An empty staging directory for this job. Leftovers of earlier jobs are named, not removed: one may hold a
    finished output whose final rename failed."""
    staging = staging_dir(output_dir)
    if staging.exists():
        shutil.rmtree(staging)
    leftovers = sorted(str(p) for p in staging.parent.glob(f".{output_dir.name}.partial*") if p != staging)
    if leftovers:
        get_logger(__name__).warning(f"staging folders of earlier jobs on {output_dir} remain: {', '.join(leftovers)} "
                                     "(delete them once you know nothing in them is wanted)")
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, output_dir: Path, keep_checkpoints: bool, carry: tuple[str, ...] = ("monitor",)) -> None:
    """Swap the finished staging directory in for ``output_dir`` (old contents removed only afterwards).

    With ``keep_checkpoints`` the run's checkpoints stay: each finished file is renamed into place instead. The
    folders named in ``carry`` that the run wrote into ``output_dir`` while it ran (the monitor's logs) move along.
    Should a rename fail, the ElsaError says where the finished output is.
    """
    old = output_dir.resolve().parent / f".{output_dir.name}.old.{os.getpid()}"
    try:
        for name in carry:
            if (output_dir / name).is_dir() and not (staging / name).exists() and not keep_checkpoints:
                (output_dir / name).rename(staging / name)
        if keep_checkpoints and output_dir.is_dir():
            for f in staging.iterdir():
                f.replace(output_dir / f.name)
            staging.rmdir()
            return
        if output_dir.exists():
            output_dir.rename(old)
        try:
            staging.rename(output_dir)
        except OSError:
            if old.exists() and not output_dir.exists():
                old.rename(output_dir)  # the previous output back where it was
            raise
    except OSError as err:
        where = (f"the files not moved yet are in {staging}: move them into {output_dir} yourself" if keep_checkpoints else
                 f"it is complete in {staging}: move it there yourself (mv {staging} {output_dir})")
        raise ElsaError(f"the finished output could not be moved to {output_dir} ({err.strerror or err}); {where}") from None
    try:
        if old.exists():
            shutil.rmtree(old)
    except OSError as err:
        get_logger(__name__).warning(f"wrote {output_dir}, but the previous output moved aside to {old} could not be removed "
                                     f"({err.strerror or err}); delete it yourself")


def verified_layers(model_dir: Path, expected_zeros: dict[str, int], goals: dict[str, LayerGoal],
                    regex: str | None) -> dict[str, dict]:
    """Per pruned layer: numel, zeros, sparsity and pattern as exported; ElsaError if any layer misses its target.

    Unstructured targets need exactly the expected zero count; N:M targets need the pattern to hold in every
    group as well.
    """
    found = sparsity_report(model_dir, regex)["layers"]
    layers = {}
    for name, zeros in sorted(expected_zeros.items()):
        got = found.get(name)
        target = goals[name]
        if got is None or got["zeros"] != zeros:
            raise ElsaError(f"exported layer {name} has {None if got is None else got['zeros']} zeros, expected {zeros}: "
                            "export is incomplete")
        if isinstance(target, NM) and str(target) not in got["nm"]:
            raise ElsaError(f"exported layer {name} does not satisfy {target} (found {got['pattern']})")
        layers[name] = {"numel": got["numel"], "zeros": got["zeros"], "sparsity": got["sparsity"], "pattern": got["pattern"],
                        "target": str(target) if isinstance(target, NM) else target}
    return layers


def layers_summary(layers: dict[str, dict]) -> float:
    """Overall sparsity of the pruned layers."""
    return sum(v["zeros"] for v in layers.values()) / max(sum(v["numel"] for v in layers.values()), 1)
