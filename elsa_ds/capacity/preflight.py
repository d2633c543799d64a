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

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elsa_ds.capacity.memory import Estimate, ModelShape, job_estimate, model_shape, oneshot_host_bytes
from elsa_ds.capacity.resident import checkpoint_tag_bytes, element_bytes
from elsa_ds.errors import ElsaError
from elsa_ds.files.disk_room import existing_ancestor
from elsa_ds.files.procfs import cgroup_room, usable_cpus
from elsa_ds.log import get_logger
from elsa_ds.methods import oneshot_names
from elsa_ds.models import check_seqlen, load_config
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.config_checks import schedule_oddities, schedule_refusals
from elsa_ds.settings.flags import flag_text
from elsa_ds.zero.ds_config import param_buffer_size

MARGIN = 0.15
GIB = 2 ** 30
ALTERNATIVES = ("zero3_offload", "zero3_offload_elsal", "zero3_nvme")  # cheapest first: no disk, then NVMe
# ELSA-L's states with the optimizer on the GPUs: bitsandbytes' 8-bit Adam (its CUDA kernel; elsa_ds's minifloat codes
# step there through their torch reference, ~32 bytes an entry of workspace)
GPU_ELSAL = {"base_optimizer": "adam8bit", "z_dtype": "fp8", "u_dtype": "bf16"}
log = get_logger(__name__)


@dataclass
class Machine:
    """What one node offers this job."""

    host: float                                   # bytes of host memory this job may use
    gpu: float | None = None                      # free bytes of this rank's GPU (None without CUDA)
    disks: dict[int, float] = field(default_factory=dict)   # file system (st_dev) -> free bytes
    host_limit: float | None = None               # the memory limit of the job's cgroup where that, not the node, binds


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
            return (f"needs ~{_gib(self.need)} {self.what}{spread}, this job's cgroup lets it take {_gib(self.have)} "
                    f"(its memory limit {_gib(self.limit)}: SLURM's --mem, a container's; the node may have more)")
        return f"needs ~{_gib(self.need)} {self.what}{spread}, this node has {_gib(self.have)} {left}"


def _gib(b: float) -> str:
    if b < GIB / 10:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / GIB:,.0f} GiB" if b >= 10 * GIB else f"{b / GIB:.1f} GiB"


