"""Pre-flight memory check: will this job fit this machine? Decided from configs alone, before any weight is loaded.

Needs come from the estimator (``memory.py``): host memory per node, memory per GPU, NVMe bytes, and the disk the
job writes (rank 0's export, checkpoints with --save_interval). What the machine has: host memory available now
plus what this job's own processes already hold (the estimate counts them), free memory of this rank's GPU, free
space on every file system the job writes to (needs on one file system add up).

The estimator is validated within ±15 % (``bench/memory.py``, ``bench/scale.py``), so a need is judged with that
margin: a run that cannot fit even if the estimate is 15 % high is refused (ElsaError: one line, exit code 2,
naming the shortfall and a shipped config, node count or setting that would fit); one that fits only if the
estimate is not 15 % low starts with a warning. ``--ignore_memory_check`` turns a refusal into a warning.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from elsa_ds.config_checks import schedule_oddities, schedule_refusals
from elsa_ds.disk_room import existing_ancestor
from elsa_ds.errors import ElsaError
from elsa_ds.log import get_logger
from elsa_ds.memory import RUNTIME_HOST_BYTES, STATE_BYTES, ModelShape, estimate, model_shape, moment_bytes
from elsa_ds.models import check_seqlen, load_config

MARGIN = 0.15
GIB = 2 ** 30
ALTERNATIVES = ("zero3_offload", "zero3_offload_elsal", "zero3_nvme")  # cheapest first: no disk, then NVMe
log = get_logger(__name__)


@dataclass
class Machine:
    """What one node offers this job."""

    host: float                                   # bytes of host memory this job may use
    gpu: float | None = None                      # free bytes of this rank's GPU (None without CUDA)
    disks: dict[int, float] = field(default_factory=dict)   # file system (st_dev) -> free bytes


@dataclass(frozen=True)
class Need:
    what: str           # "host memory", "GPU memory", "disk at /path"
    need: float
    have: float
    margin: float = MARGIN  # memory is an estimate; the bytes a disk gets are counted exactly (margin 0)

    @property
    def refused(self) -> bool:
        return self.need * (1 - self.margin) > self.have

    @property
    def tight(self) -> bool:
        return self.need * (1 + self.margin) > self.have

    def line(self) -> str:
        left = "free" if self.what.startswith("disk") else "available"
        spread = f" (estimate ±{self.margin:.0%})" if self.margin else ""
        return f"needs ~{_gib(self.need)} {self.what}{spread}, this node has {_gib(self.have)} {left}"


def _gib(b: float) -> str:
    if b < GIB / 10:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / GIB:,.0f} GiB" if b >= 10 * GIB else f"{b / GIB:.1f} GiB"


# ---- the machine --------------------------------------------------------------------------------------------------
def this_machine(paths: list[Path]) -> Machine:
    """Host memory available to this job, this rank's free GPU memory, free space where ``paths`` live."""
    import psutil
    import torch

    gpu = None
    if torch.cuda.is_available():
        gpu = float(torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0])
    disks = {}
    for path in paths:
        existing = existing_ancestor(path)
        disks[os.stat(existing).st_dev] = float(shutil.disk_usage(existing).free)
    return Machine(host=float(psutil.virtual_memory().available) + own_processes_rss(), gpu=gpu, disks=disks)


def own_processes_rss() -> float:
    """RSS of this job's processes so far: the deepspeed launcher's tree this process runs in, or this process."""
    import psutil

    root = psutil.Process()
    try:
        while (parent := root.parent()) is not None and "deepspeed" in " ".join(parent.cmdline()):
            root = parent
        return float(sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]))
    except psutil.Error:
        return float(psutil.Process().memory_info().rss)


def disk_needs(needs: dict[Path, float], machine: Machine) -> list[Need]:
    """Bytes to write per path, summed per file system, against its free space."""
    by_fs: dict[int, tuple[list[str], float]] = {}
    for path, amount in needs.items():
        if amount <= 0:
            continue
        dev = os.stat(existing_ancestor(path)).st_dev
        names, total = by_fs.get(dev, ([], 0.0))
        by_fs[dev] = ([*names, str(path)], total + amount)
    return [Need(f"disk at {' + '.join(names)}", total, machine.disks[dev], margin=0.0) for dev, (names, total) in by_fs.items()]


