"""Validation-driven selection (``--select_every``): which hard projection Π(x) of an ELSA run gets exported.

Every ``select_every`` projections the projected model Π(x) (the same hard projection the run ends with, on the
current x) is scored on the job's validation windows — the 16-bit shards are edited in place and restored, no
weight is gathered — and the best so far is kept as a snapshot of every rank's 16-bit shards beside the output
(2 bytes per parameter per rank, written only when the best improves). At the end the final Π(x) is scored too;
if an earlier one was better, its snapshot is written back into the shards and exported instead. With
``select_patience`` the run stops once that many scored projections in a row did not improve.

When x starts pruned (``--init_weights``), the start itself is scored first, as step 0: it is already a feasible
pruned model (SparseGPT's, or the directory's), so the export is never worse on validation than the warm start.

The score is only as honest as the validation windows: they must be text the run does not train on
(``--val_dataset``, or a source whose validation split is held out).
"""
from __future__ import annotations

import functools
import shutil
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from elsa_ds.admm.optimizer import AdmmOptimizer
from elsa_ds.data import PplWindows
from elsa_ds.errors import ElsaError
from elsa_ds.files.aside import START_OVER
from elsa_ds.files.output import side_path
from elsa_ds.zero import checkpoint
from elsa_ds.zero.dist import agreed
from elsa_ds.zero.engine import ZeroEngine
from elsa_ds.zero.partitions import distributed_nll, hard_projected, restore_shards, shard_snapshot


def snapshot_dir(output_dir: Path) -> Path:
    """Beside the output (like the checkpoints, on the filesystem every node shares), removed when the job ends."""
    return side_path(output_dir, "best_projection")


class Selector:
    """The curve of scored projections and the best snapshot; ``record`` is the JSON-able state a checkpoint keeps."""

    def __init__(self, every: int, patience: int, directory: Path, rank: int, record: dict[str, Any] | None = None):
        self.every: int = every  # score every this many projections
        self.patience: int = patience  # stop after this many scored projections without improvement (0: never)
        self.directory: Path = directory  # the best snapshot, one file per rank
        self.rank: int = rank
        self.record: dict[str, Any] = record or {"curve": [], "best": None, "since_best": 0, "stopped_at": None}

    @functools.cached_property
    def root(self) -> Path:
        """Where the snapshot folder really is, taken the first time it is needed (a resume's scan of the snapshot, or
        the first save, which made the folder) and kept: the snapshot is read back only from there."""
        return checkpoint.checked_root(self.directory, "--select_every")

    def due(self, projections: int) -> bool:
        return projections > 0 and projections % self.every == 0

    @property
    def stop(self) -> bool:
        return bool(self.patience) and self.record["since_best"] >= self.patience

    def score(self, zero: ZeroEngine, admm: AdmmOptimizer, windows: PplWindows, micro_batch: int, step: int,
              project: bool = True) -> float:
        """Validation perplexity of Π(x) at ``step`` (``project`` False: of the weights as they are -- a pruned start);
        a snapshot of it when it is the best so far. Collective."""
        with hard_projected(zero, admm) if project else nullcontext():
            value = windows.perplexity(*distributed_nll(zero, windows.ids, micro_batch))
            improved = self.record["best"] is None or value < self.record["best"]["ppl"]
            if improved:
                self._save(zero)
        self.record["curve"].append({"step": step, "ppl": value})
        if improved:
            self.record["best"], self.record["since_best"] = {"step": step, "ppl": value}, 0
        else:
            self.record["since_best"] += 1
        return value

    def _save(self, zero: ZeroEngine) -> None:
        """Each rank's shard of the snapshot, the previous one replaced only once every rank wrote its new one (a full
        disk on one rank would leave the ranks' files from two steps: restored together, a model that never was; its
        temp file goes). Collective."""
        tmp = None
        try:
            with agreed(f"the best projection's snapshot in {self.directory}"):
                self.directory.mkdir(parents=True, exist_ok=True)
                path = self.root / f"rank{self.rank}.pt"  # the folder's real place, taken at the first save: written there only
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.unlink(missing_ok=True)  # a link left at the name is removed, never written through
                with open(tmp, "xb") as file:
                    torch.save(shard_snapshot(zero), file)
        except BaseException:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise
        tmp.replace(path)

    def resumed(self, record: dict[str, Any] | None) -> None:
        """--resume: the checkpoint's record, whose best projection's snapshot must still be on disk (a failed end keeps
        it once a checkpoint is published; an older elsa_ds removed it): refused before any step when it is gone."""
        if record:  # the run state's own dict (a checkpoint saves it): an older elsa_ds's lacks stopped_at
            record.setdefault("stopped_at", None)
        self.record = record or self.record
        best, path = self.record["best"], self.directory / f"rank{self.rank}.pt"
        if best is not None and not path.is_file():
            raise ElsaError(f"--resume: the checkpoint's selection names the best projection of step {best['step']}, but its "
                            f"snapshot {path} is gone; {START_OVER}")
        if best is not None:  # read at the run's end: scanned now, before any step
            checkpoint.check_file(path, "the best projection's snapshot", self.root)

    def choose(self, zero: ZeroEngine, final_ppl: float | None, final_step: int) -> float | None:
        """Score the run's end against the best snapshot; write the snapshot back when it wins (``final_ppl`` None:
        the run stopped early, there is no final projection). Returns the exported model's perplexity. Collective."""
        best = self.record["best"]
        if final_ppl is not None:
            self.record["curve"].append({"step": final_step, "ppl": final_ppl, "final": True})
        if best is None or (final_ppl is not None and final_ppl <= best["ppl"]):
            self.record["chosen"] = {"step": final_step, "ppl": final_ppl, "final": True}
            return final_ppl
        restore_shards(zero, checkpoint.read_checkpoint_file(self.directory / f"rank{self.rank}.pt", root=self.root))
        self.record["chosen"] = {**best, "final": False}
        return best["ppl"]

    def clean(self) -> None:
        """Remove the snapshots (rank 0, once every rank has exported)."""
        shutil.rmtree(self.directory, ignore_errors=True)
