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


def staging_dir(output_dir: Path) -> Path:
    """Where rank 0 builds the output before it is renamed into place."""
    return output_dir.resolve().parent / f".{output_dir.name}.partial"


def fresh_staging(output_dir: Path) -> Path:
    """An empty staging directory (a leftover of a crashed run is removed)."""
    staging = staging_dir(output_dir)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def publish(staging: Path, output_dir: Path, keep_checkpoints: bool, carry: tuple[str, ...] = ("monitor",)) -> None:
    """Swap the finished staging directory in for ``output_dir`` (old contents removed only afterwards).

    With ``keep_checkpoints`` the run's checkpoints stay: each finished file is renamed into place instead. The
    folders named in ``carry`` that the run wrote into ``output_dir`` while it ran (the monitor's logs) move along.
    """
    for name in carry:
        if (output_dir / name).is_dir() and not (staging / name).exists() and not keep_checkpoints:
            (output_dir / name).rename(staging / name)
    if keep_checkpoints and output_dir.is_dir():
        for f in staging.iterdir():
            f.replace(output_dir / f.name)
        staging.rmdir()
        return
    old = output_dir.resolve().parent / f".{output_dir.name}.old"
    if old.exists():
        shutil.rmtree(old)
    if output_dir.exists():
        output_dir.rename(old)
    staging.rename(output_dir)
    if old.exists():
        shutil.rmtree(old)


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