# ---- the machine --------------------------------------------------------------------------------------------------
def this_machine(paths: list[Path]) -> Machine:
    """Host memory available to this job (the node's available memory, or less where the memory limit of the job's
    cgroup leaves less: a SLURM allocation, a container), this rank's free GPU memory, free space where ``paths`` live."""
    import psutil
    import torch

    gpu = None
    if torch.cuda.is_available():
        gpu = float(torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", "0")))[0])
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


def check_elsa(meta, ds: dict, cfg, opts, world: int, block: dict | None = None) -> None:
    """The pre-flight check of an ELSA job (meta: the model on meta, ds: the engine's config, cfg, opts, block: the JSON's
    "elsa" block): the sequence length against the model's positions, the schedule, then memory and disk."""
    from elsa_ds.capacity.machine import job_device

    check_seqlen(meta.config, cfg.seqlen, cfg.model)
    check_schedule(cfg, int(os.environ.get("RANK", "0")))
    shape = model_shape(meta.config, cfg.targets, model=meta, freeze_embeddings=cfg.freeze_embeddings)
    job = _Run(meta, ds, cfg, Path(opts.deepspeed).stem, job_device(), int(os.environ.get("LOCAL_SIZE", world)), world, block or {})
    rank = int(os.environ.get("RANK", "0"))
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
        hint = _alternatives(job, machine)
    judge(needs, hint, opts.ignore_memory_check, rank)
    if rank == 0:
        log.info(_expected_time(shape, job))


def _expected_time(shape: ModelShape, job: _Run) -> str:
    """What the run will take at the typical rates of a host like this one (its core count picks the profile), the CPU
    rates for the CPUs the job may use (a SLURM job of 32 CPUs on an 8-GPU server does not get the server's optimizer pass:
    ``step_time.allotted``)."""
    from elsa_ds.capacity.step_time import TYPICAL, allotted, step_time

    cpus = usable_cpus()
    name = "cpu-2c" if job.device == "cpu" else "gpu-server" if (os.cpu_count() or 1) >= 64 else "gpu-vm-16c"
    rates = TYPICAL[name] if job.device == "cpu" else allotted(TYPICAL[name], cpus)
    t = step_time(shape, job.ds, job.cfg, job.local, job.nodes, job.device, rates)
    return (f"expected: {t.step_s:.3g} s a step, {t.run_s / 3600:.3g} h for the run ({t.steps} steps; not counted: "
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
    written = ", ".join(f"{name} {_gib(b)}" for name, b in parts.items() if b and name != "checkpoints")
    if cfg.save_interval:
        kept = cfg.keep_checkpoints + 1
        saved = (f"checkpoints {_gib(parts['checkpoints'])} ({kept} x {_gib(each)} every {cfg.save_interval} steps: "
                 f"--keep_checkpoints {cfg.keep_checkpoints} and the one being written)")
    else:
        saved = f"no checkpoints (--save_interval 0; each would take {_gib(each)})"
    # every rank writes its partition of a checkpoint into the one --output_dir (shared by the nodes: the README's
    # multi-node rule); rank 0 writes the export
    return f"disk under --output_dir at its peak (the shared folder, all nodes): {_gib(sum(parts.values()))}: {written}; {saved}"


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
    return f"largest: {', '.join(f'{PART_NAMES.get(n, n)} {_gib(b)}' for b, n in rows)}; peak phase: {peak}" if rows else ""


@dataclass
class _Run:
    """An ELSA job as the check sees it, to estimate it and the changes that would make it fit."""

    meta: Any             # the model on the meta device (a transformers PreTrainedModel)
    ds: dict              # the engine's DeepSpeed config
    cfg: ElsaConfig       # after the defaults rule
    config_name: str      # --deepspeed's stem
    device: str           # cuda, or cpu (DeepSpeed's CPU accelerator)
    local: int            # ranks per node
    world: int
    block: dict = field(default_factory=dict)  # the JSON's "elsa" block: settings another --deepspeed would not carry

    @property
    def nodes(self) -> int:
        return max(1, self.world // max(self.local, 1))

    def estimate(self, ds: dict | None = None, elsa: dict | None = None, freeze: bool | None = None,
                 nodes: int | None = None) -> Estimate:
        """The estimate of this job, or of it with another DeepSpeed config, ELSA settings, embeddings or node count."""
        cfg = self.cfg if not elsa else type(self.cfg).model_validate({**self.cfg.model_dump(), **elsa})
        freeze = cfg.freeze_embeddings if freeze is None else freeze
        shape = model_shape(self.meta.config, cfg.targets, model=self.meta, freeze_embeddings=freeze)
        return job_estimate(shape, ds or self.ds, cfg, self.local, nodes or self.nodes, self.device)


def _alternatives(job: _Run, machine: Machine) -> str:
    """Each change that could make the job fit and its estimate, those that fit first: another shipped config, ELSA-L's
    low-precision states, with CUDA everything on the GPUs, NVMe for the optimizer states or the parameters, DeepSpeed's
    linear where the JSON turned it off, --freeze_embeddings, more nodes."""
    from elsa_ds.zero.ds_config import linear_wrapped, shipped_configs

    shipped = {name: json.loads(path.read_text()) for name, path in shipped_configs().items()}
    shape = model_shape(job.meta.config, job.cfg.targets, model=job.meta, freeze_embeddings=job.cfg.freeze_embeddings)
    zero = job.ds["zero_optimization"]
    tried: list[tuple[str, Estimate, int]] = []  # (the change, its estimate, nodes)
    for name in ALTERNATIVES:
        if name != job.config_name:
            candidate = {**job.ds, "zero_optimization": {**zero, **shipped[name]["zero_optimization"]}}
            note = _fit_param_buffers(candidate, shape, job.world) + _kept_flags(job, shipped[name].get("elsa", {}))
            tried.append((f"ds_configs/{name}.json{note}", job.estimate(candidate, shipped[name].get("elsa")), job.nodes))
    if (elsal := shipped["zero3_offload_elsal"]["elsa"]) and any(str(getattr(job.cfg, k).value) != v for k, v in elsal.items()):
        flags = " ".join(f"--{k} {v}" for k, v in elsal.items())
        tried.append((f"ELSA-L's states ({flags})", job.estimate(elsa=elsal), job.nodes))
    offloaded = [k for k in ("offload_param", "offload_optimizer") if zero.get(k, {}).get("device") in ("cpu", "nvme")]
    if job.device == "cuda" and offloaded:  # 80 GB GPUs hold a 27B job's ELSA-L states on 8 ranks: no host pass, no PCIe
        resident = {**job.ds, "zero_optimization": {**{k: v for k, v in zero.items() if k not in offloaded},
                                                    **shipped["zero3"]["zero_optimization"]}}
        flags = " ".join(f"--{k} {v}" for k, v in GPU_ELSAL.items())
        tried.append((f"everything on the GPUs (ds_configs/zero3.json{_kept_flags(job, GPU_ELSAL)}, ELSA-L's states: {flags})",
                      job.estimate(resident, GPU_ELSAL), job.nodes))
    nvme = shipped["zero3_nvme"]["zero_optimization"]
    if not any(zero.get(k, {}).get("device") == "nvme" for k in ("offload_optimizer", "offload_param")):
        # the optimizer's swap buffers are sized by the largest sub-group: with it come zero3_nvme.json's sub-groups
        for keys, what in ((("offload_optimizer", "sub_group_size"), "the optimizer states"), (("offload_param",), "the parameters")):
            candidate = {**job.ds, "zero_optimization": {**zero, **{k: nvme[k] for k in keys}}}
            note = _fit_param_buffers(candidate, shape, job.world)
            tried.append((f"{what} on NVMe ({' and '.join(keys)} of ds_configs/zero3_nvme.json{note}, --nvme_path DIR)",
                          job.estimate(candidate), job.nodes))
    if not linear_wrapped(zero):  # torch's F.linear keeps every gathered weight until its backward
        wrapped = {**job.ds, "zero_optimization": {**zero, "memory_efficient_linear": True}}
        tried.append(("DeepSpeed's linear (memory_efficient_linear true)", job.estimate(wrapped), job.nodes))
    if not job.cfg.freeze_embeddings:
        tried.append(("--freeze_embeddings", job.estimate(freeze=True), job.nodes))
    counts = [n for n in (2, 4, 8, 16, 32, 64) if n > job.nodes]
    for n in counts:  # the fewest nodes that fit, or the most tried
        e = job.estimate(nodes=n)
        if _fits(e, machine) or n == counts[-1]:
            tried.append((f"{n} nodes", e, n))
            break
    verdicts: dict[bool, dict[str, list[str]]] = {True: {}, False: {}}  # fits -> the estimate -> the changes that give it
    for label, e, n in tried:
        verdicts[_fits(e, machine)].setdefault(_cost(e, machine, n), []).append(label)
    fit, rest = ([f"{' or '.join(labels)} ({cost})" for cost, labels in verdicts[v].items()] for v in (True, False))
    return "; ".join([f"would fit: {', '.join(fit)}" if fit else "nothing tried fits this machine"] +
                     ([f"would not: {', '.join(rest)}"] if rest else []))


def _kept_flags(job: _Run, block: dict) -> str:
    """The flags that carry this job's settings from its JSON's "elsa" block to a config whose block lacks them (the
    estimate keeps them: without them an ELSA-L job under zero3_offload.json would hold fp32 states)."""
    kept = [flag_text(type(job.cfg), k, getattr(job.cfg, k)) for k in job.block if k not in block and k in type(job.cfg).model_fields]
    return f" with {' '.join(k for k in kept if k)}" if any(kept) else ""


def _fits(e: Estimate, machine: Machine) -> bool:
    return e.per_node_cpu_bytes <= machine.host and (machine.gpu is None or e.per_gpu_bytes <= machine.gpu)


def _cost(e: Estimate, machine: Machine, nodes: int) -> str:
    """An alternative's estimate: host memory per node, memory per GPU (on a GPU node), NVMe per node."""
    gpu = f", {_gib(e.per_gpu_bytes)} per GPU" if machine.gpu is not None else ""
    nvme = f" + {_gib(e.nvme_bytes / nodes)} NVMe" if e.nvme_bytes else ""
    return f"~{_gib(e.per_node_cpu_bytes)} host{gpu}{nvme}"


def _fit_param_buffers(candidate: dict, shape: ModelShape, world: int) -> str:
    """A shipped NVMe config's parameter buffers must hold the largest partition; say so when they are raised."""
    section = candidate["zero_optimization"].get("offload_param", {})
    if section.get("device") != "nvme":
        return ""
    need = -(-shape.largest_param // world)
    if param_buffer_size(candidate["zero_optimization"], shape.largest_param, world) >= need:
        return ""
    candidate["zero_optimization"]["offload_param"] = {**section, "buffer_size": need}
    return f" with offload_param.buffer_size {need}"


# ---- one-shot methods ---------------------------------------------------------------------------------------------
def check_oneshot(shape: ModelShape, cfg, opts, element: int) -> None:
    """The pre-flight check of a one-shot job (and its --finetune): the sequence length against the positions of a local
    model's config, the schedule, host memory, and the disk its model is saved to (``element`` bytes a parameter)."""
    import torch

    if Path(cfg.model).expanduser().is_dir():
        check_seqlen(load_config(cfg.model), cfg.seqlen, cfg.model)
    check_schedule(cfg, int(os.environ.get("RANK", "0")))
    cuda = torch.cuda.is_available()
    out = Path(opts.output_dir).expanduser().resolve()
    writes: dict[Path, float] = {out: float(element * shape.num_params) + sparse_export_bytes(shape, element, cfg, opts.export_format)}
    machine = this_machine(list(writes))
    needs = [Need("host memory", oneshot_host_bytes(shape, cfg.method.value, cfg, cuda), machine.host, limit=machine.host_limit),
             *disk_needs(writes, machine)]
    memory = any(n.refused for n in needs if n.what == "host memory")
    hint = ("prune with ELSA under ZeRO-3 (--method elsa) and an offloading config, or on a machine with more memory"
            if memory else "free space there or choose another --output_dir")
    judge(needs, hint, opts.ignore_memory_check, int(os.environ.get("RANK", "0")))
