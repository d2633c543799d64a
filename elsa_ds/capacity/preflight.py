"""Pre-flight memory check: will this job fit this machine? Decided from configs alone, before any weight is loaded.

Needs come from the estimator (``memory.py``): host memory per node, memory per GPU, NVMe bytes, and the disk the
job writes (rank 0's export, checkpoints with --save_interval). What the machine has: host memory available now
plus what this job's own processes already hold (the estimate counts them), free memory of this rank's GPU, free
space on every file system the job writes to (needs on one file system add up).

The estimator is validated within ±15 % (``bench/memory.py``, ``bench/scale.py``; at 27B's shapes 0.96-1.05 of the
measured host peaks, on a GPU host and here: docs/results.md section 2), so a run whose host-memory estimate exceeds
what the machine has is refused (ElsaError: one line, exit code 2, naming the shortfall, its largest parts and the phase
of its peak, and each change tried with its estimate, those that would fit first: another shipped config, ELSA-L's
states, NVMe for the optimizer states or the parameters, --freeze_embeddings, more nodes); one that fits only if the
estimate is not 15 % low starts with a warning. (Refusing only what could not fit even were the estimate 15 % high let
the 8-layer ELSA-L job, 131 GiB by the estimate on a 126 GiB host, start and be killed by the kernel at its first step.)
GPU memory keeps that wider band: running out there is CUDA's own error, which says so. A one-shot job's host memory
(``check_oneshot``) is judged as a training job's: the kernel's kill is as silent there.
``--ignore_memory_check`` turns a refusal into a warning.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from elsa_ds import launch_env
from elsa_ds.capacity.alternatives import MARGIN, Machine, Run, alternatives, gib_text
from elsa_ds.capacity.memory import Estimate, ModelShape, model_shape, oneshot_host_bytes
from elsa_ds.capacity.resident import checkpoint_tag_bytes, element_bytes
from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import existing_ancestor
from elsa_ds.files.procfs import cgroup_room, usable_cpus
from elsa_ds.log import get_logger
from elsa_ds.methods import oneshot_names
from elsa_ds.models import check_seqlen, load_config
from elsa_ds.settings.config_checks import schedule_oddities, schedule_refusals

GIB = 2 ** 30
log = get_logger(__name__)


@dataclass(frozen=True)
class Need:
    what: str           # "host memory", "GPU memory", "disk at /path"
    need: float
    have: float
    margin: float = MARGIN  # memory is an estimate (the warning's band); the bytes a disk gets are counted exactly (0)
    limit: float | None = None  # host memory: the cgroup limit that leaves the job ``have`` (SLURM, containers)
    slack: float = 0.0      # refused once need x (1 - slack) > have: GPU memory MARGIN (running out there is CUDA's
    #                         out-of-memory error, which says so; host memory runs out in the kernel's silent kill)
    detail: str = ""        # what the need is made of (memory: its largest parts and the phase of its peak)

    @property
    def refused(self) -> bool:
        return self.need * (1 - self.slack) > self.have

    @property
    def tight(self) -> bool:
        return self.need * (1 + self.margin) > self.have

    def line(self) -> str:
        left = "free" if self.what.startswith("disk") else "available"
        inside = "; ".join(x for x in (f"estimate ±{self.margin:.0%}" if self.margin else "", self.detail) if x)
        spread = f" ({inside})" if inside else ""
        if self.limit is not None:
            return (f"needs ~{gib_text(self.need)} {self.what}{spread}, this job's cgroup lets it take {gib_text(self.have)} "
                    f"(its memory limit {gib_text(self.limit)}: SLURM's --mem, a container's; the node may have more)")
        return f"needs ~{gib_text(self.need)} {self.what}{spread}, this node has {gib_text(self.have)} {left}"


# ---- the machine --------------------------------------------------------------------------------------------------
def this_machine(paths: list[Path]) -> Machine:
    """Host memory available to this job (the node's available memory, or less where the memory limit of the job's
    cgroup leaves less: a SLURM allocation, a container), this rank's free GPU memory, free space where ``paths`` live."""
    import psutil
    import torch

    gpu = None
    if torch.cuda.is_available():
        if (index := launch_env.local_rank()) >= (count := torch.cuda.device_count()):  # CUDA's "invalid device ordinal" else
            raise ElsaError(f"LOCAL_RANK={index}, but this node shows {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}): start at most {count} ranks a node")
        gpu = float(torch.cuda.mem_get_info(index)[0])
    disks = {}
    for path in paths:
        existing = existing_ancestor(path)
        disks[os.stat(existing).st_dev] = float(shutil.disk_usage(existing).free)
    host, limit = float(psutil.virtual_memory().available), None
    if (room := cgroup_room()) is not None and room[0] < host:
        host, limit = float(room[0]), float(room[1])
    return Machine(host=host + own_processes_rss(), gpu=gpu, disks=disks, host_limit=limit)


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