# ---- the verdict ----------------------------------------------------------------------------------------------------
def judge(needs: list[Need], hint: str, ignore: bool, rank: int) -> None:
    """Refuse (one ElsaError line) or warn (rank 0, one warning on stderr) about the needs that do not fit."""
    refused = [n for n in needs if n.refused]
    tight = [n for n in needs if n.tight and not n.refused]
    if refused and not ignore:
        raise ElsaError("; ".join(n.line() for n in refused) + (f": {hint}" if hint else "") +
                        "; --ignore_memory_check starts it anyway")
    if rank == 0 and (refused or tight):
        verdict = "does not fit (--ignore_memory_check: starting anyway)" if refused else "may not fit; starting"
        log.warning(f"{'; '.join(n.line() for n in refused + tight)}: the run {verdict}")


def check_schedule(cfg, rank: int) -> None:
    """The schedule as the defaults rule resolved it (``config_checks.py``): refused where the run cannot do what it was
    asked, a warning (rank 0) for each part of it the run never reaches."""
    refusals = schedule_refusals(cfg)
    if refusals:
        raise ElsaError("; ".join(refusals))
    if rank == 0:
        for line in schedule_oddities(cfg):
            log.warning(line)


def check_elsa(meta, ds: dict, cfg, opts, world: int) -> None:
    """The pre-flight check of an ELSA job (meta: the model on the meta device, ds: the engine's config, cfg: ElsaConfig,
    opts: JobOptions): the sequence length against the model's positions, the schedule, then memory and disk."""
    import torch

    check_seqlen(meta.config, cfg.seqlen, cfg.model)
    check_schedule(cfg, int(os.environ.get("RANK", "0")))
    # the shape as configured, and (an alternative for the hint) with the embeddings frozen
    shape = model_shape(meta.config, cfg.targets, model=meta, freeze_embeddings=cfg.freeze_embeddings)
    frozen = None if cfg.freeze_embeddings else model_shape(meta.config, cfg.targets, model=meta, freeze_embeddings=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    local = int(os.environ.get("LOCAL_SIZE", world))
    nodes = max(1, world // max(local, 1))
    rank = int(os.environ.get("RANK", "0"))
    settings = cfg.model_dump(mode="json")

    def est(ds_: dict, nodes_: int = nodes, shape_: ModelShape = shape, elsa: dict | None = None):
        return estimate(shape_, ds_, local, nodes_, ds_["train_micro_batch_size_per_gpu"], cfg.seqlen, elsa={**settings, **(elsa or {})},
                        gradient_checkpointing=cfg.gradient_checkpointing, device=device)

    e = est(ds)
    zero = ds["zero_optimization"]
    nvme = {Path(zero[k]["nvme_path"]) for k in ("offload_param", "offload_optimizer") if zero.get(k, {}).get("device") == "nvme"}
    writes = {p: e.nvme_bytes / nodes for p in nvme}
    if rank < local:  # rank 0's node writes the export and (shared file system) the checkpoints
        out = Path(opts.output_dir).expanduser().resolve()
        mask = shape.pruned_params / 8 if cfg.init_mask in ("magnitude", "wanda", "sparsegpt") else 0.0  # 1 bit a pruned weight
        writes[out] = writes.get(out, 0.0) + ds_bytes_export(shape, ds) + checkpoint_bytes(shape, cfg, ds) + mask
        # --init_weights' copy of x₀ (one export's size) is deleted before training: export + checkpoints cover it
    machine = this_machine(list(writes))
    host = e.per_node_cpu_bytes
    if cfg.init_mask in ("magnitude", "wanda", "sparsegpt"):  # rank 0 prunes the whole model in host memory first
        host = max(host, oneshot_host_bytes(shape, cfg.init_mask, cfg, device == "cuda") + (local - 1) * RUNTIME_HOST_BYTES)
    needs = [Need("host memory", host, machine.host), *disk_needs(writes, machine)]
    if machine.gpu is not None:
        needs.append(Need("GPU memory", e.per_gpu_bytes, machine.gpu))
    hint = ""
    if any(n.refused for n in needs if n.what in ("host memory", "GPU memory")):
        hint = _alternatives(shape, frozen, ds, opts, machine, est, nodes, world)
    judge(needs, hint, opts.ignore_memory_check, rank)


def ds_bytes_export(shape: ModelShape, ds: dict) -> float:
    """The consolidated export: every parameter once in the model's 16-bit (or fp32) dtype."""
    return (2 if ds.get("bf16", {}).get("enabled") else 4) * shape.num_params


def checkpoint_bytes(shape: ModelShape, cfg, ds: dict) -> float:
    """--save_interval: fp32 masters, Adam moments and z, u of the trained parameters, per checkpoint; the newest
    keep_checkpoints stay and one more exists while it is written."""
    if not cfg.save_interval:
        return 0.0
    states = moment_bytes(cfg.base_optimizer.value) + STATE_BYTES[cfg.z_dtype.value] + STATE_BYTES[cfg.u_dtype.value]
    per = (4 + states) * shape.trainable_params
    return per * (cfg.keep_checkpoints + 1)


def _alternatives(shape: ModelShape, frozen: ModelShape | None, ds: dict, opts, machine: Machine, est, nodes: int, world: int) -> str:
    """What would fit: another shipped config, more nodes, or --freeze_embeddings."""
    from elsa_ds.zero.ds_config import shipped_configs

    def fits(e) -> bool:
        return e.per_node_cpu_bytes <= machine.host and (machine.gpu is None or e.per_gpu_bytes <= machine.gpu)

    found = []
    current = Path(opts.deepspeed).stem
    for name in ALTERNATIVES:
        if name == current:
            continue
        raw = json.loads(shipped_configs()[name].read_text())
        candidate = {**ds, "zero_optimization": {**ds["zero_optimization"], **raw["zero_optimization"]}}
        note = _fit_param_buffers(candidate, shape, world)
        e = est(candidate, elsa=raw.get("elsa"))
        if fits(e):
            nvme = f" + {_gib(e.nvme_bytes / nodes)} NVMe" if e.nvme_bytes else ""
            found.append(f"use ds_configs/{name}.json{note} ({_gib(e.per_node_cpu_bytes)} host{nvme})")
            break
    for more in (2, 4, 8, 16, 32, 64):
        if more > nodes and fits(est(ds, more)):
            found.append(f"{more} nodes")
            break
    if frozen is not None:
        e = est(ds, shape_=frozen)
        if fits(e):
            found.append(f"--freeze_embeddings ({_gib(e.per_node_cpu_bytes)} host)")
    return " or ".join(found) if found else "no shipped config, node count up to 64 or --freeze_embeddings fits this machine"


def _fit_param_buffers(candidate: dict, shape: ModelShape, world: int) -> str:
    """A shipped NVMe config's parameter buffers must hold the largest partition; say so when they are raised."""
    section = candidate["zero_optimization"].get("offload_param", {})
    if section.get("device") != "nvme":
        return ""
    need = -(-shape.largest_param // world)
    if float(section.get("buffer_size", 1e8)) >= need:
        return ""
    candidate["zero_optimization"]["offload_param"] = {**section, "buffer_size": need}
    return f" with offload_param.buffer_size {need}"


# ---- one-shot methods ---------------------------------------------------------------------------------------------
def oneshot_host_bytes(shape: ModelShape, method: str, cfg, cuda: bool) -> float:
    """Host memory of a one-shot job (one process): the whole model (fp32 on a CPU, bf16 with a GPU), the runtime,
    and on a CPU the layer-by-layer working set: calibration (or validation) activations in and out of a layer, and
    the method's statistics of one decoder layer's Linears (SparseGPT: an in² Hessian per Linear, the largest one
    inverted; Wanda, magnitude: scores and a sort of the largest weight). Not validated by a benchmark yet."""
    h = 2 if cuda else 4
    rows = max(cfg.nsamples if method != "magnitude" else 0, cfg.val_windows)
    acts = 2 * rows * cfg.seqlen * shape.hidden * h
    largest = shape.largest_pruned_param
    if method == "sparsegpt":
        inputs = [shape.hidden] * 6 + [largest // shape.hidden]          # q, k, v, o (≈ hidden), gate, up; down
        work = 4 * sum(i * i for i in inputs) + 8 * max(inputs) ** 2 + 12 * largest
    else:
        work = 16 * largest
    return h * shape.num_params + RUNTIME_HOST_BYTES + (0 if cuda else acts + work)


def check_oneshot(shape: ModelShape, cfg, opts) -> None:
    """The pre-flight check of a one-shot job (and its --finetune): the sequence length against the positions of a local
    model's config, the schedule, host memory, and the disk its model is saved to."""
    import torch

    if Path(cfg.model).expanduser().is_dir():
        check_seqlen(load_config(cfg.model), cfg.seqlen, cfg.model)
    check_schedule(cfg, int(os.environ.get("RANK", "0")))
    cuda = torch.cuda.is_available()
    out = Path(opts.output_dir).expanduser().resolve()
    writes = {out: (2 if cuda else 4) * shape.num_params}
    machine = this_machine(list(writes))
    needs = [Need("host memory", oneshot_host_bytes(shape, cfg.method.value, cfg, cuda), machine.host), *disk_needs(writes, machine)]
    hint = "prune with ELSA under ZeRO-3 (--method elsa) and an offloading config, or on a machine with more memory"
    judge(needs, hint, opts.ignore_memory_check, int(os.environ.get("RANK", "0")))
