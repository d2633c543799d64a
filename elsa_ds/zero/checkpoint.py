"""Checkpoints of an ELSA run: DeepSpeed's layout (tags ``global_step{N}``, a ``latest`` file) plus our state.

What DeepSpeed saves with CPU offload or without offload: the fp32 masters and the base optimizer's
state dict — which holds z and u, since they live in ``optimizer.state`` — per rank. What we add as
``client_state``: the step, λ in force, the run's loss and projection history, and the RNG states; the
data position is the step itself (global batches are a pure function of seed and step).

A checkpoint becomes ``latest`` only after every rank finished writing it (barrier, then an atomic
rename of the ``latest`` file), and only the newest ``keep`` tags are kept. Loading tries the tags from
the newest down, so a checkpoint corrupted by a crash mid-write falls back to the one before.

NVMe optimizer offload is refused for checkpointing: DeepSpeed's NVMe path restores the masters but
not the optimizer state (notes/deepspeed-zero3.md §5), so a resumed run would silently restart Adam
and ADMM.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from elsa_ds.config import RESUME_DEFAULTS
from elsa_ds.errors import ElsaError
from elsa_ds.zero.ds_config import DsConfig

TAG = re.compile(r"^global_step(\d+)$")
CLIENT_KEY = "elsa"
FINGERPRINT = "elsa_fingerprint.json"  # the run's settings beside its tags: readable before any model or engine exists


def write_fingerprint(ckpt_dir: Path, fingerprint: dict) -> None:
    """The settings a resumed run must share (``ElsaConfig.resume_fingerprint``), as JSON in ``ckpt_dir`` (rank 0)."""
    from elsa_ds.io import write_json

    write_json(ckpt_dir / FINGERPRINT, fingerprint)


def resume_changes(written: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What differs between a checkpoint's fingerprint and this run's (``ElsaConfig.resume_fingerprint``), as the
    refusal's text; None when nothing does."""
    changed = {k: (v, now.get(k)) for k, v in {**RESUME_DEFAULTS, **written}.items() if now.get(k) != v}
    if not changed:
        return None
    return ("--resume with changed settings is not supported (checkpoint vs now): "
            + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in changed.items()))


def read_fingerprint(ckpt_dir: Path) -> dict | None:
    """The fingerprint ``write_fingerprint`` left, or None (a checkpoint written before it existed, or unreadable: the
    check against the checkpoint's own client state still runs once the engine loads it)."""
    try:
        written = json.loads((Path(ckpt_dir) / FINGERPRINT).read_text())
    except (OSError, ValueError):
        return None
    return written if isinstance(written, dict) else None


def resumed_fingerprint(output_dir: Path, resume: bool) -> dict | None:
    """The fingerprint of the checkpoint a ``--resume`` run continues (None: a fresh run, or none written)."""
    return read_fingerprint(Path(output_dir) / "checkpoints") if resume else None


def tags_newest_first(ckpt_dir: Path) -> list[str]:
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p.name) for p in ckpt_dir.iterdir() if p.is_dir() and (m := TAG.match(p.name))]
    return [name for _, name in sorted(found, reverse=True)]


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def check_supported(ds: DsConfig) -> None:
    if ds.optimizer_on_nvme:
        raise ElsaError("--save_interval/--resume with NVMe optimizer offload is not supported: DeepSpeed does not restore "
                        "NVMe-offloaded optimizer state (Adam moments, z, u); use zero3_offload.json for resumable runs")


def save(engine, ckpt_dir: Path, step: int, client: dict, keep: int, rank: int) -> str:
    """Save after ``step`` (0-based) as tag global_step{step+1}; publish it as latest; prune old tags. Collective."""
    import torch.distributed as dist

    tag = f"global_step{step + 1}"
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={CLIENT_KEY: client}, save_latest=False)
    dist.barrier()  # every rank's shard is on disk before the tag is published
    if rank == 0:
        tmp = ckpt_dir / "latest.tmp"
        tmp.write_text(tag)
        tmp.replace(ckpt_dir / "latest")
        for old in tags_newest_first(ckpt_dir)[keep:]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    dist.barrier()
    return tag


def load_latest(engine, ckpt_dir: Path, say, comm) -> dict | None:
    """Load the newest loadable checkpoint; returns its client state (None when there is none). Collective."""
    tags = tags_newest_first(ckpt_dir)
    latest = (ckpt_dir / "latest").read_text().strip() if (ckpt_dir / "latest").exists() else None
    if latest in tags:  # an unpublished (incomplete) newer tag is never tried first
        tags = tags[tags.index(latest):]
    for tag in tags:
        try:
            path, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=False)
            ok = path is not None and client is not None and CLIENT_KEY in client
        except Exception as err:  # a truncated or missing shard: fall back to the previous tag
            say(f"[elsa_ds] checkpoint {tag} is unreadable ({type(err).__name__}: {str(err)[:200]}); trying the previous one")
            ok = False
        loaded = comm.all_reduce_sum(torch.tensor([1.0 if ok else 0.0]))  # every rank must have loaded this tag
        if loaded.item() == comm.world_size:
            say(f"[elsa_ds] resumed from {ckpt_dir / tag}")
            return client[CLIENT_KEY]
    return None