def check_elsa(meta, ds: dict, cfg, opts, world: int, source: dict | None = None) -> None:
    """The pre-flight check of an ELSA job (meta: the model on meta, ds: the engine's config, cfg, opts, source: the JSON
    as written): the sequence length against the model's positions, the schedule, then memory and disk."""
    from elsa_ds.capacity.machine import job_device

    check_seqlen(meta.config, cfg.seqlen, cfg.model)
    check_schedule(cfg, launch_env.rank())
    shape = model_shape(meta.config, cfg.targets, model=meta, freeze_embeddings=cfg.freeze_embeddings)
    job = Run(meta, ds, cfg, Path(opts.deepspeed).stem, job_device(), launch_env.local_size(world), world, source or {})
    rank = launch_env.rank()
    e = job.estimate()
    zero = ds["zero_optimization"]
    writes: dict[Path, float] = {}  # each node's share of the parameters' and the optimizer's swap files, where each goes
    swapped = {"offload_param": e.breakdown["params"]["nvme"], "offload_optimizer": e.nvme_bytes - e.breakdown["params"]["nvme"]}
    for key, size in swapped.items():
        if zero.get(key, {}).get("device") == "nvme":
            path = Path(zero[key]["nvme_path"])
            writes[path] = writes.get(path, 0.0) + size / job.nodes
    if rank < job.local:  # rank 0's node writes the export and (shared file system) the checkpoints
        out = Path(opts.output_dir).expanduser().resolve()
        writes[out] = writes.get(out, 0.0) + sum(output_bytes(shape, ds, cfg, opts.export_format).values())
    machine = this_machine(list(writes))
    needs = [Need("host memory", e.per_node_cpu_bytes, machine.host, detail=_parts(e, "per_node_cpu"), limit=machine.host_limit),
             *disk_needs(writes, machine)]
    if machine.gpu is not None:
        needs.append(Need("GPU memory", e.per_gpu_bytes, machine.gpu, slack=MARGIN, detail=_parts(e, "per_gpu")))
    hint = ""
    if any(n.refused for n in needs if n.what in ("host memory", "GPU memory")):
        hint = alternatives(job, machine)
    elif any(n.refused for n in needs):  # disk alone: what frees it (an audit: "starts it anyway" alone, then no room)
        hint = "free space there, or choose another --output_dir" + (" or --nvme_path" if len(writes) > 1 else "")
    judge(needs, hint, opts.ignore_memory_check, rank)
    if rank == 0:
        log.info(_expected_time(shape, job))


def _expected_time(shape: ModelShape, job: Run) -> str:
    """What the run will take at the typical rates of a host like this one (its core count picks the profile), the CPU
    rates for the CPUs the job may use (a SLURM job of 32 CPUs on an 8-GPU server does not get the server's optimizer pass:
    ``step_time.allotted``)."""
    from elsa_ds.capacity.step_time import TYPICAL, allotted, step_time

    cpus = usable_cpus()
    name = "cpu-2c" if job.device == "cpu" else "gpu-server" if (os.cpu_count() or 1) >= 64 else "gpu-vm-16c"
    rates = TYPICAL[name] if job.device == "cpu" else allotted(TYPICAL[name], cpus)
    t = step_time(shape, job.ds, job.cfg, job.local, job.nodes, job.device, rates)
    return (f"expected: {t.step_s:.3g} s a step, {t.hours} h for the run ({t.steps} steps; not counted: "
            f"{', '.join(t.uncounted)}) at the typical rates of a {name} host (this job may use {cpus:g} CPUs; elsa-estimate "
            f"with this job's flags and --num_gpus {job.local}{f' --num_nodes {job.nodes}' if job.nodes > 1 else ''} "
            f"--accelerator {job.device} --measure times this one)")


def ds_bytes_export(shape: ModelShape, ds: dict) -> float:
    """The consolidated export: every parameter once in the engine's dtype (the exporter writes the tensors as held)."""
    return element_bytes(ds) * shape.num_params


HEADER_ROOM = 2**20  # the sparse checkpoint's JSON headers (a few hundred bytes a stored part) and bitmask rows' padding


def output_bytes(shape: ModelShape, ds: dict, cfg, export_format: str) -> dict[str, float]:
    """What an ELSA job writes under --output_dir (on rank 0's node), by part: the export, the sparse one beside it,
    the checkpoints, the one-shot warm start's mask (1 bit a pruned weight). --init_weights' copy of x₀ (one export's
    size) is deleted before training: the export and the checkpoints cover it."""
    return {"export": ds_bytes_export(shape, ds), "sparse export": sparse_export_bytes(shape, element_bytes(ds), cfg, export_format),
            "checkpoints": checkpoint_bytes(shape, cfg, element_bytes(ds)),
            "warm-start mask": shape.pruned_params / 8 if cfg.init_mask in oneshot_names() else 0.0}


