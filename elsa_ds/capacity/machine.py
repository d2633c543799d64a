"""Can this machine run the job's ops? Checks of the host, made before any weight is loaded.

Beside ``preflight.py`` (will the job fit this machine's memory and disks): here the CPU's bf16 matmul, DeepSpeed's
async_io op for NVMe offload, the folders the engine writes outside the output (torch's JIT builds, the CPU backend's
/dev/shm), and torch's JIT extension builds that a killed build leaves locked. Each returns what to tell the user (or
changes the engine's config and says so); the job decides whether it stops.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from elsa_ds.admm.kernels.build_lock import extensions_root
from elsa_ds.zero import compat
from elsa_ds.zero.engine import model_dtype


def job_device() -> str:
    """Where the job's ranks compute: "cpu" under DeepSpeed's CPU accelerator (also a CUDA box's with
    DS_ACCELERATOR=cpu), else "cuda"."""
    from deepspeed.accelerator import get_accelerator

    return "cpu" if get_accelerator().device_name() == "cpu" else "cuda"


def cpu_bf16_fallback(ds: dict) -> str | None:
    """On a CPU with no fast bf16 matmul, switch the engine's bf16 off (in place) and say so; None when nothing changed.

    torch runs CPU bf16 matmuls through oneDNN only where it supports them (AVX-512 or AMX); elsewhere (an AVX2 CPU
    such as AMD Zen 2/3) it takes a reference loop, measured 50x slower than fp32 (2048x256 @ 256x1024: 992 vs 19 ms),
    so a "bf16" run there is an fp32 run made slow. The weights, optimizer and ADMM states are fp32 either way; only
    the forward/backward precision changes. ``ELSA_DS_CPU_BF16=1`` keeps bf16."""
    from deepspeed.accelerator import get_accelerator

    if model_dtype(ds) is not torch.bfloat16 or get_accelerator().device_name() != "cpu":
        return None
    if os.environ.get("ELSA_DS_CPU_BF16", "0").strip() == "1" or compat.cpu_bf16_matmul_is_fast():
        return None
    ds["bf16"]["enabled"] = False
    return ("this CPU has no fast bf16 matmul (oneDNN bf16 needs AVX-512 or AMX; torch would take a loop ~50x "
            "slower than fp32): forward/backward run in fp32 instead of bf16. ELSA_DS_CPU_BF16=1 keeps bf16.")


def nvme_unavailable() -> str | None:
    """Why DeepSpeed's async_io op (NVMe offload) cannot be built on this machine, or None when it can. Without
    libaio the engine would fail only after the model is loaded and partitioned, with "Unable to JIT load the
    async_io op"."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return ("NVMe offload needs DeepSpeed's async_io op, which cannot be built here (libaio and its headers were not "
            "found): install them (Debian/Ubuntu: apt-get install libaio-dev; RHEL/Fedora: dnf install libaio-devel), "
            "or use a config without NVMe offload such as ds_configs/zero3_offload.json")


def this_gpu() -> tuple[str, float] | None:
    """This machine's first CUDA GPU as (name, the bytes CUDA reports it holds), or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return f"this machine's GPU ({props.name})", float(props.total_memory)


SHM = "/dev/shm"


def host_folders_problem(world_size: int, cpu_ranks: bool) -> str | None:
    """Why the engine could not write where it writes outside the output, or None: torch's JIT builds (DeepSpeed's and
    elsa_ds's ops, on every rank) and, with several CPU ranks, DeepSpeed's shared-memory all-reduce buffers. An audit
    (OS limits, 2026-12-07): an unwritable build folder (HOME=/ in a container started with --user) was a traceback from
    inside DeepSpeed's start; an unwritable /dev/shm hung both ranks, past SIGTERM."""
    root = extensions_root()
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        builds = root  # torch's folder for this Python and device, and the ops' folders in it
    else:
        device = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                  f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        builds = root / f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{device}"
    if why := unwritable(root) or unwritable(builds, made_only=True):
        return (f"torch builds DeepSpeed's and elsa_ds's C++ ops in {root} (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), "
                f"but {why}: set TORCH_EXTENSIONS_DIR to a folder you can write, or fix the permissions there")
    if cpu_ranks and world_size > 1 and (why := unwritable(Path(SHM))):
        return (f"DeepSpeed's CPU backend shares each rank's all-reduce buffer (~66 MiB) through {SHM}, but {why}: make {SHM} "
                "writable (in a container, its default tmpfs or a larger --shm-size), or run one rank")
    return None


def unwritable(folder: Path, made_only: bool = False) -> str | None:
    """Why no file can be made in ``folder`` (where it does not exist yet, in the nearest folder above it, where it would
    be made), nor (``made_only``: a folder of builds, nothing to say where it does not exist yet) in the folders already
    in it; None when all can."""
    where = folder
    while not where.is_dir() and where != where.parent:
        if made_only:
            return None
        where = where.parent
    try:
        handle, name = tempfile.mkstemp(prefix=".elsa_ds_probe_", dir=where)  # a real try: root's permissions, a read-only mount
        os.close(handle)
        os.unlink(name)
        inside = [p for p in where.iterdir() if p.is_dir() and not p.is_symlink()] if made_only else []
    except OSError as err:
        return f"{where} cannot be written ({err.strerror or err})"
    if made := next((p for p in inside if not os.access(p, os.W_OK | os.X_OK)), None):
        return f"{made} cannot be written (another user's build?)"
    return None
