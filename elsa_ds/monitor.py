"""Progress to DeepSpeed's configured monitor (the JSON's ``tensorboard``, ``wandb``, ``csv_monitor``, ``comet`` blocks).

Per step: loss, λ, learning rate and step time; per projection: the residual ‖x − z‖/‖x‖, the fraction of
mask flips and λ. Events are named ``elsa/<metric>`` and indexed by the optimizer step (1-based), so a
multi-day run can be followed in TensorBoard or W&B like any DeepSpeed job. Only rank 0 writes (DeepSpeed's
MonitorMaster also checks).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from elsa_ds.files.output import MONITOR_DIR

MONITOR_BLOCKS = ("tensorboard", "wandb", "csv_monitor", "comet")


def default_output_paths(ds: dict, output_dir: Path) -> bool:
    """Point enabled file-based monitors without an ``output_path`` at ``OUTPUT_DIR/monitor`` (DeepSpeed's default
    is the working directory); True when any does. The output's publication carries that folder over."""
    used = False
    for key in ("tensorboard", "csv_monitor"):
        block = ds.get(key)
        if isinstance(block, dict) and block.get("enabled") and not block.get("output_path"):
            block["output_path"] = str(output_dir / MONITOR_DIR)
            used = True
    return used


class Monitor:
    """Writes ``elsa/*`` events through an engine's ``monitor`` (a no-op when no monitor is enabled)."""

    def __init__(self, engine, rank: int):
        master = getattr(engine, "monitor", None)
        self._master = master if rank == 0 and getattr(master, "enabled", False) else None

    @property
    def enabled(self) -> bool:
        return self._master is not None

    def write(self, step: int, values: dict[str, Any]) -> None:
        if self._master is not None:
            self._master.write_events([(f"elsa/{k}", float(v), step) for k, v in values.items() if v is not None])