def format_output(parts: dict[str, float], shape: ModelShape, cfg, ds: dict) -> str:
    """elsa-estimate's line for the disk under --output_dir (``parts``: output_bytes), checkpoints always sized."""
    each = checkpoint_tag_bytes(shape, cfg, element_bytes(ds))
    written = ", ".join(f"{name} {gib_text(b)}" for name, b in parts.items() if b and name != "checkpoints")
    if cfg.save_interval:
        kept = cfg.keep_checkpoints + 1
        saved = (f"checkpoints {gib_text(parts['checkpoints'])} ({kept} x {gib_text(each)} every {cfg.save_interval} steps: "
                 f"--keep_checkpoints {cfg.keep_checkpoints} and the one being written)")
    else:
        saved = f"no checkpoints (--save_interval 0; each would take {gib_text(each)})"
    # every rank writes its partition of a checkpoint into the one --output_dir (shared by the nodes: the README's
    # multi-node rule); rank 0 writes the export
    return f"disk under --output_dir at its peak (the shared folder, all nodes): {gib_text(sum(parts.values()))}: {written}; {saved}"


def sparse_export_bytes(shape: ModelShape, element: float, cfg, export_format: str) -> float:
    """--export_format sparse: the elsa-sparse checkpoint, built beside the dense export before that goes. At most the
    bitmask code's bytes (delta8 is stored only where smaller, and a layer is stored dense where that is smaller still),
    linear in the kept weights, so the mean sparsity bounds the whole (a sparsity profile: none assumed)."""
    if export_format != "sparse":
        return 0.0
    kept = 1.0 if cfg.sparsity_profile else 1.0 - cfg.sparsity
    pruned = shape.pruned_params * min(element, kept * element + 1 / 8)
    return element * (shape.num_params - shape.pruned_params) + pruned + HEADER_ROOM


def checkpoint_bytes(shape: ModelShape, cfg, element: float) -> float:
    """--save_interval: the newest keep_checkpoints stay and one more exists while it is written."""
    return checkpoint_tag_bytes(shape, cfg, element) * (cfg.keep_checkpoints + 1) if cfg.save_interval else 0.0


PART_NAMES = {"params": "16-bit parameters", "grads": "gradients", "optimizer": "fp32 masters + moments", "admm": "ADMM z, u",
              "workspace": "step workspace", "activations": "activations", "buffers": "buffers", "runtime": "runtime",
              "warm start": "one-shot --init_mask"}


def _parts(e: Estimate, key: str) -> str:
    """The three largest rows of the estimate for ``key`` (per_node_cpu, per_gpu) and the phase of its peak."""
    rows = sorted(((row[key], name) for name, row in e.breakdown.items() if row[key] >= GIB / 10), reverse=True)[:3]
    peak = max(e.phases, key=lambda phase: e.phases[phase][key])
    return f"largest: {', '.join(f'{PART_NAMES.get(n, n)} {gib_text(b)}' for b, n in rows)}; peak phase: {peak}" if rows else ""


# ---- one-shot methods ---------------------------------------------------------------------------------------------
def check_oneshot(shape: ModelShape, cfg, opts, element: int) -> None:
    """The pre-flight check of a one-shot job (and its --finetune): the sequence length against the positions of a local
    model's config, the schedule, host memory, and the disk its model is saved to (``element`` bytes a parameter)."""
    import torch

    if Path(cfg.model).expanduser().is_dir():
        check_seqlen(load_config(cfg.model), cfg.seqlen, cfg.model)
    check_schedule(cfg, launch_env.rank())
    cuda = torch.cuda.is_available()
    out = Path(opts.output_dir).expanduser().resolve()
    writes: dict[Path, float] = {out: float(element * shape.num_params) + sparse_export_bytes(shape, element, cfg, opts.export_format)}
    machine = this_machine(list(writes))
    needs = [Need("host memory", oneshot_host_bytes(shape, cfg.method.value, cfg, cuda), machine.host, limit=machine.host_limit),
             *disk_needs(writes, machine)]
    memory = any(n.refused for n in needs if n.what == "host memory")
    hint = ("prune with ELSA under ZeRO-3 (--method elsa) and an offloading config, or on a machine with more memory"
            if memory else "free space there or choose another --output_dir")
    if memory and cfg.val_windows > cfg.nsamples:  # the windows asked, not the fewer a text may give (an audit, 2026-12-07)
        fewer = oneshot_host_bytes(shape, cfg.method.value, cfg.model_copy(update={"val_windows": cfg.nsamples}), cuda)
        if (part := needs[0].need - fewer) > needs[0].need / 10:
            hint = (f"--val_windows {cfg.val_windows} adds {part / 2 ** 30:.1f} GiB to it (each window's activations, layer by "
                    f"layer, sized for every window asked; a text may give fewer): lower it, or {hint}")
    judge(needs, hint, opts.ignore_memory_check, launch_env.rank())
