"""What would make a job fit that the pre-flight check refuses: each change tried, priced by the estimate as the job
would run with it (another shipped config and the flags that carry this JSON's "elsa" block to it, ELSA-L's states,
everything on the GPUs, NVMe for the optimizer states or the parameters, DeepSpeed's linear, --freeze_embeddings, more
nodes with the JSON resolved for their ranks and the global batch they need)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from elsa_ds.capacity.memory import Estimate, ModelShape, job_estimate, model_shape
from elsa_ds.errors import ElsaError
from elsa_ds.models import hidden_size
from elsa_ds.settings.config import ElsaConfig
from elsa_ds.settings.flags import flag_text
from elsa_ds.zero.ds_config import DsConfig, linear_wrapped, param_buffer_size, shipped_configs

GIB = 2 ** 30
MARGIN = 0.15  # the estimate's band, validated within ±15 % (preflight.py): a fit inside it only warns
ALTERNATIVES = ("zero3_offload", "zero3_offload_elsal", "zero3_nvme")  # cheapest first: no disk, then NVMe
# ELSA-L's states with the optimizer on the GPUs: bitsandbytes' 8-bit Adam (its CUDA kernel; elsa_ds's minifloat codes
# step there through their torch reference, ~32 bytes an entry of workspace)
GPU_ELSAL = {"base_optimizer": "adam8bit", "z_dtype": "fp8", "u_dtype": "bf16"}


@dataclass
class Machine:
    """What one node offers this job."""

    host: float                                   # bytes of host memory this job may use
    gpu: float | None = None                      # free bytes of this rank's GPU (None without CUDA)
    disks: dict[int, float] = field(default_factory=dict)   # file system (st_dev) -> free bytes
    host_limit: float | None = None               # the memory limit of the job's cgroup where that, not the node, binds


def gib_text(b: float) -> str:
    if b < GIB / 10:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / GIB:,.0f} GiB" if b >= 10 * GIB else f"{b / GIB:.1f} GiB"


@dataclass
class Run:
    """An ELSA job as the check sees it, to estimate it and the changes that would make it fit."""

    meta: Any             # the model on the meta device (a transformers PreTrainedModel)
    ds: dict              # the engine's DeepSpeed config
    cfg: ElsaConfig       # after the defaults rule
    config_name: str      # --deepspeed's stem
    device: str           # cuda, or cpu (DeepSpeed's CPU accelerator)
    local: int            # ranks per node
    world: int
    source: dict = field(default_factory=dict)  # the DeepSpeed JSON as written (its "elsa" block: settings another
    #                                             --deepspeed would not carry; resolved again for other rank counts)

    @property
    def nodes(self) -> int:
        return max(1, self.world // max(self.local, 1))

    @property
    def block(self) -> dict:
        return self.source.get("elsa", {}) if isinstance(self.source.get("elsa"), dict) else {}

    def on_nodes(self, nodes: int) -> tuple[Estimate, int] | None:
        """This job on ``nodes`` nodes of ``local`` ranks, its JSON resolved for them as the job would be (the parameter
        buffers "auto" sizes, the accumulation steps), and the global batch that takes: this one's, or the next multiple
        of micro batch x ranks; None where the JSON cannot run there."""
        world, micro, batch = self.local * nodes, self.ds["train_micro_batch_size_per_gpu"], self.ds["train_batch_size"]
        batch = -(-batch // (micro * world)) * micro * world
        cfg = self.cfg.model_copy(update={"batch_size": batch, "micro_batch": micro})
        shape = model_shape(self.meta.config, cfg.targets, model=self.meta, freeze_embeddings=cfg.freeze_embeddings)
        try:  # as memory.resolved_job resolves a job's JSON
            ds = DsConfig(self.source or self.ds).engine_config(cfg, world, hidden_size(self.meta.config), False, shape.largest_param)
        except ElsaError:
            return None
        return job_estimate(shape, ds, cfg, self.local, nodes, self.device), batch

    def estimate(self, ds: dict | None = None, elsa: dict | None = None, freeze: bool | None = None,
                 nodes: int | None = None) -> Estimate:
        """The estimate of this job, or of it with another DeepSpeed config, ELSA settings, embeddings or node count."""
        cfg = self.cfg if not elsa else type(self.cfg).model_validate({**self.cfg.model_dump(), **elsa})
        freeze = cfg.freeze_embeddings if freeze is None else freeze
        shape = model_shape(self.meta.config, cfg.targets, model=self.meta, freeze_embeddings=freeze)
        return job_estimate(shape, ds or self.ds, cfg, self.local, nodes or self.nodes, self.device)


def alternatives(job: Run, machine: Machine) -> str:
    """Each change that could make the job fit and its estimate, those that fit first: another shipped config, ELSA-L's
    low-precision states, with CUDA everything on the GPUs, NVMe for the optimizer states or the parameters, DeepSpeed's
    linear where the JSON turned it off, --freeze_embeddings, more nodes."""
    shipped = {name: json.loads(path.read_text()) for name, path in shipped_configs().items()}
    shape = model_shape(job.meta.config, job.cfg.targets, model=job.meta, freeze_embeddings=job.cfg.freeze_embeddings)
    zero = job.ds["zero_optimization"]
    tried: list[tuple[str, Estimate, int]] = []  # (the change, its estimate, nodes)
    for name in ALTERNATIVES:
        if name != job.config_name:
            candidate = {**job.ds, "zero_optimization": {**zero, **shipped[name]["zero_optimization"]}}
            note = _fit_param_buffers(candidate, shape, job.world) + kept_flags(job, shipped[name].get("elsa", {}))
            tried.append((f"ds_configs/{name}.json{note}", job.estimate(candidate, shipped[name].get("elsa")), job.nodes))
    if (elsal := shipped["zero3_offload_elsal"]["elsa"]) and any(str(getattr(job.cfg, k).value) != v for k, v in elsal.items()):
        flags = " ".join(f"--{k} {v}" for k, v in elsal.items())
        tried.append((f"ELSA-L's states ({flags})", job.estimate(elsa=elsal), job.nodes))
    offloaded = [k for k in ("offload_param", "offload_optimizer") if zero.get(k, {}).get("device") in ("cpu", "nvme")]
    if job.device == "cuda" and offloaded:  # 80 GB GPUs hold a 27B job's ELSA-L states on 8 ranks: no host pass, no PCIe
        resident = {**job.ds, "zero_optimization": {**{k: v for k, v in zero.items() if k not in offloaded},
                                                    **shipped["zero3"]["zero_optimization"]}}
        flags = " ".join(f"--{k} {v}" for k, v in GPU_ELSAL.items())
        tried.append((f"everything on the GPUs (ds_configs/zero3.json{kept_flags(job, GPU_ELSAL)}, ELSA-L's states: {flags})",
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
    tried += _more_nodes(job, machine)
    same = _cost(job.estimate(), machine, job.nodes)  # a change that prices as the job does is this job again
    verdicts: dict[bool, dict[str, list[str]]] = {True: {}, False: {}}  # fits -> the estimate -> the changes that give it
    for label, e, n in tried:
        if (cost := _cost(e, machine, n)) != same:
            tight = _fits(e, machine) and e.per_node_cpu_bytes * (1 + MARGIN) > machine.host
            verdicts[_fits(e, machine)].setdefault(cost + (f", tight: within the estimate's ±{MARGIN:.0%}" if tight else ""),
                                                   []).append(label)
    fit, rest = ([f"{' or '.join(labels)} ({cost})" for cost, labels in verdicts[v].items()] for v in (True, False))
    return "; ".join([f"would fit: {', '.join(fit)}" if fit else "nothing tried fits this machine"] +
                     ([f"would not: {', '.join(rest)}"] if rest else []))


def _more_nodes(job: Run, machine: Machine) -> list[tuple[str, Estimate, int]]:
    """The fewest nodes (of 2-64) on which the job fits, or the most tried; with the global batch that needs."""
    counts = [n for n in (2, 4, 8, 16, 32, 64) if n > job.nodes]
    for n in counts:
        if (found := job.on_nodes(n)) is not None and (_fits(found[0], machine) or n == counts[-1]):
            more = f" with --batch_size {found[1]}" if found[1] != job.ds["train_batch_size"] else ""
            return [(f"{n} nodes{more}", found[0], n)]
    return []


def kept_flags(job: Run, block: dict) -> str:
    """The flags that carry this job's settings from its JSON's "elsa" block to a config whose block lacks them (the
    estimate keeps them: without them an ELSA-L job under zero3_offload.json would hold fp32 states)."""
    kept = [flag_text(type(job.cfg), k, getattr(job.cfg, k)) for k in job.block if k not in block and k in type(job.cfg).model_fields]
    return f" with {' '.join(k for k in kept if k)}" if any(kept) else ""


def _fits(e: Estimate, machine: Machine) -> bool:
    return e.per_node_cpu_bytes <= machine.host and (machine.gpu is None or e.per_gpu_bytes <= machine.gpu)


def _cost(e: Estimate, machine: Machine, nodes: int) -> str:
    """An alternative's estimate: host memory per node, memory per GPU (on a GPU node), NVMe per node."""
    gpu = f", {gib_text(e.per_gpu_bytes)} per GPU" if machine.gpu is not None else ""
    nvme = f" + {gib_text(e.nvme_bytes / nodes)} NVMe" if e.nvme_bytes else ""
    return f"~{gib_text(e.per_node_cpu_bytes)} host{gpu}{nvme}"


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
